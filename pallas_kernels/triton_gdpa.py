"""GDPA forward and backward written in Triton for this project, run through jax-triton.

STATUS: UNTESTED ON GPU. Written without a GPU (jax-triton is not installed in the CPU
environment); its tests (``tests/pallas_kernels/test_triton_gpu.py``) are marked ``gpu``. The
maths mirrors the Pallas kernels (``pallas_gdpa.py``), which are tested in interpret mode.

``jax_triton`` and ``triton`` are imported lazily on the first call, never at module import.
Layout ``[B, T, H, D]`` contiguous; ``D`` must be a power of two. No padding is needed: loads are
masked by the lengths and stores by the sequence bounds. Per-head activation tuples run one launch
per distinct activation on the matching heads. Backward: a dq kernel (grid over q tiles) and a
dk/dv kernel (grid over kv tiles) that recompute the scores; no softmax state.
"""

from __future__ import annotations

import functools
import inspect
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import activations
from pallas_kernels.reference import check_gdpa_args

ACT_CODES = {"identity": 0, "gelu": 1, "fast_gelu": 2, "silu": 3, "relu": 4, "relu2": 5}


@functools.cache
def _triton():
  """Imports jax_triton/triton and defines the kernels (once)."""
  try:
    import jax_triton as jt
    import triton
    import triton.language as tl
  except ImportError as e:  # pragma: no cover - depends on the GPU image
    raise ImportError("gdpa backend 'triton' needs jax-triton (pip install 'kunlun-jax[gpu]', "
                      "jax-triton==0.3.1 with triton 3.6) and a CUDA GPU") from e

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
                 OUT_SCALE: tl.constexpr, PREC: tl.constexpr):
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
      p = tl.where(mask_fn(rows, cols, q_len, kv_len, WINDOW), act_fn(s, ACT), 0.0)
      acc += tl.dot(p.to(v.dtype), v, input_precision=PREC)
    tl.store(O + ((b * TQ + rows[:, None]) * H + h) * D + d[None, :],
             (acc * OUT_SCALE).to(O.dtype.element_ty), mask=(rows < TQ)[:, None])

  @triton.jit
  def dq_kernel(Q, K, V, DO, QL, KL, DQ, TQ: tl.constexpr, TK: tl.constexpr, H: tl.constexpr,
                D: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr, ACT: tl.constexpr,
                WINDOW: tl.constexpr, QB: tl.constexpr, SCALE: tl.constexpr,
                OUT_SCALE: tl.constexpr, PREC: tl.constexpr):
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
      ds = tl.where(mask_fn(rows, cols, q_len, kv_len, WINDOW), dp * slope_fn(s, ACT), 0.0)
      dq += tl.dot((ds * SCALE).to(k.dtype), k, input_precision=PREC)
    tl.store(DQ + ((b * TQ + rows[:, None]) * H + h) * D + d[None, :],
             dq.to(DQ.dtype.element_ty), mask=(rows < TQ)[:, None])

  @triton.jit
  def dkv_kernel(Q, K, V, DO, QL, KL, DK, DV, TQ: tl.constexpr, TK: tl.constexpr,
                 H: tl.constexpr, D: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr,
                 ACT: tl.constexpr, WINDOW: tl.constexpr, QB: tl.constexpr, SCALE: tl.constexpr,
                 OUT_SCALE: tl.constexpr, PREC: tl.constexpr):
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
      p = tl.where(m, act_fn(s, ACT), 0.0) * OUT_SCALE
      dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PREC)
      dp = tl.dot(do, tl.trans(v), input_precision=PREC) * OUT_SCALE
      ds = tl.where(m, dp * slope_fn(s, ACT), 0.0) * SCALE
      dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PREC)
    out_off = ((b * TK + cols[:, None]) * H + h) * D + d[None, :]
    tl.store(DK + out_off, dk.to(DK.dtype.element_ty), mask=(cols < TK)[:, None])
    tl.store(DV + out_off, dv.to(DV.dtype.element_ty), mask=(cols < TK)[:, None])

  return jt, triton, fwd_kernel, dq_kernel, dkv_kernel


class _Cfg(NamedTuple):
  act: int
  scale: float
  out_scale: float
  window: int  # -1: none
  broadcast_q: bool
  bq: int
  bk: int
  num_warps: int
  num_stages: int


