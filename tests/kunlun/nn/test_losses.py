"""masked_bce against a numpy loop."""

import numpy as np
import pytest

from kunlun.nn.losses import masked_bce


def np_masked_bce(logits, labels, mask, w):
  B, K = logits.shape
  per = np.zeros(K)
  for k in range(K):
    vals = []
    for b in range(B):
      if mask[b, k]:
        p = 1.0 / (1.0 + np.exp(-float(logits[b, k])))
        y = labels[b, k]
        vals.append(-(y * np.log(p) + (1 - y) * np.log(1 - p)))
    per[k] = np.mean(vals) if vals else 0.0
  return float((w * per).sum()), per


def test_masked_bce_matches_numpy():
  rng = np.random.default_rng(0)
  B, K = 13, 3
  logits = rng.normal(size=(B, K)).astype(np.float32) * 3
  labels = (rng.uniform(size=(B, K)) < 0.4).astype(np.float32)
  mask = (rng.uniform(size=(B, K)) < 0.6).astype(np.float32)
  mask[:, 2] = 0.0                                    # a task with no valid label
  w = np.array([1.0, 0.5, 2.0], np.float32)
  loss, per = masked_bce(logits, labels, mask, w)
  ref_loss, ref_per = np_masked_bce(logits, labels, mask, w)
  np.testing.assert_allclose(np.asarray(per), ref_per, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
  assert float(per[2]) == 0.0


def test_masked_bce_is_stable_for_large_logits_and_checks_shapes():
  logits = np.array([[80.0, -80.0]], np.float32)
  loss, per = masked_bce(logits, np.array([[0.0, 1.0]]), np.ones((1, 2)))
  np.testing.assert_allclose(np.asarray(per), [80.0, 80.0], rtol=1e-5)
  with pytest.raises(ValueError, match="same"):
    masked_bce(np.zeros((2, 2)), np.zeros((2, 3)), np.ones((2, 2)))
  with pytest.raises(ValueError, match="task_weights"):
    masked_bce(np.zeros((2, 2)), np.zeros((2, 2)), np.ones((2, 2)), np.ones(3))
