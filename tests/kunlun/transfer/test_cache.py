"""Speculative cache: budget, hits equal recomputation, miss fallback, elastic budget, store."""

import numpy as np
import pytest

from kunlun.transfer import cache as cache_lib

D = 4


class FakeFM:
  """Deterministic 'FM': embedding = function of (user, ad, time); records every call."""

  def __init__(self):
    self.calls = []

  def __call__(self, user, ad, now):
    self.calls.append(len(user))
    return self.reference(user, ad, now)

  @staticmethod
  def reference(user, ad, now):
    base = np.stack([user, ad, np.full_like(user, now), user * 7 + ad], -1).astype(np.float64)
    return np.sin(base * np.array([0.1, 0.37, 1e-3, 0.011])).astype(np.float32)


def _candidates(rng, n=100):
  u = rng.choice(1000, n, replace=False)
  a = rng.integers(0, 50, n)
  p = rng.uniform(size=n).astype(np.float32)
  return u, a, p


def test_budget_topk_hits_and_misses():
  rng = np.random.default_rng(0)
  fm = FakeFM()
  c = cache_lib.SpeculativeCache(fm, D, budget=10)
  u, a, p = _candidates(rng)
  info = c.refresh(u, a, p, now=1000)
  assert fm.calls == [10] and info["evaluated"] == 10 and info["budget_use"] == 1.0
  top = set(np.argsort(p)[::-1][:10].tolist())  # independent top-10
  emb, present, age = c.lookup(u, a, now=1060)
  np.testing.assert_array_equal(present, [i in top for i in range(len(u))])
  idx = np.flatnonzero(present)
  np.testing.assert_array_equal(emb[idx], FakeFM.reference(u[idx], a[idx], 1000))  # = recompute
  np.testing.assert_array_equal(emb[~present], 0.0)
  np.testing.assert_array_equal(age[present], 60)
  s = c.stats()
  assert s["hit_rate"] == pytest.approx(0.1) and s["staleness_mean_s"] == 60
  assert s["total_evaluations"] == 10


def test_elastic_budget_and_dedup():
  rng = np.random.default_rng(1)
  fm = FakeFM()
  spare = {"n": 5}
  c = cache_lib.SpeculativeCache(fm, D, budget=lambda: spare["n"])
  u, a, p = _candidates(rng)
  c.refresh(u, a, p, now=0)
  spare["n"] = 30
  c.refresh(u, a, p, now=10)
  c.set_budget(0)
  c.refresh(u, a, p, now=20)
  assert fm.calls == [5, 30]
  assert len(c) == 30
  # duplicates of one pair cost one evaluation
  c.set_budget(3)
  c.refresh(np.array([1, 1, 1, 2]), np.array([5, 5, 5, 6]), np.array([0.9, 0.8, 0.95, 0.1]), 30)
  assert fm.calls[-1] == 2
  with pytest.raises(ValueError, match="budget"):
    c.set_budget(-1)


def test_expiry_capacity_and_skip_fresh():
  fm = FakeFM()
  c = cache_lib.SpeculativeCache(fm, D, budget=10, capacity=15, max_age=100, min_refresh_age=50)
  u1, a1 = np.arange(10), np.zeros(10, int)
  u2, a2 = np.arange(10, 20), np.zeros(10, int)
  c.refresh(u1, a1, np.linspace(0, 1, 10), now=0)
  c.refresh(u2, a2, np.ones(10), now=10)
  assert len(c) == 15
  _, p_new, _ = c.lookup(u2, a2, now=20)
  assert p_new.all()                                  # newest batch kept
  _, p_old, _ = c.lookup(u1, a1, now=20)
  np.testing.assert_array_equal(p_old, np.arange(10) >= 5)  # 5 most likely old ones kept
  _, p_exp, _ = c.lookup(u1, a1, now=101)
  assert not p_exp.any()                              # older than max_age -> miss
  _, p_before, _ = c.lookup(u2, a2, now=5)
  assert not p_before.any()                           # computed after `now` -> not visible
  n = len(fm.calls)
  c.refresh(u2, a2, np.ones(10), now=40)              # all younger than 50 s: nothing to do
  assert len(fm.calls) == n


def test_disk_store_warm_restart(tmp_path):
  rng = np.random.default_rng(2)
  u, a, p = _candidates(rng)
  c = cache_lib.SpeculativeCache(FakeFM(), D, budget=20, store_dir=str(tmp_path))
  c.refresh(u, a, p, now=100)
  c.refresh(u[::-1], a[::-1], p, now=200)
  want = c.lookup(u, a, now=300)
  c2 = cache_lib.SpeculativeCache(FakeFM(), D, budget=20, store_dir=str(tmp_path))
  got = c2.lookup(u, a, now=300)
  for w, g in zip(want, got, strict=True):
    np.testing.assert_array_equal(w, g)


def test_request_likelihood_decay():
  u = np.array([1, 1, 2, 3])
  a = np.array([5, 5, 5, 5])
  ts = np.array([0, 3600, 3600, 9000])
  uu, aa, s = cache_lib.request_likelihood(u, a, ts, now=3600, half_life=3600)
  np.testing.assert_array_equal(uu, [1, 2])
  np.testing.assert_array_equal(aa, [5, 5])
  np.testing.assert_allclose(s, [1.5, 1.0])
