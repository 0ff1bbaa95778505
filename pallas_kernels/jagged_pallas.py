"""Pallas kernels on the packed ("jagged") layout (Triton on GPU, ``interpret=True`` on CPU).

Semantics and shapes of the XLA twins in ``jagged.py`` (tokens ``[N, H, D]``, ``Jagged``).
Every grid cell with no real token only stores zeros; a query tile visits only the examples /
key rows it overlaps. Every op has Pallas backward kernels (``custom_vjp``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _poison, activations, jagged, norm_qkv, tuning
from pallas_kernels._common import dot, examples_per_program, loop_spans, pad_pow2, precision
from pallas_kernels.reference import layer_norm_dx, score_clip_value

_F32 = jnp.float32
_NEG = -1e30
# Examples per program of the GDPA pool's seed-gradient kernels (at least; _dq_examples): their
# float32 partials, written and summed after, shrink by this factor, doubled while the grid keeps
# POOL_DQ_PROGRAMS programs (mid b256: 4, 256 programs of 4 heads; b1024 and prod: 8, 512)
POOL_DQ_EXAMPLES, POOL_DQ_PROGRAMS = 4, 512
# Columns of x per step where the pool projects its keys and values itself (_kv_tiles)
PROJ_COLS = 128


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
  proj: bool = False             # the pool's k, v projected in the kernels from x (_kv_tiles)
  eps: float = norm_qkv.EPS      # and x's RMSNorm epsilon
  cols: int = PROJ_COLS          # and x's columns per step
  through: bool = False          # GDPA cross: q passed through, its cotangent added to dq
  q_norm: bool = False           # GDPA cross: q = LayerNorm(x), here (_ln_rows, _q_rows)
  ln_split: bool = False         # and its statistics held in the backward: dq = r du (_held)


class _DotCfg(NamedTuple):
  """What ``_common.dot`` reads: the operands' dtype, interpret mode."""
  dtype: object
  interpret: bool


def _fast(x, interpret):
  """Hardware tanh / sigmoid: 16-bit inputs on a GPU."""
  return not interpret and jnp.dtype(x.dtype) in (jnp.bfloat16, jnp.float16)


def _rows(ref, start, n, head, valid):
  """``ref[start:start + n, head, :]`` of a ``[N, H, D]`` ref; rows where ``valid`` is False
  read as zeros (also those past N)."""
  d = ref.shape[-1]
  return plgpu.load(ref.at[pl.ds(start, n), head, :],
                    mask=jnp.broadcast_to(valid[:, None], (n, d)), other=0.0)


def _q_rows(ref, st, start, n, head, valid):
  """The query rows of ``head`` (``_rows``); with ``st = (mu_ref, r_ref)`` (``cfg.q_norm``),
  ``ref`` holds ``x [N, H, D]`` and the rows are its LayerNorm's, ``(x - mu) r`` with the rows'
  float32 statistics ``f32[N]`` each (the forward kernel's, ``_ln_rows``), rounded to x's dtype:
  the query the norm would have written."""
  x = _rows(ref, start, n, head, valid)
  if st is None:
    return x
  mu, r = (_vec(a, start, n, 0.0)[:, None] for a in st)
  return ((x.astype(_F32) - mu) * r).astype(ref.dtype)


def _held(dq, st, start, cfg: _Cfg):
  """``dq`` scaled by the rows' ``r`` where the LayerNorm's statistics are held
  (``cfg.ln_split``: the cotangent of x through ``(x - mu) r`` at constant ``mu, r``); else
  ``dq``."""
  if not cfg.ln_split:
    return dq
  return dq * _vec(st[1], start, dq.shape[0], 0.0)[:, None]


def _split_st(refs, cfg: _Cfg):
  """``(st, rest)``: a cross backward kernel's LayerNorm statistics refs (``cfg.q_norm``: the two
  after q; else None) and its other refs."""
  return (tuple(refs[:2]), refs[2:]) if cfg.q_norm else (None, refs)


def _ln_rows(ref, start, n, head, valid, cfg: _Cfg):
  """The forward's query tile with ``cfg.q_norm``: ``(rows of head, mu, r)``, the rows'
  LayerNorm statistics over all ``H D`` columns of ``x [N, H, D]`` in float32, and the head's
  rows normalised, rounded to x's dtype. Every head's tile is loaded once (outside the kernel's
  loops: no pipeline buffers) and held alone: its mean and the squares about it, combined over
  the heads (Chan et al.'s pairwise update: the squares about the row mean without a second
  pass; at prod's H 4 x d_h 128, holding every tile for two passes spilled 1.5 KB)."""
  H, D = ref.shape[1:]
  means, m2 = [], 0.0
  for j in range(H):
    a = _rows(ref, start, n, jnp.int32(j), valid).astype(_F32)
    m = jnp.mean(a, axis=1)
    means.append(m)
    m2 = m2 + jnp.sum(jnp.square(a - m[:, None]), axis=1)
  mu = sum(means) / H
  var = (m2 + D * sum(jnp.square(m - mu) for m in means)) / (H * D)
  r = lax.rsqrt(var + cfg.eps)
  x = _rows(ref, start, n, head, valid).astype(_F32)
  return ((x - mu[:, None]) * r[:, None]).astype(ref.dtype), mu, r


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


def _call(kernel, cfg: _Cfg, scalars, ops, out_shape, grid, name, stages,
          warps=tuning.JAGGED_WARPS, scalar_axis: int = 0):
  """``pallas_call`` with per-program scalars (blocked on grid axis ``scalar_axis``) and whole
  operands, ``stages`` pipeline stages (``_plan``), ``warps`` warps per program."""
  spec = pl.BlockSpec((1,), lambda *ids: (ids[scalar_axis],))
  whole = pl.no_block_spec
  return _poison.pallas_call(
      functools.partial(kernel, cfg=cfg), (*scalars, *ops), out_shape=out_shape, grid=grid,
      in_specs=[spec] * len(scalars) + [whole] * len(ops),
      out_specs=(whole,) * len(out_shape) if isinstance(out_shape, tuple) else whole,
      interpret=cfg.interpret, name=name,
      compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages))


# ----------------------------------------------------------------------------- shared memory
#
# A kernel keeps in shared memory the [rows, D] tiles it loads once and, per pipeline stage, those
# its loop loads every step (``tuning.smem_estimate``). ``_plan`` picks the most stages (at most
# jax's default 3) at which it fits the GPU's shared memory, splitting a dimension loaded whole
# (GDPA's n_kv example keys, the pool's S seeds) into the largest chunks that fit: a contracted
# dimension becomes an inner loop over chunks (``_chunks``), an independent one a third grid axis
# (``_chunk_grid``). One chunk (every mid shape) is the unsplit kernel.


def _row(x) -> int:
  """Bytes of one ``[D]`` row of ``x``."""
  return x.shape[-1] * jnp.dtype(x.dtype).itemsize


def _plan(name, cfg: _Cfg, need, whole=None, floor=64):
  """``(chunk rows, num_stages)`` of kernel ``name`` needing ``need(chunk) = (resident,
  streamed)`` bytes; ``whole``: the power-of-two rows of the dimension it may split (None:
  none), split to fewer than ``floor`` rows only at one stage. ``tuning.fit_smem`` against the
  GPU's limit (a CPU: the target's), one loop copy per distinct activation of ``cfg``."""
  return tuning.fit_smem(need, whole, copies=len(set(cfg.acts or ("",))), floor=floor, what=name)


def _span(start, n):
  """Row indices ``start + [0, n)`` (no add for a static 0)."""
  return jnp.arange(n) if isinstance(start, int) and start == 0 else start + jnp.arange(n)


def _chunks(n, size, body, carry):
  """``body(start, carry)`` over the ``size``-row chunks of ``n`` rows (one call when one chunk
  holds them all)."""
  if size >= n:
    return body(0, carry)
  return lax.fori_loop(0, pl.cdiv(n, size), lambda j, c: body(j * size, c), carry)


def _chunk_grid(size, n):
  """The grid axis over ``size``-row chunks of ``n`` rows: () for one chunk."""
  return () if size >= n else (pl.cdiv(n, size),)


def _chunk_start(size, n):
  """First row of this program's chunk (grid axis 2, ``_chunk_grid``)."""
  return 0 if size >= n else pl.program_id(2) * size


# ----------------------------------------------------------------------------- GDPA cross / pool
#
# Two loops serve the four GDPA kernels: a token tile walks the examples it overlaps (cross
# forward and dq, pool dk/dv) and an example walks its token tiles (pool forward and dq, cross
# dk/dv). Zero-filled rows need no mask: act(0) = 0 and a zero v (or do) row adds nothing.


