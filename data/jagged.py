"""The packed ("jagged") layout of one event tower (issue #28), numpy only.

Padded ``{field: [B, T, ...]}`` + ``lengths[B]`` -> packed ``{field: [N, ...]}`` at a static
capacity N: the examples' real events back to back, then padding; ``offsets i32[B+1]``,
``seg i32[N]`` (example of each token, B for padding), ``pos i32[N]`` (index in its example).
A batch over N drops the oldest events of the longest histories (``fit_lengths``), counted.
Sharded (``pack_blocks``, S batch shards): S consecutive blocks, each such a buffer of N / S
tokens for its B / S examples; ``offsets i32[S (B/S + 1)]``, ``seg`` local to the block.
"""

from __future__ import annotations

import sys
import threading

import numpy as np


def _check_lengths(lengths, max_len: int | None = None) -> np.ndarray:
  L = np.asarray(lengths)
  if L.ndim != 1 or not np.issubdtype(L.dtype, np.integer):
    raise ValueError(f"lengths must be a 1-d integer array, got {L.dtype}{list(L.shape)}")
  L = L.astype(np.int64)
  if len(L) and (L.min() < 0 or (max_len is not None and L.max() > max_len)):
    raise ValueError(f"lengths must be in [0, {max_len if max_len is not None else 'inf'}], "
                     f"got min {L.min()} max {L.max()}")
  return L


def _check_capacity(capacity) -> int:
  if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 0:
    raise ValueError(f"jagged capacity must be an int >= 0, got {capacity!r}")
  return int(capacity)


def fit_lengths(lengths, capacity: int) -> np.ndarray:
  """i64[B] events kept per example so that their sum is <= ``capacity``.

  Fits: all of them. Else the largest cap c with sum(min(len, c)) <= capacity, keep min(len, c),
  then one more event each to the ``capacity - sum`` longest histories still above c (ties: the
  lower example index), so the buffer is exactly full. Which events: the most recent ones.
  """
  L = _check_lengths(lengths)
  N = _check_capacity(capacity)
  if L.sum() <= N:
    return L
  srt = np.sort(L)
  c = np.arange(int(srt[-1]) + 1)
  below = np.searchsorted(srt, c, side="left")             # examples with len < c
  prefix = np.concatenate([[0], np.cumsum(srt)])
  total = prefix[below] + c * (len(L) - below)             # sum(min(len, c)), non-decreasing
  cap = int(np.searchsorted(total, N, side="right")) - 1   # largest c with total <= N
  keep = np.minimum(L, cap)
  room = N - int(total[cap])                                # < #(len > cap)
  longer = np.flatnonzero(L > cap)
  extra = longer[np.argsort(-L[longer], kind="stable")[:room]]
  keep[extra] += 1
  return keep


def pack_events(events: dict, lengths, capacity: int):
  """One tower, padded -> packed.

  ``events``: {field: [B, T, ...]} (valid events in ``[0, length)`` of each row, oldest first);
  ``lengths``: [B]. Returns ``(packed {field: [N, ...]}, offsets i32[B+1], seg i32[N],
  pos i32[N], dropped)``; padding tokens are 0. An overflowing example keeps its most recent
  events, re-indexed from 0 (as if its padded row had been truncated); ``dropped`` counts the rest.
  """
  if not events:
    raise ValueError("pack_events: no event fields")
  shapes = {k: np.shape(v) for k, v in events.items()}
  B, T = next(iter(shapes.values()))[:2]
  bad = {k: s for k, s in shapes.items() if len(s) < 2 or s[:2] != (B, T)}
  if bad:
    raise ValueError(f"pack_events: event fields must share the leading [B, T] = [{B}, {T}], "
                     f"got {bad}")
  L = _check_lengths(lengths, T)
  if len(L) != B:
    raise ValueError(f"pack_events: {len(L)} lengths for a batch of {B}")
  N = _check_capacity(capacity)
  keep = fit_lengths(L, N)
  offsets = np.concatenate([[0], np.cumsum(keep)]).astype(np.int32)
  n = int(offsets[-1])
  seg = np.full(N, B, np.int32)
  seg[:n] = np.repeat(np.arange(B, dtype=np.int32), keep)
  pos = np.zeros(N, np.int32)
  pos[:n] = np.arange(n) - offsets[seg[:n]]
  col = pos[:n] + (L - keep)[seg[:n]]                      # source column in the padded row
  packed = {}
  for k, v in events.items():
    v = np.asarray(v)
    out = np.zeros((N,) + v.shape[2:], v.dtype)
    out[:n] = v[seg[:n], col]
    packed[k] = out
  return packed, offsets, seg, pos, int(L.sum() - keep.sum())


