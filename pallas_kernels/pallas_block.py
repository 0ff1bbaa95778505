"""Block attention in Pallas (Triton-style ``pallas_call``; ``interpret=True`` runs it on CPU).

Every ``block_size`` block of the sequence is an independent attention problem, so one program
of the grid ``(B, H, T / block_size)`` owns one block: it loads q, k, v of the block once,
optionally rotates q and k in registers (fused rotary, half-split convention of
``reference.apply_rotary``), and writes the output. Blocks that start at or beyond
``lengths[b]`` only write zeros. The backward (``jax.custom_vjp``) is one kernel on the same grid
that recomputes the block's scores and writes dq, dk and dv (the block is self-contained, so no
softmax statistics are stored). The rotary tables are treated as constants: they get no gradient.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _poison, activations
from pallas_kernels.reference import score_clip_value

_F32 = jnp.float32
_NEG = -1e30


class _Cfg(NamedTuple):
  acts: tuple[str, ...] | None  # None: softmax
  block: int
  rot_batch: bool  # rotary table has a batch axis > 1
  rot_heads: bool  # rotary table has a heads axis > 1
  interpret: bool
  score_clip: float | None = None  # GDPA activations: clamp scores to [-c, c]; None: off


def _prec(dtype):
  return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _parts(x_ref, valid, rot):
  """Rows of the block (invalid ones zeroed), as one part or two rotated halves."""
  if rot is None:
    x = x_ref[...]
    return (jnp.where(valid[:, None], x, jnp.zeros_like(x)),)
  cos, sin = rot
  d2 = x_ref.shape[-1] // 2
  x1 = jnp.where(valid[:, None], x_ref[:, pl.ds(0, d2)].astype(_F32), 0.0)
  x2 = jnp.where(valid[:, None], x_ref[:, pl.ds(d2, d2)].astype(_F32), 0.0)
  dt = x_ref.dtype
  return ((x1 * cos - x2 * sin).astype(dt), (x2 * cos + x1 * sin).astype(dt))


def _scores(qs, ks):
  s = sum(plgpu.dot(a, b, trans_b=True, precision=_prec(a.dtype))
          for a, b in zip(qs, ks, strict=True))
  return s * (qs[0].shape[-1] * len(qs)) ** -0.5


def _probs(s, m, cfg: _Cfg, head, with_slope=False):
  """Masked attention weights of a block (softmax, or act(s) / block for GDPA activations)."""
  if cfg.acts is None:
    s = jnp.where(m, s, _NEG)
    e = jnp.where(m, jnp.exp(s - jnp.max(s, axis=-1, keepdims=True)), 0.0)
    den = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(den > 0, den, 1.0)
    return (p, None) if with_slope else p
  c = cfg.score_clip
  sc = s if c is None else jnp.minimum(jnp.maximum(s, -c), c)
  if with_slope:
    p, slope = activations.in_kernel(sc, cfg.acts, head, with_slope=True)
    if c is not None:                  # clamped scores pass no gradient
      slope = jnp.where(jnp.abs(s) <= c, slope, 0.0)
    return jnp.where(m, p, 0.0) / cfg.block, slope
  return jnp.where(m, activations.in_kernel(sc, cfg.acts, head), 0.0) / cfg.block


def _load_rot(cos_ref, sin_ref):
  return None if cos_ref is None else (cos_ref[...].astype(_F32), sin_ref[...].astype(_F32))


def _fwd_kernel(len_ref, q_ref, k_ref, v_ref, *refs, cfg: _Cfg):
  cos_ref, sin_ref = (refs[0], refs[1]) if len(refs) > 2 else (None, None)
  o_ref = refs[-1]
  h, n = pl.program_id(1), pl.program_id(2)
  length = len_ref[0]
  start = n * cfg.block

  @pl.when(start < length)
  def _():
    valid = start + jnp.arange(cfg.block) < length
    rot = _load_rot(cos_ref, sin_ref)
    s = _scores(_parts(q_ref, valid, rot), _parts(k_ref, valid, rot))
    p = _probs(s, valid[:, None] & valid[None, :], cfg, h)
    (v,) = _parts(v_ref, valid, None)
    o_ref[...] = plgpu.dot(p.astype(v.dtype), v, precision=_prec(v.dtype)).astype(o_ref.dtype)

  @pl.when(start >= length)
  def _():
    o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


def _unrotate_store(ref, gs, rot):
  """Stores the gradient w.r.t. the unrotated input given gradients of the rotated parts."""
  if rot is None:
    ref[...] = gs[0].astype(ref.dtype)
    return
  cos, sin = rot
  g1, g2 = gs
  d2 = ref.shape[-1] // 2
  ref[:, pl.ds(0, d2)] = (g1 * cos + g2 * sin).astype(ref.dtype)
  ref[:, pl.ds(d2, d2)] = (g2 * cos - g1 * sin).astype(ref.dtype)


def _bwd_kernel(len_ref, q_ref, k_ref, v_ref, *refs, cfg: _Cfg):
  cos_ref, sin_ref = (refs[0], refs[1]) if len(refs) > 5 else (None, None)
  do_ref, dq_ref, dk_ref, dv_ref = refs[-4:]
  h, n = pl.program_id(1), pl.program_id(2)
  length = len_ref[0]
  start = n * cfg.block

  @pl.when(start < length)
  def _():
    valid = start + jnp.arange(cfg.block) < length
    rot = _load_rot(cos_ref, sin_ref)
    qs, ks = _parts(q_ref, valid, rot), _parts(k_ref, valid, rot)
    (v,), (do,) = _parts(v_ref, valid, None), _parts(do_ref, valid, None)
    m = valid[:, None] & valid[None, :]
    s = _scores(qs, ks)
    p, slope = _probs(s, m, cfg, h, with_slope=True)
    prec = _prec(v.dtype)
    dv_ref[...] = plgpu.dot(p.astype(do.dtype), do, trans_a=True, precision=prec).astype(
        dv_ref.dtype)
    dp = plgpu.dot(do, v, trans_b=True, precision=prec)
    if cfg.acts is None:
      ds = p * (dp - jnp.sum(p * dp, axis=-1, keepdims=True))
    else:
      ds = jnp.where(m, dp * slope, 0.0) / cfg.block
    ds = (ds * (q_ref.shape[-1] ** -0.5)).astype(qs[0].dtype)
    _unrotate_store(dq_ref, [plgpu.dot(ds, b, precision=prec) for b in ks], rot)
    _unrotate_store(dk_ref, [plgpu.dot(ds, a, trans_a=True, precision=prec) for a in qs], rot)

  @pl.when(start >= length)
  def _():
    for ref in (dq_ref, dk_ref, dv_ref):
      ref[...] = jnp.zeros(ref.shape, ref.dtype)


def _specs(cfg: _Cfg, D, n_rot):
  blk = pl.BlockSpec((None, cfg.block, None, D), lambda b, h, n: (b, n, h, 0))
  rot = pl.BlockSpec((None, cfg.block, None, D // 2),
                     lambda b, h, n: (b if cfg.rot_batch else 0, n, h if cfg.rot_heads else 0, 0))
  lens = pl.BlockSpec((1,), lambda b, h, n: (b,))
  return lens, blk, [rot] * n_rot


def _fwd_call(cfg: _Cfg, q, k, v, lengths, rot):
  B, T, H, D = q.shape
  rot = () if rot is None else tuple(rot)
  lens, blk, rspecs = _specs(cfg, D, len(rot))
  return _poison.pallas_call(
      functools.partial(_fwd_kernel, cfg=cfg), (lengths, q, k, v, *rot),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), grid=(B, H, T // cfg.block),
      in_specs=[lens, blk, blk, blk, *rspecs], out_specs=blk, interpret=cfg.interpret,
      name="block_attention_fwd")


def _bwd_call(cfg: _Cfg, q, k, v, lengths, rot, do):
  B, T, H, D = q.shape
  rot = () if rot is None else tuple(rot)
  lens, blk, rspecs = _specs(cfg, D, len(rot))
  return _poison.pallas_call(
      functools.partial(_bwd_kernel, cfg=cfg), (lengths, q, k, v, *rot, do),
      out_shape=tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)),
      grid=(B, H, T // cfg.block), in_specs=[lens, blk, blk, blk, *rspecs, blk],
      out_specs=(blk, blk, blk), interpret=cfg.interpret, name="block_attention_bwd")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _block_attention(cfg, q, k, v, lengths, rot):
  return _fwd_call(cfg, q, k, v, lengths, rot)


def _block_attention_fwd(cfg, q, k, v, lengths, rot):
  return _fwd_call(cfg, q, k, v, lengths, rot), (q, k, v, lengths, rot)


def _block_attention_bwd(cfg, res, do):
  q, k, v, lengths, rot = res
  dq, dk, dv = _bwd_call(cfg, q, k, v, lengths, rot, do.astype(q.dtype))
  drot = None if rot is None else tuple(jnp.zeros_like(r) for r in rot)
  return dq, dk, dv, None, drot


_block_attention.defvjp(_block_attention_fwd, _block_attention_bwd)


def block_attention_pallas(q, k, v, *, block_size=64, activation="softmax", lengths=None,
                           rotary=None, backend="pallas", interpret=False, score_clip=None):
  """Pallas block attention; semantics of ``reference.block_attention_reference``.

  ``block_size`` must divide T (a power of two >= 16 for the GPU lowering). ``rotary`` is
  ``(cos, sin)`` of shape ``[B|1, T, D/2]`` or ``[B|1, T, H, D/2]``; it receives no gradient.
  ``score_clip`` clamps the scores of GDPA activations (softmax is never clipped).
  """
  del backend
  if q.ndim != 4 or q.shape != k.shape or q.shape != v.shape:
    raise ValueError(f"block_attention expects equal [B, T, H, D] q/k/v, got {q.shape} "
                     f"{k.shape} {v.shape}")
  B, T, H, D = q.shape
  if T % block_size:
    raise ValueError(f"sequence length {T} is not a multiple of block_size {block_size}")
  acts = None if activation == "softmax" else activations.per_head(activation, H)
  if lengths is None:
    lengths = jnp.full((B,), T, jnp.int32)
  else:
    lengths = jnp.asarray(lengths, jnp.int32)
    if lengths.shape != (B,):
      raise ValueError(f"lengths must have shape ({B},), got {lengths.shape}")
  rot_b = rot_h = False
  if rotary is not None:
    if D % 2:
      raise ValueError(f"rotary needs an even head_dim, got {D}")
    cos, sin = (jax.lax.stop_gradient(jnp.asarray(r, _F32)) for r in rotary)
    if cos.ndim == 3:
      cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    if (cos.shape != sin.shape or cos.shape[0] not in (1, B) or cos.shape[1] != T
        or cos.shape[2] not in (1, H) or cos.shape[3] != D // 2):
      raise ValueError(f"rotary (cos, sin) must be [B|1, T, D/2] or [B|1, T, H, D/2] with "
                       f"B={B} T={T} H={H} D/2={D // 2}; got {rotary[0].shape}")
    rot_b, rot_h = cos.shape[0] > 1, cos.shape[2] > 1
    rotary = (cos, sin)
  clip = None if acts is None else score_clip_value(score_clip)
  cfg = _Cfg(acts, int(block_size), rot_b, rot_h, bool(interpret), clip)
  return _block_attention(cfg, q, k, v, lengths, rotary)
