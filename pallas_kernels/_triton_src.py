"""Triton source of the jax-triton GDPA kernels (see ``triton_gdpa.py``).

Imports ``triton`` at module level: only ``triton_gdpa.kernels()`` (and the sm_90 report)
import this module, lazily. Layout ``[B, T, H, D]`` contiguous (row stride ``H * D``); program
ids: (tile, batch * heads). Arguments shared by the three kernels:

- ``QL, KL``: i32[B] valid q rows / keys per output row; ``QI, KI``: i32[B] q / k-v batch row
  of each output row (read only when ``HAS_QI`` / ``HAS_KI``); ``ACTC``: i32[H_q] activation
  code per q head (read only when ``ACT < 0``, i.e. mixed per-head activations, whose codes are
  the bits of ``ACT_SET``).
- ``HQ = G * HKV`` (GQA: q head h reads k/v head ``h // G``); ``WINDOW = -1``: no window;
  ``CLIP = 0.0``: no score clip; ``FAST``: hardware tanh (``tanh.approx.f32``) for the GELU /
  SiLU family (16-bit inputs only).

Activation codes follow ``activations.CODES``; the formulas mirror ``activations.kernel_fn``.
Masking: loads beyond the lengths fill zeros and every activation has act(0) = 0, so only the
window needs a mask inside the loops. Scales are applied once to the accumulators.
"""
# ruff: noqa: E741

import triton
import triton.language as tl

N_CODES = tl.constexpr(12)


@triton.jit
def _tanh(x, FAST: tl.constexpr):
  if FAST:
    t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                  is_pure=True, pack=1)
  else:
    t = 2.0 * tl.sigmoid(2.0 * x) - 1.0
  return t


@triton.jit
def _sigmoid(x, FAST: tl.constexpr):
  if FAST:
    s = 0.5 + 0.5 * _tanh(0.5 * x, True)
  else:
    s = tl.sigmoid(x)
  return s


@triton.jit
def _tanh_gelu(x, FAST: tl.constexpr):
  x2 = x * x
  t = _tanh(x * (0.7978845608028654 + 0.035677408136300125 * x2), FAST)
  hx = 0.5 * x
  p = hx + hx * t
  g = 0.5 + 0.5 * t + hx * (1.0 - t * t) * (0.7978845608028654 + 0.10703222440890037 * x2)
  return p, g


@triton.jit
def act_grad(x, C: tl.constexpr, FAST: tl.constexpr):
  """(act(x), act'(x)) for the constexpr activation code C (fp32 x)."""
  if C == 0:    # identity
    p = x
    g = x * 0.0 + 1.0
  elif C == 1:  # gelu (erf)
    cdf = 0.5 + 0.5 * tl.math.erf(x * 0.7071067811865476)
    p = x * cdf
    g = cdf + x * 0.3989422804014327 * tl.exp(-0.5 * x * x)
  elif C == 2:  # gelu_tanh (exact tanh)
    p, g = _tanh_gelu(x, False)
  elif C == 3:  # fast_gelu
    p, g = _tanh_gelu(x, FAST)
  elif C == 4:  # fast_gelu_bf16: tanh GELU of the bf16-rounded score
    p, g = _tanh_gelu(x.to(tl.bfloat16).to(tl.float32), FAST)
  elif C == 5:  # gelu_taylor: 0.5x + c2 x^2 + c4 x^4 + c6 x^6
    x2 = x * x
    p = x * (0.5 + x * (0.3989422804014327 + x2 * (-0.06649038006690545
                                                    + x2 * 0.009973557010035818)))
    g = 0.5 + x * (0.7978845608028654 + x2 * (-0.2659615202676218 + x2 * 0.05984134206021491))
  elif C == 6 or C == 7:  # silu, fast_silu
    sg = _sigmoid(x, FAST and C == 7)
    p = x * sg
    g = sg * (1.0 + x * (1.0 - sg))
  elif C == 8:  # relu
    p = tl.maximum(x, 0.0)
    g = tl.where(x > 0, 1.0, 0.0)
  elif C == 9:  # relu2
    r = tl.maximum(x, 0.0)
    p = r * r
    g = 2.0 * r
  elif C == 10:  # leaky_relu (0.01)
    p = tl.where(x >= 0, x, 0.01 * x)
    g = tl.where(x >= 0, 1.0, 0.01)
  else:  # hardswish
    p = x * tl.minimum(tl.maximum(x + 3.0, 0.0), 6.0) * 0.16666666666666666
    g = tl.where(x < -3.0, 0.0, tl.where(x > 3.0, 1.0, x * 0.3333333333333333 + 0.5))
  return p, g


