"""GDPA forward and backward written in Triton for this project, run through jax-triton.

GPU only (jax-triton has no CPU path). The kernels (``_triton_src.py``) compile to sm_90 cubins
on CPU with triton 3.6 (``pallas_kernels/sm90_report.py``, tested when triton is importable);
their numerics tests need a GPU (``tests/pallas_kernels/test_triton_gpu.py``, marked ``gpu``).
The maths mirrors the Pallas kernels (``pallas_gdpa.py``), which are tested in interpret mode.

``jax_triton`` and ``triton`` are imported lazily on the first call, never at module import.
Layout ``[B, T, H, D]`` contiguous, ``D`` a power of two. No padding and no gathers: loads are
masked by the lengths, stores by the sequence bounds, and ``q_index`` / ``kv_index`` / GQA are
pointer offsets. Per-head activation tuples run in one launch (a uniform branch per program).
Backward: a dq kernel (grid over q tiles) and a dk/dv kernel (grid over kv tiles of each kv
head, walking its G q heads) that recompute the scores; no softmax state. With an index the
per-output-row gradients of the shared operand are fp32 partials summed afterwards.
Tiles / warps / stages per kernel come from ``tuning.lookup`` (``tuning.json``, written by
``bench/kernels.py --autotune``), or from ``config=`` (a dict kernel -> (bq, bk, warps, stages)).
"""

from __future__ import annotations

import functools
import inspect
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import activations, tuning
from pallas_kernels.api import shape_class
from pallas_kernels.pallas_gdpa import segment_rows
from pallas_kernels.reference import resolve_rows, score_clip_value

ACT_CODES = activations.CODES

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
  act: int             # code, or -1: mixed per-head (ACTC array, codes in act_set)
  act_set: int         # bitmask of the codes in use
  scale: float
  out_scale: float
  window: int          # -1: none
  has_qi: bool
  has_ki: bool
  tiles: tuple         # ((bq, bk, warps, stages) for fwd, dq, dkv)
  clip: float = 0.0    # score clip c > 0, or 0.0: none
  fast: bool = False


def metaparams(cfg: _Cfg, q_shape, k_shape, dtype, bq, bk) -> dict:
  """The constexpr arguments of every kernel."""
  TQ, HQ, D = q_shape[1:]
  TK, HKV = k_shape[1:3]
  return dict(TQ=TQ, TK=TK, HQ=HQ, HKV=HKV, D=D, BQ=bq, BK=bk, ACT=cfg.act, ACT_SET=cfg.act_set,
              WINDOW=cfg.window, HAS_QI=cfg.has_qi, HAS_KI=cfg.has_ki, SCALE=cfg.scale,
              OUT_SCALE=cfg.out_scale, CLIP=cfg.clip, FAST=cfg.fast,
              PREC="ieee" if jnp.dtype(dtype) == jnp.float32 else "tf32")


def _call(kernel, args, out_shapes, grid, tiles, cfg: _Cfg, q, k):
  """One ``jax_triton.triton_call`` (``out_shape=`` in 0.3.x, ``out_type=`` in 0.4.x)."""
  jt = _jax_triton()
  bq, bk, warps, stages = tiles
  out_kw = ("out_type" if "out_type" in inspect.signature(jt.triton_call).parameters
            else "out_shape")
  return jt.triton_call(*args, kernel=kernel, grid=grid, num_warps=warps, num_stages=stages,
                        **metaparams(cfg, q.shape, k.shape, q.dtype, bq, bk),
                        **{out_kw: out_shapes})


def _fwd(cfg, q, k, v, rows):
  triton, fwd, _, _ = kernels()
  ql, kl, qi, ki, actc = rows
  B = ql.shape[0]
  tiles = cfg.tiles[0]
  out = jax.ShapeDtypeStruct((B,) + q.shape[1:], q.dtype)
  grid = (triton.cdiv(q.shape[1], tiles[0]), B * q.shape[2])
  return _call(fwd, (q, k, v, ql, kl, qi, ki, actc), out, grid, tiles, cfg, q, k)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gdpa(cfg, q, k, v, rows):
  return _fwd(cfg, q, k, v, rows)


def _gdpa_fwd(cfg, q, k, v, rows):
  return _fwd(cfg, q, k, v, rows), (q, k, v, rows)


