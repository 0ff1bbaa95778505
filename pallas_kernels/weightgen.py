"""Fused WeightGen (``kunlun.nn.weightgen``): per example, non-sequence tokens -> K and V.

``weightgen``: ``x [B, N, d]``, ``w_tok [N, m]``, ``a1 [d, e]``, ``b1 f32[e]``, ``a_k, a_v [e, W]``
-> ``k, v [B, m, W]`` in ``dtype``, per example ``X = x[b]``: ``X~ = RMSNorm(X)`` (no scale,
rounded to ``dtype``), ``Z = w_tok^T X~ [m, d]``, ``h = GELU(Z a1 + b1) [m, e]`` (tanh
approximation), ``K = h a_k``, ``V = h a_v``. Each step is rounded to ``dtype`` where
``kunlun.nn.weightgen`` rounds it, so ``weightgen_xla`` (the formulas, differentiated by autodiff)
is its twin.

One forward pass reads ``x`` and writes ``k, v``: XLA runs the chain as about eight passes with
``Z`` and ``h`` (and the pre-activation) in memory. The backward kernel recomputes the chain from
``x``, reads ``dk, dv``, and writes ``dx``, plus what the weight gradients need: ``h`` (for
``a_k``, ``a_v``), for ``a1`` ``X~`` and ``w_tok dp`` (``dp`` the pre-activation's cotangent:
``sum_b Z^T dp = sum_b X~^T (w_tok dp)``, ``N`` rows instead of ``m``), and per-example partial
sums for ``w_tok`` and ``b1``. The weight gradients sum over all examples
(``pallas_kernels.wgrad``: a ``[e, W]`` float32 accumulator does not fit a program's
registers). One program per example; the weights are read by every program (from L2). Past
one tile per width (prod) the same chain runs in chunks (``_fwd_wide_kernel``,
``_bwd_wide_kernel``). Pallas Triton, for the reason ``norm_qkv`` gives (deviceless compile
through ptxas, interpret mode on CPU).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _poison, wgrad
from pallas_kernels._common import dot, is_tile, loop_spans, round_to, spans

F32 = jnp.float32
EPS = 1e-6
_C, _A = math.sqrt(2.0 / math.pi), 0.044715      # the tanh GELU's constants
MAX_WIDTH = 256       # W, the generated keys' / values' width
MAX_HIDDEN = 128      # d and e


# ----------------------------------------------------------------------------------- twin

def _gelu(x):
  return jax.nn.gelu(x, approximate=True)


def weightgen_xla(x, w_tok, a1, b1, a_k, a_v, *, eps: float = EPS, dtype=jnp.bfloat16):
  """The formulas (module docstring), in ``dtype`` where the module computes in it."""
  xf = x.astype(F32)
  xn = (xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(dtype)
  z = jnp.einsum("bnd,nm->bmd", xn, w_tok.astype(dtype))
  h = _gelu(jnp.einsum("bmd,de->bme", z, a1.astype(dtype)) + b1.astype(dtype))
  return (jnp.einsum("bme,ew->bmw", h, a_k.astype(dtype)),
          jnp.einsum("bme,ew->bmw", h, a_v.astype(dtype)))


# ----------------------------------------------------------------------------------- kernels

class _Cfg(NamedTuple):
  B: int
  N: int
  m: int
  d: int
  e: int
  W: int
  eps: float
  dtype: object
  interpret: bool


def _whole(ref):
  """A 2-D weight, whole."""
  r, c = ref.shape
  return plgpu.load(ref.at[pl.ds(0, r), pl.ds(0, c)])


def _ex(ref, b):
  """Example ``b``'s ``[rows, c]`` block of ``ref [B, rows, c]``."""
  _, r, c = ref.shape
  return plgpu.load(ref.at[b, pl.ds(0, r), pl.ds(0, c)])


def _put(ref, b, x):
  _, r, c = ref.shape
  plgpu.store(ref.at[b, pl.ds(0, r), pl.ds(0, c)], x.astype(ref.dtype))


def _tanh(u):
  """``tanh(u)`` from one ``exp`` (saturates to +-1 for large ``|u|``)."""
  return 1.0 - 2.0 / (jnp.exp(2.0 * u) + 1.0)