def check_shards(shards, batch: int = 0, capacity: int = 0) -> int:
  """``shards`` as an int S >= 1 dividing ``batch`` and ``capacity`` (else a one-line
  ValueError)."""
  if isinstance(shards, bool) or not isinstance(shards, (int, np.integer)) or shards < 1:
    raise ValueError(f"jagged shards must be an int >= 1, got {shards!r}")
  if batch % shards or capacity % shards:
    what = f"a batch of {batch} examples" + (f" at capacity {capacity}" if capacity else "")
    raise ValueError(f"jagged shards: {what} does not split into {shards} blocks (multiples of "
                     f"{shards} needed)")
  return int(shards)


def pack_blocks(events: dict, lengths, capacity: int, shards: int = 1):
  """``pack_events`` per batch shard: examples ``[s Bs, (s + 1) Bs)`` (``Bs = B / S``) packed at
  ``capacity / S`` tokens into block s. Returns ``(packed {field: [N, ...]}, offsets
  i32[S (Bs+1)], seg i32[N], pos i32[N], dropped)``, offsets and seg local to their block (seg
  ``Bs`` for padding); S = 1 is ``pack_events``."""
  B = len(np.asarray(lengths))
  S = check_shards(shards, B, _check_capacity(capacity))
  if S == 1:
    return pack_events(events, lengths, capacity)
  Bs, Ns = B // S, capacity // S
  parts = [pack_events({k: np.asarray(v)[s * Bs:(s + 1) * Bs] for k, v in events.items()},
                       np.asarray(lengths)[s * Bs:(s + 1) * Bs], Ns) for s in range(S)]
  packed = {k: np.concatenate([p[0][k] for p in parts]) for k in events}
  return (packed, *(np.concatenate([p[i] for p in parts]) for i in (1, 2, 3)),
          sum(p[4] for p in parts))


def block_examples(seg, batch: int, shards: int = 1) -> np.ndarray:
  """``i64[N]``: each token's example in the whole batch (``batch`` for padding) from the
  block-local ``seg`` of ``pack_blocks``."""
  seg = np.asarray(seg, np.int64)
  Bs, Ns = batch // shards, len(seg) // shards
  block = np.arange(len(seg)) // Ns
  return np.where(seg < Bs, seg + block * Bs, batch)


def unpack_events(packed: dict, offsets, max_len: int):
  """Packed -> padded: ``({field: [B, max_len, ...]}, lengths i32[B])`` (0 padding)."""
  offsets = np.asarray(offsets, np.int64)
  lengths = np.diff(offsets)
  B = len(lengths)
  if B and lengths.max() > max_len:
    raise ValueError(f"unpack_events: an example has {lengths.max()} events > max_len {max_len}")
  n = int(offsets[-1])
  seg = np.repeat(np.arange(B), lengths)
  pos = np.arange(n) - offsets[seg]
  out = {}
  for k, v in packed.items():
    v = np.asarray(v)
    o = np.zeros((B, max_len) + v.shape[1:], v.dtype)
    o[seg, pos] = v[:n]
    out[k] = o
  return out, lengths.astype(np.int32)


def batch_sum_survival(lengths_sample, batch_size: int) -> np.ndarray:
  """f64[batch_size * max_len + 1]: P(sum of a batch > n) for n = 0, 1, ...

  Exact for a batch of ``batch_size`` lengths drawn with replacement from the sample: the
  sample's length pmf convolved ``batch_size`` times (its FFT raised to that power).
  """
  L = _check_lengths(lengths_sample)
  if not len(L):
    raise ValueError("capacity: the length sample is empty")
  if batch_size <= 0:
    raise ValueError(f"capacity: batch_size must be > 0, got {batch_size}")
  pmf = np.bincount(L) / len(L)
  size = batch_size * (len(pmf) - 1) + 1                   # support of the batch sum
  nfft = 1 << (size - 1).bit_length()
  dist = np.fft.irfft(np.fft.rfft(pmf, nfft) ** batch_size, nfft)[:size]
  dist = np.clip(dist, 0.0, None)
  tail = np.cumsum(dist[::-1])[::-1]                       # P(sum >= n)
  return np.clip(np.append(tail[1:], 0.0), 0.0, 1.0)       # P(sum > n)


