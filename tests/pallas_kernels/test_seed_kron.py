"""HSP's seed side (``pallas_kernels.seed_kron``): the twin against a float64 numpy computation,
the Pallas kernels (interpret mode, NaN-poisoned outputs) against the twin in values and the
gradients of ``a``, ``e`` and ``z`` (float32: 1e-5 of the largest magnitude; bfloat16: 2e-2),
with a batch that is no multiple of a program's examples, an all-zero example, and a summary
count that is no power of two (padded in the kernels)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _common, _poison, seed_kron
from tests.pallas_kernels.deviceless import close, twin_jit

EPS = 1e-6


def _inputs(B, S, R, M, d, seed):
  rng = np.random.default_rng(seed)
  a = rng.normal(size=(B, S, d)).astype(np.float32) * rng.uniform(0.1, 3.0, size=(B, S, 1))
  a[1] = 0.0
  e = (0.5 * rng.normal(size=(S, d))).astype(np.float32)
  z = rng.normal(size=(R, S, M)).astype(np.float32) / np.sqrt(S)
  dt = rng.normal(size=(B, M, R * d)).astype(np.float32)
  return a, e, z, dt


def _numpy(a, e, z, dt):
  """float64: ``t [B, M, R d]`` (``t[b, m, r d + j] = sum_s z[r, s, m] h[b, s, j]``) and the
  cotangents of a, e and z."""
  a, e, z, dt = (x.astype(np.float64) for x in (a, e, z, dt))
  B, S, d = a.shape
  R, _, M = z.shape
  t = a + e
  r = 1.0 / np.sqrt(np.mean(t * t, -1, keepdims=True) + EPS)
  h = t * r
  out = np.zeros((B, M, R * d))
  for k in range(R):
    out[:, :, k * d:(k + 1) * d] = np.einsum("sm,bsd->bmd", z[k], h)
  dt4 = dt.reshape(B, M, R, d)
  dh = np.einsum("rsm,bmrd->bsd", z, dt4)
  da = r * (dh - h * np.mean(dh * h, -1, keepdims=True))
  return out, da, da.sum(0), np.einsum("bsd,bmrd->rsm", h, dt4)


def test_twin_matches_numpy():
  a, e, z, dt = _inputs(3, 32, 4, 8, 64, 0)
  f = lambda a, e, z: seed_kron.seed_kron_xla(a, e, z, eps=EPS, dtype=jnp.float32)

  def both(a, e, z, dt):
    t, vjp = jax.vjp(f, a, e, z)
    return t, vjp(dt)

  t, grads = twin_jit(both, jnp.float32)(*map(jnp.asarray, (a, e, z, dt)))
  ref = _numpy(a, e, z, dt)
  close(t, ref[0], 1e-5)
  for got, want in zip(grads, ref[1:], strict=True):
    close(got, want, 1e-5)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
# the last two wide (K d > MAX_ACC: the output in column chunks, as prod's 512-wide towers, 128
# seeds, rank 8, 32 summaries, in 8): 4 seed chunks and 2 column chunks; padded summaries and 4
# column chunks
@pytest.mark.parametrize("B,S,R,M,d", [(5, 32, 2, 8, 64), (4, 64, 4, 16, 128), (3, 16, 4, 5, 32),
                                       (2, 64, 8, 16, 256), (3, 32, 8, 13, 512)])
def test_kernels_match_the_twin(dtype, tol, B, S, R, M, d):
  a, e, z, dt = _inputs(B, S, R, M, d, B + S + R * M)
  a = jnp.asarray(a, dtype)
  e, z, dt = jnp.asarray(e), jnp.asarray(z), jnp.asarray(dt)

  def run(fn, jit):
    def both(a, e, z, dt):
      t, vjp = jax.vjp(lambda a, e, z: fn(a, e, z, eps=EPS, dtype=dtype), a, e, z)
      return t, vjp(dt.astype(dtype))
    return jit(both)(a, e, z, dt)

  with _poison.poison_outputs():
    got, g_got = run(lambda *x, **k: seed_kron.seed_kron_pallas(*x, interpret=True, **k),
                     jax.jit)
  want, g_want = run(seed_kron.seed_kron_xla, lambda f: twin_jit(f, dtype))
  assert got.dtype == dtype
  close(got, want, tol)
  for u, w in zip(g_got, g_want, strict=True):
    assert u.dtype == w.dtype and u.shape == w.shape
    close(u, w, tol)


# 8 per program: 8 + 1 examples; 4: 4 + 4 + 2; 2: 2 + 2
@pytest.mark.parametrize("B,min_programs,examples", [(9, 1, 8), (10, 2, 4), (4, 2, 2)])
def test_wide_backward_sums_e_over_a_programs_examples(monkeypatch, B, min_programs, examples):
  """The wide backward with more examples per program (``bwd_examples``: prod's B 1024 takes 8),
  its last program part empty, against float64 numpy: ``e``'s gradient from the kernel's partial
  sums, ``a``'s and ``z``'s as before (float32, 1e-5)."""
  monkeypatch.setattr(seed_kron, "MIN_PROGRAMS", min_programs)
  assert seed_kron.bwd_examples(B) == examples
  S, R, M, d = 32, 8, 13, 512                      # wide: K d > MAX_ACC, 4 column chunks
  a, e, z, dt = _inputs(B, S, R, M, d, 7 * B)
  f = lambda a, e, z: seed_kron.seed_kron_pallas(a, e, z, eps=EPS, dtype=jnp.float32,
                                                 interpret=True)

  def both(a, e, z, dt):
    t, vjp = jax.vjp(f, a, e, z)
    return t, vjp(dt)

  with _poison.poison_outputs():
    t, grads = jax.jit(both)(*map(jnp.asarray, (a, e, z, dt)))
  ref = _numpy(a, e, z, dt)
  close(t, ref[0], 1e-5)
  for got, want in zip(grads, ref[1:], strict=True):
    close(got, want, 1e-5)


def test_refuses_what_it_cannot_tile():
  # mid's towers (S, rank, n_sum, d), prod's 256-wide ones
  assert seed_kron.supported(64, 4, 16, 256) and seed_kron.supported(32, 4, 8, 128)
  assert seed_kron.supported(32, 8, 8, 256)
  assert seed_kron.supported(128, 8, 32, 512)             # prod's 512-wide towers: wide
  assert not seed_kron.supported(128, 16, 32, 512)        # K 512: past MAX_WIDE_K
  assert not seed_kron.supported(24, 4, 16, 64) and not seed_kron.supported(32, 3, 8, 64)
  assert not seed_kron.supported(32, 2, 4, 64)            # K = 8: below a tile
  with pytest.raises(ValueError, match="seed_kron"):
    seed_kron.seed_kron_pallas(jnp.zeros((2, 24, 64)), jnp.zeros((24, 64)),
                               jnp.zeros((4, 24, 4)), eps=EPS, interpret=True)


@pytest.mark.parametrize("examples,fewest,min_programs,most", [
    (1024, 2, 128, 8), (1024, 4, 128, 16), (256, 4, 128, 16), (300, 2, 128, 8), (7, 2, 1, 8),
    (4096, 4, 512, None), (1000, 4, 250, None), (1, 4, 1, None), (20, 4, 2, None)])
def test_examples_per_program_is_the_most_that_keeps_the_programs(examples, fewest, min_programs,
                                                                   most):
  """``_common.examples_per_program`` (the backward kernels' rule) against a brute-force search:
  the largest ``fewest * 2^k`` (at most ``most``) with ``examples // per >= min_programs`` full
  programs, else ``fewest``."""
  ok = [fewest << k for k in range(20) if (most is None or fewest << k <= most)
        and examples // (fewest << k) >= max(min_programs, 1)]
  want = max(ok, default=fewest)
  assert _common.examples_per_program(examples, fewest, min_programs, most) == want
