"""HSP's seed side (``pallas_kernels.seed_kron``): the twin against a float64 numpy computation,
the Pallas kernels (interpret mode, NaN-poisoned outputs) against the twin in values and the
gradients of ``a``, ``e`` and ``z`` (float32: 1e-5 of the largest magnitude; bfloat16: 2e-2),
with a batch that is no multiple of a program's examples and an all-zero example."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _poison, seed_kron
from tests.pallas_kernels.deviceless import close

EPS = 1e-6


def _inputs(B, S, K, d, seed):
  rng = np.random.default_rng(seed)
  a = rng.normal(size=(B, S, d)).astype(np.float32) * rng.uniform(0.1, 3.0, size=(B, S, 1))
  a[1] = 0.0
  e = (0.5 * rng.normal(size=(S, d))).astype(np.float32)
  z = rng.normal(size=(S, K)).astype(np.float32) / np.sqrt(S)
  dt = rng.normal(size=(B, K, d)).astype(np.float32)
  return a, e, z, dt


def _numpy(a, e, z, dt):
  """float64: ``t`` and the cotangents of a, e and z."""
  a, e, z, dt = (x.astype(np.float64) for x in (a, e, z, dt))
  t = a + e
  r = 1.0 / np.sqrt(np.mean(t * t, -1, keepdims=True) + EPS)
  h = t * r
  dh = np.einsum("sk,bkd->bsd", z, dt)
  da = r * (dh - h * np.mean(dh * h, -1, keepdims=True))
  return np.einsum("sk,bsd->bkd", z, h), da, da.sum(0), np.einsum("bsd,bkd->sk", h, dt)


def test_twin_matches_numpy():
  a, e, z, dt = _inputs(3, 32, 16, 64, 0)
  f = lambda a, e, z: seed_kron.seed_kron_xla(a, e, z, eps=EPS, dtype=jnp.float32)
  t, vjp = jax.vjp(f, *map(jnp.asarray, (a, e, z)))
  ref = _numpy(a, e, z, dt)
  close(t, ref[0], 1e-5)
  for got, want in zip(vjp(jnp.asarray(dt)), ref[1:], strict=True):
    close(got, want, 1e-5)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("B,S,K,d", [(5, 32, 16, 64), (4, 64, 64, 128)])
def test_kernels_match_the_twin(dtype, tol, B, S, K, d):
  a, e, z, dt = _inputs(B, S, K, d, B + S + K)
  a = jnp.asarray(a, dtype)
  e, z, dt = jnp.asarray(e), jnp.asarray(z), jnp.asarray(dt)

  def run(fn):
    f = lambda a, e, z: fn(a, e, z, eps=EPS, dtype=dtype)
    t, vjp = jax.vjp(f, a, e, z)
    return t, vjp(dt.astype(dtype))

  with _poison.poison_outputs():
    got, g_got = run(lambda *x, **k: seed_kron.seed_kron_pallas(*x, interpret=True, **k))
  want, g_want = run(seed_kron.seed_kron_xla)
  assert got.dtype == dtype
  close(got, want, tol)
  for u, w in zip(g_got, g_want, strict=True):
    assert u.dtype == w.dtype and u.shape == w.shape
    close(u, w, tol)


def test_refuses_what_it_cannot_tile():
  assert seed_kron.supported(64, 64, 256) and seed_kron.supported(32, 32, 128)
  assert not seed_kron.supported(128, 256, 512)           # prod's 512-wide towers: XLA
  assert not seed_kron.supported(24, 16, 64)
  with pytest.raises(ValueError, match="seed_kron"):
    seed_kron.seed_kron_pallas(jnp.zeros((2, 24, 64)), jnp.zeros((24, 64)), jnp.zeros((24, 16)),
                               eps=EPS, interpret=True)
