"""Exact vocabularies of categorical columns, and the collision report of hashed ones.

A sparse feature whose raw values would otherwise be hashed (strings, ids that are negative or
too wide to keep) and that has at most ``vocab_max`` distinct values (``data.infer.Spec``,
default 10,000) gets an exact vocabulary, computed in the scan pass and stored in
``schema.json`` (``SparseFeature.vocab``) so that eval, serving and a later ingest with the same
spec map values identically::

    id 0            null (a null scalar value)
    id 1            out of vocabulary (a value that is not in ``vocab``)
    id 2 + i        vocab[i]; vocab sorted (strings, or integers), so ids do not depend on the
                    order the log was read in

Higher-cardinality ids stay hashed (the pipeline's ``hash_ids`` into ``vocab_size`` rows);
``report`` gives each hashed column's expected collision rate and, when the scan kept its
distinct values, the number of values that actually share a row. The spec's ``vocab:
{feature: exact | hash}`` forces either choice per column.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

NULL_ID, OOV_ID, FIRST_ID = 0, 1, 2
VOCAB_CAP = 100_000            # the scan keeps at most this many distinct values per column


def keys(vocab) -> np.ndarray:
  """The canonical int64 form of vocabulary values: strings -> their stable 63-bit hash
  (``coerce.hash_strings``, as ``data.layout.canonical`` hashes string columns), ints as they
  are."""
  from data.coerce import hash_strings
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
  from data.pipeline import hash_ids  # the hash the pipeline applies (imports jax)
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
  from data.coerce import hash_strings
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
