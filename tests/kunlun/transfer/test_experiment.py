"""Serving a time window through the speculative cache (experiment.serve_through_cache)."""

import numpy as np
import pytest

from kunlun.transfer import experiment as ex


def _window(n=600, seed=0, span=6 * 3600):
  rng = np.random.default_rng(seed)
  user = rng.choice(100_000, n, replace=False)        # distinct pairs
  ad = rng.integers(0, 500, n)
  ts = np.sort(rng.integers(1_000_000, 1_000_000 + span, n))
  emb = rng.normal(size=(n, 3)).astype(np.float32)
  return user, ad, ts, emb


def test_perfect_predictor_with_enough_budget_serves_every_request_exactly():
  user, ad, ts, emb = _window()
  e, present, age, st = ex.serve_through_cache(user, ad, ts, emb, budget_frac=3.0, noise=0.0,
                                               refresh_s=3600)
  assert present.all() and st["hit_rate"] == 1.0
  np.testing.assert_array_equal(e, emb)
  start = ts.min() + (ts - ts.min()) // 3600 * 3600     # pre-computed at its interval's start
  np.testing.assert_array_equal(age, ts - start)
  assert st["staleness_max_s"] < 3600


def test_zero_budget_is_all_misses_and_hits_grow_with_budget():
  user, ad, ts, emb = _window(seed=1)
  e, present, _, st = ex.serve_through_cache(user, ad, ts, emb, budget_frac=0.0)
  assert not present.any() and st["total_evaluations"] == 0
  assert (e == 0).all()                                   # misses carry no value
  rates = [ex.serve_through_cache(user, ad, ts, emb, budget_frac=f, seed=1)[3]["hit_rate"]
           for f in (0.25, 0.5, 1.0, 2.5)]
  assert all(a < b for a, b in zip(rates, rates[1:], strict=False)), rates
  assert rates[-1] > 0.95


@pytest.mark.parametrize("frac", [0.3, 1.0])
def test_budget_is_respected_and_hits_are_correct(frac):
  user, ad, ts, emb = _window(seed=2)
  e, present, age, st = ex.serve_through_cache(user, ad, ts, emb, budget_frac=frac, seed=3)
  n_int = int((ts.max() - ts.min()) // 3600) + 1
  assert st["total_evaluations"] <= st["budget_per_refresh"] * n_int
  assert st["budget_per_refresh"] == round(frac * len(ts) / n_int)
  np.testing.assert_array_equal(e[present], emb[present])   # a hit is that request's embedding
  assert (age[present] >= 0).all() and (age[present] < 3600).all()
  assert 0 < present.mean() < 1


def _features(fm_cutoff=None):
  from kunlun.transfer.join import AsOfIndex, EmbeddingLog, pair_key
  user, ad, ts = np.array([1, 2, 3]), np.array([10, 20, 30]), np.array([100, 200, 300])
  emb = np.arange(6, dtype=np.float32).reshape(3, 2)
  log = EmbeddingLog(user, ad, ts, emb)
  logits = AsOfIndex(pair_key(user, ad), ts, np.zeros((3, 2), np.float32))
  batch = {"user_id": user, "ad_id": ad, "request_ts": ts,
           "events": {"click": {"item": np.zeros((3, 2), np.int32),
                                "age": np.ones((3, 2), np.float32),
                                "length": np.array([2, 1, 0])}}}
  return ex.FMFeatures(log, logits, join_key="user", fm_cutoff=fm_cutoff), batch


def test_ctx_dropout_masks_context_but_not_the_join_statistics():
  f, batch = _features()
  full = f.loopfm(batch, ["click"])
  assert full["fm_ctx_present"].all()
  np.testing.assert_array_equal(full["fm_ctx"], np.arange(6).reshape(3, 2))
  dropped = f.loopfm(batch, ["click"], ctx_dropout=1.0, rng=np.random.default_rng(0))
  assert not dropped["fm_ctx_present"].any()
  assert f.present_rates()["ctx"] == 1.0        # the log had every context embedding


def test_staleness_is_time_since_the_fm_window_ended():
  f, batch = _features(fm_cutoff=150)
  np.testing.assert_array_equal(f.staleness(batch), [0, 50, 150])
  f0, _ = _features()
  np.testing.assert_array_equal(f0.staleness(batch), [0, 0, 0])