@triton.jit
def act_any(x, code, ACT: tl.constexpr, ACT_SET: tl.constexpr, FAST: tl.constexpr):
  """``act_grad`` for the head's code: constexpr ACT >= 0, or a uniform runtime branch over
  the codes in ACT_SET (mixed per-head activations). Unused results are dead code."""
  if ACT >= 0:
    p, g = act_grad(x, ACT, FAST)
  else:
    p = x
    g = x
    for c in tl.static_range(N_CODES):
      if (ACT_SET >> c) & 1:
        if code == c:
          p, g = act_grad(x, c, FAST)
  return p, g


@triton.jit
def clip_fn(s, CLIP: tl.constexpr):
  """Scores clamped to [-CLIP, CLIP]; CLIP = 0.0 means no clipping."""
  if CLIP > 0.0:
    s = tl.minimum(tl.maximum(s, -CLIP), CLIP)
  return s


@triton.jit
def clip_slope(g, s, CLIP: tl.constexpr):
  """Zero derivative where the raw score s lies outside [-CLIP, CLIP]."""
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
def window_keep(rows, cols, WINDOW: tl.constexpr):
  diff = rows[:, None] - cols[None, :]
  return (diff <= WINDOW) & (diff >= -WINDOW)


@triton.jit
def _program(QL, KL, QI, KI, ACTC, h, b, ACT: tl.constexpr, HAS_QI: tl.constexpr,
             HAS_KI: tl.constexpr):
  """(q_len, kv_len, q batch row, kv batch row, activation code) of output row b, q head h."""
  q_len = tl.load(QL + b)
  kv_len = tl.load(KL + b)
  qb = b
  kb = b
  if HAS_QI:
    qb = tl.load(QI + b)
  if HAS_KI:
    kb = tl.load(KI + b)
  code = ACT
  if ACT < 0:
    code = tl.load(ACTC + h)
  return q_len, kv_len, qb.to(tl.int64), kb.to(tl.int64), code


@triton.jit
def fwd_kernel(Q, K, V, QL, KL, QI, KI, ACTC, O, TQ: tl.constexpr, TK: tl.constexpr,
               HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BQ: tl.constexpr,
               BK: tl.constexpr, ACT: tl.constexpr, ACT_SET: tl.constexpr, WINDOW: tl.constexpr,
               HAS_QI: tl.constexpr, HAS_KI: tl.constexpr, SCALE: tl.constexpr,
               OUT_SCALE: tl.constexpr, CLIP: tl.constexpr, FAST: tl.constexpr,
               PREC: tl.constexpr):
  i, bh = tl.program_id(0), tl.program_id(1)
  b, h = bh // HQ, bh % HQ
  hk = h // (HQ // HKV)
  q_len, kv_len, qb, kb, code = _program(QL, KL, QI, KI, ACTC, h, b, ACT, HAS_QI, HAS_KI)
  rows = i * BQ + tl.arange(0, BQ)
  d = tl.arange(0, D)
  q = tl.load(Q + (qb * TQ * HQ + h) * D + rows[:, None] * (HQ * D) + d[None, :],
              mask=rows[:, None] < q_len, other=0.0)
  acc = tl.zeros((BQ, D), dtype=tl.float32)
  lo, hi = span(i * BQ, BQ, BK, kv_len, WINDOW)
  if i * BQ >= q_len:
    hi = lo
  kv_base = (kb * TK * HKV + hk) * D
  for start in range(lo, hi, BK):
    cols = start + tl.arange(0, BK)
    off = kv_base + cols[:, None] * (HKV * D) + d[None, :]
    kmask = cols[:, None] < kv_len
    k = tl.load(K + off, mask=kmask, other=0.0)
    v = tl.load(V + off, mask=kmask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * SCALE
    if WINDOW >= 0:
      s = tl.where(window_keep(rows, cols, WINDOW), s, 0.0)
    p, _ = act_any(clip_fn(s, CLIP), code, ACT, ACT_SET, FAST)
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PREC)
  tl.store(O + (b.to(tl.int64) * TQ * HQ + h) * D + rows[:, None] * (HQ * D) + d[None, :],
           (acc * OUT_SCALE).to(O.dtype.element_ty), mask=rows[:, None] < TQ)


