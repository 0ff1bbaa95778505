"""GDPA forward and backward written in Triton for this project, run through jax-triton.

STATUS: UNTESTED ON GPU. Written without a GPU (jax-triton is not installed in the CPU
environment); its tests (``tests/pallas_kernels/test_triton_gpu.py``) are marked ``gpu``. The
maths mirrors the Pallas kernels (``pallas_gdpa.py``), which are tested in interpret mode.

``jax_triton`` and ``triton`` are imported lazily on the first call, never at module import.
Layout ``[B, T, H, D]`` contiguous; ``D`` must be a power of two. No padding is needed: loads are
masked by the lengths and stores by the sequence bounds. ``score_clip`` is the ``CLIP`` constexpr
(0.0: off): scores are clamped before the activation and the score gradient is zeroed outside.
Per-head activation tuples run one launch per distinct activation on the matching heads.
Backward: a dq kernel (grid over q tiles) and a dk/dv kernel (grid over kv tiles) that recompute
the scores; no softmax state.
"""

from __future__ import annotations

import functools
import inspect
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import activations
from pallas_kernels.reference import check_gdpa_args, score_clip_value

ACT_CODES = {"identity": 0, "gelu": 1, "fast_gelu": 2, "silu": 3, "relu": 4, "relu2": 5}


_NEEDS = ("gdpa backend 'triton' needs jax-triton and triton (pip install 'kunlun-jax[gpu]': "
          "jax-triton==0.3.1 with triton 3.6) and a CUDA GPU")


@functools.cache
def _jax_triton():
  try:
    import jax_triton as jt
  except ImportError as e:  # pragma: no cover - depends on the GPU image
    raise ImportError(_NEEDS) from e
  return jt


@functools.cache
def kernels():
  """Imports triton and the kernels (once): ``(triton, fwd, dq, dkv)``."""
  try:
    import triton

    from pallas_kernels import _triton_src as src
  except ImportError as e:  # pragma: no cover - depends on the GPU image
    raise ImportError(_NEEDS) from e
  return triton, src.fwd_kernel, src.dq_kernel, src.dkv_kernel


class _Cfg(NamedTuple):
  act: int
  scale: float
  out_scale: float
  window: int  # -1: none
  broadcast_q: bool
  bq: int
  bk: int
  num_warps: int
  num_stages: int
  clip: float = 0.0  # score clip c > 0, or 0.0: none


def _call(jt, kernel, args, out_shapes, grid, cfg: _Cfg, q, k):
  """One ``jax_triton.triton_call`` (``out_shape=`` in 0.3.x, ``out_type=`` in 0.4.x)."""
  B, TK, H, D = k.shape
  out_kw = ("out_type" if "out_type" in inspect.signature(jt.triton_call).parameters
            else "out_shape")
  prec = "ieee" if q.dtype == jnp.float32 else "tf32"
  return jt.triton_call(
      *args, kernel=kernel, grid=grid, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
      TQ=q.shape[1], TK=TK, H=H, D=D, BQ=cfg.bq, BK=cfg.bk, ACT=cfg.act, WINDOW=cfg.window,
      QB=int(cfg.broadcast_q), SCALE=cfg.scale, OUT_SCALE=cfg.out_scale, CLIP=cfg.clip, PREC=prec,
      **{out_kw: out_shapes})


def _fwd(cfg, q, k, v, ql, kl):
  jt, (triton, fwd_kernel, _, _) = _jax_triton(), kernels()
  B, TK, H, D = k.shape
  out = jax.ShapeDtypeStruct((B, q.shape[1], H, D), q.dtype)
  grid = (triton.cdiv(q.shape[1], cfg.bq), B * H)
  return _call(jt, fwd_kernel, (q, k, v, ql, kl), out, grid, cfg, q, k)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gdpa(cfg, q, k, v, ql, kl):
  return _fwd(cfg, q, k, v, ql, kl)


def _gdpa_fwd(cfg, q, k, v, ql, kl):
  return _fwd(cfg, q, k, v, ql, kl), (q, k, v, ql, kl)


def _gdpa_bwd(cfg, res, do):
  q, k, v, ql, kl = res
  jt, (triton, _, dq_kernel, dkv_kernel) = _jax_triton(), kernels()
  B, TK, H, D = k.shape
  TQ = q.shape[1]
  do = do.astype(q.dtype)
  dq_dtype = jnp.float32 if cfg.broadcast_q else q.dtype
  dq = _call(jt, dq_kernel, (q, k, v, do, ql, kl),
             jax.ShapeDtypeStruct((B, TQ, H, D), dq_dtype),
             (triton.cdiv(TQ, cfg.bq), B * H), cfg, q, k)
  if cfg.broadcast_q:
    dq = dq.sum(0, keepdims=True).astype(q.dtype)
  dk, dv = _call(jt, dkv_kernel, (q, k, v, do, ql, kl),
                 (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)),
                 (triton.cdiv(TK, cfg.bk), B * H), cfg, q, k)
  return dq, dk, dv, None, None


_gdpa.defvjp(_gdpa_fwd, _gdpa_bwd)


def gdpa_triton(q, k, v, *, activation="fast_gelu", scale=None, out_scale=1.0, q_lengths=None,
                kv_lengths=None, window=None, broadcast_q=False, backend="triton",
                interpret=False, score_clip=None, block_q=64, block_k=64, num_warps=4,
                num_stages=2):
  """Triton GDPA (GPU only, untested); semantics of ``reference.gdpa_reference``."""
  del backend
  if interpret:
    raise ValueError("gdpa backend 'triton' has no interpret mode; use backend='pallas'")
  check_gdpa_args(q, k, v, broadcast_q)
  B, TK, H, D = k.shape
  TQ = q.shape[1]
  if D & (D - 1):
    raise ValueError(f"gdpa backend 'triton' needs a power-of-two head_dim, got {D}")
  acts = activations.per_head(activation, H)
  full = lambda n: jnp.full((B,), n, jnp.int32)
  ql = full(TQ) if q_lengths is None else jnp.clip(jnp.asarray(q_lengths, jnp.int32), 0, TQ)
  kl = full(TK) if kv_lengths is None else jnp.clip(jnp.asarray(kv_lengths, jnp.int32), 0, TK)
  tile = lambda n, b: min(b, max(16, 1 << (max(n, 1) - 1).bit_length()))
  base = _Cfg(0, D ** -0.5 if scale is None else float(scale), float(out_scale),
              -1 if window is None else int(window), bool(broadcast_q), tile(TQ, block_q),
              tile(TK, block_k), num_warps, num_stages, score_clip_value(score_clip) or 0.0)
  if len(set(acts)) == 1:
    return _gdpa(base._replace(act=ACT_CODES[acts[0]]), q, k, v, ql, kl)
  out = jnp.zeros((B, TQ, H, D), q.dtype)
  for a in sorted(set(acts)):
    heads = jnp.array([h for h in range(H) if acts[h] == a])
    q_h, k_h, v_h = (jnp.take(x, heads, axis=2) for x in (q, k, v))
    o = _gdpa(base._replace(act=ACT_CODES[a]), q_h, k_h, v_h, ql, kl)
    out = out.at[:, :, heads].set(o)
  return out
