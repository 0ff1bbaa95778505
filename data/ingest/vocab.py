"""Exact vocabularies of categorical columns (value -> id: ``NULL_ID``, ``OOV_ID``, ``FIRST_ID +
position`` of the sorted values; ``Lookup``, ``ids_for``) and the collision report of hashed
ones (``expected_collision_rate``, ``colliding_values``, ``encodings`` for ``ingest.json``).
Rules: data/README.md ("Vocabularies").
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from data.hashing import hash_ids
from data.ingest.coerce import hash_strings
from data.schema import FIRST_ID, NULL_ID, OOV_ID

VOCAB_CAP = 100_000            # the scan keeps at most this many distinct values per column


def keys(vocab) -> np.ndarray:
  """The canonical int64 form of vocabulary values: strings -> their stable 63-bit hash
  (``coerce.hash_strings``, as ``data.ingest.layout.canonical`` hashes string columns), ints as they
  are."""
  vals = list(vocab)
  if vals and isinstance(vals[0], str):
    return hash_strings(pa.array(vals, pa.string()))
  return np.asarray(vals, np.int64)


class Lookup:
  """``lookup(raw)``: canonical raw values i64[N] -> vocabulary ids i64[N] (OOV_ID if absent)."""

  def __init__(self, vocab):
    k = keys(vocab)
    self.order = np.argsort(k, kind="stable")
    self.sorted = k[self.order]

  def __call__(self, raw: np.ndarray) -> np.ndarray:
    raw = np.asarray(raw, np.int64)
    if not len(self.sorted):
      return np.full(len(raw), OOV_ID, np.int64)
    pos = np.clip(np.searchsorted(self.sorted, raw), 0, len(self.sorted) - 1)
    found = self.sorted[pos] == raw
    return np.where(found, self.order[pos] + FIRST_ID, OOV_ID).astype(np.int64)


def expected_collision_rate(n: int, m: int) -> float:
  """Expected fraction of ``n`` distinct values hashed uniformly into ``m`` rows that share
  their row with at least one other value: ``1 - (1 - 1/m) ** (n - 1)``."""
  if n <= 1 or m <= 0:
    return 0.0
  return float(-np.expm1((n - 1) * np.log1p(-1.0 / m))) if m > 1 else 1.0


def colliding_values(values: np.ndarray, m: int) -> tuple[int, int]:
  """``(values sharing a row, rows used)`` for distinct raw ids hashed into ``m`` rows with the
  pipeline's ``hash_ids``."""
  v = np.unique(np.asarray(values, np.int64))
  if not len(v):
    return 0, 0
  _, inv, counts = np.unique(hash_ids(np.maximum(v, 0), m), return_inverse=True,
                             return_counts=True)
  return int((counts[inv] > 1).sum()), int(len(counts))


def display(vocab, keep: int = 8) -> list:
  """A short form of a long vocabulary for printing."""
  v = list(vocab)
  return v if len(v) <= 2 * keep else v[:keep] + [f"... {len(v) - keep} more"]


def ids_for(feature, values) -> np.ndarray:
  """Raw values of one sparse feature with an exact vocabulary (``schema.json``) -> their ids,
  as ``data.ingest`` maps them: what eval on other data and serving apply to a request's
  values. ``values``: strings or integers, None = null."""
  if feature.vocab is None:
    raise ValueError(f"sparse feature {feature.name!r} has no exact vocabulary")
  vals = list(values)
  null = np.array([v is None for v in vals], bool)
  present = [v for v in vals if v is not None]
  if present and isinstance(feature.vocab[0], str):
    raw = hash_strings(pa.array([str(v) for v in present], pa.string()))
  else:
    raw = np.asarray(present, np.int64)
  out = np.full(len(vals), NULL_ID, np.int64)
  out[~null] = Lookup(feature.vocab)(raw)
  return out


def encodings(stats: dict, order, schema, spec, key_stats: dict) -> dict:
  """Per categorical column: exact vocabulary, kept ids or hashed (with the expected collision
  rate and, when the scan kept the distinct values, the values that share a row)."""
  out = {}
  for f in schema.sparse:
    c = f"sparse.{f.name}"
    st = stats.get(c)
    if f.vocab is not None:
      out[c] = {"kind": "vocab", "values": len(f.vocab), "vocab_size": f.vocab_size}
    elif not f.hashed:
      out[c] = {"kind": "ids", "vocab_size": f.vocab_size}
    else:
      d = {"kind": "hash", "vocab_size": f.vocab_size}
      if st is not None:
        d["distinct"] = st.n_distinct if st.distinct is not None else None
        d["distinct_at_least"] = st.n_distinct
        d["expected_collision_rate"] = expected_collision_rate(st.n_distinct, f.vocab_size)
        if st.distinct is not None:
          d["colliding_values"], d["rows_used"] = colliding_values(
              np.fromiter(st.distinct, np.int64, len(st.distinct)), f.vocab_size)
      out[c] = d
  for k, n in key_stats.items():          # join keys hashed to 31 bits
    out[k] = {"kind": "hash", "vocab_size": 2**31, "distinct": n,
              "expected_collision_rate": expected_collision_rate(n, 2**31)}
  return out
