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
``a_k``, ``a_v``), ``Z`` and the pre-activation's cotangent (for ``a1``), and per-example partial
sums for ``w_tok`` and ``b1``. The weight gradients are XLA GEMMs over all examples (a
``[e, W]`` float32 accumulator does not fit a program's registers). One program per example; the
weights are read by every program (from L2). Pallas Triton, for the reason ``norm_qkv`` gives
(deviceless compile through ptxas, interpret mode on CPU).
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

from pallas_kernels import _poison
from pallas_kernels._common import dot, is_tile, round_to

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
  """The forward from ``x [N, d]``: ``xn`` (float32, unrounded), its ``rs``, and ``Z`` and the
  pre-activation (in ``dtype``)."""
  xf = x.astype(F32)
  rs = lax.rsqrt(jnp.sum(xf * xf, axis=1, keepdims=True) / cfg.d + cfg.eps)
  xn = xf * rs
  z = _rnd(dot(wt, _rnd(xn, cfg), cfg, trans_a=True), cfg)                          # [m, d]
  pre = _rnd(round_to(dot(z, a1, cfg), cfg.dtype) + round_to(b1, cfg.dtype), cfg)
  return xn, rs, z, pre


def _tanh_arg(pre):
  p = pre.astype(F32)
  return _tanh(_C * (p + _A * p * p * p))


def _fwd_kernel(x_ref, wt_ref, a1_ref, b1_ref, ak_ref, av_ref, k_ref, v_ref, *, cfg: _Cfg):
  b = pl.program_id(0)
  b1 = plgpu.load(b1_ref.at[pl.ds(0, cfg.e)])[None, :]
  _, _, _, pre = _chain(_ex(x_ref, b), _whole(wt_ref), _whole(a1_ref), b1, cfg)
  h = _rnd(0.5 * pre.astype(F32) * (1.0 + _tanh_arg(pre)), cfg)
  _put(k_ref, b, dot(h, _whole(ak_ref), cfg))
  _put(v_ref, b, dot(h, _whole(av_ref), cfg))


def _bwd_kernel(x_ref, wt_ref, a1_ref, b1_ref, ak_ref, av_ref, dk_ref, dv_ref,
                dx_ref, h_ref, z_ref, dp_ref, gwt_ref, gb_ref, *, cfg: _Cfg):
  # ordered so that few [m, W] / [e, W] tiles are live at once; rounded values kept in dtype
  b = pl.program_id(0)
  dh = round_to(dot(_ex(dk_ref, b), _whole(ak_ref), cfg, trans_b=True), cfg.dtype)
  dh = _rnd(dh + round_to(dot(_ex(dv_ref, b), _whole(av_ref), cfg, trans_b=True), cfg.dtype),
            cfg)                                                                     # [m, e]
  b1 = plgpu.load(b1_ref.at[pl.ds(0, cfg.e)])[None, :]
  wt, a1 = _whole(wt_ref), _whole(a1_ref)
  xn, rs, z, pre = _chain(_ex(x_ref, b), wt, a1, b1, cfg)
  _put(z_ref, b, z)
  t, p = _tanh_arg(pre), pre.astype(F32)
  _put(h_ref, b, 0.5 * p * (1.0 + t))
  dp = _rnd(dh.astype(F32) * (0.5 * (1.0 + t) + 0.5 * p * (1.0 - t * t) * _C
                              * (1.0 + 3 * _A * p * p)), cfg)
  _put(dp_ref, b, dp)
  plgpu.store(gb_ref.at[b, pl.ds(0, cfg.e)], jnp.sum(dp.astype(F32), axis=0))
  dz = _rnd(dot(dp, a1, cfg, trans_b=True), cfg)                                    # [m, d]
  _put(gwt_ref, b, dot(_rnd(xn, cfg), dz, cfg, trans_b=True))                       # [N, m]
  dxn = round_to(dot(wt, dz, cfg), cfg.dtype)                                       # [N, d]
  _put(dx_ref, b, rs * (dxn - xn * (jnp.sum(dxn * xn, axis=1, keepdims=True) / cfg.d)))


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
  k, v = _call(_fwd_kernel, cfg, (x, w_tok, a1, b1, a_k, a_v), (kv, kv), "weightgen_fwd",
                 8 if cfg.W > 128 else 4)
  return k, v


def _vjp_fwd(x, w_tok, a1, b1, a_k, a_v, eps, dtype, interpret):
  return _fused(x, w_tok, a1, b1, a_k, a_v, eps, dtype, interpret), (x, w_tok, a1, b1, a_k, a_v)


def _vjp_bwd(eps, dtype, interpret, res, g):
  x, w_tok, a1, b1, a_k, a_v = res
  cfg = _cfg(x, w_tok, a_k, a1, eps, dtype, interpret)
  dk, dv = (c.astype(dtype) for c in g)
  S = jax.ShapeDtypeStruct
  outs = (S(x.shape, x.dtype), S((cfg.B, cfg.m, cfg.e), dtype), S((cfg.B, cfg.m, cfg.d), dtype),
          S((cfg.B, cfg.m, cfg.e), dtype), S((cfg.B, cfg.N, cfg.m), F32), S((cfg.B, cfg.e), F32))
  dx, h, z, dp, gwt, gb = _call(_bwd_kernel, cfg, (x, w_tok, a1, b1, a_k, a_v, dk, dv), outs,
                                "weightgen_bwd", 8)
  # the weights enter the kernels in their own dtype; their gradients are rounded to dtype, as
  # the twin's (autodiff of the dtype copies)
  rnd = lambda g, like: g.astype(dtype).astype(like.dtype)
  mm = lambda a, c: jnp.einsum("bmi,bmj->ij", a, c, preferred_element_type=F32)
  return (dx, rnd(jnp.sum(gwt, 0), w_tok), rnd(mm(z, dp), a1), rnd(jnp.sum(gb, 0), b1),
          rnd(mm(h, dk), a_k), rnd(mm(h, dv), a_v))


_fused.defvjp(_vjp_fwd, _vjp_bwd)


def weightgen_pallas(x, w_tok, a1, b1, a_k, a_v, *, eps: float = EPS, dtype=jnp.bfloat16,
                     interpret: bool = False):
  """``weightgen_xla``'s values and gradients from the Pallas kernels (module docstring)."""
  B, N, d = x.shape
  m, (e, W) = w_tok.shape[1], a_k.shape
  if not supported(N, m, d, e, W):
    raise ValueError(f"weightgen: no kernel for N={N}, m={m}, d={d}, e={e}, W={W} "
                     f"(supported(): powers of two >= 16, d and e at most {MAX_HIDDEN}, W at "
                     f"most {MAX_WIDTH})")
  if w_tok.shape[0] != N or a1.shape != (d, e) or b1.shape != (e,) or a_v.shape != (e, W):
    raise ValueError(f"weightgen: w_tok {w_tok.shape}, a1 {a1.shape}, b1 {b1.shape}, a_k "
                     f"{a_k.shape}, a_v {a_v.shape} do not fit x {x.shape}")
  return _fused(x, w_tok, a1, b1.astype(F32), a_k, a_v, float(eps), jnp.dtype(dtype),
                bool(interpret))


def supported(N: int, m: int, d: int, e: int, W: int) -> bool:
  """Whether the kernels take these widths: all powers of two >= 16 (Triton tiles), ``d, e <=
  MAX_HIDDEN``, ``W <= MAX_WIDTH`` and ``N, m <= 128`` (a program's tiles and registers)."""
  return (all(is_tile(n) for n in (N, m, d, e, W)) and max(d, e) <= MAX_HIDDEN
          and W <= MAX_WIDTH and max(N, m) <= 128)


def flops(B: int, N: int, m: int, d: int, e: int, W: int) -> float:
  """FLOPs of the two kernels on ``B`` examples (the weight gradients are XLA GEMMs, in the
  HLO): the forward's ``Z``, pre-activation and two projections (``2 (N m d + m d e + 2 m e W)``
  each), the backward's recomputed first two, its two back-projections, ``dZ``, ``dX~`` and the
  ``w_tok`` partials."""
  per = 2.0 * (N * m * d + m * d * e)
  return float(B) * (per + 4.0 * m * e * W          # forward
                     + per + 4.0 * m * e * W         # backward: recompute, dh
                     + 2.0 * m * e * d + 4.0 * N * m * d)   # dZ, dX~, w_tok partials
