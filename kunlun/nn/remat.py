"""Rematerialisation policies (``config.train.remat``) for the Kunlun trunk.
Notes: docs/architecture.md, ``kunlun/nn/remat.py``."""

from __future__ import annotations

import flax.linen as nn
import jax

from kunlun.configs.fields import REMAT_POLICIES as POLICIES
from kunlun.configs.fields import REMAT_SCOPES as SCOPES


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
