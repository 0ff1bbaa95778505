"""Rematerialisation policies (``config.train.remat``) for the Kunlun trunk.

A policy names which intermediate values of a wrapped module's forward pass are kept for the
backward pass; everything else is recomputed there (``jax.checkpoint``):

  none            keep everything (no recomputation; most memory)
  dots_no_batch   keep the outputs of matmuls without batch dimensions (the projections and
                  MLPs: ``btd,de->bte``); recompute norms, activations and the score matrices of
                  attention / GDPA (einsums with a batch dimension)
  dots_saveable   keep every matmul output, scores included; recompute elementwise work
  full            keep only the wrapped module's inputs; recompute its whole forward pass

``config.train.remat_scope`` says what is wrapped: ``layer`` (each Kunlun layer; the default) or
``tower`` (each tower's sequence modules inside a layer, i.e. PFFN, attention, HSP, and the
interaction block's WeightGen / MoWE, separately: recomputation peaks at one module instead of a
whole layer, at the cost of keeping every module's input). The per-stream event embeddings of
the input stage are wrapped under both scopes unless the policy is ``none``.

Parameters are unaffected (``nn.remat`` keeps the module names), so checkpoints are
interchangeable across policies; in float32 the loss and gradients are the same up to the
reassociation XLA may apply to recomputed values.
"""

from __future__ import annotations

import flax.linen as nn
import jax

POLICIES = ("none", "dots_no_batch", "dots_saveable", "full")
SCOPES = ("layer", "tower")


def policy(name: str):
  """The ``jax.checkpoint`` policy of ``name`` (``POLICIES``); ``None`` for ``full``."""
  cp = jax.checkpoint_policies
  table = {"dots_no_batch": cp.dots_with_no_batch_dims_saveable,
           "dots_saveable": cp.dots_saveable, "full": None}
  if name not in table:
    raise ValueError(f"config.train.remat = {name!r} is not allowed; allowed values: {POLICIES}")
  return table[name]


def check(name: str, scope: str = "layer") -> None:
  """Raises ValueError naming the field and the allowed values."""
  if name not in POLICIES:
    raise ValueError(f"config.train.remat = {name!r} is not allowed; allowed values: {POLICIES}")
  if scope not in SCOPES:
    raise ValueError(f"config.train.remat_scope = {scope!r} is not allowed; allowed values: "
                     f"{SCOPES}")


def wrap(module_cls, name: str):
  """``module_cls`` under the policy ``name`` (the class itself for ``none``)."""
  if name == "none":
    return module_cls
  return nn.remat(module_cls, policy=policy(name), prevent_cse=True)