def _ex_rows(ref, b, n, h, count, start=0):
  """Rows ``[start, start + n)`` of ``ref[b, :, h, :]`` (an example's keys, seeds' gradients),
  zero at and past row ``count``."""
  valid = jnp.broadcast_to((_span(start, n) < count)[:, None], (n, ref.shape[-1]))
  return plgpu.load(ref.at[b, pl.ds(start, n), h, :], mask=valid, other=0.0)


def _ex_store(ref, b, h, x, count, start=0):
  n, d = x.shape
  plgpu.store(ref.at[b, pl.ds(start, n), h, :], x.astype(ref.dtype),
              mask=jnp.broadcast_to((_span(start, n) < count)[:, None], (n, d)))


def _scores(a, b, cfg: _Cfg, h, with_slope=False):
  """``act(clip(scale a b^T))`` (and its slope) of two row tiles."""
  s = plgpu.dot(a, b, trans_b=True, precision=precision(a.dtype)) * cfg.scale
  return _act(s, cfg, h, with_slope)


def _dot(a, b, **kw):
  return plgpu.dot(a.astype(b.dtype), b, precision=precision(b.dtype), **kw)


def _tile_loop(lo_ref, hi_ref, seg_ref, n_ex, cfg: _Cfg, body, init):
  """Runs ``body(b, on_b bool[tile], carry)`` over the examples this token tile overlaps."""
  seg = _vec(seg_ref, pl.program_id(0) * cfg.tile, cfg.tile, n_ex)
  return lax.fori_loop(lo_ref[0], hi_ref[0] + 1, lambda b, c: body(b, seg == b, c), init)


def _example_loop(start_ref, end_ref, cfg: _Cfg, body, init):
  """Runs ``body(start, rows bool[kv_tile], carry)`` over this example's token tiles."""
  return _token_loop(start_ref[0], end_ref[0], cfg, body, init)


def _token_loop(start, end, cfg: _Cfg, body, init):
  """Runs ``body(start, rows bool[kv_tile], carry)`` over the token tiles of ``[start, end)``."""
  bk = cfg.kv_tile

  def step(j, c):
    s = start + j * bk
    return body(s, s + jnp.arange(bk) < end, c)

  return lax.fori_loop(0, lax.div(end - start + bk - 1, bk), step, init)


def _own_rows(seg_ref, cfg: _Cfg, n_ex):
  """(first row, bool[tile] real-token rows) of this token tile."""
  i = pl.program_id(0)
  return i * cfg.tile, _vec(seg_ref, i * cfg.tile, cfg.tile, n_ex) < n_ex


def _cross_kernel(lo_ref, hi_ref, seg_ref, kvl_ref, q_ref, k_ref, v_ref, o_ref, *st_refs,
                  cfg: _Cfg):
  """``cfg.q_norm``: q holds x, normalised here (``_ln_rows``); the head-0 programs also write
  the rows' statistics (``st_refs``: mu, r ``f32[N]``) for the backward kernels."""
  h, B = pl.program_id(1), kvl_ref.shape[0]
  r0, real = _own_rows(seg_ref, cfg, B)
  if cfg.q_norm:
    q, *st = _ln_rows(q_ref, r0, cfg.tile, h, real, cfg)
    inside = (r0 + jnp.arange(cfg.tile) < q_ref.shape[0]) & (h == 0)
    for ref, a in zip(st_refs, st, strict=True):
      plgpu.store(ref.at[pl.ds(r0, cfg.tile)], a, mask=inside)
  else:
    q = _rows(q_ref, r0, cfg.tile, h, real)

  def example(b, on_b, acc):
    def chunk(start, acc):                    # kv_tile keys of the example
      k, v = (_ex_rows(x, b, cfg.kv_tile, h, kvl_ref[b], start) for x in (k_ref, v_ref))
      return acc + _dot(jnp.where(on_b[:, None], _scores(q, k, cfg, h), 0.0), v)
    return _chunks(k_ref.shape[1], cfg.kv_tile, chunk, acc)

  acc = _tile_loop(lo_ref, hi_ref, seg_ref, B, cfg, example, jnp.zeros(q.shape, _F32))
  _store(o_ref, r0, h, acc * cfg.out_scale, r0 + jnp.arange(cfg.tile) < q_ref.shape[0])


def _cross_dq_kernel(lo_ref, hi_ref, seg_ref, kvl_ref, q_ref, *refs, cfg: _Cfg):
  st, (k_ref, v_ref, do_ref, *refs) = _split_st(refs, cfg)
  dt_ref, dq_ref = refs if cfg.through else (None, *refs)
  h, B = pl.program_id(1), kvl_ref.shape[0]
  r0, real = _own_rows(seg_ref, cfg, B)
  q, do = _q_rows(q_ref, st, r0, cfg.tile, h, real), _rows(do_ref, r0, cfg.tile, h, real)

  def example(b, on_b, dq):
    def chunk(start, dq):
      k, v = (_ex_rows(x, b, cfg.kv_tile, h, kvl_ref[b], start) for x in (k_ref, v_ref))
      _, slope = _scores(q, k, cfg, h, with_slope=True)
      ds = jnp.where(on_b[:, None], _dot(do, v, trans_b=True) * slope, 0.0)
      return dq + _dot(ds, k)
    return _chunks(k_ref.shape[1], cfg.kv_tile, chunk, dq)

  dq = _tile_loop(lo_ref, hi_ref, seg_ref, B, cfg, example, jnp.zeros(q.shape, _F32))
  rows = r0 + jnp.arange(cfg.tile) < q_ref.shape[0]
  dq = _held(dq * (cfg.scale * cfg.out_scale), st, r0, cfg)
  _store(dq_ref, r0, h, _plus_through(dq, dt_ref, r0, h, rows), rows)


def _plus_through(dq, dt_ref, start, h, rows):
  """``dq`` plus the pass-through's cotangent rows (``cfg.through``; else ``dq``)."""
  return dq if dt_ref is None else dq + _rows(dt_ref, start, dq.shape[0], h, rows).astype(_F32)


def _cross_dkv_kernel(start_ref, end_ref, kvl_ref, q_ref, *refs, cfg: _Cfg):
  st, (k_ref, v_ref, do_ref, dk_ref, dv_ref) = _split_st(refs, cfg)
  b, h = pl.program_id(0), pl.program_id(1)
  r0 = _chunk_start(cfg.tile, k_ref.shape[1])                # this program's kv rows
  k, v = (_ex_rows(x, b, cfg.tile, h, kvl_ref[0], r0) for x in (k_ref, v_ref))

  def tile(start, rows, carry):
    dk, dv = carry
    q, do = _q_rows(q_ref, st, start, cfg.kv_tile, h, rows), _rows(do_ref, start, cfg.kv_tile,
                                                                   h, rows)
    p_t, slope_t = _scores(k, q, cfg, h, with_slope=True)                # [n_kv, tile]
    return dk + _dot(_dot(v, do, trans_b=True) * slope_t, q), dv + _dot(p_t, do)

  zeros = jnp.zeros(k.shape, _F32)
  dk, dv = _example_loop(start_ref, end_ref, cfg, tile, (zeros, zeros))
  _ex_store(dk_ref, b, h, dk * (cfg.scale * cfg.out_scale), k_ref.shape[1], r0)
  _ex_store(dv_ref, b, h, dv * cfg.out_scale, k_ref.shape[1], r0)


def _zero_tail(total, n, i, h, cfg: _Cfg, *refs, src=None):
  """Program ``i`` of ``n`` zeroes its share of rows ``[total, N)`` of the ``[N, H, D]`` refs at
  head ``h``: the rows past ``offsets[B]``, which belong to no example (a one-kernel backward
  that writes per example leaves them to this); with ``src``, copies its rows there instead."""
  N = refs[0].shape[0]
  share = lax.div(N - total + n - 1, n)
  lo = jnp.minimum(total + i * share, N)
  blank = jnp.zeros((cfg.kv_tile, refs[0].shape[-1]), _F32)

  def zero(start, rows, c):
    for r in refs:
      _store(r, start, h, blank if src is None else _rows(src, start, cfg.kv_tile, h, rows),
             rows)
    return c

  _token_loop(lo, jnp.minimum(lo + share, N), cfg, zero, 0)


