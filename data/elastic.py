"""Batch iterators whose state does not depend on the number of data-loading processes.

The training stream is defined globally, independent of ``shard_count``::

    global position p = 0, 1, 2, ...      (one example each; global step t = positions
                                           [t * G, (t + 1) * G), G = global batch size)
    surface(p)  = weighted choice by hash(seed, p) over the surfaces with weight > 0
    i(p)        = number of earlier positions of the same surface (per-surface counter)
    record(p)   = epoch-e permutation of surface(p)'s records at i(p) % N_s, e = i(p) // N_s
    process k of K reads positions [t * G + k * B, t * G + (k + 1) * B), B = G / K

The iterator state is ``{"position": p, "consumed": {surface: i}}`` plus bookkeeping, the same
in every process, so a checkpoint written with K processes restores with any K' (and any global
batch size): the examples after the restore are exactly the ones an uninterrupted run would have
produced from that position on (elastic bound: 0 repeated, 0 skipped examples). Surface weights
may change on resume (the counters carry over). Invalid records (``skip_invalid``) keep their row
with ``example_mask`` 0, so every process always yields full batches at fixed positions.

Eval (``EvalPlan``): local row j of process k is global record ``k + j * K``; finite.

``BatchIterDataset`` supports ``mp_prefetch``: worker w of W produces the steps ``w, w + W, ...``
(it follows the cheap mixing plan of every step and loads only its own). The per-iterator state
also carries the skipped-record counts of the batches it produced (``invalid``) and the events
dropped over a jagged capacity (``dropped``), so the parent of ``mp_prefetch`` workers can add
them up from its state (``data.pipeline.invalid_counts`` / ``dropped_events``).
``CheckpointSave`` / ``CheckpointRestore`` (orbax args) restore a state written under another
process count: a process without its own file reads process 0's (or any other process's).
(Why not grain's own elastic iterator: data/README.md, "Pipeline".)
"""

from __future__ import annotations

import collections
import concurrent.futures
import copy
import dataclasses
import json
import sys

import grain
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from grain._src.core import sharding

from data.hashing import mix64

_MASK = (1 << 64) - 1


def _mix_int(x: int) -> int:
  x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
  x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
  return x ^ (x >> 31)


def _key(*parts: int) -> int:
  """A 64-bit key derived from integers (Python ints)."""
  h = 0x243F6A8885A308D3
  for p in parts:
    h = _mix_int(h ^ (int(p) & _MASK))
  return h


