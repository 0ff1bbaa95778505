"""Pallas kernels on the packed ("jagged") layout (Triton on GPU, ``interpret=True`` on CPU).

Semantics and shapes of the XLA twins in ``jagged.py`` (tokens ``[N, H, D]``, ``Jagged``).
Every grid cell with no real token only stores zeros; a query tile visits only the examples /
key rows it overlaps. Backward: a kernel for block attention; for the others, for now, jax
autodiff of the XLA twin (``custom_vjp``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _poison, activations, jagged
from pallas_kernels.reference import score_clip_value

_F32 = jnp.float32
_NEG = -1e30


class _Cfg(NamedTuple):
  """Static kernel configuration."""
  acts: tuple[str, ...] | None   # None: softmax
  scale: float
  out_scale: float
  tile: int                      # query rows per program (block attention: the block size)
  kv_tile: int                   # key rows per inner step
  interpret: bool
  score_clip: float | None = None
  window: int | None = None
  fast: bool = False


def _prec(dtype):
  return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _pow2(n: int) -> int:
  """Smallest power of two >= max(n, 16) (the GPU dot minimum)."""
  return max(16, 1 << (int(n) - 1).bit_length())


def _fast(x, interpret):
  """Hardware tanh / sigmoid: 16-bit inputs on a GPU."""
  return not interpret and jnp.dtype(x.dtype) in (jnp.bfloat16, jnp.float16)


def _rows(ref, start, n, head, valid):
  """``ref[start:start + n, head, :]`` of a ``[N, H, D]`` ref; rows where ``valid`` is False
  read as zeros (also those past N)."""
  d = ref.shape[-1]
  return plgpu.load(ref.at[pl.ds(start, n), head, :],
                    mask=jnp.broadcast_to(valid[:, None], (n, d)), other=0.0)


def _store(ref, start, head, x, valid):
  n, d = x.shape
  plgpu.store(ref.at[pl.ds(start, n), head, :], x.astype(ref.dtype),
              mask=jnp.broadcast_to(valid[:, None], (n, d)))


def _vec(ref, start, n, fill):
  """``ref[start:start + n]`` of an ``i32[N]`` ref, ``fill`` past its end."""
  return plgpu.load(ref.at[pl.ds(start, n)], mask=start + jnp.arange(n) < ref.shape[0],
                    other=fill)


def _act(s, cfg: _Cfg, head, with_slope=False):
  """The head's activation of the clipped scores (and its slope, zero where clipped)."""
  c = cfg.score_clip
  sc = s if c is None else jnp.minimum(jnp.maximum(s, -c), c)
  out = activations.in_kernel(sc, cfg.acts, head, with_slope=with_slope, fast=cfg.fast)
  if not with_slope or c is None:
    return out
  return out[0], jnp.where(jnp.abs(s) <= c, out[1], 0.0)


def _call(kernel, cfg: _Cfg, scalars, ops, out_shape, grid, name):
  """``pallas_call`` with per-program scalars (blocked on grid axis 0) and whole operands."""
  spec = pl.BlockSpec((1,), lambda i, h: (i,))
  whole = pl.no_block_spec
  return _poison.pallas_call(
      functools.partial(kernel, cfg=cfg), (*scalars, *ops), out_shape=out_shape, grid=grid,
      in_specs=[spec] * len(scalars) + [whole] * len(ops),
      out_specs=(whole,) * len(out_shape) if isinstance(out_shape, tuple) else whole,
      interpret=cfg.interpret, name=name)


def _with_twin_grad(kernel, twin, *args):
  """``kernel(*args)``, differentiated as ``twin`` (the XLA twin) is."""
  f = jax.custom_vjp(kernel)
  f.defvjp(lambda *a: (kernel(*a), a), lambda a, g: jax.vjp(twin, *a)[1](g))
  return f(*args)


# ----------------------------------------------------------------------------- GDPA cross


