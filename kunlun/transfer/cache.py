"""Solaris-style speculative pre-computation of FM embeddings (spec g.4).

The FM is too slow for the request path. Ahead of time, ``refresh`` takes predicted request
likelihoods of (user, ad) pairs and runs the FM on the most likely pairs, at most ``budget``
evaluations per refresh (the budget is elastic: ``set_budget`` or a callable read at every refresh,
e.g. from spare capacity). ``lookup`` serves cached embeddings; a miss (never computed, evicted, or
older than ``max_age``) returns ``present=False`` so the VM takes its non-FM path
(``kunlun.transfer.loopfm`` masks it). Hit rate, staleness of served entries and budget use are
tracked in ``stats()``.

Optional on-disk store: every refresh appends ``refresh_NNNNNN.npz`` (keys, ts, emb) to
``store_dir``; ``SpeculativeCache(..., store_dir=d)`` replays existing files on start (warm
restart).
"""

from __future__ import annotations

import glob
import os
from typing import Callable

import numpy as np

from kunlun.transfer.join import pair_key

ComputeFn = Callable[[np.ndarray, np.ndarray, int], np.ndarray]


def request_likelihood(user_id, ad_id, ts, now, half_life=3600.0):
  """Predicted request likelihood per (user, ad) from past requests (ERCache-like heuristic).

  Score = sum over past requests (ts <= now) of ``0.5 ** ((now - ts) / half_life)``.
  Returns ``(user i64[P], ad i64[P], score f32[P])`` over the distinct pairs seen.
  """
  ts = np.asarray(ts, np.float64)
  past = ts <= now
  keys = pair_key(np.asarray(user_id)[past], np.asarray(ad_id)[past])
  w = 0.5 ** ((now - ts[past]) / half_life)
  uniq, inv = np.unique(keys, return_inverse=True)
  score = np.bincount(inv, weights=w, minlength=len(uniq))
  return uniq >> 31, uniq & ((1 << 31) - 1), score.astype(np.float32)


