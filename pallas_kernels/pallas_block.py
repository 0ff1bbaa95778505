"""Block attention in Pallas (Triton lowering on GPU; ``interpret=True`` runs it on CPU).

Every ``block_size`` block of the sequence is an independent attention problem. A program of the
grid ``(B, H, n_blocks / blocks_per_program)`` walks ``blocks_per_program`` consecutive blocks in
a loop, so the loads of the next block overlap the maths of this one (the kernel is bandwidth
bound: a 64-token block does ~2 MFLOP per 64 KB moved). For each block it loads q, k, v once,
optionally rotates q and k in registers (fused rotary, half-split convention of
``reference.apply_rotary``), and writes the output. Any ``T``: loads beyond ``min(lengths[b],
T)`` fill zeros and stores stop at ``T``, so the last, partial block needs no padding copy.
The backward (``jax.custom_vjp``) is one kernel on the same grid that recomputes each block's
scores and writes dq, dk and dv (a block is self-contained, so no softmax statistics are
stored). The rotary tables are treated as constants: they get no gradient.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _poison, activations
from pallas_kernels._common import precision
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
  per_prog: int = 1                # blocks per program
  fast: bool = False               # hardware tanh / sigmoid (16-bit inputs on a GPU)
  num_warps: int | None = None
  num_stages: int | None = None

  def params(self):
    return plgpu.CompilerParams(num_warps=self.num_warps, num_stages=self.num_stages)


def _load(ref, b, start, n, h, valid, cols=None):
  """``ref[b, start:start + n, h, cols]`` with rows where ``valid`` is False read as zeros."""
  cols = pl.ds(0, ref.shape[-1]) if cols is None else cols
  m = jnp.broadcast_to(valid[:, None], (n, cols.size))
  return plgpu.load(ref.at[b, pl.ds(start, n), h, cols], mask=m, other=0.0)


def _parts(x_ref, b, start, h, valid, rot):
  """Rows of a block (invalid ones zero), as one part or two rotated halves."""
  n = valid.shape[0]
  if rot is None:
    return (_load(x_ref, b, start, n, h, valid),)
  cos, sin = rot
  d2 = x_ref.shape[-1] // 2
  x1 = _load(x_ref, b, start, n, h, valid, pl.ds(0, d2)).astype(_F32)
  x2 = _load(x_ref, b, start, n, h, valid, pl.ds(d2, d2)).astype(_F32)
  dt = x_ref.dtype
  return ((x1 * cos - x2 * sin).astype(dt), (x2 * cos + x1 * sin).astype(dt))


def _scores(qs, ks):
  s = sum(plgpu.dot(a, b, trans_b=True, precision=precision(a.dtype))
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
  if with_slope:   # invalid rows / keys are zero-filled: act(0) = 0, and ds is masked below
    p, slope = activations.in_kernel(sc, cfg.acts, head, with_slope=True, fast=cfg.fast)
    if c is not None:                  # clamped scores pass no gradient
      slope = jnp.where(jnp.abs(s) <= c, slope, 0.0)
    return p / cfg.block, slope
  return activations.in_kernel(sc, cfg.acts, head, fast=cfg.fast) / cfg.block


def _rot(cos_ref, sin_ref, cfg: _Cfg, b, start, h, valid):
  if cos_ref is None:
    return None
  zero = jnp.int32(0)   # a traced index (a Python int breaks the interpret-mode discharge)
  rb, rh = (b if cfg.rot_batch else zero), (h if cfg.rot_heads else zero)
  return tuple(_load(r, rb, start, valid.shape[0], rh, valid).astype(_F32)
               for r in (cos_ref, sin_ref))


def _blocks(cfg: _Cfg, length, body):
  """Runs ``body(start, valid)`` for this program's blocks (rows valid below ``length``)."""
  b, h, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)

  def step(t, carry):
    start = (n * cfg.per_prog + t) * cfg.block
    body(b, h, start, start + jnp.arange(cfg.block) < length)
    return carry

  jax.lax.fori_loop(0, cfg.per_prog, step, 0)


def _store(ref, b, start, h, x):
  n, d = x.shape
  m = jnp.broadcast_to((start + jnp.arange(n) < ref.shape[1])[:, None], (n, d))
  plgpu.store(ref.at[b, pl.ds(start, n), h, :], x.astype(ref.dtype), mask=m)


def _fwd_kernel(len_ref, q_ref, k_ref, v_ref, *refs, cfg: _Cfg):
  cos_ref, sin_ref = (refs[0], refs[1]) if len(refs) > 2 else (None, None)
  o_ref = refs[-1]

  def body(b, h, start, valid):
    rot = _rot(cos_ref, sin_ref, cfg, b, start, h, valid)
    s = _scores(_parts(q_ref, b, start, h, valid, rot), _parts(k_ref, b, start, h, valid, rot))
    p = _probs(s, valid[:, None] & valid[None, :], cfg, h)
    (v,) = _parts(v_ref, b, start, h, valid, None)
    _store(o_ref, b, start, h, plgpu.dot(p.astype(v.dtype), v, precision=precision(v.dtype)))

  _blocks(cfg, len_ref[0], body)


def _unrotate_store(ref, b, start, h, gs, rot):
  """Stores the gradient w.r.t. the unrotated input given gradients of the rotated parts."""
  if rot is None:
    _store(ref, b, start, h, gs[0])
    return
  cos, sin = rot
  g1, g2 = gs
  n, d2 = g1.shape
  m = jnp.broadcast_to((start + jnp.arange(n) < ref.shape[1])[:, None], (n, d2))
  for cols, val in ((pl.ds(0, d2), g1 * cos + g2 * sin), (pl.ds(d2, d2), g2 * cos - g1 * sin)):
    plgpu.store(ref.at[b, pl.ds(start, n), h, cols], val.astype(ref.dtype), mask=m)


