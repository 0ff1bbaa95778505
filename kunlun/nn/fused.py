"""Elementwise blocks of the sequence modules with hand-written VJPs (issue 19: bytes per step).

Each is one forward pass that keeps nothing full-size for the backward but its inputs; the
backward recomputes the cheap intermediates. Autodiff instead keeps (and XLA writes) full-size
float32 intermediates and broadcast masks.

  norm_residual(g, u, s, lengths)      the PFFN's ``where(t < lengths, RMSNorm(g + u) + s, 0)``
  rotary(x, age, positions)            the rotary encoding, angles recomputed from ``age``
                                       (and the positional heads' ``positions``; never
                                       stored); the backward is the inverse rotation
  qk_norm_rotary(x, scale, age, ...)   QK-norm, bucket embedding and rotary in two passes
  apart(h, n)                          n uses of h that XLA cannot merge (no dot merger)
  masked_residual(s, y, lengths)       ``where(t < lengths, s + y, 0)`` in float32, cast to
                                       ``s.dtype``, for a ``y`` that is zero at the padding
                                       rows; the backward is one masked copy of the cotangent
  add_rms_norm(a, e, dtype)            ``rms_norm(a + e)`` (HSP's seeds plus their pooled
                                       update) without the float32 sum in memory
  token_mix(x, w)                      ``einsum("bnd,nm->bmd")`` as a batched matmul, no
                                       transposes of ``x``

Values and gradients are those of the plain formulas (``tests/kunlun/nn/test_fused.py`` compares
them with autodiff of the plain formulas).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kunlun.nn.norms import EPS, scaled_rms_norm
from kunlun.nn.time_encoding import rotary_angles
from pallas_kernels.api import compile_platform

F32 = jnp.float32


def _mask(lengths, T):
  """``f32[B, T, 1]``: 1 at rows ``t < lengths[b]``, else 0. The modules zero their padding rows
  by multiplying with it (XLA:CPU fuses a multiply with the row norms, not a select); the
  padding rows of the sequence activations are finite (zero) by construction."""
  valid = jnp.arange(T)[None, :] < jnp.asarray(lengths, jnp.int32)[:, None]
  return valid.astype(F32)[..., None]


def token_mix(x, w):
  """``einsum("bnd,nm->bmd", x, w)``: ``x [B, n, d]`` mixed over its tokens by a shared ``w [n,
  m]`` -> ``[B, m, d]``, as a matmul batched over the examples with ``w`` broadcast to each (``B
  n m`` values, small beside ``x``). Contracting the tokens of an unbatched ``w`` makes XLA
  transpose ``x`` to ``[n, B d]`` (and the result, and both in the backward); batched, every
  operand keeps its layout. ``w``'s gradient is the per-example products summed over ``B``.
  For a GPU only (``batched_mixes``): XLA:CPU runs the unbatched einsum faster."""
  if not batched_mixes():
    return jnp.einsum("bnd,nm->bmd", x, w)
  wb = jnp.broadcast_to(w, (x.shape[0],) + w.shape)
  return jnp.einsum("bnm,bnd->bmd", wb, x)


def batched_mixes() -> bool:
  """Whether the token-axis mixes run batched over examples (``token_mix``, HSP's
  ``SumKronLinear``): when compiling for a GPU, where they save the transposes; XLA:CPU's
  batched small matmuls are slower than its one GEMM (the dev train step on CPU: 191 -> 151
  examples/s batched)."""
  return compile_platform() == "gpu"


def apart(h, n: int) -> list:
  """``n`` uses of ``h`` that XLA cannot merge: each passes its own (tagged) optimization
  barrier. Projections of one input (attention's q / k / v, HSP's k / v) read it apart so that
  each writes its own buffer; XLA's dot merger would otherwise compute them as one ``[..., n H
  dh]`` output and copy each out of it as a strided slice (``h``, a matmul operand, is in memory
  either way)."""
  return [jax.lax.optimization_barrier((h, jnp.int32(i)))[0] for i in range(n)]


# ---- masked residual ----------------------------------------------------------------------

@jax.custom_vjp
def masked_residual(s, y, lengths):
  """``s [B, T, d] + y [B, T, d]`` in float32, rows ``t >= lengths[b]`` zero, in ``s.dtype``.

  ``y`` must be a function that is zero at those rows whatever its cotangent there (a projection
  of an attention output, whose padding rows are zero): its cotangent is passed unmasked (the
  padding rows reach nothing), which spares a masked copy; ``s`` gets the masked one."""
  return _masked_residual(s, y, lengths)


def _masked_residual(s, y, lengths):
  out = s.astype(F32) + y.astype(F32)
  return (out * _mask(lengths, s.shape[1])).astype(s.dtype)


def _mr_fwd(s, y, lengths):
  return _masked_residual(s, y, lengths), (lengths, jnp.zeros((0,), s.dtype),
                                           jnp.zeros((0,), y.dtype))


def _mr_bwd(res, g):
  lengths, s0, y0 = res
  gm = (g.astype(F32) * _mask(lengths, g.shape[1])).astype(s0.dtype)
  return gm, g.astype(y0.dtype), None


masked_residual.defvjp(_mr_fwd, _mr_bwd)


@jax.custom_vjp
def masked_residual_pass(s, y, lengths):
  """``masked_residual``'s values with ``s``'s cotangent passed unmasked too: for an ``s`` whose
  producer masks it itself (``pallas_kernels.norm_qkv``'s pass-through of ``x`` with ``valid``),
  which spares the masked copy, or the pass adding it to ``x``'s other cotangent."""
  return _masked_residual(s, y, lengths)


def _mrp_bwd(res, g):
  _, s0, y0 = res
  return g.astype(s0.dtype), g.astype(y0.dtype), None


masked_residual_pass.defvjp(_mr_fwd, _mrp_bwd)


# ---- the PFFN's tail: RMSNorm(g + u) + s, masked ------------------------------------------

@jax.custom_vjp
def norm_residual(g, u, s, lengths):
  """``where(t < lengths, rms_norm(g + u) + s, 0)`` in float32, in ``s.dtype`` (``g, u, s [B, T,
  d]``). The backward recomputes ``g + u`` and its statistics; ``g`` and ``u`` get the same
  cotangent."""
  return _norm_residual(g, u, s, lengths)


def _norm_residual(g, u, s, lengths):
  t = g.astype(F32) + u.astype(F32)
  y = t * _rsqrt_ms(t) + s.astype(F32)
  return (y * _mask(lengths, s.shape[1])).astype(s.dtype)


def _rsqrt_ms(t):
  return jax.lax.rsqrt(jnp.mean(jnp.square(t), axis=-1, keepdims=True) + EPS)


def _nr_fwd(g, u, s, lengths):
  return _norm_residual(g, u, s, lengths), (g, u, lengths, jnp.zeros((0,), s.dtype))


def _nr_bwd(res, dy):
  g, u, lengths, s0 = res
  gm = (dy.astype(F32) * _mask(lengths, dy.shape[1])).astype(s0.dtype)
  # dt in one pass over its own (barrier-separated) inputs: no CSE with the forward, no float32
  # copy of the masked cotangent shared with gm
  g, u, lengths, dy = jax.lax.optimization_barrier((g, u, lengths, dy))
  t = g.astype(F32) + u.astype(F32)
  r = _rsqrt_ms(t)
  z = t * r
  d = dy.astype(F32) * _mask(lengths, dy.shape[1])
  dt = r * (d - z * jnp.mean(d * z, axis=-1, keepdims=True))
  return dt.astype(g.dtype), dt.astype(u.dtype), gm, None


norm_residual.defvjp(_nr_fwd, _nr_bwd)


# ---- rotary ---------------------------------------------------------------------------------

def rotary(x, age, t_scale: float = 60.0, positions=None):
  """``pallas_kernels.reference.apply_rotary(x, rotary_time(age, H, D, t_scale, positions))``:
  ``x [B, T, H, D]`` rotated in float32 by the angles of ``age f32[B, T]`` (and ``positions
  [B, T]`` on the positional heads; None: ``0..T-1``), in ``x.dtype``. The angles are recomputed
  in the backward, never stored (the float32 ``cos`` / ``sin`` tables are each half the size of
  ``x`` in float32). ``age`` and ``positions`` get no gradient (they are data)."""
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32)[None], x.shape[:2])
  return _rotary(x, age, jnp.asarray(positions, jnp.int32), float(t_scale))


