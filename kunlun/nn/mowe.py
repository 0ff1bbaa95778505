"""Mixture of Wukong Experts (spec c.6, h-8).

``M`` Wukong stacks run on the same input tokens (no routing) and their outputs are averaged:
``X' = (1/M) sum_m Wukong_m(X)``. The experts are one ``nn.vmap`` over a leading parameter axis
named ``exp`` so the sharding rules can place experts on the ``expert`` mesh axis.
``cross_layer`` turns on the cross-layer attention connections inside each expert's stack
(spec h-19, ``kunlun.nn.wukong.WukongStack``); the connection logits are per expert.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from kunlun.nn.wukong import WukongStack
from sharding import shard


class MoWE(nn.Module):
  """``x [B, N_in, d]`` -> ``[B, n_out, d]``, the mean of ``num_experts`` Wukong stacks."""
  num_experts: int
  layers_per_expert: int
  n_out: int
  rank: int
  mlp_hidden: int
  fm_fraction: float = 0.5
  dtype: Any = jnp.float32
  cross_layer: bool = False
  backend: str = "xla"

  @nn.compact
  def __call__(self, x):
    if self.num_experts < 1:
      raise ValueError(f"MoWE.num_experts must be >= 1, got {self.num_experts}")
    with jax.named_scope("MoWE"):
      experts = nn.vmap(WukongStack, in_axes=None, out_axes=0,
                        variable_axes={"params": 0}, split_rngs={"params": True},
                        axis_size=self.num_experts,
                        metadata_params={nn.PARTITION_NAME: "exp"})
      y = experts(self.layers_per_expert, self.n_out, self.rank, self.mlp_hidden,
                  self.fm_fraction, self.dtype, self.cross_layer, self.backend,
                  name="experts")(x)                                           # [M, B, n_out, d]
      y = shard(y, ("exp", "batch", "tokens", "embed"))
      return shard(jnp.mean(y.astype(jnp.float32), axis=0).astype(self.dtype),
                   ("batch", "tokens", "embed"))