def _cross_kernel(lo_ref, hi_ref, seg_ref, kvl_ref, q_ref, k_ref, v_ref, o_ref, *, cfg: _Cfg):
  i, h = pl.program_id(0), pl.program_id(1)
  B, bq, bk = kvl_ref.shape[0], cfg.tile, cfg.kv_tile
  seg = _vec(seg_ref, i * bq, bq, B)
  q = _rows(q_ref, i * bq, bq, h, seg < B)
  prec = _prec(q.dtype)

  def example(b, acc):           # keys past kv_lengths[b] load as 0: act(0) = 0, v = 0
    keys = jnp.arange(bk) < kvl_ref[b]
    k = plgpu.load(k_ref.at[b, pl.ds(0, bk), h, :], mask=keys[:, None], other=0.0)
    v = plgpu.load(v_ref.at[b, pl.ds(0, bk), h, :], mask=keys[:, None], other=0.0)
    p = _act(plgpu.dot(q, k, trans_b=True, precision=prec) * cfg.scale, cfg, h)
    p = jnp.where((seg == b)[:, None], p, 0.0)
    return acc + plgpu.dot(p.astype(v.dtype), v, precision=prec)

  acc = lax.fori_loop(lo_ref[0], hi_ref[0] + 1, example,
                      jnp.zeros((bq, q_ref.shape[-1]), _F32))
  _store(o_ref, i * bq, h, acc * cfg.out_scale, i * bq + jnp.arange(bq) < q_ref.shape[0])


def _cross_fwd(cfg: _Cfg, q, k, v, jag, kvl):
  N, H, _ = q.shape
  lo, hi = jagged.tile_examples(jag, cfg.tile)
  return _call(_cross_kernel, cfg, (lo, hi), (jag.seg, kvl, q, k, v),
               jax.ShapeDtypeStruct(q.shape, q.dtype), (lo.shape[0], H), "jagged_gdpa_cross")


def jagged_gdpa_cross_pallas(q, k, v, jag, *, activation="fast_gelu", scale=None,
                             out_scale=1.0, kv_lengths=None, score_clip=None, interpret=False,
                             block_q=64):
  """Pallas ``jagged.jagged_gdpa_cross``: grid (token tiles of ``block_q``, heads); a tile loops
  over the examples it overlaps, reading each one's ``n_kv`` keys once."""
  jagged.check_example_kv(k, v, jag, q)
  N, H, D = q.shape
  kvl = jnp.full((jag.batch,), k.shape[1], jnp.int32) if kv_lengths is None else jnp.clip(
      jnp.asarray(kv_lengths, jnp.int32), 0, k.shape[1])
  cfg = _Cfg(activations.per_head(activation, H), D ** -0.5 if scale is None else float(scale),
             float(out_scale), int(block_q), _pow2(k.shape[1]), bool(interpret),
             score_clip_value(score_clip), fast=_fast(q, interpret))
  kw = dict(activation=activation, scale=scale, out_scale=out_scale, score_clip=score_clip)
  twin = lambda q, k, v, jag, kvl: jagged.jagged_gdpa_cross(q, k, v, jag, kv_lengths=kvl, **kw)
  return _with_twin_grad(functools.partial(_cross_fwd, cfg), twin, q, k, v, jag, kvl)


# ----------------------------------------------------------------------------- GDPA pool


def _pool_kernel(start_ref, end_ref, q_ref, k_ref, v_ref, o_ref, *, cfg: _Cfg):
  b, h = pl.program_id(0), pl.program_id(1)
  S, bk = q_ref.shape[0], cfg.kv_tile
  sq = _pow2(S)
  q = _rows(q_ref, 0, sq, h, jnp.arange(sq) < S)
  start, end = start_ref[0], end_ref[0]
  prec = _prec(q.dtype)

  def tile(j, acc):              # rows past the example's end load as 0: act(0) = 0, v = 0
    rows = start + j * bk + jnp.arange(bk) < end
    k, v = (_rows(r, start + j * bk, bk, h, rows) for r in (k_ref, v_ref))
    p = _act(plgpu.dot(q, k, trans_b=True, precision=prec) * cfg.scale, cfg, h)
    return acc + plgpu.dot(p.astype(v.dtype), v, precision=prec)

  acc = lax.fori_loop(0, lax.div(end - start + bk - 1, bk), tile,
                      jnp.zeros((sq, q_ref.shape[-1]), _F32))
  d = q_ref.shape[-1]
  plgpu.store(o_ref.at[b, pl.ds(0, sq), h, :], (acc * cfg.out_scale).astype(o_ref.dtype),
              mask=jnp.broadcast_to((jnp.arange(sq) < S)[:, None], (sq, d)))


