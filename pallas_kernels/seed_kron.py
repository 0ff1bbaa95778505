"""HSP's seed side as one pass each way (issue 38): ``t = Z^T RMSNorm(a + e)`` per example.

``a [B, S, d]`` (the seeds' pooled values through the output projection), ``e f32[S, d]`` (the
learned seeds), ``z [S, K]`` (``SumKronLinear``'s ``Z`` as ``[n_in, n_out * rank]``) -> ``t [B,
K, d]`` in ``dtype``: ``h = RMSNorm(a + e)`` in float32 rounded to ``dtype``
(``kunlun.nn.fused.add_rms_norm``), then ``t = z^T h`` with ``z`` rounded to ``dtype``,
accumulated in float32 (``SumKronLinear``'s first product).

``seed_kron_xla`` is the twin: the formula, differentiated by autodiff.
``seed_kron_pallas`` runs a forward kernel (reads ``a``, writes ``t``; XLA writes ``h`` and its
statistics and reads them back, three launches and a GEMM) and a backward kernel (reads ``a``
and ``dt``, recomputes ``h``, writes ``da`` and per-program partial sums of ``z``'s gradient;
``e``'s gradient is ``da`` summed over the examples, left to XLA). A program takes ``EXAMPLES``
examples, ``ROWS`` seeds at a time. Triton on GPU, ``interpret=True`` on CPU.
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
from pallas_kernels._common import dot, is_tile, load_rows, round_to, store_rows

F32 = jnp.float32
WARPS = 8
EXAMPLES = 2          # examples per program
ROWS = 16             # seeds per step (a row's norm needs only its own row)
MAX_ACC = 64 * 256    # K x d: the forward's float32 accumulator a program holds


# ----------------------------------------------------------------------------------- twin

def seed_kron_xla(a, e, z, *, eps: float, dtype=jnp.bfloat16):
  """The twin: ``t [B, K, d]`` in ``dtype`` (module docstring)."""
  t = a.astype(F32) + e.astype(F32)
  h = (t * lax.rsqrt(jnp.mean(t * t, -1, keepdims=True) + eps)).astype(dtype)
  return jnp.einsum("sk,bsd->bkd", z.astype(dtype), h,
                    preferred_element_type=F32).astype(dtype)


# ----------------------------------------------------------------------------------- kernels

class _Cfg(NamedTuple):
  B: int
  S: int
  K: int
  d: int
  eps: float
  dtype: object
  interpret: bool


def _norm(a_ref, e_ref, b, s0, cfg: _Cfg):
  """Seeds ``s0 .. s0 + ROWS`` of example ``b``: ``(z, r)`` with ``z = t r`` the float32 norm of
  ``t = a + e`` and ``r = rsqrt(mean(t^2) + eps)`` (zero rows for an example past B)."""
  t = (load_rows(a_ref, b * cfg.S + s0, ROWS).astype(F32)
       + load_rows(e_ref, s0, ROWS).astype(F32))
  r = lax.rsqrt(jnp.mean(t * t, axis=1, keepdims=True) + cfg.eps)
  return t * r, r


def _fwd_kernel(a_ref, e_ref, z_ref, t_ref, *, cfg: _Cfg):
  zs = [load_rows(z_ref, s0, ROWS) for s0 in range(0, cfg.S, ROWS)]
  p = pl.program_id(0)

  def one(i, carry):
    b = p * EXAMPLES + i
    acc = jnp.zeros((cfg.K, cfg.d), F32)
    for c, s0 in enumerate(range(0, cfg.S, ROWS)):
      h = _norm(a_ref, e_ref, b, s0, cfg)[0]
      acc += dot(zs[c], h, cfg, trans_a=True)                    # [K, ROWS] [ROWS, d]
    store_rows(t_ref, b * cfg.K, acc.astype(cfg.dtype))           # rows past B*K dropped
    return carry

  lax.fori_loop(0, EXAMPLES, one, 0)


def _bwd_kernel(a_ref, e_ref, z_ref, dt_ref, da_ref, g_ref, *, cfg: _Cfg):
  chunks = list(range(0, cfg.S, ROWS))
  zs = [load_rows(z_ref, s0, ROWS) for s0 in chunks]
  p = pl.program_id(0)

  def one(i, gz):
    b = p * EXAMPLES + i
    dt = load_rows(dt_ref, b * cfg.K, cfg.K).astype(F32)          # zero past B
    gz = list(gz)
    for c, s0 in enumerate(chunks):
      zn, r = _norm(a_ref, e_ref, b, s0, cfg)
      dh = round_to(dot(zs[c], dt, cfg), cfg.dtype)              # [ROWS, K] [K, d]
      da = r * (dh - zn * jnp.mean(dh * zn, axis=1, keepdims=True))
      store_rows(da_ref, b * cfg.S + s0, da)
      gz[c] = gz[c] + dot(round_to(zn, cfg.dtype), dt, cfg, trans_b=True)   # [ROWS, K]
    return tuple(gz)

  gz = lax.fori_loop(0, EXAMPLES, one, tuple(jnp.zeros((ROWS, cfg.K), F32) for _ in chunks))
  for c, s0 in enumerate(chunks):
    store_rows(g_ref, p * cfg.S + s0, gz[c])


def _call(kernel, args, outs, cfg: _Cfg, name):
  whole = pl.no_block_spec
  return _poison.pallas_call(
      functools.partial(kernel, cfg=cfg), args, out_shape=outs,
      grid=(pl.cdiv(cfg.B, EXAMPLES),), in_specs=[whole] * len(args),
      out_specs=(whole,) * len(outs), interpret=cfg.interpret, name=name,
      compiler_params=plgpu.CompilerParams(num_warps=WARPS, num_stages=1))


def _cfg(a, z, eps, dtype, interpret):
  B, S, d = a.shape
  return _Cfg(B, S, z.shape[1], d, float(eps), jnp.dtype(dtype), bool(interpret))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _fused(a, e, z, eps, dtype, interpret):
  cfg = _cfg(a, z, eps, dtype, interpret)
  out = (jax.ShapeDtypeStruct((cfg.B * cfg.K, cfg.d), cfg.dtype),)
  t = _call(_fwd_kernel, (a.reshape(cfg.B * cfg.S, cfg.d), e, z), out, cfg, "seed_kron_fwd")[0]
  return t.reshape(cfg.B, cfg.K, cfg.d)


def _vjp_fwd(a, e, z, eps, dtype, interpret):
  return _fused(a, e, z, eps, dtype, interpret), (a, e, z)


def _vjp_bwd(eps, dtype, interpret, res, dt):
  a, e, z = res
  cfg = _cfg(a, z, eps, dtype, interpret)
  T = pl.cdiv(cfg.B, EXAMPLES)
  outs = (jax.ShapeDtypeStruct((cfg.B * cfg.S, cfg.d), a.dtype),
          jax.ShapeDtypeStruct((T * cfg.S, cfg.K), F32))
  da, gz = _call(_bwd_kernel, (a.reshape(cfg.B * cfg.S, cfg.d), e, z,
                               dt.reshape(cfg.B * cfg.K, cfg.d)), outs, cfg, "seed_kron_bwd")
  da = da.reshape(a.shape)
  de = jnp.sum(da.astype(F32), axis=0)            # e's: a's as rounded, summed over examples
  return da, de.astype(e.dtype), jnp.sum(gz.reshape(T, cfg.S, cfg.K), 0).astype(z.dtype)


_fused.defvjp(_vjp_fwd, _vjp_bwd)


def supported(S: int, K: int, d: int) -> bool:
  """Whether the kernels take ``S`` seeds, ``K`` outputs and width ``d``: each a power of two
  >= 16, ``S`` a multiple of ``ROWS`` and the forward's accumulator ``K x d`` at most
  ``MAX_ACC``."""
  return is_tile(S) and is_tile(K) and is_tile(d) and S % ROWS == 0 and K * d <= MAX_ACC


def seed_kron_pallas(a, e, z, *, eps: float, dtype=jnp.bfloat16, interpret: bool = False):
  """``seed_kron_xla``'s values and gradients from the Pallas kernels (module docstring)."""
  if a.ndim != 3 or e.shape != a.shape[1:] or z.ndim != 2 or z.shape[0] != a.shape[1]:
    raise ValueError(f"seed_kron: a {a.shape}, e {e.shape}, z {z.shape} must be [B, S, d], "
                     "[S, d] and [S, K]")
  if not supported(a.shape[1], z.shape[1], a.shape[2]):
    raise ValueError(f"seed_kron: no kernel for S={a.shape[1]}, K={z.shape[1]}, d={a.shape[2]} "
                     "(supported())")
  return _fused(a, e.astype(F32), z.astype(F32), float(eps), jnp.dtype(dtype), bool(interpret))
