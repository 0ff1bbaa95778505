"""Metrics against independent references (pairwise AUC count, explicit NE loops)."""

import math

import numpy as np
import pytest

from kunlun.train import metrics


def _pairwise_auc(p, y):
  pos = [a for a, t in zip(p, y, strict=False) if t == 1]
  neg = [a for a, t in zip(p, y, strict=False) if t == 0]
  s = 0.0
  for a in pos:
    for b in neg:
      s += 1.0 if a > b else 0.5 if a == b else 0.0
  return s / (len(pos) * len(neg))


def _loop_ne(p, y):
  ll = 0.0
  for a, t in zip(p, y, strict=False):
    a = min(max(a, 1e-7), 1 - 1e-7)
    ll -= t * math.log(a) + (1 - t) * math.log(1 - a)
  r = sum(y) / len(y)
  return (ll / len(y)) / -(r * math.log(r) + (1 - r) * math.log(1 - r))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auc_matches_pairwise_count_with_ties(seed):
  rng = np.random.default_rng(seed)
  p = np.round(rng.uniform(size=200), 1)  # many ties
  y = (rng.uniform(size=200) < p).astype(int)
  assert metrics.auc(p, y) == pytest.approx(_pairwise_auc(p, y), abs=1e-12)


def test_auc_mask_and_degenerate():
  p = np.array([0.1, 0.9, 0.5, 0.3])
  y = np.array([0, 1, 1, 0])
  w = np.array([1, 1, 0, 1])
  assert metrics.auc(p, y, w) == pytest.approx(_pairwise_auc(p[w > 0], y[w > 0]))
  assert math.isnan(metrics.auc(p, np.ones(4)))


def test_ne_matches_loop_and_base_rate_is_one():
  rng = np.random.default_rng(0)
  p = rng.uniform(0.01, 0.99, 300)
  y = (rng.uniform(size=300) < p).astype(float)
  assert metrics.ne(p, y) == pytest.approx(_loop_ne(p, y), rel=1e-9)
  base = np.full(300, y.mean())
  assert metrics.ne(base, y) == pytest.approx(1.0, rel=1e-6)
  w = (rng.uniform(size=300) < 0.5).astype(float)
  assert metrics.ne(p, y, w) == pytest.approx(_loop_ne(p[w > 0], y[w > 0]), rel=1e-9)


def test_calibration_and_task_record():
  p = np.array([0.2, 0.4, 0.6, 0.8])
  y = np.array([0, 1, 0, 1.0])
  assert metrics.calibration(p, y) == pytest.approx(0.5 / 0.5)
  rec = metrics.task_metrics(p, y, np.array([1, 1, 1, 0.0]), true_p_n=np.array([.1, .9, .1, .9]))
  assert rec["count"] == 3 and rec["positive_rate"] == pytest.approx(1 / 3)
  assert rec["calibration"] == pytest.approx((0.2 + 0.4 + 0.6) / 3 / (1 / 3))
  assert rec["bayes_ne"] == pytest.approx(_loop_ne([.1, .9, .1], [0, 1, 0]))
  assert metrics.task_metrics(p, y, np.ones(4), np.full(4, np.nan))["bayes_ne"] is None


def test_surface_split_and_accumulator_drop_padding():
  rng = np.random.default_rng(3)
  N, K = 400, 2
  prob = rng.uniform(0.05, 0.95, (N, K))
  labels = (rng.uniform(size=(N, K)) < prob).astype(np.float32)
  mask = np.ones((N, K), np.float32)
  mask[:, 1] = rng.uniform(size=N) < 0.5
  surf = rng.integers(0, 3, N)
  acc = metrics.EvalAccumulator(("a", "b", "c"), ("click", "conv"))
  for i in range(0, N, 64):  # last batch padded with garbage rows that example_mask removes
    sl = slice(i, i + 64)
    n = len(surf[sl])
    pad = 64 - n
    batch = {"labels": np.pad(labels[sl], ((0, pad), (0, 0)), constant_values=1),
             "label_mask": np.pad(mask[sl], ((0, pad), (0, 0)), constant_values=1),
             "surface": np.pad(surf[sl], (0, pad)),
             "example_mask": np.r_[np.ones(n), np.zeros(pad)]}
    acc.add(np.pad(prob[sl], ((0, pad), (0, 0)), constant_values=0.99), batch)
  assert acc.examples == N
  per, overall = acc.result()
  for s in range(3):
    sel = (surf == s) & (mask[:, 1] > 0)
    assert per["abc"[s]]["conv"]["ne"] == pytest.approx(_loop_ne(prob[sel, 1], labels[sel, 1]))
    assert per["abc"[s]]["conv"]["count"] == int(sel.sum())
  assert overall["click"]["auc"] == pytest.approx(_pairwise_auc(prob[:, 0], labels[:, 0]))
  assert overall["click"]["bayes_ne"] is None


