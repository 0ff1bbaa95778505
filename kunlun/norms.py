"""Affine-free normalisations computed in float32 (spec c.3, c.9, h-13).

Pure functions: they have no parameters, take any dtype and return float32, so callers decide
when to cast back to the compute dtype.

Both have a hand-written VJP (``jax.custom_vjp``): the forward keeps only the input and the
per-row statistics ``[..., 1]`` for the backward (autodiff would keep full-size float32
intermediates, e.g. the broadcast ``rsqrt``), and the backward is one row reduction and one
elementwise pass. Values are those of the plain formulas; the gradients are the same functions
with the row sums reassociated (``tests/kunlun/test_norms.py`` compares them with autodiff).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

EPS = 1e-6
F32 = jnp.float32


def layer_norm(x, eps: float = EPS):
  """LayerNorm over the last axis without scale or bias. ``[..., d] -> f32[..., d]``."""
  return _layer_norm(x, float(eps))


def rms_norm(x, eps: float = EPS):
  """RMSNorm over the last axis without scale. ``[..., d] -> f32[..., d]``."""
  return _rms_norm(x, float(eps))


def _ln_stats(x, eps):
  x = x.astype(F32)
  mu = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x - mu), axis=-1, keepdims=True)
  return x, mu, jax.lax.rsqrt(var + eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _layer_norm(x, eps):
  x, mu, r = _ln_stats(x, eps)
  return (x - mu) * r


def _layer_norm_fwd(x, eps):
  xf, mu, r = _ln_stats(x, eps)
  return (xf - mu) * r, (x, mu, r)


def _layer_norm_bwd(eps, res, dy):
  """``dx = r (dy - mean(dy) - y mean(dy y))`` with ``y = (x - mu) r``."""
  del eps
  x, mu, r = jax.lax.optimization_barrier(res)     # no CSE with the forward's intermediates
  dy = dy.astype(F32)
  y = (x.astype(F32) - mu) * r
  m1 = jnp.mean(dy, axis=-1, keepdims=True)
  m2 = jnp.mean(dy * y, axis=-1, keepdims=True)
  return ((r * (dy - m1 - y * m2)).astype(x.dtype),)


_layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


def _rms_stats(x, eps):
  x = x.astype(F32)
  return x, jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _rms_norm(x, eps):
  x, r = _rms_stats(x, eps)
  return x * r


def _rms_norm_fwd(x, eps):
  xf, r = _rms_stats(x, eps)
  return xf * r, (x, r)


def _rms_norm_bwd(eps, res, dy):
  """``dx = r (dy - y mean(dy y))`` with ``y = x r``."""
  del eps
  x, r = jax.lax.optimization_barrier(res)
  dy = dy.astype(F32)
  y = x.astype(F32) * r
  m = jnp.mean(dy * y, axis=-1, keepdims=True)
  return ((r * (dy - y * m)).astype(x.dtype),)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)
