"""Pointwise score activations shared by every GDPA / block-attention backend."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _fast_gelu(x):
  return 0.5 * x * (1.0 + jnp.tanh(_SQRT_2_OVER_PI * x * (1.0 + 0.044715 * x * x)))


ACTIVATIONS = {
    "identity": lambda x: x,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "fast_gelu": _fast_gelu,
    "silu": jax.nn.silu,
    "relu": jax.nn.relu,
    "relu2": lambda x: jnp.square(jax.nn.relu(x)),
}
NAMES = tuple(ACTIVATIONS)


def per_head(activation, num_heads: int) -> tuple[str, ...]:
  """Normalises ``activation`` (a name or a tuple of names, one per head) to a tuple."""
  if isinstance(activation, str):
    acts = (activation,) * num_heads
  else:
    acts = tuple(activation)
    if len(acts) != num_heads:
      raise ValueError(f"activation tuple has {len(acts)} entries but there are {num_heads} heads")
  for a in acts:
    if a not in ACTIVATIONS:
      raise ValueError(f"unknown activation {a!r}; allowed: {NAMES}")
  return acts


def apply_per_head(s, acts: tuple[str, ...], head_axis: int):
  """Applies ``acts[h]`` to slice h of ``s`` along ``head_axis`` (one call if all equal)."""
  if len(set(acts)) == 1:
    return ACTIVATIONS[acts[0]](s)
  parts = [ACTIVATIONS[a](jax.lax.index_in_dim(s, h, head_axis, keepdims=True))
           for h, a in enumerate(acts)]
  return jnp.concatenate(parts, axis=head_axis)