def test_running_ne_equals_full_ne():
  rng = np.random.default_rng(1)
  p = rng.uniform(0.05, 0.95, (100, 2))
  y = (rng.uniform(size=(100, 2)) < 0.3).astype(float)
  r = metrics.RunningNE(("x", "y"))
  for i in range(0, 100, 25):
    sl = slice(i, i + 25)
    r.update([metrics.log_loss_sum(p[sl, k], y[sl, k]) for k in range(2)], y[sl].sum(0),
             np.full(2, 25))
  assert r.value()["y"] == pytest.approx(_loop_ne(p[:, 1], y[:, 1]))


def _saturated(seed=5, n=60):
  """f32 sigmoid probabilities with exact 0.0 / 1.0 (|logit| > ~17), half of them confidently
  wrong, for 2 tasks."""
  rng = np.random.default_rng(seed)
  logits = rng.normal(0, 2, (n, 2)).astype(np.float32)
  logits[:10] = [[40.0, -40.0]] * 10
  logits[10:20] = [[-120.0, 25.0]] * 10                    # exp overflows: p = 0.0 exactly
  with np.errstate(over="ignore"):
    p = (1 / (1 + np.exp(-logits))).astype(np.float32)
  assert (p == 1.0).sum() >= 20 and (p == 0.0).sum() >= 10
  y = (rng.uniform(size=(n, 2)) < 0.3).astype(np.float32)
  y[:5], y[10:15] = [[0, 1]] * 5, [[1, 0]] * 5                  # wrong at p = 1 and p = 0
  y[5:10], y[15:20] = [[1, 0]] * 5, [[0, 1]] * 5                 # right at p = 1 and p = 0
  return p, y


def _loop_ne64(p, y):
  return _loop_ne(np.asarray(p, np.float64).tolist(), np.asarray(y, np.float64).tolist())


def test_ne_with_saturated_probabilities_is_finite_for_both_tasks():
  p, y = _saturated()
  for k in range(2):
    got = metrics.ne(p[:, k], y[:, k])
    assert math.isfinite(got) and got == pytest.approx(_loop_ne64(p[:, k], y[:, k]), rel=1e-9)
  acc = metrics.EvalAccumulator(("a",), ("click", "conv"))
  acc.add(p, {"labels": y, "label_mask": np.ones_like(y), "surface": np.zeros(len(y), int)})
  per, overall = acc.result()
  for k, t in enumerate(("click", "conv")):
    assert overall[t]["ne"] == pytest.approx(_loop_ne64(p[:, k], y[:, k]), rel=1e-9)
    assert per["a"][t]["ne"] == overall[t]["ne"]


def test_running_ne_with_saturated_probabilities_and_reset():
  p, y = _saturated()
  r = metrics.RunningNE(("click", "conv"))
  for sl in (slice(0, 25), slice(25, 60)):
    r.update([metrics.log_loss_sum(p[sl, k], y[sl, k]) for k in range(2)], y[sl].sum(0),
             np.full(2, sl.stop - sl.start))
  for k, t in enumerate(("click", "conv")):
    assert r.value()[t] == pytest.approx(_loop_ne64(p[:, k], y[:, k]), rel=1e-9)
  r.reset()
  sl = slice(0, 30)                        # a new window: only its examples count
  r.update([metrics.log_loss_sum(p[sl, k], y[sl, k]) for k in range(2)], y[sl].sum(0),
           np.full(2, 30))
  for k, t in enumerate(("click", "conv")):
    v = r.value()[t]
    assert math.isfinite(v) and v == pytest.approx(_loop_ne64(p[sl, k], y[sl, k]), rel=1e-9)
