"""Normalisations computed in float32 (spec c.3, c.9, h-13): affine-free LayerNorm / RMSNorm, the
RMSNorm with a given per-channel scale (the attention's QK-norm) and the affine LayerNorm of a sum
(Wukong's norms, ``affine_layer_norm``).

Pure functions: they have no parameters (scales and biases are arguments),
take any dtype and return float32, so callers decide when to cast back to the compute dtype.

All have a hand-written VJP (``jax.custom_vjp``): the forward keeps only its input for the
backward, which recomputes the per-row statistics (autodiff would keep full-size float32
intermediates, e.g. the broadcast ``rsqrt``; keeping even the ``[..., 1]`` statistics makes them
a second output of the forward, which then no longer compiles to one pass on XLA:CPU), and the
backward is row reductions and one elementwise pass. Values are those of the plain formulas; the
gradients are the same functions with the row sums reassociated (``tests/kunlun/nn/test_norms.py``
compares them with autodiff).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import reference

EPS = 1e-6
F32 = jnp.float32


def layer_norm(x, eps: float = EPS, dtype=F32):
  """LayerNorm over the last axis without scale or bias, computed in float32. ``[..., d] ->
  dtype[..., d]`` (the cast is inside the VJP: the backward receives its cotangent in ``dtype``,
  not a float32 copy of it)."""
  return _layer_norm(x, float(eps), jnp.dtype(dtype))


def layer_norm_pair(x, eps: float = EPS, dtype=F32):
  """``(layer_norm(x), layer_norm(x))``, one value for two consumers (the PFFN's GDPA query and
  its residual). The backward adds the two cotangents in float32 inside its own pass; with one
  output read twice, autodiff adds them in ``dtype`` before the backward's optimization barrier,
  which XLA cannot fuse across: a pass of its own (two ``[..., d]`` reads and a write)."""
  return _layer_norm_pair(x, float(eps), jnp.dtype(dtype))


def rms_norm(x, eps: float = EPS, dtype=F32):
  """RMSNorm over the last axis without scale, computed in float32. ``[..., d] ->
  dtype[..., d]`` (cast inside the VJP, as ``layer_norm``)."""
  return _rms_norm(x, float(eps), jnp.dtype(dtype))


def scaled_rms_norm(x, scale, eps: float = EPS, dtype=F32):
  """``rms_norm(x) * scale`` (``scale f32[d]``, a learned per-channel gain) computed in float32
  and returned in ``dtype`` (the cast is inside the VJP, so the backward receives the cotangent
  in ``dtype``)."""
  return _scaled_rms_norm(x, scale, float(eps), jnp.dtype(dtype))


def affine_layer_norm(xs, scale, bias, eps: float = EPS, dtype=F32):
  """``LayerNorm(sum(xs)) * scale + bias`` over the last axis: the addends ``xs`` (a tuple of
  ``[..., d]`` arrays of any dtypes) summed in float32, ``scale, bias f32[d]``; returned in
  ``dtype``. The backward keeps only the addends (not their float32 sum, nor the normalised
  value autodiff would keep for ``scale``'s gradient) and gives every addend the same cotangent,
  each in its own dtype."""
  return _affine_ln(tuple(xs), scale, bias, float(eps), jnp.dtype(dtype))


def _sum_f32(xs):
  return functools.reduce(lambda a, b: a + b, [x.astype(F32) for x in xs])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _affine_ln(xs, scale, bias, eps, dtype):
  t, mu, r = _ln_stats(_sum_f32(xs), eps)
  return ((t - mu) * r * scale + bias).astype(dtype)


def _affine_ln_fwd(xs, scale, bias, eps, dtype):
  return _affine_ln(xs, scale, bias, eps, dtype), (xs, scale, bias)


def _affine_ln_bwd(eps, dtype, res, dz):
  """``dscale = sum_rows(dz y)``, ``dbias = sum_rows(dz)``, every addend ``r (dy - mean(dy) - y
  mean(dy y))`` with ``dy = dz scale``. The statistics (two-pass, as the forward's) are computed
  behind a barrier (a column sum whose operand holds a row reduction does not fuse), and both the
  column sums and ``dx`` read them. A one-pass ``mean(t^2) - mu^2`` would save a pass but loses
  ``(mu / std)^2`` ulps to cancellation: enough to move Adam's first steps on tiny gradients."""
  del dtype
  xs, scale, bias, dz = jax.lax.optimization_barrier(res + (dz,))   # no CSE with the forward
  _, mu, r = _ln_stats(_sum_f32(xs), eps)
  xs, dz, mu, r = jax.lax.optimization_barrier((xs, dz, mu, r))
  y = (_sum_f32(xs) - mu) * r
  dzf = dz.astype(F32)
  rows = tuple(range(dz.ndim - 1))
  dscale, dbias = jnp.sum(dzf * y, axis=rows), jnp.sum(dzf, axis=rows)
  dy = dzf * scale
  dx = r * (dy - jnp.mean(dy, axis=-1, keepdims=True) - y * jnp.mean(dy * y, axis=-1,
                                                                       keepdims=True))
  return (tuple(dx.astype(x.dtype) for x in xs), dscale.astype(scale.dtype),
          dbias.astype(bias.dtype))


_affine_ln.defvjp(_affine_ln_fwd, _affine_ln_bwd)


_ln_stats = reference.layer_norm_stats


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _layer_norm(x, eps, dtype):
  return reference.layer_norm(x, eps, dtype)


def _fenced(x, tag: int):
  """``x`` behind an optimization barrier tagged per norm kind: XLA then shares no float32 copy
  of ``x`` between two different norms of the same ``x`` (HSP's RMSNorm and the PFFN's
  LayerNorm of one sequence), which it would write out. The tag keeps the barrier distinct from
  the backward's (which also holds the cotangent), so CSE cannot merge them either."""
  return jax.lax.optimization_barrier((x, jnp.int32(tag)))[0]


def _layer_norm_fwd(x, eps, dtype):
  return _layer_norm(_fenced(x, 1), eps, dtype), x


def _layer_norm_bwd(eps, dtype, x, dy):
  x, dy = jax.lax.optimization_barrier((x, dy))   # no CSE with the forward's intermediates
  return (_ln_dx(x, dy.astype(F32), eps),)


_ln_dx = reference.layer_norm_dx     # dx = r (dy - mean(dy) - y mean(dy y)), dy float32


_layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _layer_norm_pair(x, eps, dtype):
  y = _layer_norm(x, eps, dtype)
  return y, y


def _layer_norm_pair_fwd(x, eps, dtype):
  y = _layer_norm(_fenced(x, 1), eps, dtype)
  return (y, y), x


def _layer_norm_pair_bwd(eps, dtype, x, dys):
  x, d1, d2 = jax.lax.optimization_barrier((x, *dys))
  return (_ln_dx(x, d1.astype(F32) + d2.astype(F32), eps),)


_layer_norm_pair.defvjp(_layer_norm_pair_fwd, _layer_norm_pair_bwd)


def _rms_stats(x, eps):
  x = x.astype(F32)
  return x, jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _rms_norm(x, eps, dtype):
  x, r = _rms_stats(x, eps)
  return (x * r).astype(dtype)


def _rms_norm_fwd(x, eps, dtype):
  return _rms_norm(_fenced(x, 2), eps, dtype), x


def _rms_norm_bwd(eps, dtype, x, dy):
  """``dx = r (dy - y mean(dy y))`` with ``y = x r``."""
  x, dy = jax.lax.optimization_barrier((x, dy))
  _, r = _rms_stats(x, eps)
  dy = dy.astype(F32)
  y = x.astype(F32) * r
  m = jnp.mean(dy * y, axis=-1, keepdims=True)
  return ((r * (dy - y * m)).astype(x.dtype),)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _scaled_rms_norm(x, scale, eps, dtype):
  x, r = _rms_stats(x, eps)
  return (x * r * scale).astype(dtype)


def _scaled_rms_norm_fwd(x, scale, eps, dtype):
  return _scaled_rms_norm(_fenced(x, 3), scale, eps, dtype), (x, scale)


def _scaled_rms_norm_bwd(eps, dtype, res, dz):
  """``dscale = sum_rows(dz y)``, ``dx = rms_norm's backward of dy = dz scale``. The row
  statistics ``r`` are one small pass that both read (behind a barrier): a column sum whose
  operand holds a row reduction does not fuse, and XLA would write the float32 product ``dz y``
  out to sum it."""
  del dtype
  x, scale, dz = jax.lax.optimization_barrier(res + (dz,))   # no CSE with the forward
  _, r = _rms_stats(x, eps)
  x, dz, r = jax.lax.optimization_barrier((x, dz, r))
  y = x.astype(F32) * r
  dscale = jnp.sum(dz.astype(F32) * y, axis=tuple(range(dz.ndim - 1)))
  dy = dz.astype(F32) * scale
  m = jnp.mean(dy * y, axis=-1, keepdims=True)
  return (r * (dy - y * m)).astype(x.dtype), dscale.astype(scale.dtype)


_scaled_rms_norm.defvjp(_scaled_rms_norm_fwd, _scaled_rms_norm_bwd)
