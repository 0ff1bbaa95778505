"""Time encodings of events (spec b.5, h-12): log-time buckets, rotary angles (ROTE / RoPE per
head, ``(cos, sin)``) and per-head time/position bucket embeddings.
Notes: docs/architecture.md, ``kunlun/nn/time_encoding.py``."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from kunlun.configs.fields import BUCKET_KINDS
from kunlun.configs.types import BucketSpec
from sharding import with_axes

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


def log_time(age, t_scale: float = 60.0):
  """The time heads' rotary "position" of an event ``age`` seconds old: ``log(1 + age / t_scale)``
  (``age`` clipped at 0), float32, ``age``'s shape."""
  return jnp.log1p(jnp.maximum(jnp.asarray(age, jnp.float32), 0.0) / t_scale)


def rotary_inputs(age, positions, head_dim: int, t_scale: float = 60.0):
  """``(tau, positions, omega)``, what the rotary angles are made of: ``tau = log_time(age)``,
  ``positions`` as float32 (``age``'s shape) and ``omega = rope_frequencies(head_dim)``; the time
  heads turn by ``tau * omega``, the others by ``positions * omega`` (``rotary_angles``; the
  fused kernels of ``pallas_kernels.norm_qkv`` take these)."""
  return log_time(age, t_scale), jnp.asarray(positions, jnp.float32), rope_frequencies(head_dim)


def rotary_angles(age, heads: int, head_dim: int, t_scale: float = 60.0, positions=None):
  """The angles of ``rotary_time``: ``f32[B, T, heads, head_dim // 2]`` (same arguments)."""
  if heads < 1:
    raise ValueError(f"heads must be >= 1, got {heads}")
  omega = rope_frequencies(head_dim)                                    # [D/2]
  age = jnp.asarray(age, jnp.float32)
  B, T = age.shape
  tau_bt = log_time(age, t_scale)
  pos_bt = (jnp.broadcast_to(jnp.arange(T, dtype=jnp.float32)[None], (B, T)) if positions is None
            else jnp.asarray(positions, jnp.float32))
  n_time = (heads + 1) // 2
  is_time_h = jnp.arange(heads) < n_time                                # [H]
  x_bth = jnp.where(is_time_h[None, None, :], tau_bt[..., None], pos_bt[..., None])
  return x_bth[..., None] * omega                                       # [B, T, H, D/2]


def rotary_time(age, heads: int, head_dim: int, t_scale: float = 60.0, positions=None):
  """Per-head rotary ``(cos, sin)``, each ``f32[B, T, heads, head_dim // 2]``.

  Args:
    age: ``f32[B, T]`` request time - event time in seconds.
    heads: number of heads; heads ``[0, ceil(heads/2))`` use time, the rest use positions.
    head_dim: per-head width (even).
    t_scale: seconds; the temporal "position" is ``log(1 + age / t_scale)``.
    positions: ``[B, T]`` positions of the positional heads (None: ``0..T-1``; packed tokens:
      their ``pos``).
  """
  ang = rotary_angles(age, heads, head_dim, t_scale, positions)
  return jnp.cos(ang), jnp.sin(ang)




def even_age_bucket(age, num_buckets: int, horizon: float):
  """``age f32[B, T]`` (seconds) -> ``i32[B, T]`` = clip(floor(age * n / horizon), 0, n - 1)."""
  a = jnp.maximum(jnp.asarray(age, jnp.float32), 0.0)
  return jnp.clip(jnp.floor(a * (num_buckets / horizon)).astype(jnp.int32), 0, num_buckets - 1)


def gap_bucket(age, num_buckets: int):
  """Log2 gap to the previous (older) event: ``age f32[B, T]`` (oldest first) -> ``i32[B, T]``.

  Bucket 0: the first event (no previous one); else ``1 + clip(floor(log2(max(gap, 1))), 0,
  n - 2)`` with ``gap_t = age_{t-1} - age_t`` (clamped at 0)."""
  if num_buckets < 2:
    raise ValueError(f"gap buckets need num_buckets >= 2, got {num_buckets}")
  a = jnp.asarray(age, jnp.float32)
  b = _gap_ids(a[:, :-1] - a[:, 1:], num_buckets)
  return jnp.concatenate([jnp.zeros_like(b[:, :1]), b], axis=1)


