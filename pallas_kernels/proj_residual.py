"""The attention's output side over packed tokens as one forward pass (issue 38): the output
projection with the residual add in its epilogue, a GEMM writing only the layer's output.

``x [N, d]``, ``o [N, H, D]``, ``w [H, D, d]``, ``valid f32[N]`` (1 for a real token, 0 for a
packed block's tail) -> ``y = valid * (x + round(o w))`` in ``x.dtype``, the projection
accumulated in float32 and rounded to ``dtype`` (the model's XLA path,
``kunlun.nn.attention.SeqAttention``), the sum in float32.

``proj_residual_xla`` is the twin. ``proj_residual_pallas``: the forward kernel reads ``o``,
``x`` and ``w`` and writes ``y`` (XLA wrote ``o w`` out and read it back for the add); the
backward is XLA's GEMM ``do = dy w^T`` and ``pallas_kernels.wgrad``'s ``dw = o^T dy``, and
``x``'s cotangent is ``dy`` unmasked: its producer masks it (``pallas_kernels.norm_qkv``'s
pass-through with ``valid``). Triton on GPU, ``interpret=True`` on CPU.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _poison, wgrad
from pallas_kernels._common import is_tile, load_rows, load_vec, precision, round_to, store_rows

F32 = jnp.float32
COLS = 64              # output columns per inner step: a [K, COLS] slice of w
# by K = H D: token rows per program (its [rows, K] tile) and warps; ptxas (sm_90) spills none
# at these, and spills at K = 512 with 32 rows (either warp count) or 16 rows on 4 warps
ROWS = {64: 64, 128: 64, 256: 64, 512: 16}
WARPS = {64: 4, 128: 4, 256: 4, 512: 8}


def _project(o, w, dtype):
  return jnp.einsum("nhc,hcd->nd", o.astype(dtype), w.astype(dtype))


def proj_residual_xla(x, o, w, valid, *, dtype=jnp.bfloat16):
  """The twin: ``y [N, d]`` in ``x.dtype`` (module docstring)."""
  y = x.astype(F32) + _project(o, w, dtype).astype(F32)
  return (y * jnp.asarray(valid, F32)[:, None]).astype(x.dtype)


class _Cfg(NamedTuple):
  dtype: object
  rows: int
  interpret: bool


def _kernel(o_ref, w_ref, x_ref, v_ref, y_ref, *, cfg: _Cfg):
  rows = cfg.rows
  r0 = pl.program_id(0) * rows
  d = w_ref.shape[1]
  o = load_rows(o_ref, r0, rows).astype(cfg.dtype)
  valid = load_vec(v_ref, r0, rows)[:, None]
  for c0 in range(0, d, COLS):      # static: d / COLS steps (4 at d = 256)
    wc = plgpu.load(w_ref.at[:, pl.ds(c0, COLS)]).astype(cfg.dtype)
    a, b = (o.astype(F32), wc.astype(F32)) if cfg.interpret else (o, wc)
    p = round_to(plgpu.dot(a, b, precision=precision(o.dtype)), cfg.dtype)
    xc = load_rows(x_ref, r0, rows, (c0, COLS)).astype(F32)
    store_rows(y_ref, r0, valid * (xc + p), c0)


def supported(K: int, d: int) -> bool:
  """Whether the kernel takes ``K = H D`` and width ``d``: powers of two, ``K`` one of
  ``ROWS``' keys, ``d`` a multiple of ``COLS``."""
  return K in ROWS and is_tile(d) and d % COLS == 0


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _fused(x, o, w, valid, dtype, interpret):
  N, d = x.shape
  K = o.shape[1] * o.shape[2]
  cfg = _Cfg(dtype, ROWS[K], interpret)
  whole = pl.no_block_spec
  args = (o.reshape(N, K), w.astype(dtype).reshape(K, d), x, valid)
  return _poison.pallas_call(
      functools.partial(_kernel, cfg=cfg), args, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
      grid=(pl.cdiv(N, cfg.rows),), in_specs=[whole] * 4, out_specs=whole,
      interpret=interpret, name="proj_residual",
      compiler_params=plgpu.CompilerParams(num_warps=WARPS[K]))


def _vjp_fwd(x, o, w, valid, dtype, interpret):
  return _fused(x, o, w, valid, dtype, interpret), (o, w, valid, jnp.zeros((0,), x.dtype))


def _vjp_bwd(dtype, interpret, res, dy):
  o, w, valid, x0 = res
  g = dy.astype(dtype)
  _, vjp = jax.vjp(lambda o: _project(o, w, dtype), o)
  (do,) = vjp(g)
  # dw = o^T dy sums over every token: pallas_kernels.wgrad, whose splits weigh the SMs kept busy
  # against float32 partials (XLA's GEMM split it 16 to 128 ways at mid), rounded as the twin's
  (dw,) = wgrad.row_scaled_wgrad_pallas(o.reshape(o.shape[0], -1), None, [g], dtype=dtype,
                                        interpret=interpret)
  dw = dw.reshape(w.shape).astype(dtype).astype(w.dtype)
  return dy.astype(x0.dtype), do, dw, jnp.zeros_like(valid)


_fused.defvjp(_vjp_fwd, _vjp_bwd)


def proj_residual_pallas(x, o, w, valid, *, dtype=jnp.bfloat16, interpret: bool = False):
  """``proj_residual_xla``'s values from the kernel; gradients as the module docstring says
  (``x``'s unmasked)."""
  if x.ndim != 2 or o.ndim != 3 or o.shape[0] != x.shape[0] or w.shape != (*o.shape[1:],
                                                                            x.shape[1]):
    raise ValueError(f"proj_residual: x {x.shape}, o {o.shape}, w {w.shape} must be [N, d], "
                     "[N, H, D], [H, D, d]")
  if valid.shape != x.shape[:1]:
    raise ValueError(f"proj_residual: valid {valid.shape} must be [N] with N = {x.shape[0]}")
  K = o.shape[1] * o.shape[2]
  if not supported(K, x.shape[1]):
    raise ValueError(f"proj_residual: the kernel needs H D in {sorted(ROWS)} and d a power of "
                     f"two multiple of {COLS}; got H D = {K}, d = {x.shape[1]}")
  return _fused(x, o, w, jnp.asarray(valid, F32), jnp.dtype(dtype), bool(interpret))
