"""The id hashes shared by the training input and the ingestion (numpy only, no jax):
``hash_ids`` (ids -> ``[0, vocab_size)``, multiplicative; the pipeline's hash of hashed features)
and ``mix64`` (the splitmix64 finaliser; the plans' keyed permutations, 31-bit join keys)."""

from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def hash_ids(ids: np.ndarray, vocab_size: int) -> np.ndarray:
  """Deterministic hash of non-negative int64 ids into ``[0, vocab_size)`` (multiplicative)."""
  with np.errstate(over="ignore"):
    h = ids.astype(np.uint64) * _GOLDEN
  return ((h >> np.uint64(29)) % np.uint64(vocab_size)).astype(np.int32)


def mix64(x: np.ndarray) -> np.ndarray:
  """splitmix64 finaliser of a uint64 array (vectorised; array arithmetic wraps mod 2**64)."""
  x = np.atleast_1d(np.asarray(x, np.uint64))
  x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return x ^ (x >> np.uint64(31))
