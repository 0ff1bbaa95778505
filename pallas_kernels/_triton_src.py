"""Triton source of the jax-triton GDPA kernels (see ``triton_gdpa.py``). UNTESTED ON GPU.

Imports ``triton`` at module level: only ``triton_gdpa.kernels()`` imports this module, lazily.
Layout ``[B, T, H, D]`` contiguous; program ids: (tile, batch * heads). ``ACT`` codes follow
``triton_gdpa.ACT_CODES``; ``WINDOW = -1`` means no window; ``QB`` = broadcast q; ``CLIP = 0.0``
means no score clip.
"""
# ruff: noqa: E741

import triton
import triton.language as tl


@triton.jit
def _tanh(x):
  return 2.0 * tl.sigmoid(2.0 * x) - 1.0

@triton.jit
def act_fn(s, ACT: tl.constexpr):
  if ACT == 0:
    p = s
  elif ACT == 1:
    p = 0.5 * s * (1.0 + tl.math.erf(s * 0.7071067811865476))
  elif ACT == 2:
    p = 0.5 * s * (1.0 + _tanh(0.7978845608028654 * (s + 0.044715 * s * s * s)))
  elif ACT == 3:
    p = s * tl.sigmoid(s)
  elif ACT == 4:
    p = tl.maximum(s, 0.0)
  else:
    r = tl.maximum(s, 0.0)
    p = r * r
  return p

@triton.jit
def slope_fn(s, ACT: tl.constexpr):
  if ACT == 0:
    g = s * 0.0 + 1.0
  elif ACT == 1:
    g = (0.5 * (1.0 + tl.math.erf(s * 0.7071067811865476))
         + s * 0.3989422804014327 * tl.exp(-0.5 * s * s))
  elif ACT == 2:
    t = _tanh(0.7978845608028654 * (s + 0.044715 * s * s * s))
    g = 0.5 * (1.0 + t) + 0.5 * s * (1.0 - t * t) * 0.7978845608028654 * (
        1.0 + 0.134145 * s * s)
  elif ACT == 3:
    sg = tl.sigmoid(s)
    g = sg * (1.0 + s * (1.0 - sg))
  elif ACT == 4:
    g = tl.where(s > 0, 1.0, 0.0)
  else:
    g = 2.0 * tl.maximum(s, 0.0)
  return g

@triton.jit
def clip_fn(s, CLIP: tl.constexpr):
  """Scores clamped to [-CLIP, CLIP]; CLIP = 0.0 means no clipping."""
  if CLIP > 0.0:
    s = tl.minimum(tl.maximum(s, -CLIP), CLIP)
  return s

@triton.jit
def clip_slope_fn(s, CLIP: tl.constexpr, ACT: tl.constexpr):
  """act'(clip(s)) * clip'(s): zero where the raw score s lies outside [-CLIP, CLIP]."""
  g = slope_fn(clip_fn(s, CLIP), ACT)
  if CLIP > 0.0:
    g = tl.where((s >= -CLIP) & (s <= CLIP), g, 0.0)
  return g