def _cross_bwd_kernel(off_ref, kvl_ref, q_ref, *refs, cfg: _Cfg):
  """``_cross_dkv_kernel`` with the keys whole (one chunk), which also writes its example's
  tokens' dq: a token scores only its own example's keys, all of which this program holds, so
  each token tile's ``dS^T`` gives its dq as well (``dS k``), and q, dO are read once. The rows
  past ``offsets[B]`` belong to no example: program ``b`` zeroes the ``b``-th share of them (with
  ``cfg.through``, writes the pass-through's cotangent there)."""
  st, (k_ref, v_ref, do_ref, *refs) = _split_st(refs, cfg)
  dt_ref, dq_ref, dk_ref, dv_ref = refs if cfg.through else (None, *refs)
  b, h, B = pl.program_id(0), pl.program_id(1), kvl_ref.shape[0]
  k, v = (_ex_rows(x, b, cfg.tile, h, kvl_ref[b]) for x in (k_ref, v_ref))

  def tile(start, rows, carry):
    dk, dv = carry
    q, do = _q_rows(q_ref, st, start, cfg.kv_tile, h, rows), _rows(do_ref, start, cfg.kv_tile,
                                                                   h, rows)
    p_t, slope_t = _scores(k, q, cfg, h, with_slope=True)                # [n_kv, tile]
    ds_t = _dot(v, do, trans_b=True) * slope_t
    dq = _held(_dot(ds_t, k, trans_a=True) * (cfg.scale * cfg.out_scale), st, start, cfg)
    _store(dq_ref, start, h, _plus_through(dq, dt_ref, start, h, rows), rows)
    return dk + _dot(ds_t, q), dv + _dot(p_t, do)

  zeros = jnp.zeros(k.shape, _F32)
  dk, dv = _token_loop(off_ref[b], off_ref[b + 1], cfg, tile, (zeros, zeros))
  _ex_store(dk_ref, b, h, dk * (cfg.scale * cfg.out_scale), k_ref.shape[1])
  _ex_store(dv_ref, b, h, dv * cfg.out_scale, k_ref.shape[1])
  _zero_tail(off_ref[B], B, b, h, cfg, dq_ref, src=dt_ref)


def _cross_fwd(cfg: _Cfg, q, k, v, jag, kvl):
  """o; with ``cfg.q_norm``, ``(o, mu, r)`` (the LayerNorm's row statistics, ``f32[N]`` each)."""
  lo, hi = jagged.tile_examples(jag, cfg.tile)
  r = _row(q)
  ck, stages = _plan("jagged_gdpa_cross", cfg, lambda c: (cfg.tile * r, 2 * c * r), cfg.kv_tile)
  o = jax.ShapeDtypeStruct(q.shape, q.dtype)
  st = (jax.ShapeDtypeStruct(q.shape[:1], _F32),) * 2 if cfg.q_norm else ()
  return _call(_cross_kernel, cfg._replace(kv_tile=ck), (lo, hi), (jag.seg, kvl, q, k, v),
               (o, *st) if st else o, (lo.shape[0], q.shape[1]), "jagged_gdpa_cross", stages)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gdpa_cross(cfg: _Cfg, q, k, v, jag, kvl):
  return _cross_fwd(cfg, q, k, v, jag, kvl)


def _cross_bwd_plans(cfg: _Cfg, q, k, t: int):
  """The backward's kernels and their ``_plan``s, with ``t`` more token tiles streamed (the
  pass-through's cotangent): ``(merged, (keys chunk, stages), (dq's chunk, stages))``, the
  last None where one kernel runs (an example's keys fit whole)."""
  r = _row(q)
  st = 8 * cfg.tile if cfg.q_norm else 0      # a tile's LayerNorm statistics, 2 x f32 a row
  need = lambda c, t=0: (2 * c * r, (2 + t) * cfg.tile * r + st)
  # one kernel where an example's keys fit whole, at the most stages that hold them (dq's dot
  # takes dS^T [keys, tile] as its transposed operand: one more resident tile)
  merged = lambda c: (need(c)[0] + c * cfg.tile * q.dtype.itemsize, need(c, t)[1])
  ck, stages = _plan("jagged_gdpa_cross_bwd", cfg, merged, cfg.kv_tile, floor=cfg.kv_tile)
  if ck >= k.shape[1]:
    return True, (ck, stages), None
  # keys in chunks (a third grid axis for dk / dv): dq on the token tiles, as the forward
  kv = _plan("jagged_gdpa_cross_dkv", cfg, need, cfg.kv_tile)
  dq = _plan("jagged_gdpa_cross_dq", cfg, lambda c: ((2 + t) * cfg.tile * r + st, 2 * c * r),
             cfg.kv_tile)
  return False, kv, dq


def _through_fits(cfg: _Cfg, q, k) -> bool:
  """Whether the backward reads the pass-through's cotangent at the plans it takes without it."""
  try:
    return _cross_bwd_plans(cfg, q, k, 1) == _cross_bwd_plans(cfg, q, k, 0)
  except ValueError:                # no tile fits the GPU's shared memory with it
    return False


def _gdpa_cross_bwd(cfg: _Cfg, res, do, dt=None):
  """dq, dk, dv (and the descriptor's and kv lengths' None); with ``dt`` (the pass-through's
  cotangent, ``_gdpa_cross_through``) the kernels write ``dq + dt`` where reading it keeps
  their tiles and pipeline stages (mid: 3 stages either way); else (prod's d_h 128: the one
  backward kernel at 2 stages, 1 with it) XLA adds it after them, as without the
  pass-through."""
  q, k, v, jag, kvl, *st = res
  do = do.astype(q.dtype)
  if dt is not None and not _through_fits(cfg, q, k):
    dq, *rest = _gdpa_cross_bwd(cfg, res, do)
    return (dq + dt.astype(dq.dtype), *rest)
  dts = () if dt is None else (dt.astype(q.dtype),)
  cfg = cfg._replace(through=dt is not None)
  plans = _cross_bwd_plans(cfg, q, k, len(dts))
  H = q.shape[1]
  kv_shapes = (jax.ShapeDtypeStruct(k.shape, k.dtype),) * 2
  one, (ck, stages), dq_plan = plans
  if one:                           # the keys whole: one kernel, dq from each example's program
    per_ex = cfg._replace(tile=ck, kv_tile=cfg.tile)           # kv rows x token tiles
    # 8 warps: at 4 mid's per-head activations spill; at 8 nothing spills at mid, and prod
    # spills less than the dq and dk / dv kernels did at 4 (ptxas sm_90, fused_layers_h200.md)
    dq, dk, dv = _call(_cross_bwd_kernel, per_ex, (), (jag.offsets, kvl, q, *st, k, v, do, *dts),
                       (jax.ShapeDtypeStruct(q.shape, q.dtype), *kv_shapes), (jag.batch, H),
                       "jagged_gdpa_cross_bwd", stages, warps=8)
    return dq, dk, dv, jax.tree.map(lambda _: None, jag), None
  per_ex = cfg._replace(tile=ck, kv_tile=cfg.tile, through=False)
  lo, hi = jagged.tile_examples(jag, cfg.tile)
  cq, dq_stages = dq_plan
  dq = _call(_cross_dq_kernel, cfg._replace(kv_tile=cq), (lo, hi),
             (jag.seg, kvl, q, *st, k, v, do, *dts), jax.ShapeDtypeStruct(q.shape, q.dtype),
             (lo.shape[0], H), "jagged_gdpa_cross_dq", dq_stages)
  dk, dv = _call(_cross_dkv_kernel, per_ex, (jag.offsets[:-1], jag.offsets[1:], kvl),
                 (q, *st, k, v, do), kv_shapes, (jag.batch, H, *_chunk_grid(ck, k.shape[1])),
                 "jagged_gdpa_cross_dkv", stages)
  return dq, dk, dv, jax.tree.map(lambda _: None, jag), None


