"""pallas_kernels.seed_query (interpret mode on CPU) against its XLA twin and float64 numpy:
values and both gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _poison
from pallas_kernels import seed_query as Q
from tests.pallas_kernels.deviceless import twin_jit

# mid's click / conversion seeds, its impression tower's, and one head of 64
SHAPES = [(64, 256, 4, 64), (32, 128, 2, 64), (16, 64, 1, 64)]


def _numpy(e, w, dq, eps=Q.EPS):
  """``q``, ``de``, ``dw`` in float64 (no rounding)."""
  e, w, dq = (np.asarray(a, np.float64) for a in (e, w, dq))
  S, d = e.shape
  r = 1.0 / np.sqrt(np.mean(e * e, axis=1, keepdims=True) + eps)
  y = e * r
  wf = w.reshape(d, -1)
  q = y @ wf
  g = dq.reshape(S, -1)
  dw = y.T @ g
  dh = g @ wf.T
  de = r * (dh - y * np.mean(dh * y, axis=1, keepdims=True))
  return q.reshape(S, *w.shape[1:]), de, dw.reshape(w.shape)


def _case(shape, seed):
  S, d, H, D = shape
  rng = np.random.default_rng(seed)
  e = (0.02 * rng.normal(size=(S, d))).astype(np.float32)
  w = (rng.normal(size=(d, H, D)) / np.sqrt(d)).astype(np.float32)
  dq = rng.normal(size=(S, H, D)).astype(np.float32)
  return e, w, dq


def _run(fn, e, w, dq):
  q, vjp = jax.vjp(fn, jnp.asarray(e), jnp.asarray(w))
  return (q, *vjp(jnp.asarray(dq, q.dtype)))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_kernel_matches_the_twin_and_numpy(shape, dtype, tol):
  """``q``, ``de`` and ``dw`` from the kernels (outputs NaN-poisoned) and the twin against
  float64 numpy: float32 at 1e-5 relative (to the largest value), bfloat16 within 2e-2."""
  e, w, dq = _case(shape, 0)
  if dtype == jnp.bfloat16:          # the cotangent as the model hands it over
    dq = np.asarray(jnp.asarray(dq, jnp.bfloat16).astype(jnp.float32))
  with _poison.poison_outputs():
    got = jax.jit(lambda e, w, dq: _run(
        lambda a, b: Q.seed_query_pallas(a, b, dtype=dtype, interpret=True), e, w, dq))(e, w, dq)
  twin = twin_jit(lambda e, w, dq: _run(lambda a, b: Q.seed_query_xla(a, b, dtype=dtype),
                                        e, w, dq), dtype)(e, w, dq)
  want = _numpy(e, w, dq)
  for res in (got, twin):
    assert res[0].dtype == dtype and res[1].dtype == jnp.float32 and res[2].dtype == jnp.float32
    for a, b in zip(res, want, strict=True):
      a = np.asarray(a, np.float64)
      assert a.shape == b.shape
      np.testing.assert_allclose(a, b, atol=tol * np.max(np.abs(b)), rtol=0)
  # the kernels and the twin round at the same places: closer to each other than to numpy
  for a, b in zip(got, twin, strict=True):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               atol=tol * 0.5 * float(jnp.max(jnp.abs(b.astype(jnp.float32)))),
                               rtol=0)


def test_unsupported_shapes_are_one_line_errors():
  e, w = jnp.zeros((128, 256)), jnp.zeros((256, 4, 64))
  assert not Q.supported(128, 256, 4, 64) and Q.supported(64, 256, 4, 64)
  for a, b in ((e, w), (e[:64], w[:128])):
    with pytest.raises(ValueError, match="seed_query") as err:
      Q.seed_query_pallas(a, b, interpret=True)
    assert "\n" not in str(err.value)


def test_a_weight_cast_outside_gives_its_gradient_in_its_dtype():
  """``w`` handed over in bfloat16 (a caller's cast, which a 16-bit copy replaces): the same
  queries, ``de``, and ``dw`` in bfloat16 equal to the float32 weight's rounded."""
  e, w, dq = _case(SHAPES[0], 1)
  dq = jnp.asarray(dq, jnp.bfloat16)
  run = lambda w: jax.jit(lambda e, w, dq: _run(
      lambda a, b: Q.seed_query_pallas(a, b, interpret=True), e, w, dq))(e, w, dq)
  a, b = run(jnp.asarray(w)), run(jnp.asarray(w, jnp.bfloat16))
  assert b[2].dtype == jnp.bfloat16 and a[2].dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]))
  np.testing.assert_array_equal(np.asarray(a[1]), np.asarray(b[1]))
  np.testing.assert_array_equal(np.asarray(a[2].astype(jnp.bfloat16)), np.asarray(b[2]))
