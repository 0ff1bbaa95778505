"""Student adapter learns a planted miscalibration; distill_loss matches an explicit formula."""

import jax
import numpy as np
import pytest

from kunlun.transfer import adapter


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def _toy(rng, n, surface_dependent):
  z = rng.normal(-1.0, 1.5, (n, 2))                       # true logits, 2 tasks
  s = rng.integers(0, 3, n)
  age = rng.uniform(0, 48 * 3600, n)
  y = (rng.uniform(size=z.shape) < _sigmoid(z)).astype(np.float32)
  if surface_dependent:   # each surface miscalibrated differently; task 1 extra shift
    a = np.array([2.0, 0.5, 1.0])[s][:, None]
    c = np.array([1.0, -0.5, 0.0])[s][:, None] + np.array([0.0, 0.7])[None]
  else:
    a, c = 2.0, 1.0
  teacher = a * z + c
  return z, s, age, y, teacher


@pytest.mark.parametrize("surface_dependent", [False, True])
def test_adapter_learns_known_miscalibration(surface_dependent):
  rng = np.random.default_rng(0)
  z, s, age, y, teacher = _toy(rng, 20000, surface_dependent)
  mask = np.ones_like(y)
  module, params = adapter.fit_adapter(teacher, s, age, y, mask, num_surfaces=3, steps=200,
                                       lr=4e-2, batch_size=None, seed=0)
  zt, st, at, _, tt = _toy(np.random.default_rng(1), 5000, surface_dependent)
  p_true = _sigmoid(zt)
  err_before = np.abs(_sigmoid(tt) - p_true).mean()
  p_adapt = np.asarray(adapter.soft_targets(module, params, tt, st, at))
  err_after = np.abs(p_adapt - p_true).mean()
  assert err_before > 0.08, err_before
  assert err_after < 0.02, (err_before, err_after)


def test_untrained_adapter_is_identity():
  m = adapter.StudentAdapter(num_surfaces=3, num_tasks=2)
  t = np.array([[0.3, -2.0], [1.5, 0.0]], np.float32)
  p = m.init(jax.random.key(0), t, np.array([0, 2]), np.array([0.0, 7.0]))
  np.testing.assert_allclose(m.apply(p, t, np.array([0, 2]), np.array([0.0, 7.0])), t, atol=1e-6)
  with pytest.raises(ValueError, match="tasks"):
    m.apply(p, t[:, :1], np.array([0, 2]), np.array([0.0, 7.0]))


def test_distill_loss_formula():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(5, 2)).astype(np.float32)
  y = (rng.uniform(size=(5, 2)) < 0.4).astype(np.float32)
  m = (rng.uniform(size=(5, 2)) < 0.7).astype(np.float32)
  q = rng.uniform(size=(5, 2)).astype(np.float32)
  p = _sigmoid(x.astype(np.float64))

  def bce(t):
    return -(t * np.log(p) + (1 - t) * np.log(1 - p))

  want = (bce(y) * m).sum() / m.sum() + 0.5 * (bce(q) * m).sum() / m.sum()
  np.testing.assert_allclose(adapter.distill_loss(x, y, m, q, 0.5), want, rtol=1e-5)
  ones = np.ones_like(m)
  want2 = (bce(y) * m).sum() / m.sum() + 0.3 * bce(q).mean()
  np.testing.assert_allclose(adapter.distill_loss(x, y, m, q, 0.3, soft_mask=ones), want2,
                             rtol=1e-5)
  # gradient does not flow into the soft targets
  g = jax.grad(lambda qq: adapter.distill_loss(x, y, m, qq, 0.5))(q)
  np.testing.assert_array_equal(g, 0.0)


def test_ages_outside_the_fitted_range_are_clamped_not_extrapolated():
  rng = np.random.default_rng(2)
  z, s, _, y, teacher = _toy(rng, 4000, False)
  age = rng.uniform(10 * 86400, 14 * 86400, len(s)).astype(np.float32)   # fresh labels only
  module, params = adapter.fit_adapter(teacher, s, age, y, np.ones_like(y), num_surfaces=3,
                                       steps=50, lr=2e-2, seed=0)
  assert module.age_range == pytest.approx((age.min(), age.max()))
  t, si = teacher[:8], s[:8]
  out = lambda a: np.asarray(adapter.soft_targets(module, params, t, si, np.full(8, a, np.float32)))
  np.testing.assert_array_equal(out(0.0), out(float(age.min())))         # older training rows
  np.testing.assert_array_equal(out(30 * 86400.0), out(float(age.max())))  # staler serving
  assert not np.array_equal(out(float(age.min())), out(float(age.max())))