@triton.jit
def span(start, TILE: tl.constexpr, OTHER: tl.constexpr, other_len, WINDOW: tl.constexpr):
  """[lo, hi) element range (multiples of OTHER) of the other axis visible from the tile."""
  if WINDOW >= 0:
    end = tl.minimum(other_len, start + TILE + WINDOW)
    lo = (tl.maximum(start - WINDOW, 0) // OTHER) * OTHER
  else:
    end = other_len
    lo = start * 0
  hi = tl.maximum(((end + OTHER - 1) // OTHER) * OTHER, lo)
  return lo, hi

@triton.jit
def mask_fn(rows, cols, q_len, kv_len, WINDOW: tl.constexpr):
  m = (rows < q_len)[:, None] & (cols < kv_len)[None, :]
  if WINDOW >= 0:
    diff = rows[:, None] - cols[None, :]
    m = m & (diff <= WINDOW) & (diff >= -WINDOW)
  return m

@triton.jit
def fwd_kernel(Q, K, V, QL, KL, O, TQ: tl.constexpr, TK: tl.constexpr, H: tl.constexpr,
               D: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr, ACT: tl.constexpr,
               WINDOW: tl.constexpr, QB: tl.constexpr, SCALE: tl.constexpr,
               OUT_SCALE: tl.constexpr, CLIP: tl.constexpr, PREC: tl.constexpr):
  i, bh = tl.program_id(0), tl.program_id(1)
  b, h = bh // H, bh % H
  q_len, kv_len = tl.load(QL + b), tl.load(KL + b)
  rows = i * BQ + tl.arange(0, BQ)
  d = tl.arange(0, D)
  qb = b * (1 - QB)
  q = tl.load(Q + ((qb * TQ + rows[:, None]) * H + h) * D + d[None, :],
              mask=(rows < q_len)[:, None], other=0.0)
  acc = tl.zeros((BQ, D), dtype=tl.float32)
  lo, hi = span(i * BQ, BQ, BK, kv_len, WINDOW)
  if i * BQ >= q_len:
    hi = lo
  for start in range(lo, hi, BK):
    cols = start + tl.arange(0, BK)
    kv_off = ((b * TK + cols[:, None]) * H + h) * D + d[None, :]
    kmask = (cols < kv_len)[:, None]
    k = tl.load(K + kv_off, mask=kmask, other=0.0)
    v = tl.load(V + kv_off, mask=kmask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * SCALE
    p = tl.where(mask_fn(rows, cols, q_len, kv_len, WINDOW), act_fn(clip_fn(s, CLIP), ACT), 0.0)
    acc += tl.dot(p.to(v.dtype), v, input_precision=PREC)
  tl.store(O + ((b * TQ + rows[:, None]) * H + h) * D + d[None, :],
           (acc * OUT_SCALE).to(O.dtype.element_ty), mask=(rows < TQ)[:, None])

@triton.jit
def dq_kernel(Q, K, V, DO, QL, KL, DQ, TQ: tl.constexpr, TK: tl.constexpr, H: tl.constexpr,
              D: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr, ACT: tl.constexpr,
              WINDOW: tl.constexpr, QB: tl.constexpr, SCALE: tl.constexpr,
              OUT_SCALE: tl.constexpr, CLIP: tl.constexpr, PREC: tl.constexpr):
  i, bh = tl.program_id(0), tl.program_id(1)
  b, h = bh // H, bh % H
  q_len, kv_len = tl.load(QL + b), tl.load(KL + b)
  rows = i * BQ + tl.arange(0, BQ)
  d = tl.arange(0, D)
  rmask = (rows < q_len)[:, None]
  q = tl.load(Q + ((b * (1 - QB) * TQ + rows[:, None]) * H + h) * D + d[None, :],
              mask=rmask, other=0.0)
  do = tl.load(DO + ((b * TQ + rows[:, None]) * H + h) * D + d[None, :], mask=rmask, other=0.0)
  dq = tl.zeros((BQ, D), dtype=tl.float32)
  lo, hi = span(i * BQ, BQ, BK, kv_len, WINDOW)
  if i * BQ >= q_len:
    hi = lo
  for start in range(lo, hi, BK):
    cols = start + tl.arange(0, BK)
    kv_off = ((b * TK + cols[:, None]) * H + h) * D + d[None, :]
    kmask = (cols < kv_len)[:, None]
    k = tl.load(K + kv_off, mask=kmask, other=0.0)
    v = tl.load(V + kv_off, mask=kmask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * SCALE
    dp = tl.dot(do, tl.trans(v), input_precision=PREC) * OUT_SCALE
    ds = tl.where(mask_fn(rows, cols, q_len, kv_len, WINDOW), dp * clip_slope_fn(s, CLIP, ACT),
                  0.0)
    dq += tl.dot((ds * SCALE).to(k.dtype), k, input_precision=PREC)
  tl.store(DQ + ((b * TQ + rows[:, None]) * H + h) * D + d[None, :],
           dq.to(DQ.dtype.element_ty), mask=(rows < TQ)[:, None])

@triton.jit
def dkv_kernel(Q, K, V, DO, QL, KL, DK, DV, TQ: tl.constexpr, TK: tl.constexpr,
               H: tl.constexpr, D: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr,
               ACT: tl.constexpr, WINDOW: tl.constexpr, QB: tl.constexpr, SCALE: tl.constexpr,
               OUT_SCALE: tl.constexpr, CLIP: tl.constexpr, PREC: tl.constexpr):
  j, bh = tl.program_id(0), tl.program_id(1)
  b, h = bh // H, bh % H
  q_len, kv_len = tl.load(QL + b), tl.load(KL + b)
  cols = j * BK + tl.arange(0, BK)
  d = tl.arange(0, D)
  kv_off = ((b * TK + cols[:, None]) * H + h) * D + d[None, :]
  kmask = (cols < kv_len)[:, None]
  k = tl.load(K + kv_off, mask=kmask, other=0.0)
  v = tl.load(V + kv_off, mask=kmask, other=0.0)
  dk = tl.zeros((BK, D), dtype=tl.float32)
  dv = tl.zeros((BK, D), dtype=tl.float32)
  lo, hi = span(j * BK, BK, BQ, q_len, WINDOW)
  if j * BK >= kv_len:
    hi = lo
  for start in range(lo, hi, BQ):
    rows = start + tl.arange(0, BQ)
    rmask = (rows < q_len)[:, None]
    q = tl.load(Q + ((b * (1 - QB) * TQ + rows[:, None]) * H + h) * D + d[None, :],
                mask=rmask, other=0.0)
    do = tl.load(DO + ((b * TQ + rows[:, None]) * H + h) * D + d[None, :], mask=rmask,
                 other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * SCALE
    m = mask_fn(rows, cols, q_len, kv_len, WINDOW)
    p = tl.where(m, act_fn(clip_fn(s, CLIP), ACT), 0.0) * OUT_SCALE
    dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PREC)
    dp = tl.dot(do, tl.trans(v), input_precision=PREC) * OUT_SCALE
    ds = tl.where(m, dp * clip_slope_fn(s, CLIP, ACT), 0.0) * SCALE
    dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PREC)
  out_off = ((b * TK + cols[:, None]) * H + h) * D + d[None, :]
  tl.store(DK + out_off, dk.to(DK.dtype.element_ty), mask=(cols < TK)[:, None])
  tl.store(DV + out_off, dv.to(DV.dtype.element_ty), mask=(cols < TK)[:, None])
