"""Affine-free normalisations computed in float32 (spec c.3, c.9, h-13).

Pure functions: they have no parameters, take any dtype and return float32, so callers decide
when to cast back to the compute dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

EPS = 1e-6


def layer_norm(x, eps: float = EPS):
  """LayerNorm over the last axis without scale or bias. ``[..., d] -> f32[..., d]``."""
  x = x.astype(jnp.float32)
  mu = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x - mu), axis=-1, keepdims=True)
  return (x - mu) * jax.lax.rsqrt(var + eps)


def rms_norm(x, eps: float = EPS):
  """RMSNorm over the last axis without scale. ``[..., d] -> f32[..., d]``."""
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)