def _bwd_kernel(len_ref, q_ref, k_ref, v_ref, *refs, cfg: _Cfg):
  cos_ref, sin_ref = (refs[0], refs[1]) if len(refs) > 5 else (None, None)
  do_ref, dq_ref, dk_ref, dv_ref = refs[-4:]

  def body(b, h, start, valid):
    rot = _rot(cos_ref, sin_ref, cfg, b, start, h, valid)
    qs, ks = _parts(q_ref, b, start, h, valid, rot), _parts(k_ref, b, start, h, valid, rot)
    (v,), (do,) = _parts(v_ref, b, start, h, valid, None), _parts(do_ref, b, start, h, valid,
                                                                   None)
    m = valid[:, None] & valid[None, :]
    s = _scores(qs, ks)
    p, slope = _probs(s, m, cfg, h, with_slope=True)
    prec = precision(v.dtype)
    _store(dv_ref, b, start, h, plgpu.dot(p.astype(do.dtype), do, trans_a=True, precision=prec))
    dp = plgpu.dot(do, v, trans_b=True, precision=prec)
    if cfg.acts is None:
      ds = p * (dp - jnp.sum(p * dp, axis=-1, keepdims=True))
    else:   # zero-filled do / v make dp zero outside the valid square
      ds = dp * slope / cfg.block
    ds = (ds * (q_ref.shape[-1] ** -0.5)).astype(qs[0].dtype)
    _unrotate_store(dq_ref, b, start, h, [plgpu.dot(ds, x, precision=prec) for x in ks], rot)
    _unrotate_store(dk_ref, b, start, h,
                    [plgpu.dot(ds, x, trans_a=True, precision=prec) for x in qs], rot)

  _blocks(cfg, len_ref[0], body)


def _grid(cfg: _Cfg, q):
  B, T, H, _ = q.shape
  return (B, H, pl.cdiv(pl.cdiv(T, cfg.block), cfg.per_prog))


def _in_specs(n_rot):
  lens = pl.BlockSpec((1,), lambda b, h, n: (b,))
  return [lens] + [pl.no_block_spec] * (3 + n_rot)


def _fwd_call(cfg: _Cfg, q, k, v, lengths, rot):
  rot = () if rot is None else tuple(rot)
  return _poison.pallas_call(
      functools.partial(_fwd_kernel, cfg=cfg), (lengths, q, k, v, *rot),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), grid=_grid(cfg, q),
      in_specs=_in_specs(len(rot)), out_specs=pl.no_block_spec, interpret=cfg.interpret,
      name="block_attention_fwd", compiler_params=cfg.params())


def _bwd_call(cfg: _Cfg, q, k, v, lengths, rot, do):
  rot = () if rot is None else tuple(rot)
  return _poison.pallas_call(
      functools.partial(_bwd_kernel, cfg=cfg), (lengths, q, k, v, *rot, do),
      out_shape=tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)),
      grid=_grid(cfg, q), in_specs=_in_specs(len(rot)) + [pl.no_block_spec],
      out_specs=(pl.no_block_spec,) * 3, interpret=cfg.interpret, name="block_attention_bwd",
      compiler_params=cfg.params())


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
                           rotary=None, backend="pallas", interpret=False, score_clip=None,
                           blocks_per_program=None, num_warps=None, num_stages=None):
  """Pallas block attention; semantics of ``reference.block_attention_reference`` (any T).

  ``block_size``: on a GPU a power of two >= 16 (the dot minimum); any size in interpret mode.
  ``rotary`` is ``(cos, sin)`` of shape ``[B|1, T, D/2]`` or ``[B|1, T, H, D/2]``; it receives
  no gradient. ``score_clip``
  clamps the scores of GDPA activations (softmax is never clipped). ``blocks_per_program``
  (default 4 on GPU, 1 in interpret mode), ``num_warps`` / ``num_stages``: GPU tuning.
  """
  del backend
  if q.ndim != 4 or q.shape != k.shape or q.shape != v.shape:
    raise ValueError(f"block_attention expects equal [B, T, H, D] q/k/v, got {q.shape} "
                     f"{k.shape} {v.shape}")
  B, T, H, D = q.shape
  if block_size < 1 or (not interpret and (block_size < 16 or block_size & (block_size - 1))):
    raise ValueError(f"block_size must be a power of two >= 16 for the pallas backend on a GPU "
                     f"(any size >= 1 in interpret mode), got {block_size}")
  acts = None if activation == "softmax" else activations.per_head(activation, H)
  if lengths is None:
    lengths = jnp.full((B,), T, jnp.int32)
  else:
    lengths = jnp.asarray(lengths, jnp.int32)
    if lengths.shape != (B,):
      raise ValueError(f"lengths must have shape ({B},), got {lengths.shape}")
    lengths = jnp.clip(lengths, 0, T)
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
  n_blocks = -(-T // block_size)
  per_prog = min(blocks_per_program or (1 if interpret else 4), n_blocks)
  fast = not interpret and jnp.dtype(q.dtype) in (jnp.bfloat16, jnp.float16)
  cfg = _Cfg(acts, int(block_size), rot_b, rot_h, bool(interpret), clip, per_prog, fast,
             num_warps, num_stages)
  return _block_attention(cfg, q, k, v, lengths, rotary)
