"""Logical axis vocabulary and the single activation-constraint helper.
Notes: docs/sharding.md, ``sharding/axes.py``."""

from __future__ import annotations

import flax.linen as nn

MESH_AXES = ("data", "fsdp", "tensor", "context", "expert")

LOGICAL_AXES = ("batch", "seq", "blocks", "embed", "tokens", "heads", "head_dim", "kv", "seeds",
                "mlp", "exp", "table_rows", "table_dim", "layers")


def shard(x, logical_axes):
  """Constrains activation ``x`` to the sharding of ``logical_axes`` under the active rules.

  The one place model code expresses activation sharding. A no-op when no mesh / rules are set,
  so modules run unchanged on one device.
  """
  if len(logical_axes) != x.ndim:
    raise ValueError(
        f"shard: {len(logical_axes)} axes {logical_axes} for an array of rank {x.ndim}")
  return nn.with_logical_constraint(x, tuple(logical_axes))


def with_axes(init, logical_axes):
  """Wraps a parameter initializer with logical axis names (``nn.with_logical_partitioning``)."""
  return nn.with_logical_partitioning(init, tuple(logical_axes))