@triton.jit
def dq_kernel(Q, K, V, DO, QL, KL, QI, KI, ACTC, DQ, TQ: tl.constexpr, TK: tl.constexpr,
              HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BQ: tl.constexpr,
              BK: tl.constexpr, ACT: tl.constexpr, ACT_SET: tl.constexpr, WINDOW: tl.constexpr,
              HAS_QI: tl.constexpr, HAS_KI: tl.constexpr, SCALE: tl.constexpr,
              OUT_SCALE: tl.constexpr, CLIP: tl.constexpr, FAST: tl.constexpr,
              PREC: tl.constexpr):
  i, bh = tl.program_id(0), tl.program_id(1)
  b, h = bh // HQ, bh % HQ
  hk = h // (HQ // HKV)
  q_len, kv_len, qb, kb, code = _program(QL, KL, QI, KI, ACTC, h, b, ACT, HAS_QI, HAS_KI)
  rows = i * BQ + tl.arange(0, BQ)
  d = tl.arange(0, D)
  rmask = rows[:, None] < q_len
  row_off = rows[:, None] * (HQ * D) + d[None, :]
  q = tl.load(Q + (qb * TQ * HQ + h) * D + row_off, mask=rmask, other=0.0)
  o_base = (b.to(tl.int64) * TQ * HQ + h) * D
  do = tl.load(DO + o_base + row_off, mask=rmask, other=0.0)
  dq = tl.zeros((BQ, D), dtype=tl.float32)
  lo, hi = span(i * BQ, BQ, BK, kv_len, WINDOW)
  if i * BQ >= q_len:
    hi = lo
  kv_base = (kb * TK * HKV + hk) * D
  for start in range(lo, hi, BK):
    cols = start + tl.arange(0, BK)
    off = kv_base + cols[:, None] * (HKV * D) + d[None, :]
    kmask = cols[:, None] < kv_len
    k = tl.load(K + off, mask=kmask, other=0.0)
    v = tl.load(V + off, mask=kmask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * SCALE
    _, g = act_any(clip_fn(s, CLIP), code, ACT, ACT_SET, FAST)
    ds = tl.dot(do, tl.trans(v), input_precision=PREC) * clip_slope(g, s, CLIP)
    if WINDOW >= 0:
      ds = tl.where(window_keep(rows, cols, WINDOW), ds, 0.0)
    dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PREC)
  tl.store(DQ + o_base + row_off, (dq * (SCALE * OUT_SCALE)).to(DQ.dtype.element_ty),
           mask=rows[:, None] < TQ)


@triton.jit
def dkv_kernel(Q, K, V, DO, QL, KL, QI, KI, ACTC, DK, DV, TQ: tl.constexpr, TK: tl.constexpr,
               HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BQ: tl.constexpr,
               BK: tl.constexpr, ACT: tl.constexpr, ACT_SET: tl.constexpr,
               WINDOW: tl.constexpr, HAS_QI: tl.constexpr, HAS_KI: tl.constexpr,
               SCALE: tl.constexpr, OUT_SCALE: tl.constexpr, CLIP: tl.constexpr,
               FAST: tl.constexpr, PREC: tl.constexpr):
  """Grid (Tk / BK, B * HKV): one kv tile, all G q heads of its kv head, transposed scores."""
  j, bh = tl.program_id(0), tl.program_id(1)
  b, hk = bh // HKV, bh % HKV
  G: tl.constexpr = HQ // HKV
  q_len, kv_len, qb, kb, code = _program(QL, KL, QI, KI, ACTC, hk * G, b, ACT, HAS_QI, HAS_KI)
  cols = j * BK + tl.arange(0, BK)
  d = tl.arange(0, D)
  col_off = cols[:, None] * (HKV * D) + d[None, :]
  kmask = cols[:, None] < kv_len
  kv_base = (kb * TK * HKV + hk) * D
  k = tl.load(K + kv_base + col_off, mask=kmask, other=0.0)
  v = tl.load(V + kv_base + col_off, mask=kmask, other=0.0)
  dk = tl.zeros((BK, D), dtype=tl.float32)
  dv = tl.zeros((BK, D), dtype=tl.float32)
  lo, hi = span(j * BK, BK, BQ, q_len, WINDOW)
  if j * BK >= kv_len:
    hi = lo
  for g in range(G):
    h = hk * G + g
    if ACT < 0:
      code = tl.load(ACTC + h)
    q_base = (qb * TQ * HQ + h) * D
    o_base = (b.to(tl.int64) * TQ * HQ + h) * D
    for start in range(lo, hi, BQ):
      rows = start + tl.arange(0, BQ)
      row_off = rows[:, None] * (HQ * D) + d[None, :]
      rmask = rows[:, None] < q_len
      q = tl.load(Q + q_base + row_off, mask=rmask, other=0.0)
      do = tl.load(DO + o_base + row_off, mask=rmask, other=0.0)
      s_t = tl.dot(k, tl.trans(q), input_precision=PREC) * SCALE            # [BK, BQ]
      if WINDOW >= 0:
        keep = window_keep(cols, rows, WINDOW)
        s_t = tl.where(keep, s_t, 0.0)
      p_t, g_t = act_any(clip_fn(s_t, CLIP), code, ACT, ACT_SET, FAST)
      dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PREC)
      ds_t = tl.dot(v, tl.trans(do), input_precision=PREC) * clip_slope(g_t, s_t, CLIP)
      if WINDOW >= 0:
        ds_t = tl.where(keep, ds_t, 0.0)
      dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=PREC)
  out = (b.to(tl.int64) * TK * HKV + hk) * D + col_off
  smask = cols[:, None] < TK
  tl.store(DK + out, (dk * (SCALE * OUT_SCALE)).to(DK.dtype.element_ty), mask=smask)
  tl.store(DV + out, (dv * OUT_SCALE).to(DV.dtype.element_ty), mask=smask)