class SpeculativeCache:
  """In-process cache of FM embeddings keyed by (user, ad).

  Args:
    compute_fn: ``(user i64[n], ad i64[n], now) -> f32[n, dim]``, one batched FM evaluation.
    dim: embedding width.
    budget: FM evaluations per refresh (int), or a zero-argument callable returning it.
    capacity: max entries kept (oldest computed evicted first, then least likely); None = no cap.
    max_age: entries older than this (seconds) are served as misses; None = never expire.
    min_refresh_age: a cached pair younger than this is not recomputed (saves budget); None
      recomputes every selected pair.
    store_dir: optional directory for the write-through on-disk store.
  """

  def __init__(self, compute_fn: ComputeFn, dim: int, budget: int | Callable[[], int], *,
               capacity: int | None = None, max_age: float | None = None,
               min_refresh_age: float | None = None, store_dir: str | None = None):
    self.compute_fn, self.dim, self.capacity = compute_fn, dim, capacity
    self.max_age, self.min_refresh_age = max_age, min_refresh_age
    self.set_budget(budget)
    self._keys = np.zeros(0, np.int64)       # sorted
    self._ts = np.zeros(0, np.int64)
    self._emb = np.zeros((0, dim), np.float32)
    self._score = np.zeros(0, np.float32)
    self.reset_stats()
    self.total_evaluations = 0
    self.refreshes = 0
    self.store_dir = store_dir
    if store_dir:
      os.makedirs(store_dir, exist_ok=True)
      for f in sorted(glob.glob(os.path.join(store_dir, "refresh_*.npz"))):
        with np.load(f) as z:
          self._insert(z["keys"], z["ts"], z["emb"], z["score"])
        self.refreshes += 1

  # ---- budget ---------------------------------------------------------------------------------
  def set_budget(self, budget):
    """Changes the per-refresh FM evaluation budget (takes effect at the next refresh)."""
    if not callable(budget) and (int(budget) != budget or budget < 0):
      raise ValueError(f"budget must be a non-negative int or a callable, got {budget!r}")
    self._budget = budget

  @property
  def budget(self) -> int:
    b = self._budget() if callable(self._budget) else self._budget
    if int(b) != b or b < 0:
      raise ValueError(f"budget callable returned {b!r}; need a non-negative int")
    return int(b)

  def __len__(self):
    return len(self._keys)

  # ---- pre-computation -------------------------------------------------------------------------
  def refresh(self, user_id, ad_id, likelihood, now: int) -> dict:
    """Pre-computes the most likely pairs within the budget. Returns what it did."""
    user_id, ad_id = np.asarray(user_id, np.int64), np.asarray(ad_id, np.int64)
    likelihood = np.asarray(likelihood, np.float32)
    if not user_id.shape == ad_id.shape == likelihood.shape:
      raise ValueError("refresh: user_id, ad_id and likelihood need the same shape, got "
                       f"{user_id.shape}, {ad_id.shape}, {likelihood.shape}")
    budget = self.budget
    keys = pair_key(user_id, ad_id)
    # distinct pairs, keeping each pair's highest likelihood
    order = np.lexsort((-likelihood, keys))
    first = np.ones(len(order), bool)
    first[1:] = keys[order][1:] != keys[order][:-1]
    keys, likelihood = keys[order][first], likelihood[order][first]
    if self.min_refresh_age is not None and len(self._keys):
      _, present, age = self._find(keys, now)
      fresh = present & (age < self.min_refresh_age)
      keys, likelihood = keys[~fresh], likelihood[~fresh]
    top = np.argsort(-likelihood, kind="stable")[:budget]
    keys, likelihood = keys[top], likelihood[top]
    n = len(keys)
    if n:
      emb = np.asarray(self.compute_fn(keys >> 31, keys & ((1 << 31) - 1), now), np.float32)
      if emb.shape != (n, self.dim):
        raise ValueError(f"compute_fn returned shape {emb.shape}, expected {(n, self.dim)}")
      ts = np.full(n, now, np.int64)
      self._insert(keys, ts, emb, likelihood)
      if self.store_dir:
        path = os.path.join(self.store_dir, f"refresh_{self.refreshes:06d}.npz")
        np.savez(path + ".tmp.npz", keys=keys, ts=ts, emb=emb, score=likelihood)
        os.replace(path + ".tmp.npz", path)
    self.total_evaluations += n
    self.refreshes += 1
    self.last_refresh = {"evaluated": n, "budget": budget,
                         "budget_use": n / budget if budget else 0.0, "size": len(self)}
    return self.last_refresh

  def _insert(self, keys, ts, emb, score):
    keep = ~np.isin(self._keys, keys)
    k = np.concatenate([self._keys[keep], keys])
    t = np.concatenate([self._ts[keep], ts])
    e = np.concatenate([self._emb[keep], emb])
    s = np.concatenate([self._score[keep], score])
    if self.capacity is not None and len(k) > self.capacity:
      survivors = np.lexsort((-s, -t))[:self.capacity]  # newest first, then most likely
      k, t, e, s = k[survivors], t[survivors], e[survivors], s[survivors]
    order = np.argsort(k)
    self._keys, self._ts, self._emb, self._score = k[order], t[order], e[order], s[order]

  # ---- serving ---------------------------------------------------------------------------------
  def _find(self, keys, now):
    i = np.clip(np.searchsorted(self._keys, keys), 0, max(len(self._keys) - 1, 0))
    present = (self._keys[i] == keys) if len(self._keys) else np.zeros(keys.shape, bool)
    age = np.where(present, now - self._ts[i] if len(self._keys) else 0, 0)
    present &= age >= 0  # an entry computed after `now` is not visible
    if self.max_age is not None:
      present &= age <= self.max_age
    return i, present, np.where(present, age, 0)

  def lookup(self, user_id, ad_id, now):
    """Serves cached embeddings: ``(emb f32[n, dim], present bool[n], age f32[n])``.

    ``now`` is a scalar or per-request times ``[n]``. Misses get zeros AND ``present=False``;
    the caller must take its non-FM path for them.
    """
    keys = pair_key(np.asarray(user_id).reshape(-1), np.asarray(ad_id).reshape(-1))
    now = np.broadcast_to(np.asarray(now, np.int64), keys.shape)
    i, present, age = self._find(keys, now)
    emb = np.zeros((len(keys), self.dim), np.float32)
    emb[present] = self._emb[i[present]]
    self._requests += len(keys)
    self._hits += int(present.sum())
    self._age_sum += float(age[present].sum())
    self._age_max = max(self._age_max, float(age[present].max()) if present.any() else 0.0)
    return emb, present, age.astype(np.float32)

  def augment(self, batch):
    """Adds ``fm_ctx [B, dim]``, ``fm_ctx_present [B]``, ``fm_ctx_age [B]`` to a copy of a batch
    (looked up at each example's ``request_ts``), the LoopFM context inputs."""
    emb, present, age = self.lookup(batch["user_id"], batch["ad_id"], batch["request_ts"])
    return {**batch, "fm_ctx": emb, "fm_ctx_present": present, "fm_ctx_age": age}

  def reset_stats(self):
    self._requests = self._hits = 0
    self._age_sum = self._age_max = 0.0
    self.last_refresh = {"evaluated": 0, "budget": 0, "budget_use": 0.0, "size": len(self)}

  def stats(self) -> dict:
    """Hit rate and staleness (seconds) of served entries since ``reset_stats``; budget use."""
    return {
        "requests": self._requests, "hits": self._hits,
        "hit_rate": self._hits / self._requests if self._requests else 0.0,
        "staleness_mean_s": self._age_sum / self._hits if self._hits else 0.0,
        "staleness_max_s": self._age_max,
        "size": len(self), "refreshes": self.refreshes, "total_evaluations": self.total_evaluations,
        **{f"last_refresh_{k}": v for k, v in self.last_refresh.items() if k != "size"},
    }
