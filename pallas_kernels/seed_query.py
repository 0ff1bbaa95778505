"""HSP's seed queries in one launch each way (issue 38): ``q = rms_norm(e) w``.

``e f32[S, d]`` (the learned seeds) and ``w [d, H, D]`` -> ``q [S, H, D]`` in ``dtype``: ``h =
rms_norm(e)`` (float32, no scale) rounded to ``dtype``, ``q = h w`` accumulated in float32 and
rounded, as ``kunlun.nn.hsp``'s ``_to_heads(rms_norm(e))``. The backward, from ``dq``: ``dw = h^T
dq`` and ``dh = dq w^T``, each rounded to ``dtype`` as the einsum's gradients are, then the
norm's backward (``kunlun.nn.norms.rms_norm``'s): ``de = r (dh - y mean(dh y))``, ``y = e r``.

XLA ran the forward as a norm pass and a split-K GEMM with its sum (3 launches) and the backward
as two GEMMs (one split-K, with its sum) and the norm's three passes (6), for a few MFLOP: here
one program each way. ``seed_query_xla`` is the twin (the formulas, differentiated by
autodiff). Triton on GPU, ``interpret=True`` on CPU.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _poison
from pallas_kernels._common import dot, is_tile, round_to
from pallas_kernels.norm_qkv import _norm_rows

F32 = jnp.float32
EPS = 1e-6
COLS = 64              # columns of w (and of q, dq, dw) per step
WARPS = 8
MAX_SEEDS, MAX_WIDTH = 64, 256   # a program holds [S, d] float32 (64 KB at mid's 64 x 256)


def seed_query_xla(e, w, *, eps: float = EPS, dtype=jnp.bfloat16):
  """The twin: ``rms_norm(e)`` in float32, then the heads' projection in ``dtype``."""
  ef = e.astype(F32)
  return jnp.einsum("sd,dhc->shc", (ef * _norm_rows(ef, eps)).astype(dtype), w.astype(dtype))


class _Cfg(NamedTuple):
  eps: float
  dtype: object
  interpret: bool


def _norm(e_ref, cfg: _Cfg):
  """``(y = e r, r)`` of the seeds, float32."""
  e = e_ref[...].astype(F32)
  r = _norm_rows(e, cfg.eps)
  return e * r, r


def _fwd_kernel(e_ref, w_ref, q_ref, *, cfg: _Cfg):
  y, _ = _norm(e_ref, cfg)
  h = y.astype(cfg.dtype)
  for c in range(q_ref.shape[1] // COLS):
    cols = pl.ds(c * COLS, COLS)
    q_ref[:, cols] = dot(h, w_ref[:, cols], cfg).astype(q_ref.dtype)


def _bwd_kernel(e_ref, w_ref, dq_ref, dw_ref, de_ref, *, cfg: _Cfg):
  y, r = _norm(e_ref, cfg)
  h = y.astype(cfg.dtype)
  n = dq_ref.shape[1] // COLS
  for c in range(n):                       # dw = h^T dq, a column block at a time
    cols = pl.ds(c * COLS, COLS)
    dw = dot(h, dq_ref[:, cols], cfg, trans_a=True)
    dw_ref[:, cols] = dw.astype(cfg.dtype).astype(dw_ref.dtype)
  dh = jnp.zeros(y.shape, F32)
  for c in range(n):                       # dh = dq w^T
    cols = pl.ds(c * COLS, COLS)
    dh = dh + dot(dq_ref[:, cols], w_ref[:, cols], cfg, trans_b=True)
  dh = round_to(dh, cfg.dtype)
  m = jnp.mean(dh * y, axis=1, keepdims=True)
  de_ref[...] = r * (dh - y * m)


def _call(kernel, args, outs, cfg: _Cfg, name: str):
  whole = pl.no_block_spec
  return _poison.pallas_call(
      functools.partial(kernel, cfg=cfg), args, out_shape=outs, grid=(1,),
      in_specs=[whole] * len(args), out_specs=tuple(whole for _ in outs) if isinstance(
          outs, tuple) else whole, interpret=cfg.interpret, name=name,
      compiler_params=plgpu.CompilerParams(num_warps=WARPS, num_stages=1))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _op(e, w, cfg: _Cfg):
  S, d = e.shape
  q = _call(_fwd_kernel, (e, w.reshape(d, -1).astype(cfg.dtype)),
            jax.ShapeDtypeStruct((S, w.shape[1] * w.shape[2]), cfg.dtype), cfg, "seed_query_fwd")
  return q.reshape(S, *w.shape[1:])


def _op_fwd(e, w, cfg: _Cfg):
  return _op(e, w, cfg), (e, w)


def _op_bwd(cfg: _Cfg, res, dq):
  e, w = res
  S, d = e.shape
  dw, de = _call(_bwd_kernel, (e, w.reshape(d, -1).astype(cfg.dtype),
                               dq.reshape(S, -1).astype(cfg.dtype)),
                 (jax.ShapeDtypeStruct((d, w.shape[1] * w.shape[2]), w.dtype),
                  jax.ShapeDtypeStruct((S, d), F32)), cfg, "seed_query_bwd")
  return de.astype(e.dtype), dw.reshape(w.shape)


_op.defvjp(_op_fwd, _op_bwd)


def supported(S: int, d: int, heads: int, head_dim: int) -> bool:
  """Whether one program holds the seeds: ``S <= MAX_SEEDS``, ``d <= MAX_WIDTH``, both and ``H D``
  tiles (``H D`` a multiple of ``COLS``)."""
  K = heads * head_dim
  return (is_tile(S) and is_tile(d) and S <= MAX_SEEDS and d <= MAX_WIDTH and K % COLS == 0
          and K >= COLS)


def seed_query_pallas(e, w, *, eps: float = EPS, dtype=jnp.bfloat16, interpret: bool = False):
  """``seed_query_xla``'s values and gradients from one kernel each way (module docstring).
  ``w`` in ``dtype`` is read as it is (a caller casts a float32 parameter where a 16-bit copy
  can stand in for the cast); its gradient comes back in ``w``'s dtype."""
  if e.ndim != 2 or w.ndim != 3 or w.shape[0] != e.shape[1]:
    raise ValueError(f"seed_query: e {e.shape} and w {w.shape} must be [S, d] and [d, H, D]")
  if not supported(e.shape[0], e.shape[1], w.shape[1], w.shape[2]):
    raise ValueError(f"seed_query: no kernel for {e.shape[0]} seeds of width {e.shape[1]} in "
                     f"{w.shape[1]} x {w.shape[2]} (see seed_query.supported)")
  return _op(e, w, _Cfg(float(eps), jnp.dtype(dtype), bool(interpret)))
