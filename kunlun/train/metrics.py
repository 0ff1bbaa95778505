"""Ranking metrics: NE, AUC, calibration, per surface x task, and a running NE for training.

All functions take host numpy arrays. Shapes: ``p_n`` predicted probabilities, ``y_n`` 0/1
labels, ``w_n`` 0/1 weights (validity mask) of the same length N.
"""

from __future__ import annotations

import numpy as np

EPS = 1e-7


def _entropy(rate: float) -> float:
  if rate <= 0.0 or rate >= 1.0:
    return 0.0
  return float(-(rate * np.log(rate) + (1 - rate) * np.log(1 - rate)))


def log_loss_sum(p_n, y_n, w_n=None) -> float:
  """Sum of weighted binary cross-entropies (natural log), probabilities clipped to [EPS, 1-EPS]."""
  p = np.clip(np.asarray(p_n, np.float64), EPS, 1 - EPS)
  y = np.asarray(y_n, np.float64)
  w = np.ones_like(y) if w_n is None else np.asarray(w_n, np.float64)
  return float(-np.sum(w * (y * np.log(p) + (1 - y) * np.log(1 - p))))


def ne_from_sums(loss_sum: float, pos_sum: float, count: float) -> float:
  """NE = mean log-loss / entropy of the window's positive rate (nan if undefined)."""
  if count <= 0:
    return float("nan")
  h = _entropy(pos_sum / count)
  return float(loss_sum / count / h) if h > 0 else float("nan")


def ne(p_n, y_n, w_n=None) -> float:
  """Normalized entropy (He et al. 2014); lower is better, 1.0 = base-rate predictor."""
  y = np.asarray(y_n, np.float64)
  w = np.ones_like(y) if w_n is None else np.asarray(w_n, np.float64)
  return ne_from_sums(log_loss_sum(p_n, y, w), float(np.sum(w * y)), float(np.sum(w)))