def _gdpa_bwd(cfg, res, do):
  q, k, v, rows = res
  triton, _, dq_kernel, dkv_kernel = kernels()
  ql, kl, qi, ki, actc = rows
  B = ql.shape[0]
  TQ, HQ, D = q.shape[1:]
  TK, HKV = k.shape[1:3]
  do = do.astype(q.dtype)
  args = (q, k, v, do, ql, kl, qi, ki, actc)
  t_dq, t_dkv = cfg.tiles[1], cfg.tiles[2]
  dq = _call(dq_kernel, args,
             jax.ShapeDtypeStruct((B, TQ, HQ, D), jnp.float32 if cfg.has_qi else q.dtype),
             (triton.cdiv(TQ, t_dq[0]), B * HQ), t_dq, cfg, q, k)
  kv_dtype = jnp.float32 if cfg.has_ki else k.dtype
  # dkv: block_k is the kernel's own tile, block_q the inner loop's.
  dk, dv = _call(dkv_kernel, args, (jax.ShapeDtypeStruct((B, TK, HKV, D), kv_dtype),) * 2,
                 (triton.cdiv(TK, t_dkv[1]), B * HKV), t_dkv, cfg, q, k)
  dq = segment_rows(dq, qi if cfg.has_qi else None, q.shape, q.dtype)
  dk, dv = (segment_rows(x, ki if cfg.has_ki else None, k.shape, k.dtype) for x in (dk, dv))
  return dq, dk, dv, jax.tree.map(lambda _: None, rows)


_gdpa.defvjp(_gdpa_fwd, _gdpa_bwd)


def make_cfg(q, k, *, activation, scale, out_scale, window, has_qi, has_ki, score_clip,
             config=None) -> _Cfg:
  """Static configuration (activation codes, scales, tiles) for shapes ``q``, ``k``."""
  TQ, HQ, D = q.shape[1:]
  TK = k.shape[1]
  acts = activations.per_head(activation, HQ)
  codes = sorted({ACT_CODES[a] for a in acts})
  key = tuning.key(shape_class("gdpa", TQ, TK), D, q.dtype)
  config = config or {}
  tiles = []
  for kern in ("fwd", "dq", "dkv"):
    bq, bk, w, s = config.get(kern) or tuning.lookup("triton", kern, key, q.dtype)
    tiles.append((tuning.clamp_tile(bq, TQ), tuning.clamp_tile(bk, TK), w, s))
  fast = jnp.dtype(q.dtype) in (jnp.bfloat16, jnp.float16)
  return _Cfg(codes[0] if len(codes) == 1 else -1, sum(1 << c for c in codes),
              D ** -0.5 if scale is None else float(scale), float(out_scale),
              -1 if window is None else int(window), has_qi, has_ki, tuple(tiles),
              score_clip_value(score_clip) or 0.0, fast)


def gdpa_triton(q, k, v, *, activation="fast_gelu", scale=None, out_scale=1.0, q_lengths=None,
                kv_lengths=None, window=None, broadcast_q=False, q_index=None, kv_index=None,
                backend="triton", interpret=False, score_clip=None, config=None):
  """Triton GDPA (GPU only); semantics of ``reference.gdpa_reference``.

  ``config``: optional dict ``{"fwd" | "dq" | "dkv": (block_q, block_k, num_warps,
  num_stages)}`` overriding ``tuning.lookup``.
  """
  del backend
  if interpret:
    raise ValueError("gdpa backend 'triton' has no interpret mode; use backend='pallas'")
  r = resolve_rows(q, k, v, broadcast_q=broadcast_q, q_index=q_index, kv_index=kv_index,
                   q_lengths=q_lengths, kv_lengths=kv_lengths, window=window)
  D = q.shape[3]
  if D & (D - 1) or D < 16:
    raise ValueError(f"gdpa backend 'triton' needs a power-of-two head_dim >= 16, got {D}")
  cfg = make_cfg(q, k, activation=activation, scale=scale, out_scale=out_scale, window=window,
                 has_qi=r.q_index is not None, has_ki=r.kv_index is not None,
                 score_clip=score_clip, config=config)
  acts = activations.per_head(activation, q.shape[2])
  actc = jnp.asarray([ACT_CODES[a] for a in acts], jnp.int32)
  unit = jnp.zeros((1,), jnp.int32)   # placeholder pointer for an absent index
  rows = (r.q_len, r.kv_len, unit if r.q_index is None else r.q_index,
          unit if r.kv_index is None else r.kv_index, actc)
  return _gdpa(cfg, q, k, v, rows)