def _rotated(x, age, positions, t_scale, sign=1.0):
  """``x`` rotated (``sign`` -1: the inverse rotation) by the angles of ``age`` / ``positions``,
  in float32: ``x cos(a) + sign [-x2, x1] sin(a)`` with the angles ``a`` laid out over the whole
  head (``[a, a]``), so every output element takes its own ``cos`` and ``sin`` and the pass is one
  fusion that reads ``x`` and writes the result (with ``cos`` / ``sin`` of half-width tables, each
  used by two output halves, XLA writes the float32 tables out rather than compute them twice).
  The inputs pass an optimization barrier together: no table is shared between two rotations."""
  x, age, positions = jax.lax.optimization_barrier((x, age, positions))
  ang = rotary_angles(age, x.shape[2], x.shape[3], t_scale, positions)        # [B, T, H, D/2]
  ang = jnp.concatenate([ang, ang], axis=-1)
  xf = x.astype(F32)
  x1, x2 = jnp.split(xf, 2, axis=-1)
  return xf * jnp.cos(ang) + sign * jnp.concatenate([-x2, x1], axis=-1) * jnp.sin(ang)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _rotary(x, age, positions, t_scale):
  return _rotated(x, age, positions, t_scale).astype(x.dtype)


def _rotary_fwd(x, age, positions, t_scale):
  return _rotary(x, age, positions, t_scale), (age, positions, jnp.zeros((0,), x.dtype))