def capacity_for(lengths_sample, batch_size: int, quantile: float = 0.999,
                 multiple: int = 64) -> int:
  """The smallest multiple of ``multiple`` at which a batch of ``batch_size`` examples
  overflows with probability <= 1 - ``quantile``, batches drawn with replacement from
  ``lengths_sample`` (exact: ``batch_sum_survival``); at most batch_size * max(sample)."""
  if not 0.0 < quantile <= 1.0:
    raise ValueError(f"capacity: quantile must be in (0, 1], got {quantile}")
  if multiple <= 0:
    raise ValueError(f"capacity: multiple must be > 0, got {multiple}")
  surv = batch_sum_survival(lengths_sample, batch_size)
  top = len(surv) - 1                                      # batch_size * max_len: never overflows
  n = int(np.argmax(surv <= 1.0 - quantile + 1e-12))       # smallest n meeting the quantile
  return min(-(-n // multiple) * multiple, top)


# data.jagged_buckets = K: the batch-total quantiles of the K capacities (the last the overflow
# bound of capacity_for). Chosen on a grid by simulating mid's click and impression lengths at
# batch 256 / 1024 (one bucket index for both towers): their mean fill rises from 0.86 / 0.93
# (K = 1) to 0.93 / 0.97 (K = 2), 0.95 / 0.98 (K = 3) and 0.96 / 0.98 (K = 4). With all three of
# mid's towers, bench/jagged_buckets.py measures 0.88 -> 0.94 at b256 for K = 3.
BUCKET_QUANTILES = {1: (0.999,), 2: (0.8, 0.999), 3: (0.6, 0.9, 0.999), 4: (0.5, 0.8, 0.95, 0.999)}


def capacity_buckets(lengths_sample, batch_size: int, buckets: int,
                     multiple: int = 64) -> tuple[int, ...]:
  """``buckets`` static capacities, ascending: ``capacity_for`` at each of
  ``BUCKET_QUANTILES[buckets]`` (a batch of ``batch_size`` fits bucket i with probability >=
  its quantile); the last is ``capacity_for``'s P(overflow) bound. A batch takes the smallest
  that fits (``pick_bucket``): a few compiled shapes instead of one sized for the rare batch."""
  if buckets not in BUCKET_QUANTILES:
    raise ValueError(f"jagged buckets must be one of {sorted(BUCKET_QUANTILES)}, got {buckets!r}")
  return tuple(capacity_for(lengths_sample, batch_size, q, multiple)
               for q in BUCKET_QUANTILES[buckets])


def pick_bucket(lengths: dict, buckets: dict, shards: int = 1) -> int:
  """The smallest bucket index i at which every stream's every block fits: ``lengths`` {stream:
  i[B]} kept lengths, ``buckets`` {stream: (N_0 <= ... <= N_{K-1})} per process batch in
  ``shards`` blocks of N_i / shards tokens. K - 1 if none fits (that batch drops events)."""
  i = 0
  for s, caps in buckets.items():
    block = int(np.asarray(lengths[s], np.int64).reshape(shards, -1).sum(1).max(initial=0))
    fits = [j for j, n in enumerate(caps) if block <= n // shards]
    i = max(i, fits[0] if fits else len(caps) - 1)
  return i


class DroppedCounter:
  """Thread-safe count of events dropped per stream by the jagged capacity; the first
  ``log_first`` overflowing batches are printed to stderr."""

  def __init__(self, log_first: int = 10):
    self._lock = threading.Lock()
    self.counts: dict[str, int] = {}
    self.batches = 0                                        # batches that overflowed
    self.log_first = log_first

  def __getstate__(self):   # picklable for mp_prefetch workers (each keeps its own count)
    return {"counts": dict(self.counts), "batches": self.batches, "log_first": self.log_first}

  def __setstate__(self, d):
    self.__dict__.update(d)
    self._lock = threading.Lock()

  def add(self, dropped: dict[str, int]) -> None:
    dropped = {s: int(v) for s, v in dropped.items() if v}
    if not dropped:
      return
    with self._lock:
      for s, v in dropped.items():
        self.counts[s] = self.counts.get(s, 0) + v
      self.batches += 1
      n = self.batches
    if n <= self.log_first:
      print(f"warning: batch over the jagged capacity ({n} so far"
            f"{', no more of these messages' if n == self.log_first else ''}): dropped the "
            f"oldest events of the longest histories {dropped}", file=sys.stderr, flush=True)

  @property
  def total(self) -> int:
    return sum(self.counts.values())

  def report(self) -> str:
    return (f"dropped {self.total} events over the jagged capacity in {self.batches} batches: "
            f"{dict(sorted(self.counts.items()))}")


__all__ = ["fit_lengths", "pack_events", "pack_blocks", "block_examples", "check_shards",
           "unpack_events", "batch_sum_survival", "capacity_for", "BUCKET_QUANTILES",
           "capacity_buckets", "pick_bucket",
           "DroppedCounter"]