def _gap_ids(gap, num_buckets: int):
  """``1 + clip(floor(log2(max(gap, 1))), 0, n - 2)`` (``gap`` clamped at 0)."""
  gap = jnp.maximum(gap, 0.0)
  return 1 + jnp.clip(jnp.floor(jnp.log2(jnp.maximum(gap, 1.0))).astype(jnp.int32), 0,
                      num_buckets - 2)


def _rank_ids(r, num_buckets: int, kept_len: int):
  return jnp.clip((jnp.maximum(r, 0) * num_buckets) // kept_len, 0, num_buckets - 1).astype(
      jnp.int32)


def position_bucket(lengths, T: int, num_buckets: int, kept_len: int):
  """Recency rank ``r = length - 1 - t`` -> ``i32[B, T]`` = clip(floor(r * n / kept_len), 0, n-1)
  (padding slots: bucket 0; their rows are masked downstream)."""
  r = jnp.asarray(lengths, jnp.int32)[:, None] - 1 - jnp.arange(T)[None, :]
  return _rank_ids(r, num_buckets, kept_len)


def bucket_ids(age, lengths, spec: BucketSpec, jag=None):
  """``age f32[B, T]``, ``lengths i32[B]`` -> ``i32[B, T, len(spec.kinds)]``; packed tokens
  (``jag``: a ``pallas_kernels.jagged.Jagged``, ``age f32[N]``, ``lengths`` unused) -> ``i32[N,
  kinds]``, each token's ids in its padded row."""
  n = spec.num_buckets
  if jag is None:
    T = age.shape[1]
    gap = lambda: gap_bucket(age, n)
    position = lambda: position_bucket(lengths, T, n, spec.kept_len)
  else:                                       # the previous token is the older event of a run
    prev = jag.shifted(age)
    gap = lambda: jnp.where(jag.pos == 0, 0, _gap_ids(prev - age, n))
    rank = jag.per_token(jag.lengths) - 1 - jag.pos
    position = lambda: _rank_ids(rank, n, spec.kept_len)
  make = {"age": lambda: even_age_bucket(age, n, spec.age_horizon),
          "log_age": lambda: log_time_bucket(age, n),
          "gap": gap, "position": position}
  bad = [k for k in spec.kinds if k not in make]
  if bad:
    raise ValueError(f"unknown time-bucket kind(s) {bad}; allowed: {BUCKET_KINDS}")
  return jnp.stack([make[k]() for k in spec.kinds], axis=-1)


def bucket_embedding(mod: nn.Module, name: str, x_bthc, age, lengths, spec: BucketSpec | None,
                     jag=None):
  """``sum_k E[k, id_k]`` (``f32[B, T, H, d_h]``, the shape of ``x``) with ``E`` the parameter
  ``name`` of ``mod`` (``f32[kinds, n_buckets, H, d_h]``, zeros at init); None when ``spec`` is
  None. Packed tokens (``jag``): ``x [N, H, d_h]``, ``age f32[N]`` (``bucket_ids``)."""
  if spec is None:
    return None
  if age is None or (lengths is None and jag is None):
    raise ValueError(f"{type(mod).__name__}: time buckets need the events' age and lengths")
  H, dh = x_bthc.shape[-2:]
  table = mod.param(name, with_axes(nn.initializers.zeros, (None, None, "heads", "head_dim")),
                    (len(spec.kinds), spec.num_buckets, H, dh), jnp.float32)
  age = jnp.asarray(age, jnp.float32)
  ids = bucket_ids(age if jag is not None else age[:, :x_bthc.shape[1]], lengths, spec, jag)
  return sum(table[k][ids[..., k]] for k in range(len(spec.kinds)))          # [B, T, H, dh]


def add_bucket_embedding(mod: nn.Module, name: str, x_bthc, age, lengths, spec: BucketSpec | None,
                         jag=None):
  """``x [B, T, H, d_h] + sum_k E[k, id_k]`` (``bucket_embedding``), in ``x.dtype``; ``x``
  unchanged when ``spec`` is None."""
  emb = bucket_embedding(mod, name, x_bthc, age, lengths, spec, jag)
  if emb is None:
    return x_bthc
  return (x_bthc.astype(jnp.float32) + emb).astype(x_bthc.dtype)
