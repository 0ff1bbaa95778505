"""Multi-surface x multi-task heads (spec d.3, h-16).

* The learned per-surface vector added to the trunk input X0 (domain-aware trunk) is part of
  ``kunlun.nn.inputs.ContextEncoder``, which the model uses to build X0.
* ``Heads``: shared top MLP, then either per-(surface, task) 2-layer towers (``kind="towers"``) or
  MMoE domain-expert heads (``kind="mmoe"``: shared expert MLPs, one softmax gate per
  (surface, task), then a per-(surface, task) 2-layer tower). Every surface's heads are evaluated
  (they are tiny) and the example's own surface is selected with a one-hot, so only that surface's
  head receives gradient from the example.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from kunlun.nn.activations import gelu
from sharding import shard, with_axes

_INIT = nn.initializers.lecun_normal()
_ZEROS = nn.initializers.zeros_init()


class MLP(nn.Module):
  """Dense stack with GELU between layers (and after the last one if ``final_act``)."""
  features: tuple[int, ...]
  final_act: bool = True
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    for i, f in enumerate(self.features):
      x = nn.Dense(f, dtype=self.dtype, kernel_init=with_axes(_INIT, (None, "mlp")),
                   bias_init=with_axes(_ZEROS, ("mlp",)), name=f"dense_{i}")(x)
      if i < len(self.features) - 1 or self.final_act:
        x = gelu(x)
    return x


def _stacked_tower(mod, x_bskh, hidden, prefix):
  """Per-(surface, task) 2-layer tower on ``x [B, S, K, H]`` -> logits ``[B, S, K]``."""
  _, S, K, H = x_bskh.shape
  w1 = mod.param(f"{prefix}w1", with_axes(_INIT, (None, None, None, "mlp")), (S, K, H, hidden))
  b1 = mod.param(f"{prefix}b1", with_axes(_ZEROS, (None, None, "mlp")), (S, K, hidden))
  w2 = mod.param(f"{prefix}w2", with_axes(_INIT, (None, None, "mlp")), (S, K, hidden))
  b2 = mod.param(f"{prefix}b2", with_axes(_ZEROS, (None, None)), (S, K))
  h = gelu(jnp.einsum("bskh,skhf->bskf", x_bskh, w1.astype(x_bskh.dtype)) + b1)
  return jnp.einsum("bskf,skf->bsk", h, w2.astype(h.dtype)) + b2


class Heads(nn.Module):
  """``(z f32[B, D], surface i32[B]) -> (logits f32[B, K], shared f32[B, top_mlp[-1]])``."""
  num_surfaces: int
  num_tasks: int
  kind: str = "towers"
  top_mlp: tuple[int, ...] = (64,)
  tower_hidden: int = 32
  num_experts: int = 2
  expert_hidden: int = 32
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, z_bd, surface_b):
    with jax.named_scope("Heads"):
      S, K = self.num_surfaces, self.num_tasks
      shared = MLP(self.top_mlp, dtype=self.dtype, name="top_mlp")(z_bd.astype(self.dtype))
      shared = shard(shared, ("batch", "mlp"))
      B, D = shared.shape
      if self.kind == "towers":
        x = jnp.broadcast_to(shared[:, None, None, :], (B, S, K, D))
      elif self.kind == "mmoe":
        E, He = self.num_experts, self.expert_hidden
        we = self.param("expert_w", with_axes(_INIT, (None, None, "mlp")), (E, D, He))
        be = self.param("expert_b", with_axes(_ZEROS, (None, "mlp")), (E, He))
        experts = gelu(jnp.einsum("bd,edh->beh", shared, we.astype(shared.dtype)) + be)
        wg = self.param("gate_w", with_axes(_INIT, (None, None, None, None)), (S, K, D, E))
        gates = jax.nn.softmax(jnp.einsum("bd,skde->bske", shared.astype(jnp.float32), wg),
                               axis=-1)
        x = jnp.einsum("bske,beh->bskh", gates.astype(experts.dtype), experts)
      else:
        raise ValueError(f"Heads.kind = {self.kind!r}; allowed: ('towers', 'mmoe')")
      logits_bsk = _stacked_tower(self, x, self.tower_hidden, "tower_").astype(jnp.float32)
      onehot = jax.nn.one_hot(surface_b, S, dtype=jnp.float32)
      logits = jnp.einsum("bsk,bs->bk", logits_bsk, onehot)
      return logits, shared.astype(jnp.float32)