def _rnd(x, cfg: _Cfg):
  """``x`` rounded to ``dtype``, kept in it (half the registers of a float32 tile)."""
  return x.astype(cfg.dtype)


def _chain(x, wt, a1, b1, cfg: _Cfg):
  """The forward from ``x [N, d]``: ``xn`` (float32, unrounded), its ``rs``, and the
  pre-activation (in ``dtype``) of ``Z = w_tok^T X~``."""
  xf = x.astype(F32)
  rs = lax.rsqrt(jnp.sum(xf * xf, axis=1, keepdims=True) / cfg.d + cfg.eps)
  xn = xf * rs
  z = _rnd(dot(wt, _rnd(xn, cfg), cfg, trans_a=True), cfg)                          # [m, d]
  pre = _rnd(round_to(dot(z, a1, cfg), cfg.dtype) + round_to(b1, cfg.dtype), cfg)
  return xn, rs, pre


def _tanh_arg(pre):
  p = pre.astype(F32)
  return _tanh(_C * (p + _A * p * p * p))


def _fwd_kernel(x_ref, wt_ref, a1_ref, b1_ref, ak_ref, av_ref, k_ref, v_ref, *, cfg: _Cfg):
  b = pl.program_id(0)
  b1 = plgpu.load(b1_ref.at[pl.ds(0, cfg.e)])[None, :]
  _, _, pre = _chain(_ex(x_ref, b), _whole(wt_ref), _whole(a1_ref), b1, cfg)
  h = _rnd(0.5 * pre.astype(F32) * (1.0 + _tanh_arg(pre)), cfg)
  _put(k_ref, b, dot(h, _whole(ak_ref), cfg))
  _put(v_ref, b, dot(h, _whole(av_ref), cfg))


def _bwd_kernel(x_ref, wt_ref, a1_ref, b1_ref, ak_ref, av_ref, dk_ref, dv_ref,
                dx_ref, h_ref, xn_ref, u_ref, gwt_ref, gb_ref, *, cfg: _Cfg):
  # ordered so that few [m, W] / [e, W] tiles are live at once; rounded values kept in dtype
  b = pl.program_id(0)
  dh = round_to(dot(_ex(dk_ref, b), _whole(ak_ref), cfg, trans_b=True), cfg.dtype)
  dh = _rnd(dh + round_to(dot(_ex(dv_ref, b), _whole(av_ref), cfg, trans_b=True), cfg.dtype),
            cfg)                                                                     # [m, e]
  b1 = plgpu.load(b1_ref.at[pl.ds(0, cfg.e)])[None, :]
  wt, a1 = _whole(wt_ref), _whole(a1_ref)
  xn, rs, pre = _chain(_ex(x_ref, b), wt, a1, b1, cfg)
  _put(xn_ref, b, xn)                                     # X~, rounded as the chain reads it
  t, p = _tanh_arg(pre), pre.astype(F32)
  _put(h_ref, b, 0.5 * p * (1.0 + t))
  dp = _rnd(dh.astype(F32) * (0.5 * (1.0 + t) + 0.5 * p * (1.0 - t * t) * _C
                              * (1.0 + 3 * _A * p * p)), cfg)
  plgpu.store(gb_ref.at[b, pl.ds(0, cfg.e)], jnp.sum(dp.astype(F32), axis=0))
  dz = _rnd(dot(dp, a1, cfg, trans_b=True), cfg)                                    # [m, d]
  _put(u_ref, b, dot(wt, dp, cfg))                        # w_tok dp [N, e]: a1's gradient
  _put(gwt_ref, b, dot(_rnd(xn, cfg), dz, cfg, trans_b=True))                       # [N, m]
  dxn = round_to(dot(wt, dz, cfg), cfg.dtype)                                       # [N, d]
  _put(dx_ref, b, rs * (dxn - xn * (jnp.sum(dxn * xn, axis=1, keepdims=True) / cfg.d)))


