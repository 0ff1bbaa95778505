"""The PFFN's tail over packed tokens as one pass each way (issue 38): ``RMSNorm(g + u) + s``.

``g, u, s [N, d]``, ``valid f32[N]`` (1 for a real token, 0 for a packed block's tail) ->
``y = valid * (t * rsqrt(mean(t^2) + eps) + s)`` in ``s.dtype``, ``t = g + u`` in float32
(``kunlun.nn.fused.norm_residual`` on one packed row).

With ``u_norm`` (an epsilon; ``u`` None) the residual is ``u = LayerNorm(s)`` (affine-free,
float32 statistics, rounded to ``s.dtype``: the PFFN's query, which the GDPA kernels also
compute themselves, ``jagged_pallas``'s ``q_norm``), computed here, so ``u`` is never written;
the backward kernel then also writes ``s``'s whole cotangent, the norm's backward included.

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
from pallas_kernels.reference import layer_norm, layer_norm_project, layer_norm_stats

F32 = jnp.float32
WARPS = 4
ROW_ELEMS = 8192          # rows per program: this many elements, so 32 rows at d = 256


# ----------------------------------------------------------------------------------- twin

def norm_residual_xla(g, u, s, valid, *, eps: float, u_norm: float | None = None):
  """The twin: ``y [N, d]`` in ``s.dtype`` (module docstring); ``u`` None:
  ``reference.layer_norm(s, u_norm)``."""
  u = layer_norm(s, u_norm) if u is None else u
  t = g.astype(F32) + u.astype(F32)
  y = t * lax.rsqrt(jnp.mean(t * t, -1, keepdims=True) + eps) + s.astype(F32)
  return (y * valid.astype(F32)[:, None]).astype(s.dtype)


# ----------------------------------------------------------------------------------- kernels

class _Cfg(NamedTuple):
  eps: float
  rows: int
  interpret: bool
  u_norm: float | None = None    # u = LayerNorm(s) here, with this epsilon (_ln)


def _ln(s_ref, r0, cfg: _Cfg):
  """``s``'s rows in float32, ``y = (s - mu) r`` and ``r`` (``reference.layer_norm_stats``)."""
  x, mu, r = layer_norm_stats(load_rows(s_ref, r0, cfg.rows), cfg.u_norm)
  return x, (x - mu) * r, r


def _stats(g_ref, u_ref, r0, cfg: _Cfg, u=None):
  """``t = g + u`` in float32 (``u`` given: the norm's, rounded to its dtype) and its RMS
  reciprocal."""
  u = load_rows(u_ref, r0, cfg.rows) if u is None else u
  t = load_rows(g_ref, r0, cfg.rows).astype(F32) + u.astype(F32)
  return t, lax.rsqrt(jnp.mean(t * t, axis=1, keepdims=True) + cfg.eps)


def _fwd_ln_kernel(g_ref, s_ref, v_ref, y_ref, *, cfg: _Cfg):
  r0 = pl.program_id(0) * cfg.rows
  s, y, _ = _ln(s_ref, r0, cfg)
  t, r = _stats(g_ref, None, r0, cfg, u=y.astype(s_ref.dtype))
  store_rows(y_ref, r0, load_vec(v_ref, r0, cfg.rows)[:, None] * (t * r + s))


def _bwd_ln_kernel(g_ref, s_ref, v_ref, dy_ref, dt_ref, ds_ref, *, cfg: _Cfg):
  """``dt`` as ``_bwd_kernel``'s, and ``ds = valid dy + LN'(dt)``: the norm's backward of u's
  cotangent (``dt`` rounded to u's dtype, as autodiff hands it over)."""
  r0 = pl.program_id(0) * cfg.rows
  _, y, rl = _ln(s_ref, r0, cfg)
  t, r = _stats(g_ref, None, r0, cfg, u=y.astype(s_ref.dtype))
  z = t * r
  d = load_vec(v_ref, r0, cfg.rows)[:, None] * load_rows(dy_ref, r0, cfg.rows).astype(F32)
  dt = r * (d - z * jnp.mean(d * z, axis=1, keepdims=True))
  store_rows(dt_ref, r0, dt)
  du = dt.astype(s_ref.dtype).astype(F32)
  dx = rl * layer_norm_project(y, du)
  store_rows(ds_ref, r0, d + dx)


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
  n = out[0].shape[0] if isinstance(out, tuple) else out.shape[0]
  return _poison.pallas_call(
      functools.partial(kernel, cfg=cfg), args, out_shape=out,
      grid=(pl.cdiv(n, cfg.rows),), in_specs=[whole] * len(args),
      out_specs=jax.tree.map(lambda _: whole, out),
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _fused_ln(g, s, valid, eps, u_norm, interpret):
  cfg = _cfg(s.shape[1], eps, interpret)._replace(u_norm=u_norm)
  return _call(_fwd_ln_kernel, (g, s, valid), jax.ShapeDtypeStruct(s.shape, s.dtype), cfg,
               "norm_residual_fwd")


def _ln_vjp_fwd(g, s, valid, eps, u_norm, interpret):
  return _fused_ln(g, s, valid, eps, u_norm, interpret), (g, s, valid)


def _ln_vjp_bwd(eps, u_norm, interpret, res, dy):
  g, s, valid = res
  cfg = _cfg(g.shape[1], eps, interpret)._replace(u_norm=u_norm)
  dt, ds = _call(_bwd_ln_kernel, (g, s, valid, dy),
                 (jax.ShapeDtypeStruct(g.shape, g.dtype), jax.ShapeDtypeStruct(s.shape, s.dtype)),
                 cfg, "norm_residual_bwd")
  return dt, ds, jnp.zeros_like(valid)


_fused_ln.defvjp(_ln_vjp_fwd, _ln_vjp_bwd)


def supported(d: int) -> bool:
  """Whether the kernels take width ``d``: a power of two >= 16 (a row is one tile)."""
  return is_tile(d) and d <= ROW_ELEMS


def norm_residual_pallas(g, u, s, valid, *, eps: float, interpret: bool = False,
                         u_norm: float | None = None):
  """``norm_residual_xla``'s values and gradients from the Pallas kernels (module docstring)."""
  if (u is None) != (u_norm is not None):
    raise ValueError("norm_residual: give u, or u=None with u_norm (its LayerNorm's epsilon)")
  ushape = g.shape if u is None else u.shape
  if g.ndim != 2 or g.shape != ushape or g.shape != s.shape or valid.shape != g.shape[:1]:
    raise ValueError(f"norm_residual: g {g.shape}, u {ushape}, s {s.shape} must be one [N, d] "
                     f"and valid {valid.shape} [N]")
  if not supported(g.shape[1]):
    raise ValueError(f"norm_residual: the kernels need d a power of two in [16, {ROW_ELEMS}]; "
                     f"got d={g.shape[1]}")
  if u is None:
    return _fused_ln(g, s, jnp.asarray(valid, F32), float(eps), float(u_norm), bool(interpret))
  return _fused(g, u, s, jnp.asarray(valid, F32), float(eps), bool(interpret))
