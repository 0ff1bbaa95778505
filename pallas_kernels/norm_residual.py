"""The PFFN's tail over packed tokens as one pass each way (issue 38): ``RMSNorm(g + u) + s``.

``g, u, s [N, d]``, ``valid f32[N]`` (1 for a real token, 0 for a packed block's tail) ->
``y = valid * (t * rsqrt(mean(t^2) + eps) + s)`` in ``s.dtype``, ``t = g + u`` in float32
(``kunlun.nn.fused.norm_residual`` on one packed row).

``norm_residual_xla`` is the twin: the formula, differentiated by autodiff.
``norm_residual_pallas`` runs a forward kernel (reads ``g, u, s``, writes ``y``) and a backward
kernel (reads ``g, u`` and ``dy``, writes ``dt``, the cotangent of ``g`` and of ``u``); ``s``'s
cotangent ``valid * dy`` is left to XLA, which fuses it into its consumer. XLA itself writes the
float32 ``t`` out in the forward and makes three passes in the backward. Triton on GPU,
``interpret=True`` on CPU.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _poison
from pallas_kernels._common import is_tile, load_rows, load_vec, store_rows

F32 = jnp.float32
WARPS = 4
ROW_ELEMS = 8192          # rows per program: this many elements, so 32 rows at d = 256


# ----------------------------------------------------------------------------------- twin

def norm_residual_xla(g, u, s, valid, *, eps: float):
  """The twin: ``y [N, d]`` in ``s.dtype`` (module docstring)."""
  t = g.astype(F32) + u.astype(F32)
  y = t * lax.rsqrt(jnp.mean(t * t, -1, keepdims=True) + eps) + s.astype(F32)
  return (y * valid.astype(F32)[:, None]).astype(s.dtype)


# ----------------------------------------------------------------------------------- kernels

class _Cfg(NamedTuple):
  eps: float
  rows: int
  interpret: bool


def _stats(g_ref, u_ref, r0, cfg: _Cfg):
  t = load_rows(g_ref, r0, cfg.rows).astype(F32) + load_rows(u_ref, r0, cfg.rows).astype(F32)
  return t, lax.rsqrt(jnp.mean(t * t, axis=1, keepdims=True) + cfg.eps)


def _fwd_kernel(g_ref, u_ref, s_ref, v_ref, y_ref, *, cfg: _Cfg):
  r0 = pl.program_id(0) * cfg.rows
  t, r = _stats(g_ref, u_ref, r0, cfg)
  s = load_rows(s_ref, r0, cfg.rows).astype(F32)
  store_rows(y_ref, r0, load_vec(v_ref, r0, cfg.rows)[:, None] * (t * r + s))


def _bwd_kernel(g_ref, u_ref, v_ref, dy_ref, dt_ref, *, cfg: _Cfg):
  r0 = pl.program_id(0) * cfg.rows
  t, r = _stats(g_ref, u_ref, r0, cfg)
  z = t * r
  d = load_vec(v_ref, r0, cfg.rows)[:, None] * load_rows(dy_ref, r0, cfg.rows).astype(F32)
  store_rows(dt_ref, r0, r * (d - z * jnp.mean(d * z, axis=1, keepdims=True)))


def _call(kernel, args, out, cfg: _Cfg, name):
  whole = pl.no_block_spec
  return _poison.pallas_call(
      functools.partial(kernel, cfg=cfg), args, out_shape=out,
      grid=(pl.cdiv(out.shape[0], cfg.rows),), in_specs=[whole] * len(args), out_specs=whole,
      interpret=cfg.interpret, name=name, compiler_params=plgpu.CompilerParams(num_warps=WARPS))


def _cfg(d, eps, interpret):
  return _Cfg(float(eps), max(1, ROW_ELEMS // d), bool(interpret))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _fused(g, u, s, valid, eps, interpret):
  cfg = _cfg(s.shape[1], eps, interpret)
  return _call(_fwd_kernel, (g, u, s, valid), jax.ShapeDtypeStruct(s.shape, s.dtype), cfg,
               "norm_residual_fwd")


def _vjp_fwd(g, u, s, valid, eps, interpret):
  return _fused(g, u, s, valid, eps, interpret), (g, u, valid, jnp.zeros((0,), s.dtype))


def _vjp_bwd(eps, interpret, res, dy):
  g, u, valid, s0 = res
  cfg = _cfg(g.shape[1], eps, interpret)
  wide = jnp.promote_types(g.dtype, u.dtype)       # one dt for both, each rounded once
  dt = _call(_bwd_kernel, (g, u, valid, dy), jax.ShapeDtypeStruct(g.shape, wide), cfg,
             "norm_residual_bwd")
  ds = (dy.astype(F32) * valid[:, None]).astype(s0.dtype)
  return dt.astype(g.dtype), dt.astype(u.dtype), ds, jnp.zeros_like(valid)


_fused.defvjp(_vjp_fwd, _vjp_bwd)


def supported(d: int) -> bool:
  """Whether the kernels take width ``d``: a power of two >= 16 (a row is one tile)."""
  return is_tile(d) and d <= ROW_ELEMS


def norm_residual_pallas(g, u, s, valid, *, eps: float, interpret: bool = False):
  """``norm_residual_xla``'s values and gradients from the Pallas kernels (module docstring)."""
  if g.ndim != 2 or g.shape != u.shape or g.shape != s.shape or valid.shape != g.shape[:1]:
    raise ValueError(f"norm_residual: g {g.shape}, u {u.shape}, s {s.shape} must be one [N, d] "
                     f"and valid {valid.shape} [N]")
  if not supported(g.shape[1]):
    raise ValueError(f"norm_residual: the kernels need d a power of two in [16, {ROW_ELEMS}]; "
                     f"got d={g.shape[1]}")
  return _fused(g, u, s, jnp.asarray(valid, F32), float(eps), bool(interpret))