# ------------------------------------------------------------------------- wide shapes (prod)
#
# Past the one-tile widths (prod: 48 tokens of 256 to 256 keys and values of 512, hidden 256) a
# program still takes one example, but in chunks: ``m`` in rows of ``MC`` (a key's row needs only
# its own row of ``w_tok``), ``d``, ``e`` and ``W`` in columns of ``CH``; ``N`` is padded to a
# power of two by masked loads (zero tokens and zero rows of ``w_tok`` add nothing). The
# backward's ``dX~`` is accumulated over the key chunks in float32, ``[Np, CH]`` per column chunk.
# The key chunks run as a loop (``_over_keys``): ptxas sm_90 at prod spills 1.0 KB forward and
# 4.1 KB backward, 1.8 / 13.5 KB unrolled (and builds them in 13 s instead of 60); key chunks of
# 32 or 16 rows spill less (0.9 / 2.6 KB, 0.5 / 1.4 KB) but reload the weights 2-4x as often.
# Accumulating ``w_tok dp`` ([Np, e] in float32) over the key chunks raised the backward's spill
# to 5.0 KB, in exchange for ``X~`` and ``w_tok dp`` (48 rows) written instead of ``Z`` and
# ``dp`` (256 rows).

MC, CH = 64, 128
MAX_WIDE = {"N": 64, "m": 1024, "d": 256, "e": 512, "W": 1024}


def _np(cfg: _Cfg) -> int:
  """The tokens padded to a power of two (at least 16)."""
  return max(16, 1 << (cfg.N - 1).bit_length())


def _block(ref, rows, cols, n_rows=None, b=None):
  """``ref[b?, rows, cols]`` (``(start, width)`` spans, static widths) in the ref's dtype, rows
  past ``n_rows`` zero."""
  (r0, rn), (c0, cn) = rows, cols
  at = ref.at[pl.ds(r0, rn), pl.ds(c0, cn)] if b is None else ref.at[b, pl.ds(r0, rn),
                                                                     pl.ds(c0, cn)]
  if n_rows is None:
    return plgpu.load(at)
  ok = jnp.broadcast_to((r0 + jnp.arange(rn) < n_rows)[:, None], (rn, cn))
  return plgpu.load(at, mask=ok, other=0.0)


def _store_block(ref, b, rows, cols, x, n_rows=None):
  (r0, rn), (c0, cn) = rows, cols
  ok = None if n_rows is None else jnp.broadcast_to((r0 + jnp.arange(rn) < n_rows)[:, None],
                                                    (rn, cn))
  at = ref.at[b, pl.ds(r0, rn), pl.ds(c0, cn)]
  plgpu.store(at, x.astype(ref.dtype), mask=ok)


def _over_keys(cfg: _Cfg, body, carry):
  """``body(mc, carry)`` over the key chunks ``mc = (start, MC)``, a loop (``loop_spans``)."""
  return loop_spans(cfg.m, min(cfg.m, MC), body, carry)


def _x(x_ref, b, dc, cfg: _Cfg):
  """Example ``b``'s columns ``dc`` of ``x`` (float32, zero rows past N)."""
  return _block(x_ref, (0, _np(cfg)), dc, cfg.N, b).astype(F32)


def _wide_norm(x_ref, b, cfg: _Cfg):
  """``(rs [Np, 1], xn chunks [Np, CH] rounded to dtype)`` of example ``b`` (the unrounded
  float32 ``xn`` is loaded again where the backward needs it: fewer live registers)."""
  dcs = spans(cfg.d, CH)
  rs = lax.rsqrt(sum(jnp.sum(x * x, axis=1, keepdims=True) for x in (_x(x_ref, b, dc, cfg)
                                                                      for dc in dcs))
                 / cfg.d + cfg.eps)
  return rs, [_rnd(_x(x_ref, b, dc, cfg) * rs, cfg) for dc in dcs]


