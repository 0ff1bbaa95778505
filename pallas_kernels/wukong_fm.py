"""A Wukong layer's passes over its examples (issue 38): the token side (the factorization
machine's interactions, their LayerNorm, the token-axis maps) and the output norm.

``wukong_fm``: ``x [B, N, d]``, ``y [N, r]``, ``ws = (w_k [N, m_k], ...)``, ``scale, bias
f32[N r]`` -> ``h [B, N r]`` and ``mixes = (mix_k [B, m_k, d], ...)``, in ``dtype``, per example
``X = x[b]`` (rounded to ``dtype``): ``F = X (X^T y)`` (``X^T y [d, r]`` rounded to ``dtype``,
then ``F [N, r]``), ``h = LayerNorm(flatten(F)) * scale + bias`` (statistics over all ``N r``
values, float32) and ``mix_k = w_k^T X`` (the layer's LCB and residual maps, and the stack's
first cross-layer map). Each step is rounded to ``dtype`` where ``kunlun.nn.wukong`` rounds it.
``wukong_out``: ``LayerNorm(concat(parts) + res) * scale + bias`` over ``d`` per token (the FM's
and the LCB's tokens plus the residual; optionally the FM MLP's output bias ``bias0 [n_0, d]``
on the first part), without the concatenation in memory.

``wukong_fm_xla`` / ``wukong_out_xla`` are the twins: the formulas, differentiated by autodiff.
``wukong_fm_pallas`` runs a forward kernel (reads ``x``, writes ``h`` and the mixes) and a
backward kernel (reads ``x`` and the cotangents, recomputes ``F``, writes ``dx`` and
per-program partial sums of the gradients of ``y``, the ``w_k``, ``scale`` and ``bias``);
``wukong_out_pallas`` one of each (the backward writes every input's cotangent and partial sums
of the scale's and bias's). ``pallas_kernels.partials`` sums each backward's partials and cuts
them into the gradients in one more launch. A program takes a few examples in turn, loading the
small shared operands once (the token side's backward ``bwd_examples(B)``: more where enough
programs remain, so fewer partial sums). Triton on GPU, ``interpret=True`` on CPU.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _poison
from pallas_kernels._common import (
  MIN_PROGRAMS,
  dot,
  examples_per_program,
  is_tile,
  loop_spans,
  pad_pow2,
  round_to,
)
from pallas_kernels.partials import Piece, sum_split_pallas

F32 = jnp.float32
EPS = 1e-6
WARPS = 8
EXAMPLES = 4          # examples per program (token side; the backward: ``bwd_examples``)
OUT_EXAMPLES, OUT_WARPS = 8, 4   # the output norm's
MAX_TILE = 128 * 128  # N (padded to a power of two) x d: the example tile a program holds
# wider examples (prod's layer 0: 120 tokens x 256) run in column chunks of MAX_TILE / N values,
# up to this width, with the padded N at most MAX_WIDE_N
MAX_WIDE_N, MAX_WIDE_D = 128, 1024


# ----------------------------------------------------------------------------------- twin

def wukong_fm_xla(x, y, ws, scale, bias, *, eps: float = EPS, dtype=jnp.bfloat16):
  """The twin: ``(h [B, N r], (mix_k [B, m_k, d], ...))`` in ``dtype`` (module docstring). The
  model's XLA path (``kunlun.nn.wukong.WukongLayer``) computes the same values with hand-written
  VJPs."""
  B = x.shape[0]
  xc = x.astype(dtype)
  xty = jnp.einsum("bnd,nr->bdr", xc, y.astype(dtype))
  fm = jnp.einsum("bnd,bdr->bnr", xc, xty).reshape(B, -1).astype(F32)
  mu = jnp.mean(fm, -1, keepdims=True)
  var = jnp.mean(jnp.square(fm - mu), -1, keepdims=True)
  h = ((fm - mu) * lax.rsqrt(var + eps) * scale + bias).astype(dtype)
  return h, tuple(jnp.einsum("bnd,nm->bmd", xc, w.astype(dtype)) for w in ws)


# ----------------------------------------------------------------------------------- kernels

class _Cfg(NamedTuple):
  B: int
  N: int
  d: int
  r: int
  ms: tuple           # the mixes' widths m_k
  eps: float
  dtype: object
  interpret: bool
  through: bool = False   # x passed through: the backward adds its cotangent to dx

  @property
  def Np(self):
    return pad_pow2(self.N)

  @property
  def dc(self):
    """The columns of ``x`` a program holds at once (``chunk_width``)."""
    return chunk_width(self.N, self.d)


def _mask(rows, n_rows, cols, n_cols=None, ok=True):
  r = (jnp.arange(rows) < n_rows)[:, None]
  if n_cols is not None:
    r = r & (jnp.arange(cols) < n_cols)[None, :]
  return jnp.broadcast_to(r & ok, (rows, cols))


def _shared(ref, cfg: _Cfg):
  """``ref [N, c]`` as ``[Np, pad(c)]``, zero past its rows and columns."""
  c = ref.shape[1]
  cols = pad_pow2(c)
  return plgpu.load(ref.at[pl.ds(0, cfg.Np), pl.ds(0, cols)],
                    mask=_mask(cfg.Np, cfg.N, cols, c), other=0.0)


def _rows(ref, b, ok, n=None, off=0):
  """``ref[b, off:off + n]`` (``n``: default all of ``ref``'s rows) as ``[pad(n), c]``, zero past
  ``n`` and for an example past B."""
  n = ref.shape[1] if n is None else n
  rows, c = pad_pow2(n), ref.shape[-1]
  return plgpu.load(ref.at[b, pl.ds(jnp.int32(off), rows), :], mask=_mask(rows, n, c, ok=ok),
                    other=0.0)


def _cols(ref, b, ok, c0, c):
  """``ref[b, :, c0:c0 + c]`` (all of its rows) as ``[pad(rows), c]``, zero past its rows and
  for an example past B."""
  n = ref.shape[1]
  rows = pad_pow2(n)
  return plgpu.load(ref.at[b, pl.ds(0, rows), pl.ds(c0, c)], mask=_mask(rows, n, c, ok=ok),
                    other=0.0)


def _put(ref, b, x, ok, n=None, off=0, col=0, c=None):
  """``ref[b, off:off + n, col:col + c] = x[:n, :c]`` (``x [pad(n), c or pad(c)]``; ``n``:
  default all of ``ref``'s rows; ``c``: default all of its columns)."""
  rows, cols = x.shape
  n = ref.shape[1] if n is None else n
  c = ref.shape[-1] if c is None else c
  plgpu.store(ref.at[b, pl.ds(jnp.int32(off), rows), pl.ds(jnp.int32(col), cols)],
              x.astype(ref.dtype), mask=_mask(rows, n, cols, c if cols != c else None, ok=ok))


def _fm(x, yv, valid, cfg: _Cfg):
  """``X^T y`` (rounded), ``F`` (rounded, float32) and its statistics: ``xty [d, r]``,
  ``yhat = (F - mu) rsqrt(var + eps)`` (zero past N), ``rs``."""
  xty = round_to(dot(x, yv, cfg, trans_a=True), cfg.dtype)
  return (xty,) + _stats(dot(x, xty, cfg), valid, cfg)


def _stats(fm, valid, cfg: _Cfg):
  """``(yhat, rs)`` of ``F`` (accumulated in float32, rounded here) (``_fm``)."""
  fm = round_to(fm, cfg.dtype)
  n = cfg.N * cfg.r
  mu = jnp.sum(fm) / n
  cen = (fm - mu) * valid
  rs = lax.rsqrt(jnp.sum(cen * cen) / n + cfg.eps)
  return cen * rs, rs


def _fm_wide(x_ref, b, ok, yv, cfg: _Cfg, each=None):
  """``F`` (float32, unrounded) of example ``b`` accumulated over ``x``'s column chunks
  (``cfg.dc``), calling ``each(c0, x_c)`` on every chunk ``x_c [Np, dc]`` too."""
  def chunk(cols, fm):
    x = _cols(x_ref, b, ok, *cols)
    if each is not None:
      each(cols[0], x)
    return fm + dot(x, round_to(dot(x, yv, cfg, trans_a=True), cfg.dtype), cfg)
  return loop_spans(cfg.d, cfg.dc, chunk, jnp.zeros((cfg.Np, cfg.r), F32))


def _fwd_kernel(x_ref, y_ref, s_ref, b_ref, *refs, cfg: _Cfg):
  K = len(cfg.ms)
  w_refs, h_ref, mix_refs = refs[:K], refs[K], refs[K + 1:]
  yv = _shared(y_ref, cfg)
  wvs = [_shared(w, cfg) for w in w_refs]
  sc, bi = _shared(s_ref, cfg), _shared(b_ref, cfg)
  valid = _mask(cfg.Np, cfg.N, cfg.r).astype(F32)
  i0 = pl.program_id(0)

  def one(i, carry):
    b = i0 * EXAMPLES + i
    ok = b < cfg.B
    if chunked(cfg.N, cfg.d):       # F accumulates over x's column chunks, each chunk's columns
      def mixes(c0, x):             # of the maps written on the way
        for wv, mix_ref in zip(wvs, mix_refs, strict=True):
          _put(mix_ref, b, dot(wv, x, cfg, trans_a=True), ok, col=c0, c=cfg.dc)
      yhat, _ = _stats(_fm_wide(x_ref, b, ok, yv, cfg, mixes), valid, cfg)
      _put(h_ref, b, yhat * sc + bi, ok)
      return carry
    x = _rows(x_ref, b, ok)
    _, yhat, _ = _fm(x, yv, valid, cfg)
    _put(h_ref, b, yhat * sc + bi, ok)
    for wv, mix_ref in zip(wvs, mix_refs, strict=True):
      _put(mix_ref, b, dot(wv, x, cfg, trans_a=True), ok)
    return carry

  lax.fori_loop(0, EXAMPLES, one, 0)


def _bwd_kernel(x_ref, y_ref, s_ref, dh_ref, *refs, cfg: _Cfg, examples: int):
  """Chunked examples (``chunked``) take two passes each: ``F`` and its cotangent first, then
  each column chunk's ``X^T y``, ``dx`` and gradient terms. A program takes ``examples``
  examples in turn, its partial sums accumulated over them."""
  K = len(cfg.ms)
  w_refs, dm_refs = refs[:K], refs[K:2 * K]
  dt_ref = refs[2 * K] if cfg.through else None
  dx_ref, part_ref = refs[2 * K + cfg.through:]
  i0 = pl.program_id(0)
  yv, sc = _shared(y_ref, cfg), _shared(s_ref, cfg)
  wvs = [_shared(w, cfg) for w in w_refs]
  valid = _mask(cfg.Np, cfg.N, cfg.r).astype(F32)
  n = cfg.N * cfg.r

  def terms(x, xty, dfm, b, ok, acc, c0=None):
    """``dx`` of ``x``'s columns (all, or the chunk at ``c0``), stored, and the gradient terms
    of ``y`` and the maps added to ``acc``."""
    gy, gws = acc
    cols = {} if c0 is None else {"col": c0, "c": cfg.dc}
    dxty = round_to(dot(x, dfm, cfg, trans_a=True), cfg.dtype)       # [d, r]
    dx = dot(dfm, xty, cfg, trans_b=True) + dot(yv, dxty, cfg, trans_b=True)
    new_gws = []
    for wv, dm_ref, gw in zip(wvs, dm_refs, gws, strict=True):
      gm = _rows(dm_ref, b, ok) if c0 is None else _cols(dm_ref, b, ok, c0, cfg.dc)
      dx = dx + dot(wv, gm, cfg)
      new_gws.append(gw + dot(x, gm, cfg, trans_b=True))
    if cfg.through:                                  # the pass-through's cotangent
      dx = dx + (_rows(dt_ref, b, ok) if c0 is None else _cols(dt_ref, b, ok, c0, cfg.dc))
    _put(dx_ref, b, dx, ok, **cols)
    return gy + dot(x, dxty, cfg), tuple(new_gws)

  def one(i, carry):
    gy, gs, gb, gws = carry
    b = i0 * examples + i
    ok = b < cfg.B
    if chunked(cfg.N, cfg.d):
      yhat, rs = _stats(_fm_wide(x_ref, b, ok, yv, cfg), valid, cfg)
    else:
      x = _rows(x_ref, b, ok)
      xty, yhat, rs = _fm(x, yv, valid, cfg)
    g = _rows(dh_ref, b, ok).astype(F32)
    dyh = g * sc
    dfm = rs * (dyh - jnp.sum(dyh) / n - yhat * (jnp.sum(dyh * yhat) / n)) * valid
    dfm = round_to(dfm, cfg.dtype)                    # F's cotangent, in F's dtype
    if chunked(cfg.N, cfg.d):
      def chunk(cols, acc):
        xc = _cols(x_ref, b, ok, *cols)
        xty_c = round_to(dot(xc, yv, cfg, trans_a=True), cfg.dtype)     # [dc, r]
        return terms(xc, xty_c, dfm, b, ok, acc, cols[0])
      gy, gws = loop_spans(cfg.d, cfg.dc, chunk, (gy, gws))
    else:
      gy, gws = terms(x, xty, dfm, b, ok, (gy, gws))
    return gy, gs + g * yhat, gb + g, gws

  z = lambda c: jnp.zeros((cfg.Np, c), F32)
  carry = (z(cfg.r), z(cfg.r), z(cfg.r), tuple(z(pad_pow2(m)) for m in cfg.ms))
  gy, gs, gb, gws = lax.fori_loop(0, examples, one, carry)
  col = 0
  for v, c in zip((gy, gs, gb) + gws, _part_widths(cfg), strict=True):
    _put(part_ref, i0, v, True, col=col, c=c)
    col += c


def _part_widths(cfg: _Cfg) -> tuple:
  """The columns of the backward's partial sums, side by side in one output: the gradients of
  y, scale and bias (r each), then of each map (m_k)."""
  return (cfg.r,) * 3 + cfg.ms


def bwd_examples(B: int) -> int:
  """Examples per program of the token side's backward: the most of 4, 8 and 16 that leaves at
  least ``MIN_PROGRAMS`` full programs (4 where none does). The per-program partial sums, read
  back to be summed, shrink with it (B 1024: 8 examples, half of what 4 write)."""
  return examples_per_program(B, EXAMPLES, MIN_PROGRAMS, most=16)


def _call(kernel, cfg, args, outs, examples, warps, interpret, name):
  """``kernel`` over ``ceil(B / examples)`` programs, every operand whole (the kernels index)."""
  whole = pl.no_block_spec
  return _poison.pallas_call(
      functools.partial(kernel, cfg=cfg), args, out_shape=outs,
      grid=(pl.cdiv(cfg.B, examples),), in_specs=[whole] * len(args),
      out_specs=(whole,) * len(outs), interpret=interpret, name=name,
      compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1))


def _fwd(x, y, ws, sc, bi, cfg: _Cfg):
  outs = (jax.ShapeDtypeStruct((cfg.B, cfg.N, cfg.r), cfg.dtype),) + tuple(
      jax.ShapeDtypeStruct((cfg.B, m, cfg.d), cfg.dtype) for m in cfg.ms)
  return _call(_fwd_kernel, cfg, (x, y, sc, bi) + tuple(ws), outs, EXAMPLES, WARPS,
               cfg.interpret, "wukong_fm_fwd")


def _bwd(x, y, ws, sc, dh, dms, dt, cfg: _Cfg):
  """``dt``: the pass-through's cotangent (``cfg.through``), else None."""
  # per program, every weight's partial sums in one [N, 3r + sum m_k] block, summed after
  n = bwd_examples(cfg.B)
  part = (pl.cdiv(cfg.B, n), cfg.N, sum(_part_widths(cfg)))
  outs = (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(part, F32))
  args = (x, y, sc, dh) + tuple(ws) + tuple(dms) + ((dt,) if cfg.through else ())
  return _call(functools.partial(_bwd_kernel, examples=n), cfg, args, outs, n, WARPS,
               cfg.interpret, "wukong_fm_bwd")


def _cfg(x, y, ws, eps, dtype, interpret, through=False) -> _Cfg:
  B, N, d = x.shape
  return _Cfg(B, N, d, y.shape[1], tuple(w.shape[1] for w in ws), eps, dtype, interpret,
              through)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _fused(x, y, ws, scale, bias, eps, dtype, interpret, through):
  cfg = _cfg(x, y, ws, eps, dtype, interpret)
  h, *mixes = _fwd(x, y, ws, scale.reshape(cfg.N, cfg.r), bias.reshape(cfg.N, cfg.r), cfg)
  out = h.reshape(cfg.B, -1), tuple(mixes)
  return out + (x,) if through else out


def _vjp_fwd(x, y, ws, scale, bias, eps, dtype, interpret, through):
  return _fused(x, y, ws, scale, bias, eps, dtype, interpret, through), (x, y, ws, scale, bias)


def _vjp_bwd(eps, dtype, interpret, through, res, g):
  x, y, ws, scale, bias = res
  cfg = _cfg(x, y, ws, eps, dtype, interpret, through)
  dh, dms = g[:2]
  dx, part = _bwd(x, y, ws, scale.reshape(cfg.N, cfg.r),
                  dh.reshape(cfg.B, cfg.N, cfg.r).astype(dtype),
                  [dm.astype(dtype) for dm in dms], g[2] if through else None, cfg)
  # y and the ws enter in their own dtype (no cast launches outside: the kernels round them to
  # dtype at their dots); their gradients are rounded to dtype, as the twin's. The partials are
  # summed and cut into the gradients in one launch (XLA: a reduction, then a slice each).
  edges = np.cumsum((0,) + _part_widths(cfg))
  likes = (y, scale, bias) + tuple(ws)
  rounds = (dtype, None, None) + (dtype,) * len(ws)       # y's and the maps' rounded to dtype
  pieces = [Piece((0, cfg.N), (int(a), int(b)), like.dtype, r)
            for a, b, like, r in zip(edges[:-1], edges[1:], likes, rounds, strict=True)]
  gy, gs, gb, *gws = sum_split_pallas(part, pieces, interpret=interpret, name="wukong_fm_sums")
  return dx, gy, tuple(gws), gs.reshape(-1), gb.reshape(-1)


_fused.defvjp(_vjp_fwd, _vjp_bwd)


def wukong_fm_pallas(x, y, ws, scale, bias, *, eps: float = EPS, dtype=jnp.bfloat16,
                     interpret: bool = False, through: bool = False):
  """``wukong_fm_xla``'s values and gradients from the Pallas kernels (module docstring).

  ``through``: also return ``x`` itself, third (a layer's residual when its token count does not
  change); the backward kernel adds that output's cotangent to ``dx``, so no pass sums the two.
  Under ``vmap`` ``x`` must then be batched: an unbatched ``x``'s pass-through cotangent reaches
  every instance's backward summed over the instances, so ``dx`` would count it once per
  instance."""
  B, N, d = x.shape
  ws = tuple(ws)
  r, ms = y.shape[1], tuple(w.shape[1] for w in ws)
  if not supported(N, d, r, ms):
    raise ValueError(f"wukong_fm: no kernel for N={N}, d={d}, rank={r}, mixes={ms} "
                     "(supported(): d and rank powers of two >= 16, N padded times d at most "
                     f"{MAX_TILE} or N padded at most {MAX_WIDE_N} and d at most {MAX_WIDE_D}, "
                     "one to four mixes, each at most 128 wide)")
  if (y.shape[0] != N or any(w.shape[0] != N for w in ws) or scale.shape != (N * r,)
      or bias.shape != (N * r,)):
    raise ValueError(f"wukong_fm: y {y.shape}, ws {[w.shape for w in ws]}, scale "
                     f"{scale.shape}, bias {bias.shape} do not fit x {x.shape}")
  return _fused(x, y, ws, scale.astype(F32), bias.astype(F32), float(eps), jnp.dtype(dtype),
                bool(interpret), bool(through))


def supported(N: int, d: int, rank: int, mixes) -> bool:
  """Whether the kernels take a layer of ``N`` tokens of width ``d``, rank ``rank`` and mixes of
  widths ``mixes``: ``d`` and ``rank`` powers of two >= 16, an example tile (``N`` padded to a
  power of two, times ``d``) of at most ``MAX_TILE`` values or, in column chunks, ``N`` padded
  at most ``MAX_WIDE_N`` and ``d`` at most ``MAX_WIDE_D``, one to four mixes of at most 128
  tokens each (the callers fall back to XLA)."""
  Np = pad_pow2(N)
  fits = Np * d <= MAX_TILE or (Np <= MAX_WIDE_N and d <= MAX_WIDE_D)
  return (is_tile(d) and is_tile(rank) and N >= 1 and fits
          and 1 <= len(mixes) <= 4 and all(1 <= m <= 128 for m in mixes))


def chunk_width(N: int, d: int) -> int:
  """The columns of an example of ``N`` tokens of width ``d`` a program holds at once: all of
  ``d`` where its tile (``N`` padded to a power of two, times ``d``) fits ``MAX_TILE``, else
  ``MAX_TILE / pad(N)``."""
  return min(d, MAX_TILE // pad_pow2(N))


def chunked(N: int, d: int) -> bool:
  """Whether such an example runs in column chunks (the backward's second pass over the chunks
  computes ``X^T y`` once more)."""
  return chunk_width(N, d) < d


# ------------------------------------------------------------------------- the output norm

def mix_weights(logits, dtype):
  """GEM's cross-layer weights ``softmax(logits)`` rounded to ``dtype``, in float32 (as
  ``kunlun.nn.wukong.WukongStack`` rounds them)."""
  return jax.nn.softmax(logits.astype(F32)).astype(dtype).astype(F32)


def wukong_out_xla(parts, res, scale, bias, *, bias0=None, others=(), logits=None,
                   eps: float = EPS, dtype=jnp.bfloat16):
  """The twin of ``wukong_out_pallas``: ``z = LayerNorm(concat(parts) + res) * scale + bias``
  over ``d`` per token in float32, in ``dtype`` (``parts``: ``[B, n_i, d]`` arrays, ``res [B,
  sum n_i, d]``, ``scale, bias f32[d]``): the Wukong layer's output norm over its FM and LCB
  tokens plus the residual. ``bias0 [n_0, d]`` (optional) is added to the first part first (the
  FM MLP's output bias). With ``logits f32[J + 1]`` (and ``others``: J arrays like ``res``) the
  result is the next layer's cross-layer input instead, ``z + sum_j w_j others_j + w_J z``
  (``kunlun.nn.wukong.cross_mix``) with ``w = mix_weights(logits, dtype)``, from the float32
  ``z``."""
  ps = [p.astype(F32) for p in parts]
  if bias0 is not None:
    ps[0] = ps[0] + bias0.astype(F32)
  t = jnp.concatenate(ps, axis=1) + res.astype(F32)
  mu = jnp.mean(t, -1, keepdims=True)
  var = jnp.mean(jnp.square(t - mu), -1, keepdims=True)
  z = (t - mu) * lax.rsqrt(var + eps) * scale + bias
  if logits is not None:
    w = mix_weights(logits, dtype)
    z = z + sum(w[j] * o.astype(F32) for j, o in enumerate(others)) + w[len(others)] * z
  return z.astype(dtype)


class _OutCfg(NamedTuple):
  B: int
  d: int
  ns: tuple           # the parts' token counts
  eps: float
  dtype: object
  bias0: bool = False  # a bias [n_0, d] on the first part
  mix: int = -1        # J: the output is the cross-layer mix with J other inputs (-1: plain)


def _row_norm(t, eps):
  """``(y, rs)``: the rows of ``t`` normalised, ``y = (t - mean) rs``, ``rs = rsqrt(var + eps)``."""
  c = t - jnp.mean(t, axis=1, keepdims=True)
  rs = lax.rsqrt(jnp.mean(c * c, axis=1, keepdims=True) + eps)
  return c * rs, rs


def _bias0(b0_ref, cfg: _OutCfg):
  """The first part's bias ``[pad(n_0), d]`` (zero past ``n_0``), or None without one."""
  if b0_ref is None:
    return None
  n = cfg.ns[0]
  return plgpu.load(b0_ref.at[pl.ds(0, pad_pow2(n)), :], mask=_mask(pad_pow2(n), n, cfg.d),
                    other=0.0)


def _pre_norm(p_ref, res_ref, b, ok, n, off, b0):
  """A part's rows plus the residual's (and ``b0``, the first part's bias, unless None), in
  float32."""
  t = _rows(p_ref, b, ok, n).astype(F32) + _rows(res_ref, b, ok, n, off).astype(F32)
  return t if b0 is None else t + b0


def _weights(l_ref, cfg: _OutCfg) -> list:
  """The mix's ``J + 1`` weights, ``mix_weights`` of the logits (one masked load of the
  vector; every program computes the softmax of these few values itself), as float32
  scalars."""
  J1 = cfg.mix + 1
  n = pad_pow2(J1)
  idx = jnp.arange(n)
  v = plgpu.load(l_ref.at[pl.ds(0, n)], mask=idx < J1, other=0.0)
  v = jnp.where(idx < J1, v, -jnp.inf)
  e = jnp.exp(v - jnp.max(v))
  w = round_to(e / jnp.sum(e), cfg.dtype)
  return [jnp.sum(jnp.where(idx == j, w, 0.0)) for j in range(J1)]


def _split_refs(refs, cfg: _OutCfg, n_front: int):
  """``(front, b0_ref, w_ref, other_refs, rest)`` of a kernel's refs: ``n_front`` leading refs,
  then ``bias0``'s (if any), the mix's logits and other inputs (if any), then the rest."""
  front, rest = refs[:n_front], refs[n_front:]
  b0_ref, rest = (rest[0], rest[1:]) if cfg.bias0 else (None, rest)
  J = max(cfg.mix, 0)
  w_ref, rest = (rest[0], rest[1:]) if cfg.mix >= 0 else (None, rest)
  return front, b0_ref, w_ref, rest[:J], rest[J:]


def _out_fwd_kernel(*refs, cfg: _OutCfg):
  K = len(cfg.ns)
  front, b0_ref, w_ref, o_refs, (out_ref,) = _split_refs(refs, cfg, K + 3)
  part_refs, (res_ref, s_ref, b_ref) = front[:K], front[K:]
  sc, bi = plgpu.load(s_ref.at[:])[None, :], plgpu.load(b_ref.at[:])[None, :]
  b0 = _bias0(b0_ref, cfg)
  w = _weights(w_ref, cfg) if w_ref is not None else None
  i0 = pl.program_id(0)

  def one(i, carry):
    b = i0 * OUT_EXAMPLES + i
    ok = b < cfg.B
    off = 0
    for k, (n, p_ref) in enumerate(zip(cfg.ns, part_refs, strict=True)):
      t = _pre_norm(p_ref, res_ref, b, ok, n, off, b0 if k == 0 else None)
      z = _row_norm(t, cfg.eps)[0] * sc + bi
      if w is not None:                                  # the next layer's cross-layer input
        m = z * (1.0 + w[-1])
        for j, o_ref in enumerate(o_refs):
          m = m + w[j] * _rows(o_ref, b, ok, n, off).astype(F32)
        z = m
      _put(out_ref, b, z, ok, n, off)
      off += n
    return carry

  lax.fori_loop(0, OUT_EXAMPLES, one, 0)


def _out_bwd_kernel(*refs, cfg: _OutCfg):
  K = len(cfg.ns)
  J = max(cfg.mix, 0)
  front, b0_ref, w_ref, o_refs, rest = _split_refs(refs, cfg, K + 3)
  part_refs, (res_ref, s_ref, b_ref) = front[:K], front[K:]
  dm_ref, dpart_refs, dres_ref = rest[0], rest[1:K + 1], rest[K + 1]
  do_refs, g_ref = rest[K + 2:K + 2 + J], rest[K + 2 + J]
  sc = plgpu.load(s_ref.at[:])[None, :]
  b0 = _bias0(b0_ref, cfg)
  w = _weights(w_ref, cfg) if w_ref is not None else None
  zs = sc if w is None else sc * (1.0 + w[-1])      # d out / d y: z's own share of the mix
  i0 = pl.program_id(0)

  def one(i, carry):
    gs, gb, g0, ga = carry
    b = i0 * OUT_EXAMPLES + i
    ok = b < cfg.B
    off = 0
    for k, (n, p_ref, dp_ref) in enumerate(zip(cfg.ns, part_refs, dpart_refs, strict=True)):
      t = _pre_norm(p_ref, res_ref, b, ok, n, off, b0 if k == 0 else None)
      y, rs = _row_norm(t, cfg.eps)
      dm = _rows(dm_ref, b, ok, n, off).astype(F32)     # the output's cotangent
      dy = dm * zs
      dx = rs * (dy - jnp.mean(dy, axis=1, keepdims=True)
                 - y * jnp.mean(dy * y, axis=1, keepdims=True))
      _put(dp_ref, b, dx, ok)
      _put(dres_ref, b, dx, ok, n, off)
      if k == 0 and cfg.bias0:       # rows past n_0, and an example past B, load as zeros
        g0 = g0 + dx * _mask(dx.shape[0], n, cfg.d, ok=ok)
      if J:                          # the mix's other inputs: their cotangents, their weights'
        ga = tuple(ga[j] + jnp.sum(dm * _rows(o_ref, b, ok, n, off).astype(F32), axis=0)
                   for j, o_ref in enumerate(o_refs))
        for j, do_ref in enumerate(do_refs):
          _put(do_ref, b, dm * w[j], ok, n, off)
      gs, gb = gs + jnp.sum(dm * y, axis=0), gb + jnp.sum(dm, axis=0)
      off += n
    return gs, gb, g0, ga

  z = jnp.zeros((cfg.d,), F32)
  g0 = jnp.zeros((pad_pow2(cfg.ns[0]), cfg.d), F32) if cfg.bias0 else jnp.float32(0)
  gs, gb, g0, ga = lax.fori_loop(0, OUT_EXAMPLES, one, (z, z, g0, (z,) * J))
  # one partial-sum output per program, rows: sum(dm y) and sum(dm) per column (the scale's and
  # bias's gradients up to z's mix weight), bias0's pad(n_0) rows, the other inputs' J rows,
  # then (with the mix) z's own weight's: scale sum(dm y) + bias sum(dm), summed over d later
  n0 = pad_pow2(cfg.ns[0]) if cfg.bias0 else 0
  if w is not None:
    own = sc * gs[None, :] + (plgpu.load(b_ref.at[:]) * gb)[None, :]
    plgpu.store(g_ref.at[i0, pl.ds(2 + n0 + J, 1), :], own)
  f = 1.0 if w is None else 1.0 + w[-1]            # z = y scale + bias has weight 1 + w_J
  plgpu.store(g_ref.at[i0, pl.ds(0, 1), :], (gs * f)[None, :])
  plgpu.store(g_ref.at[i0, pl.ds(1, 1), :], (gb * f)[None, :])
  if cfg.bias0:
    plgpu.store(g_ref.at[i0, pl.ds(2, n0), :], g0)      # zero past n_0
  for j in range(J):
    plgpu.store(g_ref.at[i0, pl.ds(2 + n0 + j, 1), :], ga[j][None, :])


def _out_cfg(parts, res, bias0, others, logits, eps, dtype):
  B, _, d = res.shape
  return _OutCfg(B, d, tuple(p.shape[1] for p in parts), eps, dtype, bias0 is not None,
                 -1 if logits is None else len(others))


def _extra(bias0, others, logits):
  """The optional operands, in the kernels' order: bias0, the mix's logits, the other inputs."""
  return ((() if bias0 is None else (bias0,))
          + (() if logits is None else (logits,) + tuple(others)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _out(parts, res, scale, bias, bias0, others, logits, eps, dtype, interpret):
  cfg = _out_cfg(parts, res, bias0, others, logits, eps, dtype)
  out = (jax.ShapeDtypeStruct(res.shape, dtype),)
  return _call(_out_fwd_kernel, cfg, (*parts, res, scale, bias, *_extra(bias0, others, logits)),
               out, OUT_EXAMPLES, OUT_WARPS, interpret, "wukong_out_fwd")[0]


def _out_vjp_fwd(parts, res, scale, bias, bias0, others, logits, eps, dtype, interpret):
  return (_out(parts, res, scale, bias, bias0, others, logits, eps, dtype, interpret),
          (parts, res, scale, bias, bias0, others, logits))


def _out_vjp_bwd(eps, dtype, interpret, resid, dm):
  parts, res, scale, bias, bias0, others, logits = resid
  cfg = _out_cfg(parts, res, bias0, others, logits, eps, dtype)
  J = max(cfg.mix, 0)
  n0 = pad_pow2(cfg.ns[0]) if cfg.bias0 else 0
  T = pl.cdiv(cfg.B, OUT_EXAMPLES)
  outs = (tuple(jax.ShapeDtypeStruct(p.shape, p.dtype) for p in parts)
          + (jax.ShapeDtypeStruct(res.shape, res.dtype),)
          + tuple(jax.ShapeDtypeStruct(o.shape, o.dtype) for o in others)
          + (jax.ShapeDtypeStruct((T, 2 + n0 + (0 if logits is None else J + 1), cfg.d), F32),))
  got = _call(_out_bwd_kernel, cfg, (*parts, res, scale, bias, *_extra(bias0, others, logits),
                                     dm), outs, OUT_EXAMPLES, OUT_WARPS, interpret,
              "wukong_out_bwd")
  K = len(parts)
  dparts, dres, dothers, g = got[:K], got[K], tuple(got[K + 1:K + 1 + J]), got[-1]
  # every partial sum summed and cut into the gradients in one launch; the kernel has scaled
  # the scale's and bias's by z's mix weight 1 + w_J
  pieces = [Piece((0, 1), (0, cfg.d), scale.dtype), Piece((1, 2), (0, cfg.d), bias.dtype)]
  if bias0 is not None:
    pieces.append(Piece((2, 2 + cfg.ns[0]), (0, cfg.d), bias0.dtype))
  if logits is not None:
    pieces.append(Piece((2 + n0, 2 + n0 + J + 1), (0, cfg.d)))
  gs, gb, *rest = sum_split_pallas(g, pieces, interpret=interpret, name="wukong_out_sums")
  g0 = rest.pop(0) if bias0 is not None else None
  dl = None
  if logits is not None:   # the weights' gradients (z's own last), through their rounding and
    a = jax.nn.softmax(logits.astype(F32))                         # the softmax to the logits
    gw = jnp.sum(rest[0], axis=1).astype(dtype).astype(F32)
    dl = (a * (gw - jnp.sum(a * gw))).astype(logits.dtype)
  return (tuple(dparts), dres, gs.reshape(-1), gb.reshape(-1), g0, dothers, dl)


_out.defvjp(_out_vjp_fwd, _out_vjp_bwd)


def wukong_out_pallas(parts, res, scale, bias, *, bias0=None, others=(), logits=None,
                      eps: float = EPS, dtype=jnp.bfloat16, interpret: bool = False):
  """``wukong_out_xla``'s values and gradients from one forward and one backward kernel: a
  program takes ``OUT_EXAMPLES`` examples, each part's rows with the residual's (and the mix's
  other inputs') rows beside them (nothing concatenated in memory); the backward writes each
  part's, the residual's and the other inputs' cotangents and per-program partial sums of the
  gradients of the scale, the bias, ``bias0`` and the mix's weights (one output, one
  reduction). The mix's weights are computed from ``logits`` in both kernels (no XLA pass); XLA
  takes their gradient through the softmax to the logits."""
  parts, others = tuple(parts), tuple(others)
  B, n, d = res.shape
  ns = tuple(p.shape[1] for p in parts)
  if not out_supported(d, ns) or sum(ns) != n or any(p.shape[::2] != (B, d) for p in parts):
    raise ValueError(f"wukong_out: parts {[p.shape for p in parts]} and res {res.shape} must be "
                     "[B, n_i, d] and [B, sum n_i, d] with d a power of two >= 16 "
                     "(out_supported())")
  if bias0 is not None and bias0.shape != (ns[0], d):
    raise ValueError(f"wukong_out: bias0 {bias0.shape} must be [n_0, d] = {(ns[0], d)}")
  if (logits is None and others) or (logits is not None and (
      logits.shape != (len(others) + 1,) or any(o.shape != res.shape for o in others))):
    raise ValueError(f"wukong_out: the mix needs logits [J + 1] for J other inputs shaped like "
                     f"res {res.shape}; got logits "
                     f"{None if logits is None else logits.shape}, others "
                     f"{[o.shape for o in others]}")
  return _out(parts, res, scale.astype(F32), bias.astype(F32),
              None if bias0 is None else bias0.astype(F32), others,
              None if logits is None else logits.astype(F32), float(eps), jnp.dtype(dtype),
              bool(interpret))


def out_supported(d: int, ns) -> bool:
  """Whether the output-norm kernels take parts of ``ns`` tokens of width ``d``: ``d`` a power of
  two >= 16 and at most 1024, one to four parts of at most 128 tokens."""
  return is_tile(d) and d <= 1024 and 1 <= len(ns) <= 4 and all(1 <= n <= 128 for n in ns)