def _call(jt, kernel, args, out_shapes, grid, cfg: _Cfg, q, k):
  """One ``jax_triton.triton_call`` (``out_shape=`` in 0.3.x, ``out_type=`` in 0.4.x)."""
  B, TK, H, D = k.shape
  out_kw = ("out_type" if "out_type" in inspect.signature(jt.triton_call).parameters
            else "out_shape")
  prec = "ieee" if q.dtype == jnp.float32 else "tf32"
  return jt.triton_call(
      *args, kernel=kernel, grid=grid, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
      TQ=q.shape[1], TK=TK, H=H, D=D, BQ=cfg.bq, BK=cfg.bk, ACT=cfg.act, WINDOW=cfg.window,
      QB=int(cfg.broadcast_q), SCALE=cfg.scale, OUT_SCALE=cfg.out_scale, PREC=prec,
      **{out_kw: out_shapes})


def _fwd(cfg, q, k, v, ql, kl):
  jt, triton, fwd_kernel, _, _ = _triton()
  B, TK, H, D = k.shape
  out = jax.ShapeDtypeStruct((B, q.shape[1], H, D), q.dtype)
  grid = (triton.cdiv(q.shape[1], cfg.bq), B * H)
  return _call(jt, fwd_kernel, (q, k, v, ql, kl), out, grid, cfg, q, k)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gdpa(cfg, q, k, v, ql, kl):
  return _fwd(cfg, q, k, v, ql, kl)


def _gdpa_fwd(cfg, q, k, v, ql, kl):
  return _fwd(cfg, q, k, v, ql, kl), (q, k, v, ql, kl)


def _gdpa_bwd(cfg, res, do):
  q, k, v, ql, kl = res
  jt, triton, _, dq_kernel, dkv_kernel = _triton()
  B, TK, H, D = k.shape
  TQ = q.shape[1]
  do = do.astype(q.dtype)
  dq_dtype = jnp.float32 if cfg.broadcast_q else q.dtype
  dq = _call(jt, dq_kernel, (q, k, v, do, ql, kl),
             jax.ShapeDtypeStruct((B, TQ, H, D), dq_dtype),
             (triton.cdiv(TQ, cfg.bq), B * H), cfg, q, k)
  if cfg.broadcast_q:
    dq = dq.sum(0, keepdims=True).astype(q.dtype)
  dk, dv = _call(jt, dkv_kernel, (q, k, v, do, ql, kl),
                 (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
                 (triton.cdiv(TK, cfg.bk), B * H), cfg, q, k)
  return dq, dk, dv, None, None


_gdpa.defvjp(_gdpa_fwd, _gdpa_bwd)


def gdpa_triton(q, k, v, *, activation="fast_gelu", scale=None, out_scale=1.0, q_lengths=None,
                kv_lengths=None, window=None, broadcast_q=False, backend="triton",
                interpret=False, block_q=64, block_k=64, num_warps=4, num_stages=2):
  """Triton GDPA (GPU only, untested); semantics of ``reference.gdpa_reference``."""
  del backend
  if interpret:
    raise ValueError("gdpa backend 'triton' has no interpret mode; use backend='pallas'")
  check_gdpa_args(q, k, v, broadcast_q)
  B, TK, H, D = k.shape
  TQ = q.shape[1]
  if D & (D - 1):
    raise ValueError(f"gdpa backend 'triton' needs a power-of-two head_dim, got {D}")
  acts = activations.per_head(activation, H)
  full = lambda n: jnp.full((B,), n, jnp.int32)
  ql = full(TQ) if q_lengths is None else jnp.clip(jnp.asarray(q_lengths, jnp.int32), 0, TQ)
  kl = full(TK) if kv_lengths is None else jnp.clip(jnp.asarray(kv_lengths, jnp.int32), 0, TK)
  tile = lambda n, b: min(b, max(16, 1 << (max(n, 1) - 1).bit_length()))
  base = _Cfg(0, D ** -0.5 if scale is None else float(scale), float(out_scale),
              -1 if window is None else int(window), bool(broadcast_q), tile(TQ, block_q),
              tile(TK, block_k), num_warps, num_stages)
  if len(set(acts)) == 1:
    return _gdpa(base._replace(act=ACT_CODES[acts[0]]), q, k, v, ql, kl)
  out = jnp.zeros((B, TQ, H, D), q.dtype)
  for a in sorted(set(acts)):
    heads = jnp.array([h for h in range(H) if acts[h] == a])
    q_h, k_h, v_h = (jnp.take(x, heads, axis=2) for x in (q, k, v))
    o = _gdpa(base._replace(act=ACT_CODES[a]), q_h, k_h, v_h, ql, kl)
    out = out.at[:, :, heads].set(o)
  return out