def _wide_chain(xn, wt_ref, a1_ref, b1_ref, mc, cfg: _Cfg):
  """Key rows ``mc``: ``(w_tok's columns [Np, MC], the pre-activation's chunks [MC, CH] in
  ``dtype``)``, from ``Z``'s chunks."""
  wt = _block(wt_ref, (0, _np(cfg)), mc, cfg.N)                                   # [Np, MC]
  zs = [_rnd(dot(wt, x, cfg, trans_a=True), cfg) for x in xn]
  pres = []
  for ec in spans(cfg.e, CH):
    acc = sum(dot(z, _block(a1_ref, dc, ec), cfg) for z, dc in zip(zs, spans(cfg.d, CH),
                                                                     strict=True))
    b1 = plgpu.load(b1_ref.at[pl.ds(*ec)])[None, :]
    pres.append(_rnd(round_to(acc, cfg.dtype) + round_to(b1, cfg.dtype), cfg))
  return wt, pres


def _fwd_wide_kernel(x_ref, wt_ref, a1_ref, b1_ref, ak_ref, av_ref, k_ref, v_ref, *, cfg: _Cfg):
  b = pl.program_id(0)
  _, xn = _wide_norm(x_ref, b, cfg)
  ecs = spans(cfg.e, CH)

  def keys(mc, carry):
    _, pres = _wide_chain(xn, wt_ref, a1_ref, b1_ref, mc, cfg)
    hs = [_rnd(0.5 * p.astype(F32) * (1.0 + _tanh_arg(p)), cfg) for p in pres]
    for wc in spans(cfg.W, CH):
      for w_ref, o_ref in ((ak_ref, k_ref), (av_ref, v_ref)):
        acc = sum(dot(h, _block(w_ref, ec, wc), cfg) for h, ec in zip(hs, ecs, strict=True))
        _store_block(o_ref, b, mc, wc, acc)
    return carry
  _over_keys(cfg, keys, 0)


def _bwd_wide_kernel(x_ref, wt_ref, a1_ref, b1_ref, ak_ref, av_ref, dk_ref, dv_ref,
                     dx_ref, h_ref, xn_ref, u_ref, gwt_ref, gb_ref, *, cfg: _Cfg):
  b = pl.program_id(0)
  rs, xn = _wide_norm(x_ref, b, cfg)
  dcs, ecs, wcs, Np = spans(cfg.d, CH), spans(cfg.e, CH), spans(cfg.W, CH), _np(cfg)
  for x, dc in zip(xn, dcs, strict=True):
    _store_block(xn_ref, b, (0, Np), dc, x, cfg.N)

  def keys(mc, carry):
    dxn, gb, u = list(carry[0]), list(carry[1]), list(carry[2])
    wt, pres = _wide_chain(xn, wt_ref, a1_ref, b1_ref, mc, cfg)
    dps = []
    for i, (ec, p) in enumerate(zip(ecs, pres, strict=True)):
      dh = [round_to(sum(dot(_block(g_ref, mc, wc, b=b), _block(w_ref, ec, wc), cfg, trans_b=True)
                         for wc in wcs), cfg.dtype) for g_ref, w_ref in ((dk_ref, ak_ref),
                                                                          (dv_ref, av_ref))]
      dh = _rnd(dh[0] + dh[1], cfg)                                                 # [MC, CH]
      t, pf = _tanh_arg(p), p.astype(F32)
      _store_block(h_ref, b, mc, ec, 0.5 * pf * (1.0 + t))
      dp = _rnd(dh.astype(F32) * (0.5 * (1.0 + t) + 0.5 * pf * (1.0 - t * t) * _C
                                  * (1.0 + 3 * _A * pf * pf)), cfg)
      u[i] = u[i] + dot(wt, dp, cfg)                                               # [Np, CH]
      gb[i] = gb[i] + jnp.sum(dp.astype(F32), axis=0)
      dps.append(dp)
    gwt = 0.0
    for j, dc in enumerate(dcs):
      dz = _rnd(sum(dot(dp, _block(a1_ref, dc, ec), cfg, trans_b=True)
                    for dp, ec in zip(dps, ecs, strict=True)), cfg)                 # [MC, CH]
      gwt = gwt + dot(xn[j], dz, cfg, trans_b=True)                                # [Np, MC]
      dxn[j] = dxn[j] + dot(wt, dz, cfg)                                            # [Np, CH]
    _store_block(gwt_ref, b, (0, Np), mc, gwt, cfg.N)
    return tuple(dxn), tuple(gb), tuple(u)
  dxn, gb, u = _over_keys(cfg, keys, (tuple(jnp.zeros((Np, dc[1]), F32) for dc in dcs),
                                      tuple(jnp.zeros((ec[1],), F32) for ec in ecs),
                                      tuple(jnp.zeros((Np, ec[1]), F32) for ec in ecs)))
  for ec, g, ui in zip(ecs, gb, u, strict=True):
    plgpu.store(gb_ref.at[b, pl.ds(*ec)], g)
    _store_block(u_ref, b, (0, Np), ec, ui, cfg.N)
  dxn = [round_to(g, cfg.dtype) for g in dxn]
  xf = lambda dc: _x(x_ref, b, dc, cfg) * rs                     # xn unrounded, as the narrow
  corr = sum(jnp.sum(g * xf(dc), axis=1, keepdims=True) for g, dc in zip(dxn, dcs, strict=True))
  for g, dc in zip(dxn, dcs, strict=True):
    _store_block(dx_ref, b, (0, Np), dc, rs * (g - xf(dc) * (corr / cfg.d)), cfg.N)


