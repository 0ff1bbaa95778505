"""kunlun.nn.norms: values and gradients (hand-written VJPs) against numpy and against autodiff of
the plain formulas, in float32 and from bfloat16 inputs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kunlun.nn import norms


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


@pytest.mark.parametrize("name", ["layer_norm", "rms_norm", "scaled_rms_norm"])
def test_output_dtype_inside_the_vjp(name):
  """``dtype=bfloat16``: the float32 value rounded once; gradients (also the scale's) equal
  autodiff of the plain formula followed by the cast."""
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(4, 6, 16)), jnp.bfloat16)
  w = jnp.asarray(rng.normal(size=(4, 6, 16)), jnp.float32)
  sc = jnp.asarray(1 + 0.3 * rng.normal(size=16), jnp.float32)
  plain = {"layer_norm": lambda x, sc: _plain_ln(x), "rms_norm": lambda x, sc: _plain_rms(x),
           "scaled_rms_norm": lambda x, sc: _plain_rms(x) * sc}[name]
  fn = getattr(norms, name)
  got = ((lambda x, sc, dt: fn(x, sc, dtype=dt)) if name == "scaled_rms_norm"
         else (lambda x, sc, dt: fn(x, dtype=dt)))
  np.testing.assert_array_equal(np.asarray(got(x, sc, jnp.float32)), np.asarray(plain(x, sc)))
  yb = got(x, sc, jnp.bfloat16)
  assert yb.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(yb, np.float32),
                                np.asarray(plain(x, sc).astype(jnp.bfloat16), np.float32))
  loss = lambda f: (lambda x, sc: jnp.sum(f(x, sc).astype(jnp.float32) * w))
  g = jax.grad(loss(lambda x, sc: got(x, sc, jnp.bfloat16)), argnums=(0, 1))(x, sc)
  g_ref = jax.grad(loss(lambda x, sc: plain(x, sc).astype(jnp.bfloat16)), argnums=(0, 1))(x, sc)
  assert g[0].dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(g[0], np.float32), np.asarray(g_ref[0], np.float32),
                             rtol=2e-2, atol=2e-2)
  np.testing.assert_allclose(np.asarray(g[1]), np.asarray(g_ref[1]), rtol=1e-4, atol=1e-4)
  # float32: the scale's gradient and dx as autodiff (row sums reassociated: rtol 1e-5)
  xf = x.astype(jnp.float32)
  g = jax.grad(loss(lambda x, sc: got(x, sc, jnp.float32)), argnums=(0, 1))(xf, sc)
  g_ref = jax.grad(loss(plain), argnums=(0, 1))(xf, sc)
  for a, b in zip(g, g_ref, strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def _np_affine_ln(xs, scale, bias, eps=1e-6):
  t = sum(np.asarray(x, np.float64) for x in xs)
  tc = t - t.mean(-1, keepdims=True)
  return tc / np.sqrt((tc ** 2).mean(-1, keepdims=True) + eps) * scale + bias


@pytest.mark.parametrize("n_addends", [1, 2, 3])
def test_affine_layer_norm(n_addends):
  """``LayerNorm(sum(xs)) * scale + bias``: values against numpy (float64); gradients of every
  addend, the scale and the bias against autodiff of the plain formula (float32, rtol 1e-5), also
  under vmap (the MoWE experts); bfloat16 addends get bfloat16 gradients and a ``dtype`` output
  rounded once."""
  rng = np.random.default_rng(2)
  shape = (2, 3, 5, 32)
  xs = tuple(jnp.asarray(rng.normal(size=shape) + 0.3 * i, jnp.float32)
             for i in range(n_addends))
  sc = jnp.asarray(1 + 0.3 * rng.normal(size=32), jnp.float32)
  bi = jnp.asarray(0.1 * rng.normal(size=32), jnp.float32)
  w = jnp.asarray(rng.normal(size=shape), jnp.float32)
  got = norms.affine_layer_norm(xs, sc, bi)
  np.testing.assert_allclose(np.asarray(got), _np_affine_ln(xs, np.asarray(sc), np.asarray(bi)),
                             rtol=1e-5, atol=1e-5)
  plain = lambda xs, sc, bi: _plain_ln(functools.reduce(jnp.add, [x.astype(jnp.float32) for x in xs])) * sc + bi
  loss = lambda f: (lambda xs, sc, bi: jnp.sum(jnp.sin(f(xs, sc, bi)) * w))
  g = jax.grad(loss(norms.affine_layer_norm), argnums=(0, 1, 2))(xs, sc, bi)
  g_ref = jax.grad(loss(plain), argnums=(0, 1, 2))(xs, sc, bi)
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
  vm = lambda f: jax.vmap(jax.grad(loss(f), argnums=(0, 1, 2)), in_axes=(0, None, None))
  gv = jax.jit(vm(norms.affine_layer_norm))(xs, sc, bi)
  gv_ref = vm(plain)(xs, sc, bi)
  for a, b in zip(jax.tree.leaves(gv), jax.tree.leaves(gv_ref), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
  # bfloat16 addends, bfloat16 output
  xb = tuple(x.astype(jnp.bfloat16) for x in xs)
  yb = norms.affine_layer_norm(xb, sc, bi, dtype=jnp.bfloat16)
  assert yb.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(yb, np.float32),
                                np.asarray(plain(xb, sc, bi).astype(jnp.bfloat16), np.float32))
  gb = jax.grad(loss(lambda *a: norms.affine_layer_norm(*a, dtype=jnp.bfloat16)),
                argnums=(0, 1, 2))(xb, sc, bi)
  gb_ref = jax.grad(loss(lambda *a: plain(*a).astype(jnp.bfloat16)), argnums=(0, 1, 2))(xb, sc, bi)
  assert all(x.dtype == jnp.bfloat16 for x in gb[0])
  for a, b in zip(jax.tree.leaves(gb), jax.tree.leaves(gb_ref), strict=True):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=2e-2, atol=2e-2)


def test_affine_layer_norm_offset_rows():
  """Rows whose mean is 50x their spread: the backward's statistics are two-pass, so gradients
  stay within 1e-5 of autodiff of the plain formula (a one-pass ``mean(t^2) - mu^2`` would lose
  ~2500 ulps to cancellation)."""
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=(64, 48)) + 50.0, jnp.float32)
  sc = jnp.asarray(1 + 0.3 * rng.normal(size=48), jnp.float32)
  bi = jnp.zeros(48, jnp.float32)
  w = jnp.asarray(rng.normal(size=(64, 48)), jnp.float32)
  g = jax.grad(lambda x: jnp.sum(norms.affine_layer_norm((x,), sc, bi) * w))(x)
  g_ref = jax.grad(lambda x: jnp.sum((_plain_ln(x) * sc + bi) * w))(x)
  np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-5, atol=1e-5)


def test_layer_norm_pair_is_two_layer_norms_with_one_backward():
  """Both outputs equal ``layer_norm`` (float32 and rounded to bfloat16); the gradient of a loss
  reading each with its own weights equals autodiff of the plain formula read twice, float32
  and from bfloat16 (the two cotangents summed in float32 before the backward: tighter than
  autodiff's bfloat16 sum, within its rounding); under vmap too."""
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.normal(size=(3, 5, 16)) * 2 + 0.5, jnp.float32)
  w1, w2 = (jnp.asarray(rng.normal(size=(3, 5, 16)), jnp.float32) for _ in range(2))
  for dt in (jnp.float32, jnp.bfloat16):
    a, b = norms.layer_norm_pair(x, dtype=dt)
    assert a.dtype == b.dtype == dt
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    np.testing.assert_array_equal(np.asarray(a, np.float32),
                                  np.asarray(_plain_ln(x).astype(dt), np.float32))
  loss = lambda pair: (lambda x, w1, w2: jnp.sum(jnp.sin(pair(x)[0].astype(jnp.float32)) * w1)
                       + jnp.sum(pair(x)[1].astype(jnp.float32) * w2))
  plain = lambda x: (_plain_ln(x),) * 2
  g = jax.grad(loss(norms.layer_norm_pair))(x, w1, w2)
  g_ref = jax.grad(loss(plain))(x, w1, w2)
  np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-5, atol=1e-6)
  xb = x.astype(jnp.bfloat16)
  gb = jax.grad(loss(functools.partial(norms.layer_norm_pair, dtype=jnp.bfloat16)))(xb, w1, w2)
  gb_ref = jax.grad(loss(lambda x: (_plain_ln(x).astype(jnp.bfloat16),) * 2))(xb, w1, w2)
  assert gb.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(gb, np.float32), np.asarray(gb_ref, np.float32),
                             rtol=2e-2, atol=2e-2)
  gv = jax.jit(jax.vmap(jax.grad(loss(norms.layer_norm_pair))))(x, w1, w2)
  gv_ref = jax.vmap(jax.grad(loss(plain)))(x, w1, w2)
  np.testing.assert_allclose(np.asarray(gv), np.asarray(gv_ref), rtol=1e-5, atol=1e-6)