def auc(p_n, y_n, w_n=None) -> float:
  """ROC AUC by the rank-sum (Mann-Whitney) statistic, ties get the average rank; nan if one class
  is absent. Weights must be 0/1 (they select examples)."""
  p = np.asarray(p_n, np.float64)
  y = np.asarray(y_n, np.float64)
  if w_n is not None:
    keep = np.asarray(w_n) > 0
    p, y = p[keep], y[keep]
  n_pos = float(np.sum(y > 0.5))
  n_neg = float(len(y) - n_pos)
  if n_pos == 0 or n_neg == 0:
    return float("nan")
  order = np.argsort(p, kind="mergesort")
  p_sorted = p[order]
  ranks = np.empty(len(p), np.float64)
  # average ranks (1-based) over runs of equal scores
  starts = np.flatnonzero(np.r_[True, p_sorted[1:] != p_sorted[:-1]])
  ends = np.r_[starts[1:], len(p)]
  avg = (starts + ends + 1) / 2.0
  ranks[order] = np.repeat(avg, ends - starts)
  return float((np.sum(ranks[y > 0.5]) - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def calibration(p_n, y_n, w_n=None) -> float:
  """Mean prediction / observed positive rate (1.0 = calibrated; nan without positives)."""
  p = np.asarray(p_n, np.float64)
  y = np.asarray(y_n, np.float64)
  w = np.ones_like(y) if w_n is None else np.asarray(w_n, np.float64)
  pos = np.sum(w * y)
  return float(np.sum(w * p) / pos) if pos > 0 else float("nan")


def task_metrics(p_n, y_n, w_n, true_p_n=None) -> dict:
  """The eval record for one (surface, task) cell: ne, auc, calibration, count, positive_rate,
  bayes_ne (NE of the planted probabilities, None when they are unknown / NaN)."""
  w = np.asarray(w_n, np.float64)
  y = np.asarray(y_n, np.float64)
  count = int(np.sum(w > 0))
  bayes = None
  if true_p_n is not None and count:
    tp = np.asarray(true_p_n, np.float64)[w > 0]
    if np.all(np.isfinite(tp)):
      bayes = _none_if_nan(ne(tp, y[w > 0]))
  return {
      "ne": _none_if_nan(ne(p_n, y, w)),
      "auc": _none_if_nan(auc(p_n, y, w)),
      "calibration": _none_if_nan(calibration(p_n, y, w)),
      "count": count,
      "positive_rate": float(np.sum(w * y) / count) if count else None,
      "bayes_ne": bayes,
  }


def _none_if_nan(x):
  return None if x is None or not np.isfinite(x) else float(x)


def surface_task_metrics(prob_nk, labels_nk, label_mask_nk, surface_n, surfaces, tasks,
                         true_prob_nk=None) -> tuple[dict, dict]:
  """Per surface x task and overall (per task) metrics over N examples and K tasks.

  Returns ``(metrics[surface][task], overall[task])``, each leaf a ``task_metrics`` record.
  """
  per_surface = {}
  for s_idx, s in enumerate(surfaces):
    sel = np.asarray(surface_n) == s_idx
    per_surface[s] = {
        t: task_metrics(prob_nk[sel, k], labels_nk[sel, k], label_mask_nk[sel, k],
                        None if true_prob_nk is None else true_prob_nk[sel, k])
        for k, t in enumerate(tasks)}
  overall = {
      t: task_metrics(prob_nk[:, k], labels_nk[:, k], label_mask_nk[:, k],
                      None if true_prob_nk is None else true_prob_nk[:, k])
      for k, t in enumerate(tasks)}
  return per_surface, overall


class EvalAccumulator:
  """Collects masked eval batches on the host; ``result()`` computes the metric tables."""

  def __init__(self, surfaces, tasks):
    self.surfaces, self.tasks = tuple(surfaces), tuple(tasks)
    self._parts = {"prob": [], "labels": [], "label_mask": [], "true_prob": [], "surface": []}

  def add(self, prob_bk, batch: dict):
    """``prob_bk`` f32[B, K]; ``batch`` host numpy with labels, label_mask, surface, example_mask
    and optionally true_prob. Rows with example_mask == 0 (padding) are dropped."""
    keep = np.asarray(batch.get("example_mask", np.ones(len(prob_bk)))) > 0
    self._parts["prob"].append(np.asarray(prob_bk, np.float64)[keep])
    self._parts["labels"].append(np.asarray(batch["labels"])[keep])
    self._parts["label_mask"].append(np.asarray(batch["label_mask"])[keep])
    self._parts["surface"].append(np.asarray(batch["surface"])[keep])
    tp = batch.get("true_prob")
    self._parts["true_prob"].append(
        np.full(prob_bk.shape, np.nan)[keep] if tp is None else np.asarray(tp, np.float64)[keep])

  @property
  def examples(self) -> int:
    return int(sum(len(x) for x in self._parts["surface"]))

  def arrays(self) -> dict:
    K = len(self.tasks)
    empty = {"prob": (0, K), "labels": (0, K), "label_mask": (0, K), "true_prob": (0, K),
             "surface": (0,)}
    return {k: np.concatenate(v) if v else np.zeros(empty[k]) for k, v in self._parts.items()}

  def result(self) -> tuple[dict, dict]:
    a = self.arrays()
    return surface_task_metrics(a["prob"], a["labels"], a["label_mask"], a["surface"],
                                self.surfaces, self.tasks, a["true_prob"])


class RunningNE:
  """Per-task NE over the examples seen since the last ``reset`` (the training log window).

  Feed it the per-task sums a train step returns: ``loss_sum f[K]``, ``pos_sum f[K]``,
  ``count f[K]`` (log-loss, positives and valid labels of the batch).
  """

  def __init__(self, tasks):
    self.tasks = tuple(tasks)
    self.reset()

  def reset(self):
    K = len(self.tasks)
    self.loss, self.pos, self.count = np.zeros(K), np.zeros(K), np.zeros(K)

  def update(self, loss_sum_k, pos_sum_k, count_k):
    self.loss += np.asarray(loss_sum_k, np.float64)
    self.pos += np.asarray(pos_sum_k, np.float64)
    self.count += np.asarray(count_k, np.float64)

  def value(self) -> dict[str, float]:
    return {t: ne_from_sums(self.loss[k], self.pos[k], self.count[k])
            for k, t in enumerate(self.tasks)}