def _pool_fwd(cfg: _Cfg, q, k, v, jag):
  S, H, D = q.shape
  B = jag.batch
  return _call(_pool_kernel, cfg, (jag.offsets[:-1], jag.offsets[1:]), (q, k, v),
               jax.ShapeDtypeStruct((B, S, H, D), q.dtype), (B, H), "jagged_gdpa_pool")


def jagged_gdpa_pool_pallas(q, k, v, jag, *, activation="fast_gelu", scale=None, out_scale=1.0,
                            score_clip=None, interpret=False, block_k=64):
  """Pallas ``jagged.jagged_gdpa_pool``: grid (examples, heads); a program keeps the seeds and
  walks its example's tokens ``[offsets[b], offsets[b+1])`` in tiles of ``block_k``."""
  jagged.check_tokens(jag, k, v)
  S, H, D = q.shape
  cfg = _Cfg(activations.per_head(activation, H), D ** -0.5 if scale is None else float(scale),
             float(out_scale), _pow2(S), int(block_k), bool(interpret),
             score_clip_value(score_clip), fast=_fast(q, interpret))
  kw = dict(activation=activation, scale=scale, out_scale=out_scale, score_clip=score_clip)
  twin = lambda q, k, v, jag: jagged.jagged_gdpa_pool(q, k, v, jag, **kw)
  return _with_twin_grad(functools.partial(_pool_fwd, cfg), twin, q, k, v, jag)


# ----------------------------------------------------------------------------- block attention


