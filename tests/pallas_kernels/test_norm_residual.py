"""The PFFN's tail over packed tokens (``pallas_kernels.norm_residual``): the twin against a
float64 numpy computation, the Pallas kernels (interpret mode, NaN-poisoned outputs) against the
twin in values and gradients (float32: 1e-5 of the largest magnitude; bfloat16: 2e-2), with row
counts no multiple of the tile, a zero tail and masked rows that hold values; the same with the
residual ``u`` the LayerNorm of ``s`` computed in the kernels (``u_norm``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _poison, norm_residual
from tests.pallas_kernels.deviceless import close

EPS = 1e-6


def _inputs(N, d, seed, dead=5):
  rng = np.random.default_rng(seed)
  g, u, s = (rng.normal(size=(N, d)).astype(np.float32) * rng.uniform(0.1, 3.0, size=(N, 1))
             for _ in range(3))
  valid = np.ones((N,), np.float32)
  valid[N - dead:] = 0.0
  g[N - 2:], u[N - 2:], s[N - 2:] = 0.0, 0.0, 0.0          # a zero tail; the other dead rows
  return g, u, s, valid                                     # hold values the mask must drop


def _numpy(g, u, s, valid, dy):
  """float64: the output and the cotangents of g (= u's) and s."""
  g, u, s, dy = (a.astype(np.float64) for a in (g, u, s, dy))
  t = g + u
  r = 1.0 / np.sqrt(np.mean(t * t, -1, keepdims=True) + EPS)
  m = valid[:, None]
  z = t * r
  d = dy * m
  return m * (z + s), r * (d - z * np.mean(d * z, -1, keepdims=True)), d


def _same_grads(names, grads, want, tol, dead=5):
  """Each gradient as the twin's (dtype, shape, values within ``tol``), zero on the masked rows."""
  for name, a, b in zip(names, grads, want, strict=True):
    assert a.dtype == b.dtype and a.shape == b.shape, name
    close(a, b, tol)
    assert not np.any(np.asarray(a, np.float32)[-dead:]), name


def test_twin_matches_numpy():
  g, u, s, valid = _inputs(50, 64, 0)
  y = norm_residual.norm_residual_xla(*map(jnp.asarray, (g, u, s, valid)), eps=EPS)
  dy = np.random.default_rng(1).normal(size=g.shape).astype(np.float32)
  ref_y, ref_dt, ref_ds = _numpy(g, u, s, valid, dy)
  close(y, ref_y, 1e-6)
  f = lambda g, u, s: jnp.sum(norm_residual.norm_residual_xla(g, u, s, valid, eps=EPS) * dy)
  dg, du, ds = jax.grad(f, argnums=(0, 1, 2))(*map(jnp.asarray, (g, u, s)))
  close(dg, ref_dt, 1e-5)
  close(du, ref_dt, 1e-5)
  close(ds, ref_ds, 1e-6)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("N,d", [(77, 64), (40, 256)])
def test_kernels_match_the_twin(dtype, tol, N, d):
  g, u, s, valid = (jnp.asarray(a, dtype) if a.ndim == 2 else jnp.asarray(a)
                    for a in _inputs(N, d, N + d))
  dy = jnp.asarray(np.random.default_rng(3).normal(size=(N, d)), jnp.float32)

  def loss(fn):
    return jax.value_and_grad(lambda g, u, s: jnp.sum(fn(g, u, s, valid, eps=EPS)
                                                      .astype(jnp.float32) * dy),
                              argnums=(0, 1, 2))(g, u, s)

  pal = lambda *a, **k: norm_residual.norm_residual_pallas(
      *a, interpret=True, **k)
  with _poison.poison_outputs():
    y = pal(g, u, s, valid, eps=EPS)
    val, grads = loss(pal)
  ref = norm_residual.norm_residual_xla(g, u, s, valid, eps=EPS)
  assert y.dtype == dtype and y.shape == ref.shape
  close(y, ref, tol)
  assert not np.any(np.asarray(y, np.float32)[N - 5:])     # masked rows: zero
  rval, rgrads = loss(norm_residual.norm_residual_xla)
  close(val, rval, tol)
  _same_grads("gus", grads, rgrads, tol)


def test_bad_shapes_and_widths_are_refused():
  z = jnp.zeros((8, 48))
  with pytest.raises(ValueError, match="power of two"):
    norm_residual.norm_residual_pallas(z, z, z, jnp.ones(8), eps=EPS, interpret=True)
  z = jnp.zeros((8, 64))
  with pytest.raises(ValueError, match="must be one"):
    norm_residual.norm_residual_pallas(z, z, z[:4], jnp.ones(8), eps=EPS, interpret=True)
  assert norm_residual.supported(256) and not norm_residual.supported(48)


def _np_ln(s):
  s = s.astype(np.float64)
  mu = s.mean(-1, keepdims=True)
  r = 1.0 / np.sqrt(np.mean((s - mu) ** 2, -1, keepdims=True) + EPS)
  return (s - mu) * r, r


def test_twin_with_the_norm_matches_numpy():
  """``u = None, u_norm``: ``u = LN(s)``; s's cotangent is the residual's plus the norm's
  backward of u's (float64 numpy, by hand)."""
  g, _, s, valid = _inputs(50, 64, 4)
  s = s + 2.0                                                # a mean the norm must remove
  s[-2:] = 0.0
  dy = np.random.default_rng(5).normal(size=g.shape).astype(np.float32)
  y_ln, r_ln = _np_ln(s)
  ref_y, ref_dt, ref_ds = _numpy(g, y_ln, s, valid, dy)
  du = ref_dt
  ref_ds = ref_ds + r_ln * (du - du.mean(-1, keepdims=True)
                            - y_ln * np.mean(du * y_ln, -1, keepdims=True))
  f = lambda g, s: norm_residual.norm_residual_xla(g, None, s, valid, eps=EPS, u_norm=EPS)
  close(f(jnp.asarray(g), jnp.asarray(s)), ref_y, 1e-5)
  dg, ds = jax.grad(lambda g, s: jnp.sum(f(g, s) * dy), argnums=(0, 1))(jnp.asarray(g),
                                                                        jnp.asarray(s))
  close(dg, ref_dt, 1e-5)
  close(ds, ref_ds, 1e-5)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("N,d", [(77, 64), (40, 256)])
def test_kernels_with_the_norm_match_the_twin(dtype, tol, N, d):
  g, _, s, valid = _inputs(N, d, N + d + 1)
  g, s = jnp.asarray(g, dtype), jnp.asarray(s * 1.5 - 0.7, dtype)
  valid = jnp.asarray(valid)
  dy = jnp.asarray(np.random.default_rng(6).normal(size=(N, d)), jnp.float32)

  def run(fn, **k):
    f = lambda g, s: fn(g, None, s, valid, eps=EPS, u_norm=EPS, **k)
    return f(g, s), jax.grad(lambda g, s: jnp.sum(f(g, s).astype(jnp.float32) * dy),
                             argnums=(0, 1))(g, s)

  with _poison.poison_outputs():
    y, grads = jax.jit(lambda: run(norm_residual.norm_residual_pallas, interpret=True))()
  ref, rgrads = jax.jit(lambda: run(norm_residual.norm_residual_xla))()
  assert y.dtype == dtype
  close(y, ref, tol)
  _same_grads("gs", grads, rgrads, tol)


def test_u_and_its_norm_are_exclusive():
  z = jnp.zeros((8, 64))
  with pytest.raises(ValueError, match="u=None with u_norm"):
    norm_residual.norm_residual_pallas(z, z, z, jnp.ones(8), eps=EPS, u_norm=EPS,
                                       interpret=True)
  with pytest.raises(ValueError, match="u=None with u_norm"):
    norm_residual.norm_residual_pallas(z, None, z, jnp.ones(8), eps=EPS, interpret=True)
