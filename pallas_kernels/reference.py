"""Pure-XLA reference twins of every kernel (same signatures as the kernel API).

``gdpa_reference`` (GDPA), ``block_attention_reference`` (block attention) and
``softmax_attention_reference`` (softmax attention, full or banded ``|i - j| <= window``: the
banded XLA path of the sequence self-attention).

Layout everywhere: ``[batch, seq, heads, head_dim]``. Scores are accumulated in float32 and the
output is cast back to ``q.dtype``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax import lax

from pallas_kernels.activations import apply_per_head, per_head

_F32 = jnp.float32


def layer_norm_stats(x, eps: float):
  """``(x, mu, r)`` over the last axis, in float32: x, its mean and the reciprocal of its
  deviation (the mean square about the mean, then ``rsqrt(. + eps)``)."""
  x = x.astype(_F32)
  mu = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x - mu), axis=-1, keepdims=True)
  return x, mu, lax.rsqrt(var + eps)


def layer_norm(x, eps: float, dtype=None):
  """Affine-free LayerNorm over the last axis, computed in float32 (``layer_norm_stats``),
  returned in ``dtype`` (None: x's). The formula of ``kunlun.nn.norms.layer_norm`` and of the
  Pallas kernels that normalise inside (the PFFN's query: ``jagged_pallas``'s ``q_norm``,
  ``norm_residual``'s ``u_norm``)."""
  xf, mu, r = layer_norm_stats(x, eps)
  return ((xf - mu) * r).astype(x.dtype if dtype is None else dtype)


def layer_norm_held(x, eps: float, dtype=None):
  """``layer_norm``'s values, differentiated with the row statistics held constant: the VJP is
  ``r dy`` (``jagged_gdpa_cross(q_norm=eps, ln_split=True)``). The backward's other part, through
  the statistics, is ``ln_through``'s: ``layer_norm_held(ln_through(x))`` is ``layer_norm(x)``,
  values and VJP."""
  xf, mu, r = layer_norm_stats(x, eps)
  mu, r = lax.stop_gradient(mu), lax.stop_gradient(r)
  return ((xf - mu) * r).astype(x.dtype if dtype is None else dtype)


def ln_through(x, eps: float):
  """``x`` itself (exactly), whose VJP is the part of ``layer_norm``'s backward that runs
  through the row statistics, the factor ``r`` taken out: ``g -> g - mean(g) - y mean(g y)``,
  ``y = layer_norm(x)``, in float32, returned in x's dtype (the Jacobian of ``(x - mu) r /
  r_c + mu_c`` with ``r_c, mu_c`` constants equal to ``r, mu``). The tokens' pass-through of
  ``jagged_gdpa_pool_proj(through=eps)``; with ``layer_norm_held`` after it, the PFFN's query."""
  xf, mu, r = layer_norm_stats(x, eps)
  t = (xf - mu) * (r / lax.stop_gradient(r)) + lax.stop_gradient(mu)
  return (lax.stop_gradient(xf) + (t - lax.stop_gradient(t))).astype(x.dtype)


def layer_norm_project(y, g):
  """``g - mean(g) - y mean(g y)`` over the last axis, ``y`` a LayerNorm's output and ``g``
  float32: the norm's backward without its factor ``r`` (``layer_norm_dx`` is ``r`` times it,
  ``ln_through``'s VJP is it; the Pallas kernels that take a norm's backward call it on their
  rows)."""
  return (g - jnp.mean(g, axis=-1, keepdims=True)
          - y * jnp.mean(g * y, axis=-1, keepdims=True))


def layer_norm_dx(x, dy, eps: float):
  """``layer_norm``'s backward over the last axis: ``dx = r (dy - mean(dy) - y mean(dy y))``
  with ``y = (x - mu) r`` and ``dy`` float32, returned in x's dtype."""
  xf, mu, r = layer_norm_stats(x, eps)
  return (r * layer_norm_project((xf - mu) * r, dy)).astype(x.dtype)


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


class Rows(NamedTuple):
  """Which q and k/v batch row each output row reads, and its lengths (see ``resolve_rows``)."""
  batch: int                        # B: output rows
  q_index: jnp.ndarray | None       # i32[B] into q's batch, or None (identity)
  kv_index: jnp.ndarray | None      # i32[B] into k/v's batch, or None (identity)
  q_len: jnp.ndarray                # i32[B] valid query rows of each output row, in [0, Tq]
  kv_len: jnp.ndarray               # i32[B] valid keys of each output row, in [0, Tk]
  groups: int                       # G = H_q / H_kv (GQA; 1 = multi-head)


def _index(idx, n_rows, what):
  if idx is None:
    return None
  idx = jnp.asarray(idx)
  if idx.ndim != 1 or not jnp.issubdtype(idx.dtype, jnp.integer):
    raise ValueError(f"{what} must be a 1-D integer array, got {idx.dtype}{list(idx.shape)}")
  return jnp.clip(idx.astype(jnp.int32), 0, n_rows - 1)


def _lens(lengths, n, t, what):
  if lengths is None:
    return jnp.full((n,), t, jnp.int32)
  lengths = jnp.asarray(lengths, jnp.int32)
  if lengths.shape != (n,):
    raise ValueError(f"{what} must have shape ({n},), got {lengths.shape}")
  return jnp.clip(lengths, 0, t)


def resolve_rows(q, k, v, *, broadcast_q=False, q_index=None, kv_index=None, q_lengths=None,
                 kv_lengths=None, window=None) -> Rows:
  """Checks the GDPA operands (and ``window >= 0``) and maps every output row to its q and k/v
  rows.

  Output row ``b`` reads ``q[q_index[b]]`` and ``k/v[kv_index[b]]`` (identity when None; indices
  are clipped into range). ``q_lengths`` has q's batch and ``kv_lengths`` k's batch (indexed
  like their operand), except with the legacy ``broadcast_q=True`` (= ``q_index`` all zeros),
  where ``q_lengths`` has the output batch. Heads: ``H_q = G * H_kv``; q head ``h`` reads k/v
  head ``h // G``.
  """
  if window is not None and window < 0:
    raise ValueError(f"window must be >= 0, got {window}")
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(f"gdpa expects [B, T, H, D] inputs, got q{q.shape} k{k.shape} v{v.shape}")
  if k.shape != v.shape:
    raise ValueError(f"k {k.shape} and v {v.shape} must have the same shape")
  if q.shape[3] != k.shape[3]:
    raise ValueError(f"q {q.shape} and k {k.shape} must agree on head_dim")
  if q.shape[2] % k.shape[2]:
    raise ValueError(f"q heads {q.shape[2]} must be a multiple of the k/v heads {k.shape[2]} "
                     "(GQA: H_q = G * H_kv)")
  Bq, Tq = q.shape[:2]
  Bk, Tk = k.shape[:2]
  if broadcast_q:
    if q_index is not None:
      raise ValueError("give either broadcast_q=True or q_index, not both")
    if Bq != 1:
      raise ValueError(f"broadcast_q=True needs q of shape [1, Tq, H, D], got {q.shape}")
  qi, ki = _index(q_index, Bq, "q_index"), _index(kv_index, Bk, "kv_index")
  if qi is not None and ki is not None and qi.shape != ki.shape:
    raise ValueError(f"q_index {qi.shape} and kv_index {ki.shape} must have the same length")
  B = qi.shape[0] if qi is not None else ki.shape[0] if ki is not None else Bk
  if ki is None and Bk != B:
    raise ValueError(f"k batch {Bk} != output batch {B} (q_index has {B} rows; give kv_index)")
  if qi is None and not broadcast_q and Bq != B:
    raise ValueError(f"q batch {Bq} != k batch {B} (use broadcast_q=True or q_index to share q)")
  if broadcast_q:
    qi = jnp.zeros((B,), jnp.int32)
    q_len = _lens(q_lengths, B, Tq, "q_lengths (broadcast_q: one per output row)")
  else:
    q_len = _lens(q_lengths, Bq, Tq, "q_lengths")
    q_len = q_len if qi is None else q_len[qi]
  kv_len = _lens(kv_lengths, Bk, Tk, "kv_lengths")
  kv_len = kv_len if ki is None else kv_len[ki]
  return Rows(B, qi, ki, q_len, kv_len, q.shape[2] // k.shape[2])


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
                   kv_lengths=None, window=None, broadcast_q=False, q_index=None, kv_index=None,
                   backend="xla", interpret=False, score_clip=None):
  """Generalized dot-product attention: ``o_i = out_scale * sum_j act(clip(scale <q_i, k_j>)) v_j``.

  Args:
    q: ``[Bq, Tq, H_q, D]``; k, v: ``[Bk, Tk, H_kv, D]`` with ``H_q = G * H_kv`` (GQA: q head h
      reads k/v head ``h // G``).
    activation: a name from ``pallas_kernels.activations.NAMES`` or a tuple with one per q head.
    scale: multiplies q.k before the activation (default ``1/sqrt(D)``).
    out_scale: multiplies the output.
    q_lengths: ``i32[Bq]``, kv_lengths: ``i32[Bk]`` (each indexed like its operand); query rows
      at or beyond the length output zeros and keys at or beyond it contribute nothing.
    window: keep only ``|i - j| <= window``.
    broadcast_q: q is ``[1, Tq, H, D]`` shared by every example (= ``q_index`` all zeros, but
      ``q_lengths`` then has the output batch, one per example).
    q_index, kv_index: ``i32[B]`` or None (request-level sharing, spec d.6): output row b reads
      ``q[q_index[b]]`` and ``k, v[kv_index[b]]``, so one q (or k/v) row can serve many output
      rows (its gradient is the sum over them). The output batch B is their length (else k's).
    score_clip: clamp the scaled scores to ``[-score_clip, score_clip]`` before the activation
      (spec h-13); None or 0: no clipping. The gradient is zero where a score is clamped.
  Returns:
    ``[B, Tq, H_q, D]`` in ``q.dtype``.
  """
  del backend, interpret
  r = resolve_rows(q, k, v, broadcast_q=broadcast_q, q_index=q_index, kv_index=kv_index,
                   q_lengths=q_lengths, kv_lengths=kv_lengths, window=window)
  Tq, Hq, D = q.shape[1:]
  Tk = k.shape[1]
  acts = per_head(activation, Hq)
  scale = D ** -0.5 if scale is None else scale
  take = lambda x, idx: x if idx is None else jnp.take(x, idx, axis=0)   # AD: scatter-add
  # Zero the rows beyond the lengths: keeps NaN/Inf stored in padding out of valid outputs.
  q = _zero_invalid(take(q, r.q_index), r.q_len)
  k, v = (_zero_invalid(take(x, r.kv_index), r.kv_len) for x in (k, v))
  if r.groups > 1:
    k, v = (jnp.repeat(x, r.groups, axis=2) for x in (k, v))
  s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(_F32), k.astype(_F32)) * scale   # [B, H, Tq, Tk]
  p = apply_per_head(clip_scores(s, score_clip), acts, head_axis=1)
  m = gdpa_mask(r.batch, Tq, Tk, r.q_len, r.kv_len, window)[:, None]
  p = jnp.where(m, p, 0.0)
  o = jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(_F32))
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
  beyond ``lengths[b]`` output zeros. Any ``T``: the last block may be partial (it holds
  ``T mod block_size`` tokens; the GDPA normalisation stays ``1/block_size``, as if the sequence
  were zero-padded to a multiple of the block). ``score_clip``
  clamps the scores of a GDPA activation to ``[-c, c]`` first (as in ``gdpa_reference``); softmax
  scores are never clipped.

  Args: q, k, v ``[B, T, H, D]``; lengths ``i32[B]``; rotary ``(cos, sin)`` applied to q and k.
  Returns: ``[B, T, H, D]`` in ``q.dtype``.
  """
  del backend, interpret
  B, T0, H, D = q.shape
  if block_size < 1:
    raise ValueError(f"block_size must be >= 1, got {block_size}")
  lengths = jnp.clip(jnp.asarray(T0 if lengths is None else lengths, jnp.int32), 0, T0)
  lengths = jnp.broadcast_to(lengths, (B,))
  q, k, v = (_zero_invalid(x, lengths) for x in (q, k, v))
  if rotary is not None:
    q, k = apply_rotary(q, rotary), apply_rotary(k, rotary)
  nb = -(-T0 // block_size)
  T = nb * block_size                        # zero-pad a partial last block (masked below)
  q, k, v = (jnp.pad(x, ((0, 0), (0, T - T0), (0, 0), (0, 0))) for x in (q, k, v))
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
  return o.reshape(B, T, H, D)[:, :T0].astype(q.dtype)


# ---- softmax attention (full or banded) -------------------------------------------------------

def masked_softmax_attention(q, k, v, mask, scale=None):
  """Masked softmax attention, ``[..., Tq, H, D]`` output.

  ``q [..., Tq, H, D]``, ``k, v [..., Tk, H, D]``, ``mask bool[..., Tq, Tk]``. Scores and softmax
  in float32 with ``scale`` (default ``1/sqrt(D)``); rows without a valid key give zeros.
  """
  D = q.shape[-1]
  scale = D ** -0.5 if scale is None else scale
  s = jnp.einsum("...qhd,...khd->...hqk", q, k, preferred_element_type=_F32) * scale
  m = mask[..., None, :, :]
  s = jnp.where(m, s, -jnp.inf)
  mx = jnp.max(s, axis=-1, keepdims=True)
  e = jnp.where(m, jnp.exp(s - jnp.where(jnp.isfinite(mx), mx, 0.0)), 0.0)
  den = jnp.sum(e, axis=-1, keepdims=True)
  p = e / jnp.where(den > 0, den, 1.0)
  return jnp.einsum("...hqk,...khd->...qhd", p.astype(v.dtype), v,
                    preferred_element_type=_F32).astype(q.dtype)


def band_chunk(window: int) -> int:
  """Query chunk of the banded path: ``c >= window`` (at least 16 rows)."""
  return max(int(window), 16)


def _banded(q, k, v, kv_lo, kv_hi, window, q_offset, scale):
  """Banded softmax attention in ``O(Tq * 3c)``: query chunk ``n`` (``c`` rows) sees the key rows
  ``q_offset + (n - 1) c + [0, 3c)``, which cover its whole band ``|i + q_offset - j| <= window``.
  ``kv_lo / kv_hi i32[B]``: valid keys ``[kv_lo, kv_hi)``."""
  B, Tq, H, D = q.shape
  Tk = k.shape[1]
  c = band_chunk(window)
  nb = -(-Tq // c)
  qb = jnp.pad(q, ((0, 0), (0, nb * c - Tq), (0, 0), (0, 0))).reshape(B, nb, c, H, D)
  base, n_ext = q_offset - c, (nb + 2) * c          # key rows [base, base + n_ext) of k
  lpad, rpad = max(0, -base), max(0, base + n_ext - Tk)

  def three(x):                                      # [B, nb, 3c, H, D]
    x = jnp.pad(x, ((0, 0), (lpad, rpad), (0, 0), (0, 0)))[:, base + lpad:base + lpad + n_ext]
    x = x.reshape(B, nb + 2, c, H, D)
    return jnp.concatenate([x[:, :-2], x[:, 1:-1], x[:, 2:]], axis=2)

  qpos = q_offset + jnp.arange(nb * c).reshape(nb, c)                          # [nb, c]
  kpos = base + jnp.arange(nb)[:, None] * c + jnp.arange(3 * c)[None, :]       # [nb, 3c]
  band = jnp.abs(qpos[:, :, None] - kpos[:, None, :]) <= window                # [nb, c, 3c]
  kval = (kpos[None] >= kv_lo[:, None, None]) & (kpos[None] < kv_hi[:, None, None])
  mask = band[None] & kval[:, :, None, :]                                      # [B, nb, c, 3c]
  o = masked_softmax_attention(qb, three(k), three(v), mask, scale)
  return o.reshape(B, nb * c, H, D)[:, :Tq]


def kv_start_rows(kv_start, n, t):
  """``kv_start`` (first valid key of each k/v row; None = 0) as ``i32[n]`` clipped to [0, t]."""
  if kv_start is None:
    return jnp.zeros((n,), jnp.int32)
  kv_start = jnp.asarray(kv_start, jnp.int32)
  if kv_start.shape != (n,):
    raise ValueError(f"kv_start must have shape ({n},), got {kv_start.shape}")
  return jnp.clip(kv_start, 0, t)


def check_q_offset(q_offset) -> int:
  if int(q_offset) != q_offset or q_offset < 0:
    raise ValueError(f"q_offset must be an integer >= 0, got {q_offset!r}")
  return int(q_offset)


def softmax_attention_reference(q, k, v, *, window=None, scale=None, q_lengths=None,
                                kv_lengths=None, kv_start=None, q_offset=0, q_index=None,
                                kv_index=None, backend="xla", interpret=False):
  """Softmax attention over the valid keys, optionally banded to ``|i + q_offset - j| <= window``.

  Args:
    q: ``[Bq, Tq, H_q, D]``; k, v: ``[Bk, Tk, H_kv, D]`` (GQA: q head h reads k/v head h // G).
    window: keep only keys with ``|i + q_offset - j| <= window`` (None: every valid key).
    scale: multiplies q.k (default ``1/sqrt(D)``).
    q_lengths ``i32[Bq]``, kv_lengths ``i32[Bk]``: valid query rows / keys (indexed like their
      operand, as in ``gdpa_reference``); kv_start ``i32[Bk]``: first valid key (default 0), so
      the valid keys are ``[kv_start, kv_lengths)``.
    q_offset: static position of query row 0 in key coordinates (0 for self-attention; the
      context-parallel path passes its halo width).
    q_index, kv_index: request-level sharing, as in ``gdpa_reference``.
  Returns:
    ``[B, Tq, H_q, D]`` in ``q.dtype``; rows at or beyond ``q_lengths`` and rows that see no key
    are zero. Scores and softmax in float32 (P rounded to v's dtype before P.V).

  With a window and ``Tq > 3 c`` (``c = band_chunk(window)``) the computation is banded (chunks of
  ``c`` queries against ``3c`` keys, ``O(Tq * 3c)``); otherwise one dense masked ``[Tq, Tk]``.
  """
  del backend, interpret
  r = resolve_rows(q, k, v, q_index=q_index, kv_index=kv_index, q_lengths=q_lengths,
                   kv_lengths=kv_lengths, window=window)
  q_offset = check_q_offset(q_offset)
  Tq, Tk = q.shape[1], k.shape[1]
  kv_lo = kv_start_rows(kv_start, k.shape[0], Tk)
  kv_lo = kv_lo if r.kv_index is None else kv_lo[r.kv_index]
  take = lambda x, idx: x if idx is None else jnp.take(x, idx, axis=0)   # AD: scatter-add
  q = _zero_invalid(take(q, r.q_index), r.q_len)
  kvalid = ((jnp.arange(Tk)[None, :] >= kv_lo[:, None])
            & (jnp.arange(Tk)[None, :] < r.kv_len[:, None]))
  k, v = (jnp.where(kvalid[:, :, None, None], take(x, r.kv_index), 0).astype(x.dtype)
          for x in (k, v))
  if r.groups > 1:
    k, v = (jnp.repeat(x, r.groups, axis=2) for x in (k, v))
  if window is not None and Tq > 3 * band_chunk(window):
    o = _banded(q, k, v, kv_lo, r.kv_len, window, q_offset, scale)
  else:
    m = kvalid[:, None, :]
    if window is not None:
      i, j = jnp.arange(Tq) + q_offset, jnp.arange(Tk)
      m = m & (jnp.abs(i[:, None] - j[None, :]) <= window)[None]
    o = masked_softmax_attention(q, k, v, jnp.broadcast_to(m, (r.batch, Tq, Tk)), scale)
  return _zero_invalid(o, r.q_len)
