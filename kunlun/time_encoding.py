"""Time encodings of events (spec b.5, h-12).

* ``log_time_bucket``: log2-bucketed event->request gap, for an additive learned embedding.
* ``rotary_time``: rotary angles. The first ``ceil(H / 2)`` heads are temporal (ROTE, angle
  ``omega_i * log(1 + age / t_scale)``), the others positional (ordinary RoPE on the index),
  ``omega_i = 10000 ** (-2 i / head_dim)``. The returned ``(cos, sin)`` pair is the per-head
  layout taken by ``pallas_kernels.block_attention(rotary=...)`` and
  ``pallas_kernels.reference.apply_rotary`` (half-split rotation).

Choice: with a single head the head is temporal (``ceil``), because time is the signal that
index distance cannot carry.
"""

from __future__ import annotations

import jax.numpy as jnp

ROPE_BASE = 10000.0


def log_time_bucket(age, num_buckets: int):
  """``age f32[B, T]`` (seconds, >= 0) -> ``i32[B, T]`` = clip(floor(log2(max(age, 1))), 0, n-1)."""
  if num_buckets < 1:
    raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
  a = jnp.maximum(jnp.asarray(age, jnp.float32), 1.0)
  b = jnp.floor(jnp.log2(a)).astype(jnp.int32)
  return jnp.clip(b, 0, num_buckets - 1)


def rope_frequencies(head_dim: int):
  """``f32[head_dim // 2]`` with ``omega_i = base ** (-2 i / head_dim)``."""
  if head_dim % 2:
    raise ValueError(f"rotary encodings need an even head_dim, got {head_dim}")
  return ROPE_BASE ** (-jnp.arange(head_dim // 2, dtype=jnp.float32) * 2.0 / head_dim)


def rotary_time(age, heads: int, head_dim: int, t_scale: float = 60.0):
  """Per-head rotary ``(cos, sin)``, each ``f32[B, T, heads, head_dim // 2]``.

  Args:
    age: ``f32[B, T]`` request time - event time in seconds.
    heads: number of heads; heads ``[0, ceil(heads/2))`` use time, the rest use positions.
    head_dim: per-head width (even).
    t_scale: seconds; the temporal "position" is ``log(1 + age / t_scale)``.
  """
  if heads < 1:
    raise ValueError(f"heads must be >= 1, got {heads}")
  omega = rope_frequencies(head_dim)                                    # [D/2]
  age = jnp.asarray(age, jnp.float32)
  B, T = age.shape
  tau_bt = jnp.log1p(jnp.maximum(age, 0.0) / t_scale)
  pos_bt = jnp.broadcast_to(jnp.arange(T, dtype=jnp.float32)[None], (B, T))
  n_time = (heads + 1) // 2
  is_time_h = jnp.arange(heads) < n_time                                # [H]
  x_bth = jnp.where(is_time_h[None, None, :], tau_bt[..., None], pos_bt[..., None])
  ang = x_bth[..., None] * omega                                        # [B, T, H, D/2]
  return jnp.cos(ang), jnp.sin(ang)