def block_table(jag, block_size: int):
  """Work list of the block kernel: ``(start, n_store, n_valid) i32[ceil(N / bs) + B]``. Each
  real block of each example (``start = offsets[b] + m * bs``, ``n_valid`` tokens), then
  zero-writing blocks over the padding tail (``n_valid = 0``), then empty slots (``n_store =
  0``)."""
  B, N, bs = jag.batch, jag.capacity, block_size
  nblk = -(-jag.lengths // bs)
  cum = jnp.cumsum(nblk)
  real = cum[-1]
  slot = jnp.arange(-(-N // bs) + B, dtype=jnp.int32)
  b = jnp.minimum(jnp.searchsorted(cum, slot, side="right"), B - 1)
  m = slot - (cum[b] - nblk[b])
  pad_start = jag.total + (slot - real) * bs
  is_real = slot < real
  start = jnp.where(is_real, jag.offsets[b] + m * bs, jnp.minimum(pad_start, N))
  n_valid = jnp.where(is_real, jnp.minimum(jag.lengths[b] - m * bs, bs), 0)
  n_store = jnp.where(is_real, n_valid, jnp.clip(N - pad_start, 0, bs))
  return tuple(x.astype(jnp.int32) for x in (start, n_store, n_valid))


def _block_probs(q, k, valid, cfg: _Cfg, h, with_slope=False):
  """Scores and attention weights of one block (rows / keys outside ``valid`` zero-filled):
  ``(s, p)`` or, with ``with_slope``, ``(s, p, act'(s) / block)`` (None for softmax)."""
  s = plgpu.dot(q, k, trans_b=True, precision=_prec(q.dtype)) * cfg.scale
  if cfg.acts is None:
    keep = valid[:, None] & valid[None, :]
    e = jnp.where(keep, jnp.exp(jnp.where(keep, s, _NEG) - jnp.max(
        jnp.where(keep, s, _NEG), axis=-1, keepdims=True)), 0.0)
    den = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(den > 0, den, 1.0)
    return (s, p, None) if with_slope else (s, p)
  if not with_slope:             # zero-filled rows / keys: act(0) = 0
    return s, _act(s, cfg, h) * (1.0 / cfg.tile)
  p, slope = _act(s, cfg, h, with_slope=True)
  return s, p * (1.0 / cfg.tile), slope * (1.0 / cfg.tile)


def _block_kernel(start_ref, nst_ref, nva_ref, q_ref, k_ref, v_ref, o_ref, *, cfg: _Cfg):
  h, bs = pl.program_id(1), cfg.tile
  start, r = start_ref[0], jnp.arange(bs)
  valid = r < nva_ref[0]
  q, k, v = (_rows(x, start, bs, h, valid) for x in (q_ref, k_ref, v_ref))
  _, p = _block_probs(q, k, valid, cfg, h)
  _store(o_ref, start, h, plgpu.dot(p.astype(v.dtype), v, precision=_prec(v.dtype)),
         r < nst_ref[0])


def _block_bwd_kernel(start_ref, nst_ref, nva_ref, q_ref, k_ref, v_ref, do_ref, dq_ref, dk_ref,
                      dv_ref, *, cfg: _Cfg):
  """dq, dk, dv of one block from recomputed scores (a block is self-contained)."""
  h, bs = pl.program_id(1), cfg.tile
  start, r = start_ref[0], jnp.arange(bs)
  valid = r < nva_ref[0]
  q, k, v, do = (_rows(x, start, bs, h, valid) for x in (q_ref, k_ref, v_ref, do_ref))
  prec = _prec(q.dtype)
  _, p, slope = _block_probs(q, k, valid, cfg, h, with_slope=True)
  dp = plgpu.dot(do, v, trans_b=True, precision=prec)   # zero outside the valid square
  ds = p * (dp - jnp.sum(p * dp, axis=-1, keepdims=True)) if slope is None else dp * slope
  ds = (ds * cfg.scale).astype(q.dtype)
  out = r < nst_ref[0]
  _store(dv_ref, start, h, plgpu.dot(p.astype(do.dtype), do, trans_a=True, precision=prec), out)
  _store(dq_ref, start, h, plgpu.dot(ds, k, precision=prec), out)
  _store(dk_ref, start, h, plgpu.dot(ds, q, trans_a=True, precision=prec), out)


def _block_fwd(cfg: _Cfg, q, k, v, jag):
  table = block_table(jag, cfg.tile)
  return _call(_block_kernel, cfg, table, (q, k, v), jax.ShapeDtypeStruct(q.shape, q.dtype),
               (table[0].shape[0], q.shape[1]), "jagged_block_attention")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _block_attention(cfg: _Cfg, q, k, v, jag):
  return _block_fwd(cfg, q, k, v, jag)


def _block_attention_bwd(cfg: _Cfg, res, do):
  q, k, v, jag = res
  table = block_table(jag, cfg.tile)
  grads = _call(_block_bwd_kernel, cfg, table, (q, k, v, do.astype(q.dtype)),
                (jax.ShapeDtypeStruct(q.shape, q.dtype),) * 3, (table[0].shape[0], q.shape[1]),
                "jagged_block_attention_bwd")
  return (*grads, jax.tree.map(lambda _: None, jag))


_block_attention.defvjp(lambda cfg, q, k, v, jag: (_block_fwd(cfg, q, k, v, jag), (q, k, v, jag)),
                        _block_attention_bwd)


def jagged_block_attention_pallas(q, k, v, jag, *, block_size=64, activation="softmax",
                                  score_clip=None, interpret=False):
  """Pallas ``jagged.jagged_block_attention``: grid (``block_table`` slots, heads); a program
  is one block of one example (its tokens are contiguous in the buffer), so no pair of tokens
  from different blocks or examples is ever scored. The backward is a kernel on the same grid
  (scores recomputed; dq, dk, dv of the block)."""
  jagged.check_tokens(jag, q, k, v)
  H, D = q.shape[1:]
  if block_size < 1 or (not interpret and (block_size < 16 or block_size & (block_size - 1))):
    raise ValueError(f"block_size must be a power of two >= 16 on a GPU (any size >= 1 in "
                     f"interpret mode), got {block_size}")
  acts = None if activation == "softmax" else activations.per_head(activation, H)
  cfg = _Cfg(acts, D ** -0.5, 1.0, int(block_size), int(block_size), bool(interpret),
             None if acts is None else score_clip_value(score_clip), fast=_fast(q, interpret))
  return _block_attention(cfg, q, k, v, jag)


# ----------------------------------------------------------------------------- softmax


def key_ranges(jag, tile: int, window):
  """``(klo, khi) i32[ceil(N / tile)]``: the buffer rows a query tile's keys lie in (its
  examples' tokens, within ``window`` of its rows); ``khi <= klo`` past ``offsets[B]``."""
  lo, hi = jagged.tile_examples(jag, tile)
  B = jag.batch
  klo = jag.offsets[jnp.minimum(lo, B)]
  khi = jnp.where(hi >= lo, jag.offsets[jnp.clip(hi + 1, 0, B)], klo)
  if window is not None:
    starts = jnp.arange(lo.shape[0], dtype=jnp.int32) * tile
    klo = jnp.maximum(klo, starts - window)
    khi = jnp.minimum(khi, jnp.minimum(starts + tile, jag.total) + window)
  return klo.astype(jnp.int32), khi.astype(jnp.int32)


def _flash_step(carry, s, keep, v, prec):
  """Online softmax: ``(acc, running max m, running sum l)`` after one key tile's scores ``s``
  (pairs outside ``keep`` excluded). The same update as ``pallas_softmax``'s forward."""
  acc, m, l = carry
  m_new = jnp.maximum(m, jnp.max(jnp.where(keep, s, _NEG), axis=1))
  p = jnp.where(keep, jnp.exp(s - m_new[:, None]), 0.0)
  alpha = jnp.exp(m - m_new)
  return (acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v, precision=prec), m_new,
          l * alpha + jnp.sum(p, axis=1))


def _softmax_kernel(klo_ref, khi_ref, seg_ref, q_ref, k_ref, v_ref, o_ref, *, cfg: _Cfg, B):
  i, h = pl.program_id(0), pl.program_id(1)
  bq, bk = cfg.tile, cfg.kv_tile
  rows = i * bq + jnp.arange(bq)
  seg_q = _vec(seg_ref, i * bq, bq, B)
  q = _rows(q_ref, i * bq, bq, h, seg_q < B)
  klo, khi = klo_ref[0], khi_ref[0]
  prec = _prec(q.dtype)

  def tile(j, carry):            # online softmax over the key tiles in [klo, khi)
    cols = j * bk + jnp.arange(bk)
    inside = (cols >= klo) & (cols < khi)
    seg_k = jnp.where(inside, _vec(seg_ref, j * bk, bk, B), -1)
    keep = seg_q[:, None] == seg_k[None, :]
    if cfg.window is not None:
      keep &= jnp.abs(rows[:, None] - cols[None, :]) <= cfg.window
    k, v = (_rows(r, j * bk, bk, h, inside) for r in (k_ref, v_ref))
    return _flash_step(carry, plgpu.dot(q, k, trans_b=True, precision=prec) * cfg.scale, keep,
                       v, prec)

  init = (jnp.zeros((bq, q_ref.shape[-1]), _F32), jnp.full((bq,), _NEG, _F32),
          jnp.zeros((bq,), _F32))
  acc, _, l = lax.fori_loop(lax.div(klo, bk), jnp.where(khi > klo, lax.div(khi + bk - 1, bk),
                                                        lax.div(klo, bk)), tile, init)
  o = jnp.where((l > 0)[:, None], acc / jnp.where(l > 0, l, 1.0)[:, None], 0.0)
  _store(o_ref, i * bq, h, o, rows < q_ref.shape[0])


def _softmax_fwd(cfg: _Cfg, q, k, v, jag):
  klo, khi = key_ranges(jag, cfg.tile, cfg.window)
  return _call(functools.partial(_softmax_kernel, B=jag.batch), cfg, (klo, khi),
               (jag.seg, q, k, v), jax.ShapeDtypeStruct(q.shape, q.dtype),
               (klo.shape[0], q.shape[1]), "jagged_softmax_attention")


def jagged_softmax_attention_pallas(q, k, v, jag, *, window=None, scale=None, interpret=False,
                                    block_q=64, block_k=64):
  """Pallas ``jagged.jagged_softmax_attention`` (flash attention): grid (query tiles of
  ``block_q``, heads); a tile walks only the ``block_k`` key tiles of ``key_ranges`` (its
  examples, within the band): ``O(N * (block_q + 2 window))`` with a window."""
  jagged.check_tokens(jag, q, k, v)
  if window is not None and window < 0:
    raise ValueError(f"window must be >= 0, got {window}")
  D = q.shape[-1]
  cfg = _Cfg(None, D ** -0.5 if scale is None else float(scale), 1.0, int(block_q),
             int(block_k), bool(interpret), window=None if window is None else int(window))
  twin = lambda q, k, v, jag: jagged.jagged_softmax_attention(q, k, v, jag, window=window,
                                                              scale=scale)
  return _with_twin_grad(functools.partial(_softmax_fwd, cfg), twin, q, k, v, jag)