def permute(i: np.ndarray, n, key, rounds: int = 4) -> np.ndarray:
  """Keyed bijections of ``[0, n)`` applied to ``i`` (vectorised Feistel + cycle walking).

  ``n`` and ``key`` (uint64) are scalars or per-element arrays (one permutation per distinct
  (n, key)). O(1) memory: no permutation table, so it scales to billions of records.
  """
  i = np.asarray(i, np.int64)
  n = np.broadcast_to(np.asarray(n, np.int64), i.shape)
  key = np.broadcast_to(np.asarray(key, np.uint64), i.shape)
  uniq, inv = np.unique(n, return_inverse=True)
  bits = np.array([int(max(v, 2) - 1).bit_length() for v in uniq.tolist()], np.int64)[inv]
  h = np.maximum((bits.reshape(n.shape) + 1) // 2, 1).astype(np.uint64)   # 4**h >= n, < 4n
  mask = (np.uint64(1) << h) - np.uint64(1)
  keys = [mix64(key + np.uint64(0x9E3779B97F4A7C15 * (r + 1) % 2**64)) for r in range(rounds)]

  def once(x, sel):
    hs, ms = h[sel], mask[sel]
    left, right = x >> hs, x & ms
    for k in keys:
      left, right = right, left ^ (mix64(right + k[sel]) & ms)
    return (left << hs) | right

  x = i.astype(np.uint64)
  todo = np.flatnonzero(n > 1)
  while len(todo):
    x[todo] = once(x[todo], todo)
    todo = todo[x[todo] >= n[todo].astype(np.uint64)]
  return np.where(n > 1, x.astype(np.int64), 0)


def uniform(seed: int, positions: np.ndarray) -> np.ndarray:
  """f64 in [0, 1) per global position (counter-based, stateless)."""
  h = mix64(np.asarray(positions, np.uint64) ^ np.uint64(_key(seed, 0x5EED)))
  return (h >> np.uint64(11)).astype(np.float64) * 2.0**-53


# ---- plans: state -> (local rows, next state) --------------------------------------------------

@dataclasses.dataclass
class Rows:
  """Local rows of one step: ``source`` i64[B] (-1 = padding) and record index i64[B]."""
  source: np.ndarray
  index: np.ndarray


class TrainPlan:
  """Global weighted mixing over per-surface shuffled, repeated record streams (module doc)."""

  def __init__(self, sizes: dict[str, int], weights: dict[str, float], seed: int,
               global_batch: int, shard_index: int, shard_count: int):
    self.names = list(sizes)                      # all surfaces of the schema, in order
    self.sizes = np.array([sizes[s] for s in self.names], np.int64)
    w = np.array([max(float(weights.get(s, 0.0)), 0.0) for s in self.names])
    self.active = np.flatnonzero(w > 0)
    self.cum = np.cumsum(w[self.active]) / w[self.active].sum()
    self.seed, self.G = int(seed), int(global_batch)
    self.k, self.K = int(shard_index), int(shard_count)
    self.B = self.G // self.K
    self._surface_key = mix64(np.array([_key(self.seed, s) for s in range(len(self.names))],
                                       np.uint64))

  def initial_state(self) -> dict:
    return {"position": 0, "consumed": {s: 0 for s in self.names}}

  def step(self, state: dict, rows: bool = True):
    p0 = int(state["position"])
    u = uniform(self.seed, np.arange(p0, p0 + self.G, dtype=np.uint64))
    pick = self.active[np.minimum(np.searchsorted(self.cum, u, side="right"),
                                  len(self.active) - 1)]
    consumed = dict(state["consumed"])
    within = np.empty(self.G, np.int64)
    for s in np.unique(pick).tolist():
      sel = pick == s
      name = self.names[s]
      within[sel] = consumed.get(name, 0) + np.arange(int(sel.sum()))
      consumed[name] = consumed.get(name, 0) + int(sel.sum())
    nxt = {"position": p0 + self.G, "consumed": consumed}
    if not rows:
      return None, nxt
    lo = self.k * self.B
    src, i = pick[lo:lo + self.B], within[lo:lo + self.B]
    n = self.sizes[src]
    epoch, r = i // n, i % n
    key = mix64(self._surface_key[src] ^ mix64(epoch.astype(np.uint64)))
    index = permute(r, n, key)
    return Rows(src.astype(np.int64), index), nxt


class EvalPlan:
  """Every record once, in order; local row j of process k = record ``k + j * K`` (or pad)."""

  def __init__(self, size: int, batch: int, shard_index: int, shard_count: int):
    self.n, self.B, self.k, self.K = int(size), int(batch), int(shard_index), int(shard_count)
    rows = -(-self.n // self.K)                 # rows of the largest process
    self.num_batches = -(-rows // self.B)

  def initial_state(self) -> dict:
    return {"step": 0}

  def step(self, state: dict, rows: bool = True):
    t = int(state["step"])
    if t >= self.num_batches:
      return None, None
    nxt = {"step": t + 1}
    if not rows:
      return None, nxt
    g = self.k + (t * self.B + np.arange(self.B, dtype=np.int64)) * self.K
    real = g < self.n
    return Rows(np.where(real, 0, -1), np.where(real, g, 0)), nxt


# ---- dataset / iterator -------------------------------------------------------------------------

class BatchIterDataset(grain.IterDataset):
  """``plan`` decides the rows of every step, ``load(rows) -> (batch, invalid_counts[,
  dropped_counts])`` builds the batch. Threads: ``num_threads`` loaders, up to ``prefetch``
  batches in flight."""

  def __init__(self, plan, load, *, num_threads: int = 2, prefetch: int = 4,
               shard_index: int = 0, shard_count: int = 1):
    super().__init__()
    self.plan, self.load = plan, load
    self.num_threads, self.prefetch = max(int(num_threads), 1), max(int(prefetch), 0)
    self.shard = (int(shard_index), int(shard_count))
    self.stride, self.offset = 1, 0

  def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
    """``mp_prefetch`` worker slice: steps ``start, start + step, ...``."""
    del sequential_slice
    self.offset, self.stride = sl.start or 0, sl.step or 1

  def __iter__(self):
    return BatchIterator(self)

  def __str__(self):
    return f"BatchIterDataset({type(self.plan).__name__}, stride={self.stride})"


class BatchIterator(grain.DatasetIterator):
  """State: the plan's state at the next step to produce (global: same in every process), the
  skipped-record and dropped-event counts of the batches produced so far and the shard it was
  written by."""

  def __init__(self, ds: BatchIterDataset):
    super().__init__()
    self.ds = ds
    self._pool = None
    self._inflight = collections.deque()          # (future, plan state after that step)
    self._invalid: dict[str, int] = {}
    self._dropped: dict[str, int] = {}
    st = ds.plan.initial_state()
    for _ in range(ds.offset):
      st = ds.plan.step(st, rows=False)[1]
      if st is None:
        break
    self._next = st                                 # plan state of the next step to produce
    self._sched = st                                # plan state of the next step to schedule

  # -- scheduling --
  def _schedule_one(self) -> bool:
    if self._sched is None:
      return False
    rows, nxt = self.ds.plan.step(self._sched)
    if rows is None:
      self._sched = None
      return False
    for _ in range(self.ds.stride - 1):           # other mp_prefetch workers' steps: plan only
      if nxt is None:
        break
      nxt = self.ds.plan.step(nxt, rows=False)[1]
    if self.ds.prefetch:
      if self._pool is None:
        self._pool = concurrent.futures.ThreadPoolExecutor(self.ds.num_threads)
      fut = self._pool.submit(self.ds.load, rows)
    else:
      fut = concurrent.futures.Future()
      fut.set_result(self.ds.load(rows))
    self._inflight.append((fut, nxt))
    self._sched = nxt
    return True

  def __next__(self):
    self._assert_not_closed()
    while len(self._inflight) < max(self.ds.prefetch, 1) and self._schedule_one():
      pass
    if not self._inflight:
      raise StopIteration
    fut, nxt = self._inflight.popleft()
    batch, invalid, *dropped = fut.result()
    for counts, new in ((self._invalid, invalid), (self._dropped, dropped[0] if dropped else {})):
      for k, v in new.items():
        counts[k] = counts.get(k, 0) + int(v)
    self._next = nxt
    return batch

  # -- state --
  def get_state(self) -> dict:
    k, K = self.ds.shard
    return {"plan": copy.deepcopy(self._next), "invalid": dict(self._invalid),
            "dropped": dict(self._dropped), "shard_index": k, "shard_count": K,
            "exhausted": int(self._next is None)}

  def set_state(self, state: dict) -> None:
    want = sorted(self.ds.plan.initial_state())
    if not isinstance(state, dict) or "plan" not in state or (
        state["plan"] is not None and sorted(state["plan"]) != want):
      got = sorted(state) if isinstance(state, dict) else type(state).__name__
      raise ValueError(f"data iterator state with keys {got} does not fit this pipeline "
                       f"({type(self.ds.plan).__name__}, plan keys {want}): written by another "
                       "pipeline version or for another split / mode?")
    self._cancel()
    k, K = self.ds.shard
    same_shard = (state.get("shard_index"), state.get("shard_count")) == (k, K)
    if not same_shard:
      logging.info("data iterator: elastic restore from shard %s/%s to %d/%d (skip counts "
                   "restart at 0)", state.get("shard_index"), state.get("shard_count"), k, K)
    self._invalid = dict(state.get("invalid", {})) if same_shard else {}
    self._dropped = dict(state.get("dropped", {})) if same_shard else {}
    plan_state = None if state.get("exhausted") else copy.deepcopy(state["plan"])
    self._next = self._sched = plan_state

  def _cancel(self):
    for fut, _ in self._inflight:
      fut.cancel()
    self._inflight.clear()

  def close(self) -> None:
    if self._closed:
      return
    self._cancel()
    if self._pool is not None and not sys.is_finalizing():  # at exit the pool is torn down anyway
      self._pool.shutdown(wait=False, cancel_futures=True)
    super().close()


def iterator_states(state) -> list[dict]:
  """The ``BatchIterator`` states inside a (possibly ``mp_prefetch``) iterator state."""
  found = []

  def walk(x):
    if isinstance(x, dict):
      if "plan" in x and "invalid" in x:
        found.append(x)
        return
      for v in x.values():
        walk(v)
    elif isinstance(x, (list, tuple)):
      for v in x:
        walk(v)

  walk(state)
  return found


def global_state(state) -> dict:
  """A plain ``BatchIterator`` state equivalent to ``state``, e.g. one of ``mp_prefetch`` with
  any number of workers: the earliest step not yet produced (worker w of W holds steps
  w, w + W, ...) and the skip counts of all workers. Restores a run under another worker count
  (into an iterator without ``mp_prefetch``)."""
  its = iterator_states(state)
  if not its:
    raise ValueError("no data iterator state found (not written by data.pipeline.make_dataset?)")
  live = [s for s in its if s["plan"] is not None and not s.get("exhausted")]
  key = lambda s: s["plan"].get("position", s["plan"].get("step", 0))
  out = dict(min(live, key=key)) if live else dict(its[0], plan=None, exhausted=1)
  for key in ("invalid", "dropped"):          # states written before "dropped" existed: {}
    total: dict[str, int] = {}
    for s in its:
      for k, v in s.get(key, {}).items():
        total[k] = total.get(k, 0) + int(v)
    out[key] = total
  return copy.deepcopy(out)


# ---- orbax: restore a state written under another process count --------------------------------

class ElasticCheckpointHandler(grain.checkpoint.CheckpointHandler):
  """grain's handler (one ``process_<i>-of-<n>.json`` per process); a restore that finds no file
  for this process reads process 0's of the saved process count, else any process's (the plan
  state is global)."""

  def restore(self, directory, item=None, args=None):
    item = item or args.item
    i, n = sharding.get_process_index_and_count()
    own = directory / f"process_{i}-of-{n}.json"
    if own.exists():
      return super().restore(directory, item=item)
    files = (sorted(directory.glob("process_0-of-*.json"))   # any process's state would do
             or sorted(directory.glob("process_*-of-*.json")))
    if not files:
      raise ValueError(f"no data iterator state (process_*-of-*.json) in {directory}")
    item.set_state(json.loads(files[0].read_text()))
    return item


try:

  @ocp.args.register_with_handler(ElasticCheckpointHandler, for_save=True)
  @dataclasses.dataclass
  class CheckpointSave(ocp.args.CheckpointArgs):
    item: object

  @ocp.args.register_with_handler(ElasticCheckpointHandler, for_restore=True)
  @dataclasses.dataclass
  class CheckpointRestore(ocp.args.CheckpointArgs):
    item: object
except ImportError:  # orbax is optional for the data pipeline
  pass