def _call(kernel, cfg, args, outs, name, warps):
  whole = pl.no_block_spec
  return _poison.pallas_call(
      functools.partial(kernel, cfg=cfg), args, out_shape=outs, grid=(cfg.B,),
      in_specs=[whole] * len(args), out_specs=(whole,) * len(outs), interpret=cfg.interpret,
      name=name, compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1))


def _cfg(x, w_tok, a_k, a1, eps, dtype, interpret) -> _Cfg:
  B, N, d = x.shape
  return _Cfg(B, N, w_tok.shape[1], d, a1.shape[1], a_k.shape[1], eps, dtype, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _fused(x, w_tok, a1, b1, a_k, a_v, eps, dtype, interpret):
  cfg = _cfg(x, w_tok, a_k, a1, eps, dtype, interpret)
  kv = jax.ShapeDtypeStruct((cfg.B, cfg.m, cfg.W), dtype)
  k, v = _call(_fwd_kernel if _narrow(cfg) else _fwd_wide_kernel, cfg,
               (x, w_tok, a1, b1, a_k, a_v), (kv, kv), "weightgen_fwd", 8 if cfg.W > 128 else 4)
  return k, v


def _vjp_fwd(x, w_tok, a1, b1, a_k, a_v, eps, dtype, interpret):
  return _fused(x, w_tok, a1, b1, a_k, a_v, eps, dtype, interpret), (x, w_tok, a1, b1, a_k, a_v)


def _vjp_bwd(eps, dtype, interpret, res, g):
  x, w_tok, a1, b1, a_k, a_v = res
  cfg = _cfg(x, w_tok, a_k, a1, eps, dtype, interpret)
  dk, dv = (c.astype(dtype) for c in g)
  S = jax.ShapeDtypeStruct
  # a1's gradient sum_b Z^T dp = sum_b X~^T (w_tok dp): the kernels write X~ and w_tok dp, [N, .]
  # rows instead of [m, .] (N < m at mid and prod)
  outs = (S(x.shape, x.dtype), S((cfg.B, cfg.m, cfg.e), dtype), S((cfg.B, cfg.N, cfg.d), dtype),
          S((cfg.B, cfg.N, cfg.e), dtype), S((cfg.B, cfg.N, cfg.m), F32), S((cfg.B, cfg.e), F32))
  kernel = _bwd_kernel if _narrow(cfg) else _bwd_wide_kernel
  dx, h, xn, u, gwt, gb = _call(kernel, cfg, (x, w_tok, a1, b1, a_k, a_v, dk, dv), outs,
                                "weightgen_bwd", 8)
  # the weights enter the kernels in their own dtype; their gradients are rounded to dtype, as
  # the twin's (autodiff of the dtype copies)
  rnd = lambda g, like: g.astype(dtype).astype(like.dtype)
  # the weight gradients sum over examples and rows: pallas_kernels.wgrad, whose splits weigh
  # the SMs kept busy against float32 partials (XLA's GEMMs split these short sums 32 and 64
  # ways); a_k's and a_v's in one call, reading h once
  rows = lambda a: a.reshape(-1, a.shape[-1])
  (ga1,) = wgrad.row_scaled_wgrad_pallas(rows(xn), None, [rows(u)], dtype=dtype,
                                         interpret=interpret)
  gk, gv = wgrad.row_scaled_wgrad_pallas(rows(h), None, [rows(dk), rows(dv)], dtype=dtype,
                                         interpret=interpret)
  return (dx, rnd(jnp.sum(gwt, 0), w_tok), rnd(ga1, a1), rnd(jnp.sum(gb, 0), b1),
          rnd(gk, a_k), rnd(gv, a_v))


_fused.defvjp(_vjp_fwd, _vjp_bwd)


def weightgen_pallas(x, w_tok, a1, b1, a_k, a_v, *, eps: float = EPS, dtype=jnp.bfloat16,
                     interpret: bool = False):
  """``weightgen_xla``'s values and gradients from the Pallas kernels (module docstring)."""
  B, N, d = x.shape
  m, (e, W) = w_tok.shape[1], a_k.shape
  if not supported(N, m, d, e, W):
    raise ValueError(f"weightgen: no kernel for N={N}, m={m}, d={d}, e={e}, W={W} "
                     f"(supported(): m, d, e, W powers of two >= 16, at most {MAX_WIDE})")
  if w_tok.shape[0] != N or a1.shape != (d, e) or b1.shape != (e,) or a_v.shape != (e, W):
    raise ValueError(f"weightgen: w_tok {w_tok.shape}, a1 {a1.shape}, b1 {b1.shape}, a_k "
                     f"{a_k.shape}, a_v {a_v.shape} do not fit x {x.shape}")
  return _fused(x, w_tok, a1, b1.astype(F32), a_k, a_v, float(eps), jnp.dtype(dtype),
                bool(interpret))


def supported(N: int, m: int, d: int, e: int, W: int) -> bool:
  """Whether the kernels take these widths: ``m, d, e, W`` powers of two >= 16 (Triton tiles),
  and either all of ``N, m, d, e, W`` in one tile (``N`` a power of two too, ``d, e <=
  MAX_HIDDEN``, ``W <= MAX_WIDTH``, ``N, m <= 128``) or, in chunks (wide), ``N`` up to 64 and the
  rest up to ``MAX_WIDE``'s."""
  if not all(is_tile(n) for n in (m, d, e, W)) or N < 1:
    return False
  return _narrow_widths(N, m, d, e, W) or all(
      n <= MAX_WIDE[k] for k, n in zip(("N", "m", "d", "e", "W"), (N, m, d, e, W), strict=True))


def _narrow_widths(N, m, d, e, W) -> bool:
  return is_tile(N) and max(d, e) <= MAX_HIDDEN and W <= MAX_WIDTH and max(N, m) <= 128


def _narrow(cfg: _Cfg) -> bool:
  """Whether one tile takes each width (the narrow kernels; mid's shapes)."""
  return _narrow_widths(cfg.N, cfg.m, cfg.d, cfg.e, cfg.W)


def flops(B: int, N: int, m: int, d: int, e: int, W: int) -> float:
  """FLOPs of the kernels on ``B`` examples: the forward's ``Z``, pre-activation and two
  projections (``2 (N m d + m d e + 2 m e W)`` each), the backward's recomputed first two, its
  two back-projections, ``dZ``, ``dX~`` and the ``w_tok`` partials, ``w_tok dp`` for ``a1``'s
  gradient, and the weight gradients of ``a1``, ``a_k`` and ``a_v`` (``pallas_kernels.wgrad``:
  ``2 N d e + 4 m e W``)."""
  per = 2.0 * (N * m * d + m * d * e)
  u = 2.0 * N * m * e
  return float(B) * (per + 4.0 * m * e * W          # forward
                     + per + 4.0 * m * e * W         # backward: recompute, dh
                     + 2.0 * m * e * d + 4.0 * N * m * d + u    # dZ, dX~, w_tok partials
                     + 2.0 * N * d * e + 4.0 * m * e * W)       # the weight gradients