_gdpa_cross.defvjp(lambda cfg, *a: (_cross_fwd(cfg, *a), a), _gdpa_cross_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gdpa_cross_through(cfg: _Cfg, q, k, v, jag, kvl):
  """``(_gdpa_cross(q, ...), q)``: q passed through, the two cotangents of q summed in the
  backward kernels (no pass of their own)."""
  return _cross_fwd(cfg, q, k, v, jag, kvl), q


_gdpa_cross_through.defvjp(
    lambda cfg, *a: ((_cross_fwd(cfg, *a), a[0]), a),
    lambda cfg, res, cts: _gdpa_cross_bwd(cfg, res, *cts))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gdpa_cross_ln(cfg: _Cfg, x, k, v, jag, kvl):
  """``_gdpa_cross(LayerNorm(x), ...)`` with the norm applied in the kernels (``cfg.q_norm``):
  the normalised query is never written. The forward kernel computes the rows' statistics from
  every head's tile of x and writes them (8 bytes a row) for the backward kernels, which
  normalise their tiles with them (their tiles and pipeline stages are ``_gdpa_cross``'s plus
  that vector pair) and write the query's cotangent; the norm's backward
  (``reference.layer_norm_dx``, behind a barrier as ``kunlun.nn.norms.layer_norm``'s) is
  XLA's, which fuses it into the pass that adds x's other cotangents. With ``cfg.ln_split`` the
  statistics are held (``reference.layer_norm_held``): the kernels write ``r du`` and nothing
  follows them."""
  return _cross_fwd(cfg, x, k, v, jag, kvl)[0]


def _gdpa_cross_ln_fwd(cfg: _Cfg, x, k, v, jag, kvl):
  o, *st = _cross_fwd(cfg, x, k, v, jag, kvl)
  return o, (x, k, v, jag, kvl, *st)


def _gdpa_cross_ln_bwd(cfg: _Cfg, res, do):
  du, *rest = _gdpa_cross_bwd(cfg, res, do)
  if cfg.ln_split:                # r du from the kernels: the statistics' part is the caller's
    return (du, *rest)
  x = res[0]
  # rows of d elements (XLA fuses the norm's row reductions with their consumers where the rows
  # are the last axis), behind a barrier: no CSE with the forward's values
  x2, du2 = lax.optimization_barrier((x.reshape(x.shape[0], -1), du.reshape(x.shape[0], -1)))
  return (layer_norm_dx(x2, du2.astype(_F32), cfg.eps).reshape(x.shape), *rest)


_gdpa_cross_ln.defvjp(_gdpa_cross_ln_fwd, _gdpa_cross_ln_bwd)


def _cross_cfg(q, k, activation, scale, out_scale, score_clip, interpret, block_q) -> _Cfg:
  H, D = q.shape[1:]
  return _Cfg(activations.per_head(activation, H), D ** -0.5 if scale is None else float(scale),
              float(out_scale), int(block_q), pad_pow2(k.shape[1]), bool(interpret),
              score_clip_value(score_clip), fast=_fast(q, interpret))


def cross_through_fits(q, k, *, activation="fast_gelu", score_clip=None, interpret=False,
                       block_q=64, **_) -> bool:
  """Whether ``jagged_gdpa_cross_pallas(through=True)``'s backward kernels read the
  pass-through's cotangent at the chunks and pipeline stages they take without it (mid: yes;
  prod's d_h 128: the one-kernel backward would drop from 2 stages to 1). ``q``, ``k``: arrays
  or shape structs (the global ones serve: the plan depends on widths, not on token counts)."""
  return _through_fits(_cross_cfg(q, k, activation, None, 1.0, score_clip, interpret, block_q),
                       q, k)


def jagged_gdpa_cross_pallas(q, k, v, jag, *, activation="fast_gelu", scale=None,
                             out_scale=1.0, kv_lengths=None, score_clip=None, interpret=False,
                             block_q=64, through=False, q_norm=None, ln_split=False):
  """Pallas ``jagged.jagged_gdpa_cross``: grid (token tiles of ``block_q``, heads); a tile loops
  over the examples it overlaps, reading each one's ``n_kv`` keys once (in chunks where they do
  not fit shared memory, ``_plan``). Backward: dk, dv on (examples, heads), each walking its
  example's token tiles and writing their dq too; where the keys must be split, (examples,
  heads, key chunks) and dq on the forward's grid. ``through``: returns ``(o, q)``, q passed
  through (PFFN's residual reads the query), and the backward kernels write dq plus the
  pass-through's cotangent, which XLA added in a pass of its own (where ``cross_through_fits``;
  elsewhere XLA adds the two after the kernels, inside this op). ``q_norm`` (an epsilon): the
  query is the LayerNorm of each token's row (``reference.layer_norm``), computed inside the
  kernels, forward and backward (``_gdpa_cross_ln``); not with ``through``. ``ln_split``
  (with ``q_norm``): the norm's statistics held in the backward (``reference.layer_norm_held``;
  x's cotangent is ``r du``, written by the kernels), for a caller whose x is
  ``jagged_gdpa_pool_proj_pallas(through=eps)``'s pass-through, which adds the rest."""
  jagged.check_example_kv(k, v, jag, q)
  kvl = jnp.full((jag.batch,), k.shape[1], jnp.int32) if kv_lengths is None else jnp.clip(
      jnp.asarray(kv_lengths, jnp.int32), 0, k.shape[1])
  cfg = _cross_cfg(q, k, activation, scale, out_scale, score_clip, interpret, block_q)
  if q_norm is not None:
    if through:
      raise ValueError("jagged_gdpa_cross: q_norm and through do not combine (a caller that "
                       "reads the normalised query computes it itself)")
    return _gdpa_cross_ln(cfg._replace(q_norm=True, eps=float(q_norm), ln_split=bool(ln_split)),
                          q, k, v, jag, kvl)
  if ln_split:
    raise ValueError("jagged_gdpa_cross: ln_split needs q_norm")
  return (_gdpa_cross_through if through else _gdpa_cross)(cfg, q, k, v, jag, kvl)


def _kv_tiles(refs, start, n, h, valid, cfg: _Cfg):
  """Head ``h``'s k, v rows ``[start, start + n)``, ``[n, D]`` each (rows where ``valid`` is
  False zero): loaded from ``refs = (k, v)`` ``[N, H, D]``, or (``cfg.proj``) projected here
  from ``refs = (x [N, d], w_k, w_v [d, H, D])`` as ``pallas_kernels.norm_qkv.norm_proj_pallas``
  computes them: ``h = rms_norm(x)`` rounded to the weights' dtype, ``h w[:, h]`` accumulated in
  float32 and rounded. ``x`` in column chunks of ``cfg.cols``: one pass for the rows' RMS
  statistic, one for the products (the same values at any chunk width)."""
  if not cfg.proj:
    return tuple(_rows(r, start, n, h, valid) for r in refs)
  x_ref, wk_ref, wv_ref = refs
  d, dt = x_ref.shape[1], wk_ref.dtype
  dc = min(d, cfg.cols)
  ok = jnp.broadcast_to(valid[:, None], (n, dc))
  cols = lambda c0: plgpu.load(x_ref.at[pl.ds(start, n), pl.ds(c0, dc)], mask=ok,
                               other=0.0).astype(_F32)
  at = _DotCfg(dt, cfg.interpret)

  def square(cs, ss):
    xc = cols(cs[0])
    return ss + jnp.sum(xc * xc, axis=1)

  r = lax.rsqrt(loop_spans(d, dc, square, jnp.zeros((n,), _F32)) / d + cfg.eps)[:, None]

  def project(cs, kv):
    hc = cols(cs[0]) * r                                 # rounded to dt by dot, as norm_proj's
    w = [plgpu.load(a.at[pl.ds(cs[0], dc), h, :]) for a in (wk_ref, wv_ref)]
    return tuple(acc + dot(hc, wi, at) for acc, wi in zip(kv, w, strict=True))

  D = wk_ref.shape[-1]
  zero = jnp.zeros((n, D), _F32)
  return tuple(a.astype(dt) for a in loop_spans(d, dc, project, (zero, zero)))


def _pool_kernel(start_ref, end_ref, q_ref, *refs, cfg: _Cfg):
  """``cfg.proj``: the operands ``x, w_k, w_v`` and the outputs ``o`` and, where the backward
  reads them (``_recomputes``), ``k, v``: the projected k, v stored for it (by the first seed
  chunk's program). Grid (heads, examples[, seed chunks]): an example's heads are neighbouring
  programs, which read its rows (``x``'s, projecting) at about the same time."""
  n_in = 3 if cfg.proj else 2
  kv_refs, (o_ref, *kv_out) = refs[:n_in], refs[n_in:]
  h, b, S = pl.program_id(0), pl.program_id(1), q_ref.shape[0]
  s0 = _chunk_start(cfg.tile, S)                             # this program's seeds
  q = _rows(q_ref, s0, cfg.tile, h, _span(s0, cfg.tile) < S)

  def tile(start, rows, acc):
    k, v = _kv_tiles(kv_refs, start, cfg.kv_tile, h, rows, cfg)
    if kv_out:
      for ref, t in zip(kv_out, (k, v), strict=True):
        _store(ref, start, h, t, rows & (s0 == 0))
    return acc + _dot(_scores(q, k, cfg, h), v)

  acc = _example_loop(start_ref, end_ref, cfg, tile, jnp.zeros(q.shape, _F32))
  _ex_store(o_ref, b, h, acc * cfg.out_scale, S, s0)


def _pool_dq_kernel(off_ref, q_ref, k_ref, v_ref, do_ref, dq_ref, *, cfg: _Cfg, per: int):
  """The seed gradient summed over ``per`` consecutive examples, ``[ceil(B / per), S, H, D]``
  (summed over the groups after): fewer float32 partials written and read back than one per
  example."""
  i, h, S, B = pl.program_id(0), pl.program_id(1), q_ref.shape[0], do_ref.shape[0]
  s0 = _chunk_start(cfg.tile, S)
  q = _rows(q_ref, s0, cfg.tile, h, _span(s0, cfg.tile) < S)

  def example(j, dq):
    b = i * per + j
    bb = jnp.minimum(b, B - 1)                 # past the batch: no tokens, nothing added
    do = _ex_rows(do_ref, bb, cfg.tile, h, S, s0)

    def tile(start, rows, dq):
      k, v = (_rows(x, start, cfg.kv_tile, h, rows) for x in (k_ref, v_ref))
      _, slope = _scores(q, k, cfg, h, with_slope=True)
      return dq + _dot(_dot(do, v, trans_b=True) * slope, k)

    start = off_ref[bb]
    return _token_loop(start, jnp.where(b < B, off_ref[bb + 1], start), cfg, tile, dq)

  dq = lax.fori_loop(0, per, example, jnp.zeros(q.shape, _F32))
  _ex_store(dq_ref, i, h, dq * (cfg.scale * cfg.out_scale), S, s0)


def _pool_dkv_kernel(lo_ref, hi_ref, seg_ref, q_ref, k_ref, v_ref, do_ref, dk_ref, dv_ref, *,
                     cfg: _Cfg):
  h, B, S = pl.program_id(1), do_ref.shape[0], q_ref.shape[0]
  r0, real = _own_rows(seg_ref, cfg, B)
  k, v = (_rows(x, r0, cfg.tile, h, real) for x in (k_ref, v_ref))
  sq = cfg.kv_tile                                           # seeds per step

  def seeds(q, do, on_b, carry):
    dk, dv = carry
    p_t, slope_t = _scores(k, q, cfg, h, with_slope=True)                # [tile, sq]
    p_t = jnp.where(on_b[:, None], p_t, 0.0)
    ds_t = jnp.where(on_b[:, None], _dot(v, do, trans_b=True) * slope_t, 0.0)
    return dk + _dot(ds_t, q), dv + _dot(p_t, do)

  if sq >= S:                                                # all seeds, loaded once
    q = _rows(q_ref, 0, sq, h, jnp.arange(sq) < S)
    example = lambda b, on_b, c: seeds(q, _ex_rows(do_ref, b, sq, h, S), on_b, c)
  else:
    def example(b, on_b, carry):
      def chunk(s0, c):
        q = _rows(q_ref, s0, sq, h, _span(s0, sq) < S)
        return seeds(q, _ex_rows(do_ref, b, sq, h, S, s0), on_b, c)
      return _chunks(S, sq, chunk, carry)

  zeros = jnp.zeros(k.shape, _F32)
  dk, dv = _tile_loop(lo_ref, hi_ref, seg_ref, B, cfg, example, (zeros, zeros))
  out = r0 + jnp.arange(cfg.tile) < k_ref.shape[0]
  _store(dk_ref, r0, h, dk * (cfg.scale * cfg.out_scale), out)
  _store(dv_ref, r0, h, dv * cfg.out_scale, out)


def _pool_bwd_kernel(off_ref, q_ref, *refs, cfg: _Cfg, per: int):
  """``_pool_dq_kernel`` with the seeds whole (one chunk), which also writes its examples' tokens'
  dk, dv: a token is scored only by its own example's seeds, all of which this program holds,
  so each token tile's ``dS^T`` gives its dk (``dS^T q``) and dv (``P^T dO``) whole, and k, v are
  read once, or (``cfg.proj``) projected once more from ``x`` (``_kv_tiles``: ``refs`` start
  ``x, w_k, w_v`` instead of ``k, v``). Grid (heads, example groups): a group's heads are
  neighbouring programs, which read its ``x`` rows at about the same time (from L2 after the
  first). The rows past ``offsets[B]`` belong to no example: program ``i`` zeroes the ``i``-th
  share of them."""
  n_in = 3 if cfg.proj else 2
  kv_refs, (do_ref, dq_ref, dk_ref, dv_ref) = refs[:n_in], refs[n_in:]
  h, i, S, B = pl.program_id(0), pl.program_id(1), q_ref.shape[0], do_ref.shape[0]
  sq = cfg.tile
  q = _rows(q_ref, 0, sq, h, jnp.arange(sq) < S)

  def example(j, dq):
    b = i * per + j
    bb = jnp.minimum(b, B - 1)                 # past the batch: no tokens, nothing added
    do = _ex_rows(do_ref, bb, sq, h, S)

    def tile(start, rows, dq):
      k, v = _kv_tiles(kv_refs, start, cfg.kv_tile, h, rows, cfg)
      p_t, slope_t = _scores(k, q, cfg, h, with_slope=True)              # [tile, seeds]
      ds_t = _dot(v, do, trans_b=True) * slope_t
      _store(dk_ref, start, h, _dot(ds_t, q) * (cfg.scale * cfg.out_scale), rows)
      _store(dv_ref, start, h, _dot(p_t, do) * cfg.out_scale, rows)
      return dq + _dot(ds_t, k, trans_a=True)

    start = off_ref[bb]
    return _token_loop(start, jnp.where(b < B, off_ref[bb + 1], start), cfg, tile, dq)

  dq = lax.fori_loop(0, per, example, jnp.zeros(q.shape, _F32))
  _ex_store(dq_ref, i, h, dq * (cfg.scale * cfg.out_scale), S)
  _zero_tail(off_ref[B], pl.num_programs(1), i, h, cfg, dk_ref, dv_ref)


def _streamed(cfg: _Cfg, kv, r):
  """Shared-memory bytes a pool kernel's token loop loads per step: the k, v tiles, or
  (``cfg.proj``) an ``x`` column chunk and the two weights' rows for it."""
  if not cfg.proj:
    return 2 * cfg.kv_tile * r
  x, w = kv[0], kv[1]
  dc = min(x.shape[1], cfg.cols)
  return (cfg.kv_tile * dc + 2 * dc * w.shape[-1]) * jnp.dtype(w.dtype).itemsize


def _pool_fwd(cfg: _Cfg, q, kv, jag, store: bool = True):
  """``kv``: ``(k, v)``, or (``cfg.proj``) ``(x, w_k, w_v)``, then returning ``(o, k, v)``
  (``store``) or ``o``."""
  S, H, D = q.shape
  r = _row(q)
  sc, stages = _plan("jagged_gdpa_pool", cfg, lambda c: (c * r, _streamed(cfg, kv, r)),
                     cfg.tile)
  o = jax.ShapeDtypeStruct((jag.batch, S, H, D), q.dtype)
  outs = ((o, *(jax.ShapeDtypeStruct((kv[0].shape[0], H, D), q.dtype),) * 2)
          if cfg.proj and store else o)
  return _call(_pool_kernel, cfg._replace(tile=sc), (jag.offsets[:-1], jag.offsets[1:]),
               (q, *kv), outs, (H, jag.batch, *_chunk_grid(sc, S)), "jagged_gdpa_pool", stages,
               warps=8 if cfg.proj else tuning.JAGGED_WARPS, scalar_axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gdpa_pool(cfg: _Cfg, q, k, v, jag):
  return _pool_fwd(cfg, q, (k, v), jag)


def _gdpa_pool_bwd(cfg: _Cfg, res, do):
  q, k, v, jag = res
  return (*_pool_grads(cfg, q, (k, v), jag, do), jax.tree.map(lambda _: None, jag))


def _dq_examples(B: int, H: int) -> int:
  """Examples per program of the pool's seed-gradient kernels (``POOL_DQ_EXAMPLES`` doubled while
  ``B H / per`` keeps ``POOL_DQ_PROGRAMS`` programs)."""
  return examples_per_program(B * H, POOL_DQ_EXAMPLES, POOL_DQ_PROGRAMS)


def _bwd_plan(cfg: _Cfg, q, kv):
  """``(cfg, seed chunk, stages)`` of the pool's one-kernel backward (``_pool_bwd_kernel``) on
  ``kv``: ``(k, v)`` or (``cfg.proj``) ``(x, w_k, w_v)``, the returned ``cfg`` then carrying
  ``x``'s columns per step: ``PROJ_COLS`` or its half, whichever holds the most seeds at the
  most stages. The seeds fit whole where the chunk is ``S``. dq's dot takes ``dS^T [tile,
  seeds]`` as its transposed operand: one more resident tile."""
  r, t = _row(q), cfg.kv_tile
  best = None
  for cols in ((PROJ_COLS, PROJ_COLS // 2) if cfg.proj else (cfg.cols,)):
    c = cfg._replace(cols=cols)
    sc, stages = _plan("jagged_gdpa_pool_bwd", c,
                       lambda n, c=c: (2 * n * r + n * t * q.dtype.itemsize, _streamed(c, kv, r)),
                       cfg.tile, floor=cfg.tile)
    if best is None or (sc, stages) > best[1:]:
      best = (c, sc, stages)
  return best


def _recompute_pays(x, q) -> bool:
  """Whether projecting a token's k and v again (``4 d H D`` FLOPs) takes less time on the target
  than the bytes it saves (k and v written and read back, ``4 H D`` elements, against ``x``'s
  ``d`` read once more): FLOPs per byte saved under the ridge (``tuning.RIDGE``). mid's towers:
  171 (d 256, H D 256) and 85 (d 128, H D 128), in bfloat16; prod's 512-wide ones 341."""
  _, H, D = q.shape
  d = x.shape[-1]
  saved = 4 * H * D * jnp.dtype(q.dtype).itemsize - d * jnp.dtype(x.dtype).itemsize
  return saved > 0 and 4.0 * d * H * D / saved < tuning.RIDGE


def _recomputes(cfg: _Cfg, q, kv) -> bool:
  """Whether the pool projecting its keys and values (``kv = (x, w_k, w_v)``) projects them again
  in its backward instead of reading the forward's: where that pays (``_recompute_pays``) and
  the backward is one kernel (the seeds fit whole)."""
  if not _recompute_pays(kv[0], q):
    return False
  try:
    return _bwd_plan(cfg, q, kv)[1] >= q.shape[0]
  except ValueError:                          # no tile of x and the weights fits: read k, v
    return False


def _pool_grads(cfg: _Cfg, q, kv, jag, do):
  """``dq, dk, dv`` of the pool on ``kv``: ``(k, v)``, or (``cfg.proj``, where ``_recomputes``)
  ``(x, w_k, w_v)``, whose k, v the backward kernel projects again."""
  do = do.astype(q.dtype)
  S, H, D = q.shape
  r, t = _row(q), cfg.kv_tile
  N, kd = kv[0].shape[0], q.dtype if cfg.proj else kv[0].dtype
  per = _dq_examples(jag.batch, H)
  groups = pl.cdiv(jag.batch, per)
  # one kernel where the seeds fit whole, at the most stages that hold them
  bcfg, sc, stages = _bwd_plan(cfg, q, kv)
  if sc >= S:
    # 8 warps, as the cross backward's; grid (heads, groups): a group's heads neighbours
    dq, dk, dv = _call(functools.partial(_pool_bwd_kernel, per=per),
                       bcfg._replace(tile=sc), (), (jag.offsets, q, *kv, do),
                       (jax.ShapeDtypeStruct((groups, S, H, D), _F32),
                        *(jax.ShapeDtypeStruct((N, H, D), kd),) * 2), (H, groups),
                       "jagged_gdpa_pool_bwd", stages, warps=8)
    return jnp.sum(dq, axis=0).astype(q.dtype), dk, dv
  # seeds in chunks: dq per example group and seed chunk, dk / dv per token tile
  if cfg.proj:
    raise ValueError("jagged_gdpa_pool_proj: the seeds do not fit one backward kernel, which "
                     "projecting k, v again needs (_recomputes)")
  k, v = kv
  sc, stages = _plan("jagged_gdpa_pool_dq", cfg, lambda c: (2 * c * r, 2 * t * r), cfg.tile)
  dq = _call(functools.partial(_pool_dq_kernel, per=per), cfg._replace(tile=sc),
             (), (jag.offsets, q, k, v, do), jax.ShapeDtypeStruct((groups, S, H, D), _F32),
             (groups, H, *_chunk_grid(sc, S)), "jagged_gdpa_pool_dq", stages)
  lo, hi = jagged.tile_examples(jag, t)
  # k, v tiles resident; all seeds: q too and do per example; chunks: q and do per step
  need = lambda c: ((2 * t + c) * r, c * r) if c >= S else (2 * t * r, 2 * c * r)
  sc, stages = _plan("jagged_gdpa_pool_dkv", cfg, need, cfg.tile)
  per_tile = cfg._replace(tile=t, kv_tile=sc)                # token tiles x seeds
  dk, dv = _call(_pool_dkv_kernel, per_tile, (lo, hi), (jag.seg, q, k, v, do),
                 (jax.ShapeDtypeStruct(k.shape, k.dtype),) * 2, (lo.shape[0], H),
                 "jagged_gdpa_pool_dkv", stages)
  return jnp.sum(dq, axis=0).astype(q.dtype), dk, dv


_gdpa_pool.defvjp(lambda cfg, q, k, v, jag: (_pool_fwd(cfg, q, (k, v), jag), (q, k, v, jag)),
                  _gdpa_pool_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gdpa_pool_proj(cfg: _Cfg, q, x, wk, wv, jag):
  return _pool_fwd(cfg, q, (x, wk, wv), jag, store=False)


def _gdpa_pool_proj_fwd(cfg: _Cfg, q, x, wk, wv, jag):
  """Stores k, v only where the backward cannot project them again (``_recomputes``)."""
  if _recomputes(cfg, q, (x, wk, wv)):
    return _pool_fwd(cfg, q, (x, wk, wv), jag, store=False), (q, x, wk, wv, None, None, jag)
  o, k, v = _pool_fwd(cfg, q, (x, wk, wv), jag)
  return o, (q, x, wk, wv, k, v, jag)


def _gdpa_pool_proj_bwd(cfg: _Cfg, res, do, ln=None):
  """``ln``: the cotangents of ``_gdpa_pool_proj_through``'s two pass-throughs of x, which the
  projections' backward kernel adds to dx (``norm_qkv.norm_proj_grads``)."""
  q, x, wk, wv, k, v, jag = res
  if k is None:
    dq, dk, dv = _pool_grads(cfg, q, (x, wk, wv), jag, do)
  else:
    dq, dk, dv = _pool_grads(cfg._replace(proj=False), q, (k, v), jag, do)
  # the projections' backward as norm_proj_pallas's: dx and the rows' RMS factors from one
  # kernel, dw_k and dw_v on pallas_kernels.wgrad
  dx, (dwk, dwv) = norm_qkv.norm_proj_grads(x, (wk, wv), (dk, dv), eps=cfg.eps, dtype=q.dtype,
                                            interpret=cfg.interpret, ln=ln)
  return dq, dx, dwk, dwv, jax.tree.map(lambda _: None, jag)


_gdpa_pool_proj.defvjp(_gdpa_pool_proj_fwd, _gdpa_pool_proj_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 6))
def _gdpa_pool_proj_through(cfg: _Cfg, q, x, wk, wv, jag, ln_eps: float):
  """``(_gdpa_pool_proj(...), reference.ln_through(x, ln_eps), x)``: x passed through twice (no
  copy); the backward kernel of the projections takes both cotangents (``norm_qkv``'s
  ``ln``)."""
  return _gdpa_pool_proj(cfg, q, x, wk, wv, jag), x, x


def _pool_proj_through_fwd(cfg: _Cfg, q, x, wk, wv, jag, ln_eps: float):
  o, res = _gdpa_pool_proj_fwd(cfg, q, x, wk, wv, jag)
  return (o, x, x), res


def _pool_proj_through_bwd(cfg: _Cfg, ln_eps: float, res, cts):
  do, g_ln, g_id = cts
  return _gdpa_pool_proj_bwd(cfg, res, do, ln=(g_ln, g_id, ln_eps))


_gdpa_pool_proj_through.defvjp(_pool_proj_through_fwd, _pool_proj_through_bwd)


def jagged_gdpa_pool_pallas(q, k, v, jag, *, activation="fast_gelu", scale=None, out_scale=1.0,
                            score_clip=None, interpret=False, block_k=64):
  """Pallas ``jagged.jagged_gdpa_pool``: grid (heads, examples [, seed chunks where the seeds do
  not fit shared memory, ``_plan``]); a program keeps its seeds and walks its example's tokens
  ``[offsets[b], offsets[b+1])`` in tiles of ``block_k``. Backward: one kernel on (heads, groups
  of ``_dq_examples`` examples), the seed gradients summed over a group's examples (the
  groups summed after) and their token tiles' dk, dv written on the way; where the seeds must be
  split, the seed gradients so per seed chunk and dk, dv on (token tiles, heads), each tile
  walking the examples it overlaps."""
  jagged.check_tokens(jag, k, v)
  cfg = _pool_cfg(q, activation, scale, out_scale, score_clip, interpret, block_k)
  return _gdpa_pool(cfg, q, k, v, jag)


def _pool_cfg(q, activation, scale, out_scale, score_clip, interpret, block_k, **extra) -> _Cfg:
  """The pool's configuration from its public arguments (``extra``: ``_Cfg``'s optional
  fields)."""
  S, H, D = q.shape
  return _Cfg(activations.per_head(activation, H), D ** -0.5 if scale is None else float(scale),
              float(out_scale), pad_pow2(S), int(block_k), bool(interpret),
              score_clip_value(score_clip), fast=_fast(q, interpret), **extra)


def pool_proj_recomputes(q, x, w, *, activation="fast_gelu", block_k: int = 64, **_) -> bool:
  """Whether ``jagged_gdpa_pool_proj_pallas(q, x, w, ...)``'s backward projects the keys and
  values again from ``x`` (its forward then stores none; ``_recomputes``), on this GPU's (or, on
  a CPU, the compile target's) shared memory; shapes suffice. Other keywords are ignored."""
  cfg = _pool_cfg(q, activation, None, 1.0, None, False, block_k, proj=True)
  return _recomputes(cfg, q, (x, *w))


def jagged_gdpa_pool_proj_pallas(q, x, w, jag, *, activation="fast_gelu", scale=None,
                                 out_scale=1.0, score_clip=None, interpret=False, block_k=64,
                                 eps: float = norm_qkv.EPS, through: float | None = None):
  """``jagged_gdpa_pool_pallas(q, *norm_proj_pallas(x, w), jag)`` (HSP's keys, values and
  pooling) in one forward kernel: each token tile's keys and values are projected where the pool
  reads them, from ``x [N, d]`` and ``w = (w_k, w_v)``, each ``[d, H, D]`` in ``q``'s dtype
  (``_kv_tiles``). The backward is the pool's (``_pool_grads``), then the projections'
  (``norm_qkv.norm_proj_grads``: ``dx`` and the weight gradients). Where projecting k, v again
  pays and the pool's backward is one kernel (its seeds fit whole: ``_recomputes``), that kernel
  projects each tile's k, v again from ``x`` (2 N d H D FLOPs each) and the forward stores
  none: ``[N, H, D]`` k and v are neither written nor read back, ``x`` read in their place. Else
  the forward stores them on the way (not read back in the forward) for the backward. Widths:
  ``norm_qkv.supported``'s.

  ``through`` (a LayerNorm epsilon): returns ``(o, x_ln, x_id)``, x passed through twice for the
  PFFN after it, ``x_ln = reference.ln_through(x, through)`` (its query, read by
  ``jagged_gdpa_cross_pallas(q_norm=through, ln_split=True)``) and ``x_id = x`` (its residual).
  The projections' backward kernel adds both cotangents to dx where it reads x's rows anyway, the
  first through the norm's statistics: the pass XLA otherwise makes over x and the three
  readers' cotangents (the norm's backward and their sum) is not made."""
  jagged.check_tokens(jag, jax.ShapeDtypeStruct((x.shape[0], 1, x.shape[-1]), x.dtype))
  wk, wv = w
  S, H, D = q.shape
  if (wk.shape != (x.shape[1], H, D) or wv.shape != wk.shape
          or not norm_qkv.supported(x.shape[1], H, D, q.dtype)):
    raise ValueError(f"jagged_gdpa_pool_proj: w {[a.shape for a in w]} must be two [d, H, D] "
                     f"with x {x.shape}, q {q.shape}, widths norm_qkv.supported")
  cfg = _pool_cfg(q, activation, scale, out_scale, score_clip, interpret, block_k, proj=True,
                  eps=float(eps))
  if through is not None:
    return _gdpa_pool_proj_through(cfg, q, x, wk.astype(q.dtype), wv.astype(q.dtype), jag,
                                   float(through))
  return _gdpa_pool_proj(cfg, q, x, wk.astype(q.dtype), wv.astype(q.dtype), jag)


# ----------------------------------------------------------------------------- block attention


def _block_probs(q, k, valid, cfg: _Cfg, h, with_slope=False):
  """Scores and attention weights of one block (rows / keys outside ``valid`` zero-filled):
  ``(s, p)`` or, with ``with_slope``, ``(s, p, act'(s) / block)`` (None for softmax)."""
  s = plgpu.dot(q, k, trans_b=True, precision=precision(q.dtype)) * cfg.scale
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
  _store(o_ref, start, h, plgpu.dot(p.astype(v.dtype), v, precision=precision(v.dtype)),
         r < nst_ref[0])


def _block_bwd_kernel(start_ref, nst_ref, nva_ref, q_ref, k_ref, v_ref, do_ref, dq_ref, dk_ref,
                      dv_ref, *, cfg: _Cfg):
  """dq, dk, dv of one block from recomputed scores (a block is self-contained)."""
  h, bs = pl.program_id(1), cfg.tile
  start, r = start_ref[0], jnp.arange(bs)
  valid = r < nva_ref[0]
  q, k, v, do = (_rows(x, start, bs, h, valid) for x in (q_ref, k_ref, v_ref, do_ref))
  prec = precision(q.dtype)
  _, p, slope = _block_probs(q, k, valid, cfg, h, with_slope=True)
  dp = plgpu.dot(do, v, trans_b=True, precision=prec)   # zero outside the valid square
  ds = p * (dp - jnp.sum(p * dp, axis=-1, keepdims=True)) if slope is None else dp * slope
  ds = (ds * cfg.scale).astype(q.dtype)
  out = r < nst_ref[0]
  _store(dv_ref, start, h, plgpu.dot(p.astype(do.dtype), do, trans_a=True, precision=prec), out)
  _store(dq_ref, start, h, plgpu.dot(ds, k, precision=prec), out)
  _store(dk_ref, start, h, plgpu.dot(ds, q, trans_a=True, precision=prec), out)


def _block_fwd(cfg: _Cfg, q, k, v, jag):
  table = jagged.block_table(jag, cfg.tile)
  _, stages = _plan("jagged_block_attention", cfg, lambda _: (3 * cfg.tile * _row(q), 0))
  return _call(_block_kernel, cfg, table, (q, k, v), jax.ShapeDtypeStruct(q.shape, q.dtype),
               (table[0].shape[0], q.shape[1]), "jagged_block_attention", stages)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _block_attention(cfg: _Cfg, q, k, v, jag):
  return _block_fwd(cfg, q, k, v, jag)


def _block_attention_bwd(cfg: _Cfg, res, do):
  q, k, v, jag = res
  table = jagged.block_table(jag, cfg.tile)
  _, stages = _plan("jagged_block_attention_bwd", cfg, lambda _: (4 * cfg.tile * _row(q), 0))
  grads = _call(_block_bwd_kernel, cfg, table, (q, k, v, do.astype(q.dtype)),
                (jax.ShapeDtypeStruct(q.shape, q.dtype),) * 3, (table[0].shape[0], q.shape[1]),
                "jagged_block_attention_bwd", stages)
  return (*grads, jax.tree.map(lambda _: None, jag))


_block_attention.defvjp(lambda cfg, q, k, v, jag: (_block_fwd(cfg, q, k, v, jag), (q, k, v, jag)),
                        _block_attention_bwd)


def jagged_block_attention_pallas(q, k, v, jag, *, block_size=64, activation="softmax",
                                  score_clip=None, interpret=False):
  """Pallas ``jagged.jagged_block_attention``: grid (``jagged.block_table`` slots, heads); a program
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
  """``(lo, hi) i32[ceil(N / tile)]``: the buffer rows a tile's partners lie in (its examples'
  tokens, within ``window`` of its rows); ``hi <= lo`` past ``offsets[B]``. The pairs are
  symmetric: for a query tile these are its keys, for a key tile the queries that see it."""
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


def _own(seg_ref, cfg: _Cfg, B):
  """(first row, row indices, example of each row or B) of this program's tile."""
  r0 = pl.program_id(0) * cfg.tile
  return r0, r0 + jnp.arange(cfg.tile), _vec(seg_ref, r0, cfg.tile, B)


def _partners(lo_ref, hi_ref, seg_ref, rows, seg, cfg: _Cfg, body, init):
  """Runs ``body(start, inside bool[kv_tile], keep bool[tile, kv_tile], carry)`` over the
  ``kv_tile`` tiles of partner rows in ``[lo, hi)``: same example, within the window."""
  lo, hi, n = lo_ref[0], hi_ref[0], cfg.kv_tile

  def step(j, carry):
    cols = j * n + jnp.arange(n)
    inside = (cols >= lo) & (cols < hi)
    keep = seg[:, None] == jnp.where(inside, _vec(seg_ref, j * n, n, -1), -1)[None, :]
    if cfg.window is not None:
      keep &= jnp.abs(rows[:, None] - cols[None, :]) <= cfg.window
    return body(j * n, inside, keep, carry)

  return lax.fori_loop(lax.div(lo, n), jnp.where(hi > lo, lax.div(hi + n - 1, n), lax.div(lo, n)),
                       step, init)


def _row_stat(ref, h, start, n):
  """``ref[h, start:start + n]`` of an f32 ``[H, N]`` row statistic (0 past N)."""
  return plgpu.load(ref.at[h, pl.ds(start, n)], mask=start + jnp.arange(n) < ref.shape[1],
                    other=0.0)


def _softmax_kernel(klo_ref, khi_ref, seg_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *,
                    cfg: _Cfg, B):
  h = pl.program_id(1)
  r0, rows, seg = _own(seg_ref, cfg, B)
  q = _rows(q_ref, r0, cfg.tile, h, seg < B)
  prec = precision(q.dtype)

  def tile(start, inside, keep, carry):
    k, v = (_rows(r, start, cfg.kv_tile, h, inside) for r in (k_ref, v_ref))
    return _flash_step(carry, plgpu.dot(q, k, trans_b=True, precision=prec) * cfg.scale, keep,
                       v, prec)

  init = (jnp.zeros(q.shape, _F32), jnp.full((cfg.tile,), _NEG, _F32),
          jnp.zeros((cfg.tile,), _F32))
  acc, m, l = _partners(klo_ref, khi_ref, seg_ref, rows, seg, cfg, tile, init)
  seen = l > 0
  _store(o_ref, r0, h, jnp.where(seen[:, None], acc / jnp.where(seen, l, 1.0)[:, None], 0.0),
         rows < q_ref.shape[0])
  plgpu.store(lse_ref.at[h, pl.ds(r0, cfg.tile)],
              jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0),
              mask=rows < lse_ref.shape[1])


def _delta(do, o):
  """``rowsum(dO * O)`` of a row tile (float32)."""
  return jnp.sum(do.astype(_F32) * o.astype(_F32), axis=1)


def _softmax_bwd_kernel(lo_ref, hi_ref, seg_ref, q_ref, k_ref, v_ref, o_ref, do_ref, lse_ref,
                        dq_ref, dk_ref, dv_ref, *, cfg: _Cfg, B):
  """A tile's rows as queries (dq: they walk their key tiles) and as keys (dk, dv: they walk the
  query tiles that see them, transposed score tiles ``k q^T``). The pairs are symmetric
  (``key_ranges``), so one program takes both and one kernel reads q, k, v, O, dO and the
  log-sum-exp; ``delta = rowsum(dO * O)`` of a query tile is computed where it is loaded."""
  h = pl.program_id(1)
  r0, rows, seg = _own(seg_ref, cfg, B)
  q, o, do = (_rows(x, r0, cfg.tile, h, seg < B) for x in (q_ref, o_ref, do_ref))
  lse, delta = _row_stat(lse_ref, h, r0, cfg.tile), _delta(do, o)

  def dq_step(start, inside, keep, dq):   # dS = P (dO V^T - delta), P = exp(s - lse)
    k, v = (_rows(r, start, cfg.kv_tile, h, inside) for r in (k_ref, v_ref))
    s = plgpu.dot(q, k, trans_b=True, precision=precision(q.dtype)) * cfg.scale
    p = jnp.where(keep, jnp.exp(s - lse[:, None]), 0.0)
    return dq + _dot(p * (_dot(do, v, trans_b=True) - delta[:, None]), k)

  dq = _partners(lo_ref, hi_ref, seg_ref, rows, seg, cfg, dq_step, jnp.zeros(q.shape, _F32))
  out = rows < q_ref.shape[0]
  _store(dq_ref, r0, h, dq * cfg.scale, out)
  k, v = (_rows(x, r0, cfg.tile, h, seg < B) for x in (k_ref, v_ref))

  def kv_step(start, inside, keep_t, carry):
    dk, dv = carry
    q, o, do = (_rows(x, start, cfg.kv_tile, h, inside) for x in (q_ref, o_ref, do_ref))
    lse = _row_stat(lse_ref, h, start, cfg.kv_tile)
    s_t = plgpu.dot(k, q, trans_b=True, precision=precision(k.dtype)) * cfg.scale
    p_t = jnp.where(keep_t, jnp.exp(s_t - lse[None, :]), 0.0)
    ds_t = p_t * (_dot(v, do, trans_b=True) - _delta(do, o)[None, :])
    return dk + _dot(ds_t, q), dv + _dot(p_t, do)

  zeros = jnp.zeros(k.shape, _F32)
  dk, dv = _partners(lo_ref, hi_ref, seg_ref, rows, seg, cfg, kv_step, (zeros, zeros))
  _store(dk_ref, r0, h, dk * cfg.scale, out)
  _store(dv_ref, r0, h, dv, out)


def _softmax_fwd(cfg: _Cfg, q, k, v, jag):
  """``(o [N, H, D], lse f32[H, N])``."""
  klo, khi = key_ranges(jag, cfg.tile, cfg.window)
  N, H, _ = q.shape
  r = _row(q)        # streamed: k, v rows and their segment ids
  _, stages = _plan("jagged_softmax_attention", cfg,
                    lambda _: (cfg.tile * r, cfg.kv_tile * (2 * r + 4)))
  return _call(functools.partial(_softmax_kernel, B=jag.batch), cfg, (klo, khi),
               (jag.seg, q, k, v), (jax.ShapeDtypeStruct(q.shape, q.dtype),
                                    jax.ShapeDtypeStruct((H, N), _F32)),
               (klo.shape[0], H), "jagged_softmax_attention", stages)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _softmax_attention(cfg: _Cfg, q, k, v, jag):
  return _softmax_fwd(cfg, q, k, v, jag)[0]


def _softmax_attention_fwd(cfg: _Cfg, q, k, v, jag):
  o, lse = _softmax_fwd(cfg, q, k, v, jag)
  return o, (q, k, v, jag, o, lse)


def _softmax_attention_bwd(cfg: _Cfg, res, do):
  q, k, v, jag, o, lse = res
  do = do.astype(q.dtype)
  r = _row(q)
  lo, hi = key_ranges(jag, cfg.tile, cfg.window)
  # resident: the tile's q, O, dO (then its k, v); streamed: k, v rows, then q, O, dO rows, their
  # segment ids and log-sum-exp. 8 warps: at d_h 128 (prod) 4 spill (ptxas sm_90: 304 bytes of
  # spill stores, 255 registers); 8 spill nothing there or at mid's d_h 64 (178 registers)
  _, stages = _plan("jagged_softmax_attention_bwd", cfg,
                    lambda _: (3 * cfg.tile * r, cfg.kv_tile * (3 * r + 8)))
  dq, dk, dv = _call(functools.partial(_softmax_bwd_kernel, B=jag.batch), cfg, (lo, hi),
                     (jag.seg, q, k, v, o, do, lse), (jax.ShapeDtypeStruct(q.shape, q.dtype),
                                                      jax.ShapeDtypeStruct(k.shape, k.dtype),
                                                      jax.ShapeDtypeStruct(v.shape, v.dtype)),
                     (lo.shape[0], q.shape[1]), "jagged_softmax_attention_bwd", stages,
                     warps=8)
  return dq, dk, dv, jax.tree.map(lambda _: None, jag)


_softmax_attention.defvjp(_softmax_attention_fwd, _softmax_attention_bwd)


def jagged_softmax_attention_pallas(q, k, v, jag, *, window=None, scale=None, interpret=False,
                                    block_q=64, block_k=64):
  """Pallas ``jagged.jagged_softmax_attention`` (flash attention): grid (query tiles of
  ``block_q``, heads); a tile walks only the ``block_k`` key tiles of ``key_ranges`` (its
  examples, within the band): ``O(N * (block_q + 2 window))`` with a window. Backward
  (FlashAttention-2, from the stored log-sum-exp): one kernel on the same grid, a tile's dq
  from its key tiles and its dk / dv from the query tiles that see it (the same tiles)."""
  jagged.check_tokens(jag, q, k, v)
  if window is not None and window < 0:
    raise ValueError(f"window must be >= 0, got {window}")
  D = q.shape[-1]
  cfg = _Cfg(None, D ** -0.5 if scale is None else float(scale), 1.0, int(block_q),
             int(block_k), bool(interpret), window=None if window is None else int(window))
  return _softmax_attention(cfg, q, k, v, jag)
