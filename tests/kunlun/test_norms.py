"""kunlun.norms: values and gradients (hand-written VJPs) against numpy and against autodiff of
the plain formulas, in float32 and from bfloat16 inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kunlun import norms


def _plain_ln(x, eps=1e-6):
  x = x.astype(jnp.float32)
  mu = jnp.mean(x, -1, keepdims=True)
  return (x - mu) * jax.lax.rsqrt(jnp.mean(jnp.square(x - mu), -1, keepdims=True) + eps)


def _plain_rms(x, eps=1e-6):
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), -1, keepdims=True) + eps)


@pytest.mark.parametrize("name", ["layer_norm", "rms_norm"])
def test_values_and_gradients(name):
  """Values equal the plain formula bitwise-close and numpy (f64); gradients of a weighted sum
  equal autodiff of the plain formula (row sums reassociated: rtol 1e-5)."""
  fn, plain = getattr(norms, name), {"layer_norm": _plain_ln, "rms_norm": _plain_rms}[name]
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(3, 5, 16)) * 2 + 0.5, jnp.float32)
  w = jnp.asarray(rng.normal(size=(3, 5, 16)), jnp.float32)
  xn = np.asarray(x, np.float64)
  if name == "layer_norm":
    xc = xn - xn.mean(-1, keepdims=True)
    want = xc / np.sqrt((xc ** 2).mean(-1, keepdims=True) + 1e-6)
  else:
    want = xn / np.sqrt((xn ** 2).mean(-1, keepdims=True) + 1e-6)
  np.testing.assert_allclose(np.asarray(fn(x)), want, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(fn(x)), np.asarray(plain(x)))
  g = jax.grad(lambda x: jnp.sum(jnp.sin(fn(x)) * w))(x)
  g_ref = jax.grad(lambda x: jnp.sum(jnp.sin(plain(x)) * w))(x)
  np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-5, atol=1e-6)
  # bfloat16 input: float32 output, bfloat16 gradient (as autodiff through the cast)
  xb = x.astype(jnp.bfloat16)
  assert fn(xb).dtype == jnp.float32
  gb = jax.grad(lambda x: jnp.sum(fn(x) * w))(xb)
  gb_ref = jax.grad(lambda x: jnp.sum(plain(x) * w))(xb)
  assert gb.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(gb, np.float32), np.asarray(gb_ref, np.float32),
                             rtol=2e-2, atol=2e-2)
  # under vmap and jit (the MoWE experts)
  gv = jax.jit(jax.vmap(jax.grad(lambda x, w: jnp.sum(fn(x) * w))))(x, w)
  gv_ref = jax.vmap(jax.grad(lambda x, w: jnp.sum(plain(x) * w)))(x, w)
  np.testing.assert_allclose(np.asarray(gv), np.asarray(gv_ref), rtol=1e-5, atol=1e-6)
