"""Pure-XLA reference twins of every kernel (same signatures as the kernel API).

Layout everywhere: ``[batch, seq, heads, head_dim]``. Scores are accumulated in float32 and the
output is cast back to ``q.dtype``.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.activations import apply_per_head, per_head

_F32 = jnp.float32


def _lengths_mask(lengths, batch, size):
  if lengths is None:
    return jnp.ones((batch, size), bool)
  return jnp.arange(size)[None, :] < jnp.asarray(lengths, jnp.int32)[:, None]


def _zero_invalid(x_bthd, lengths):
  """Zeroes the sequence rows at or beyond ``lengths[b]`` of ``x [B, T, H, D]``."""
  if lengths is None:
    return x_bthd
  valid = _lengths_mask(lengths, x_bthd.shape[0], x_bthd.shape[1])[:, :, None, None]
  return jnp.where(valid, x_bthd, jnp.zeros_like(x_bthd))


def gdpa_mask(batch, tq, tk, q_lengths=None, kv_lengths=None, window=None):
  """Boolean mask ``[B, Tq, Tk]``: valid query row, valid key, and |i - j| <= window."""
  m = (_lengths_mask(q_lengths, batch, tq)[:, :, None]
       & _lengths_mask(kv_lengths, batch, tk)[:, None, :])
  if window is not None:
    i = jnp.arange(tq)[:, None]
    j = jnp.arange(tk)[None, :]
    m = m & (jnp.abs(i - j) <= window)[None]
  return m


def check_gdpa_args(q, k, v, broadcast_q):
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(f"gdpa expects [B, T, H, D] inputs, got q{q.shape} k{k.shape} v{v.shape}")
  if k.shape != v.shape[:3] + (k.shape[3],) or k.shape[:3] != v.shape[:3]:
    raise ValueError(f"k {k.shape} and v {v.shape} must agree on [B, Tk, H]")
  if broadcast_q:
    if q.shape[0] != 1:
      raise ValueError(f"broadcast_q=True needs q of shape [1, Tq, H, D], got {q.shape}")
  elif q.shape[0] != k.shape[0]:
    raise ValueError(f"q batch {q.shape[0]} != k batch {k.shape[0]} "
                     "(use broadcast_q=True to share q)")
  if q.shape[2] != k.shape[2] or q.shape[3] != k.shape[3]:
    raise ValueError(f"q {q.shape} and k {k.shape} must agree on heads and head_dim")


def score_clip_value(score_clip) -> float | None:
  """Normalises the ``score_clip`` argument: None or 0 -> None (off), else a positive float."""
  if score_clip is None:
    return None
  c = float(score_clip)
  if not c >= 0:
    raise ValueError(f"score_clip must be None or a number >= 0 (0 = off), got {score_clip!r}")
  return c or None


def clip_scores(s, score_clip):
  """``s`` clamped to ``[-score_clip, score_clip]`` (identity when off); zero gradient outside."""
  c = score_clip_value(score_clip)
  return s if c is None else jnp.clip(s, -c, c)


def gdpa_reference(q, k, v, *, activation="fast_gelu", scale=None, out_scale=1.0, q_lengths=None,
                   kv_lengths=None, window=None, broadcast_q=False, backend="xla", interpret=False,
                   score_clip=None):
  """Generalized dot-product attention: ``o_i = out_scale * sum_j act(clip(scale <q_i, k_j>)) v_j``.

  Args:
    q: ``[B, Tq, H, D]`` (``[1, Tq, H, D]`` with ``broadcast_q``).
    k, v: ``[B, Tk, H, D]``.
    activation: a name from ``pallas_kernels.activations.NAMES`` or a tuple with one per head.
    scale: multiplies q.k before the activation (default ``1/sqrt(D)``).
    out_scale: multiplies the output.
    q_lengths, kv_lengths: ``i32[B]``; rows at or beyond ``q_lengths[b]`` output zeros and keys
      at or beyond ``kv_lengths[b]`` contribute nothing.
    window: keep only ``|i - j| <= window``.
    score_clip: clamp the scaled scores to ``[-score_clip, score_clip]`` before the activation
      (spec h-13); None or 0: no clipping. The gradient is zero where a score is clamped.
  Returns:
    ``[B, Tq, H, D]`` in ``q.dtype``.
  """
  del backend, interpret
  check_gdpa_args(q, k, v, broadcast_q)
  B, Tk, H, D = k.shape
  Tq = q.shape[1]
  acts = per_head(activation, H)
  scale = D ** -0.5 if scale is None else scale
  # Zero the rows beyond the lengths: keeps NaN/Inf stored in padding out of valid outputs.
  k, v = (_zero_invalid(x, kv_lengths) for x in (k, v))
  if not broadcast_q:
    q = _zero_invalid(q, q_lengths)
  s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(_F32), k.astype(_F32)) * scale   # [B|1, H, Tq, Tk]
  p = apply_per_head(clip_scores(s, score_clip), acts, head_axis=1)
  m = gdpa_mask(B, Tq, Tk, q_lengths, kv_lengths, window)[:, None]
  p = jnp.where(m, p, 0.0)
  o = jnp.einsum("bhqk,bkhd->bqhd", jnp.broadcast_to(p, (B, H, Tq, Tk)), v.astype(_F32))
  return (o * out_scale).astype(q.dtype)


def apply_rotary(x, rotary):
  """Rotates ``x [B, T, H, D]`` with ``rotary = (cos, sin)``.

  ``cos``/``sin`` are ``[B|1, T, D // 2]`` (shared by all heads) or ``[B|1, T, H, D // 2]``
  (per head, e.g. temporal angles on some heads and positional on others). Half-split
  convention: ``x = [x1, x2]`` -> ``[x1 cos - x2 sin, x2 cos + x1 sin]``.
  """
  cos, sin = rotary
  if cos.ndim == 3:
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
  cos, sin = cos.astype(_F32), sin.astype(_F32)
  xf = x.astype(_F32)
  x1, x2 = jnp.split(xf, 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def block_attention_reference(q, k, v, *, block_size=64, activation="softmax", lengths=None,
                              rotary=None, backend="xla", interpret=False, score_clip=None):
  """Attention within independent ``block_size`` blocks of the sequence (bidirectional).

  Token i attends to token j iff ``i // block_size == j // block_size`` and both are below
  ``lengths[b]``. ``activation="softmax"`` is softmax attention with scale ``1/sqrt(D)``; a GDPA
  activation uses ``act(q.k / sqrt(D)) / block_size`` (HSTU-style 1/N normalisation). Rows at or
  beyond ``lengths[b]`` output zeros. ``T`` must be a multiple of ``block_size``. ``score_clip``
  clamps the scores of a GDPA activation to ``[-c, c]`` first (as in ``gdpa_reference``); softmax
  scores are never clipped.

  Args: q, k, v ``[B, T, H, D]``; lengths ``i32[B]``; rotary ``(cos, sin)`` applied to q and k.
  Returns: ``[B, T, H, D]`` in ``q.dtype``.
  """
  del backend, interpret
  B, T, H, D = q.shape
  if T % block_size:
    raise ValueError(f"sequence length {T} is not a multiple of block_size {block_size}")
  q, k, v = (_zero_invalid(x, lengths) for x in (q, k, v))
  if rotary is not None:
    q, k = apply_rotary(q, rotary), apply_rotary(k, rotary)
  nb = T // block_size
  blk = lambda x: x.astype(_F32).reshape(B, nb, block_size, H, D)
  s = jnp.einsum("bnqhd,bnkhd->bnhqk", blk(q), blk(k)) * D ** -0.5
  valid = _lengths_mask(lengths, B, T).reshape(B, nb, block_size)
  m = valid[:, :, None, :, None] & valid[:, :, None, None, :]                    # [B,nb,1,bq,bk]
  if activation == "softmax":
    s = jnp.where(m, s, -jnp.inf)
    mx = jnp.max(s, axis=-1, keepdims=True)
    mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
    e = jnp.where(m, jnp.exp(s - mx), 0.0)
    den = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(den > 0, den, 1.0)
  else:
    acts = per_head(activation, H)
    p = jnp.where(m, apply_per_head(clip_scores(s, score_clip), acts, head_axis=2), 0.0)
    p = p / block_size
  o = jnp.einsum("bnhqk,bnkhd->bnqhd", p, blk(v))
  return o.reshape(B, T, H, D).astype(q.dtype)