def _rotary_bwd(t_scale, res, g):
  age, positions, x0 = res
  return (_rotated(g, age, positions, t_scale, sign=-1.0).astype(x0.dtype),           # R^T g
          jnp.zeros_like(age), np.zeros(positions.shape, jax.dtypes.float0))


_rotary.defvjp(_rotary_fwd, _rotary_bwd)


# ---- QK-norm + rotary ---------------------------------------------------------------------

def qk_norm_rotary(x, scale, age, *, dtype, t_scale: float = 60.0, emb=None, positions=None):
  """The attention's query / key preparation: ``scaled_rms_norm(x, scale)`` (None: skipped),
  ``+ emb`` (None: nothing), each rounded to ``dtype`` as before, then ``rotary(., age,
  positions)`` (``age`` None: no rotation). The normalised values pass an optimization barrier
  before the rotation, so that the norm is one pass writing ``dtype`` (XLA otherwise splits it
  where its norm fusion ends, writing the normalised values in float32) and the rotation
  another."""
  if scale is not None:
    x = scaled_rms_norm(x, scale, dtype=dtype)
  if emb is not None:
    x = (x.astype(F32) + emb).astype(dtype)
  if age is None:
    return x
  return rotary(jax.lax.optimization_barrier(x), age, t_scale, positions)


# ---- HSP's seeds: rms_norm(a + e) -----------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def add_rms_norm(a, e, dtype):
  """``rms_norm(a + e)`` computed in float32, in ``dtype``: ``a [..., S, d]`` (any dtype), ``e
  [S, d]`` broadcast over the leading axes. The float32 sum is never written: the backward
  recomputes it from ``a`` and ``e`` (autodiff keeps it, a float32 array twice ``a``'s size in
  16 bits); ``e``'s gradient is ``a``'s summed over the leading axes."""
  return _add_rms_norm(a, e, dtype)


def _add_rms_norm(a, e, dtype):
  t = a.astype(F32) + e.astype(F32)
  return (t * _rsqrt_ms(t)).astype(dtype)


def _arn_fwd(a, e, dtype):
  return _add_rms_norm(a, e, dtype), (a, e)


def _arn_bwd(dtype, res, dy):
  a, e = jax.lax.optimization_barrier(res)            # no CSE with the forward
  t = a.astype(F32) + e.astype(F32)
  r = _rsqrt_ms(t)
  z = t * r
  d = dy.astype(F32)
  da = (r * (d - z * jnp.mean(d * z, axis=-1, keepdims=True))).astype(a.dtype)
  # e's gradient sums a's as rounded: the float32 dt is then never written (XLA wrote it out
  # for the two consumers and read it back; in float32 the two are the same)
  lead = tuple(range(da.ndim - e.ndim))
  return da, jnp.sum(da.astype(F32), axis=lead).astype(e.dtype)


add_rms_norm.defvjp(_arn_fwd, _arn_bwd)
