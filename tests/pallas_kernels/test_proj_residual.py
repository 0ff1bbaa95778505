"""The attention's output side over packed tokens (``pallas_kernels.proj_residual``): the twin
against float64 numpy, the kernel (interpret mode, NaN-poisoned output) against the twin in
values (float32: 1e-5 of the largest magnitude; bfloat16: 2e-2) and gradients, with row counts
no multiple of the tile and masked rows that hold values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _poison, proj_residual
from tests.pallas_kernels.deviceless import close


def _inputs(N, H, D, d, seed):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(N, d)).astype(np.float32)
  o = rng.normal(size=(N, H, D)).astype(np.float32)
  w = (rng.normal(size=(H, D, d)) / np.sqrt(H * D)).astype(np.float32)
  valid = (np.arange(N) < N - 6).astype(np.float32)
  o[N - 6:] = 0.0              # as the attention's output at a block's tail; x there holds values
  return x, o, w, valid


def test_twin_matches_numpy():
  x, o, w, valid = _inputs(30, 2, 32, 64, 0)
  got = proj_residual.proj_residual_xla(*map(jnp.asarray, (x, o, w, valid)), dtype=jnp.float32)
  ref = valid[:, None] * (x.astype(np.float64) + np.einsum("nhc,hcd->nd", o.astype(np.float64),
                                                           w.astype(np.float64)))
  close(got, ref, 1e-6)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("N,H,D,d", [(77, 2, 64, 128), (40, 4, 64, 256)])
def test_kernel_matches_the_twin(dtype, tol, N, H, D, d):
  x, o, w, valid = _inputs(N, H, D, d, N + d)
  x, o = jnp.asarray(x, dtype), jnp.asarray(o, dtype)
  w, valid = jnp.asarray(w), jnp.asarray(valid)
  dy = jnp.asarray(np.random.default_rng(2).normal(size=(N, d)), jnp.float32)
  pal = lambda x, o, w: proj_residual.proj_residual_pallas(x, o, w, valid, dtype=dtype,
                                                           interpret=True)
  twin = lambda x, o, w: proj_residual.proj_residual_xla(x, o, w, valid, dtype=dtype)
  with _poison.poison_outputs():
    y = pal(x, o, w)
    grads = jax.grad(lambda *a: jnp.sum(pal(*a).astype(jnp.float32) * dy), (0, 1, 2))(x, o, w)
  ref = twin(x, o, w)
  assert y.dtype == dtype
  close(y, ref, tol)
  assert not np.any(np.asarray(y, np.float32)[N - 6:])
  # the cotangents pass unmasked: x's (its producer masks it) and the projection's (o is zero
  # at the masked rows, as the attention's output is): o's and w's equal the twin's unmasked
  ones = jnp.ones_like(valid)
  rgrads = jax.grad(lambda *a: jnp.sum(proj_residual.proj_residual_xla(*a, ones, dtype=dtype)
                                       .astype(jnp.float32) * dy), (0, 1, 2))(x, o, w)
  np.testing.assert_array_equal(np.asarray(grads[0]), np.asarray(dy.astype(dtype)))
  for name, g, r in zip("ow", grads[1:], rgrads[1:], strict=True):
    assert g.dtype == r.dtype and g.shape == r.shape, name
    close(g, r, tol)


def test_bad_shapes_are_refused():
  x, o, w, valid = map(jnp.asarray, _inputs(8, 2, 32, 64, 1))
  with pytest.raises(ValueError, match="must be"):
    proj_residual.proj_residual_pallas(x, o, w[:, :, :32], valid, interpret=True)
  with pytest.raises(ValueError, match="needs"):
    proj_residual.proj_residual_pallas(x, o[:, :, :24], w[:, :24], valid, interpret=True)
  assert proj_residual.supported(256, 256) and not proj_residual.supported(48, 256)
