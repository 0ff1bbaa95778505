"""Explicit type coercions from common log forms to the Parquet column layout (``parquet``).
Each change of type is reported once per column through ``Coercions``; what cannot be coerced
safely is a ``CoerceError`` naming the column and the first offending row. The forms handled:
data/README.md ("Coercions").
"""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from data.hashing import hash_ids, mix64

INT32_MAX = 2**31 - 1
TS_SCALE = {"s": 1, "ms": 1000, "us": 1_000_000}


class CoerceError(ValueError):
  """A value that no documented coercion can turn into the column's type; ``row``: the first
  offending row of the table (None: the whole column)."""

  def __init__(self, msg: str, row: int | None = None):
    super().__init__(msg)
    self.msg, self.row = msg, row


class Coercions:
  """Logged coercions: ``{column: message}``, first message per column kept."""

  def __init__(self):
    self.done: dict[str, str] = {}

  def add(self, column: str, msg: str) -> None:
    self.done.setdefault(column, msg)

  def lines(self) -> list[str]:
    """One line per distinct coercion, naming every column it applied to."""
    by: dict[str, list[str]] = {}
    for c, m in self.done.items():
      by.setdefault(m, []).append(c)
    return [f"{', '.join(cs)}: {m}" for m, cs in by.items()]


def hash_strings(values: pa.Array, bits: int = 63) -> np.ndarray:
  """Stable hash (blake2b, independent of the process) of strings -> int64 in [0, 2**bits)."""
  enc = pc.dictionary_encode(values).combine_chunks() if isinstance(
      values, pa.ChunkedArray) else pc.dictionary_encode(values)
  words = [int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little")
           >> (64 - bits) for s in enc.dictionary.to_pylist()]
  codes = enc.indices.to_numpy(zero_copy_only=False)
  return np.asarray(words, np.int64)[codes] if len(words) else np.zeros(len(codes), np.int64)


def hash31(x: np.ndarray) -> np.ndarray:
  """Deterministic 31-bit hash of int64 ids (join keys that do not fit int32)."""
  return (mix64(np.asarray(x).astype(np.uint64)) & np.uint64(INT32_MAX)).astype(np.int64)


def first_row(mask: np.ndarray) -> int:
  return int(np.flatnonzero(mask)[0])


def _arr(col) -> pa.Array:
  return col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col


def _is_list(t) -> bool:
  return pa.types.is_list(t) or pa.types.is_large_list(t)


def _nulls(arr: pa.Array) -> np.ndarray:
  return np.asarray(arr.is_null().to_numpy(zero_copy_only=False), bool)


def timestamps(arr: pa.Array, name: str, unit: str, log: Coercions) -> np.ndarray:
  """int64 seconds from an integer / floating / timestamp array (no nulls allowed)."""
  t = arr.type
  nulls = _nulls(arr)
  if nulls.any():
    raise CoerceError(f"column {name!r} is null (a time is required)", first_row(nulls))
  if pa.types.is_timestamp(t):
    log.add(name, f"timestamp[{t.unit}] -> unix seconds (floor)")
    per_s = {"s": 1, "ms": 1000, "us": 1_000_000, "ns": 1_000_000_000}[t.unit]
    return arr.cast(pa.int64()).to_numpy(zero_copy_only=False) // per_s
  if pa.types.is_floating(t):
    log.add(name, f"{t} -> integer seconds (floor)")
    x = np.floor(arr.to_numpy(zero_copy_only=False) / TS_SCALE[unit])
    if not np.isfinite(x).all():
      raise CoerceError(f"column {name!r} is not finite", first_row(~np.isfinite(x)))
    return x.astype(np.int64)
  if pa.types.is_integer(t):
    x = arr.to_numpy(zero_copy_only=False).astype(np.int64)
    if unit != "s":
      log.add(name, f"{unit} -> seconds (floor)")
      x = x // TS_SCALE[unit]
    return x
  raise CoerceError(f"column {name!r} has type {t}, expected integer, floating or timestamp "
                    "seconds")


def keys(arr: pa.Array, name: str, log: Coercions,
         hash_all: bool = False) -> tuple[np.ndarray, np.ndarray]:
  """Join key -> ``(int32-range key, int64 feature id >= 0)``. Integer ids are hashed when
  ``hash_all`` (the whole column has ids outside [0, 2**31): ``sources.key_decision``) or
  when this batch has such ids."""
  t = arr.type
  nulls = _nulls(arr)
  if nulls.any():
    raise CoerceError(f"column {name!r} is null", first_row(nulls))
  if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_dictionary(t):
    log.add(name, "strings -> stable 31-bit hash (join key and id feature)")
    h = hash_strings(arr.cast(pa.string()), 31)
    return h, h
  if pa.types.is_floating(t):
    x = arr.to_numpy(zero_copy_only=False)
    big = np.isfinite(x) & (x == np.floor(x)) & (np.abs(x) >= 2.0**63)
    if big.any():
      i = first_row(big)
      raise CoerceError(f"column {name!r} has integer ids outside the int64 range (e.g. "
                        f"{x[i]:.0f}: the reader turned the column into floating point, which "
                        "loses digits); "
                        "give such ids as strings (a string column in Parquet)", i)
  if not pa.types.is_integer(t):
    raise CoerceError(f"column {name!r} has type {t}, expected integer or string ids")
  x = arr.to_numpy(zero_copy_only=False).astype(np.int64)
  if hash_all or (len(x) and (x.min() < 0 or x.max() > INT32_MAX)):
    log.add(name, "ids outside [0, 2**31) -> 31-bit hash (join key and id feature)")
    h = hash31(x)
    return h, h
  return x, x


def dense(arr: pa.Array, name: str, log: Coercions) -> pa.Array:
  t = arr.type
  if not (pa.types.is_floating(t) or pa.types.is_integer(t) or pa.types.is_boolean(t)):
    raise CoerceError(f"column {name!r} has type {t}, expected a number")
  nulls = _nulls(arr)
  if nulls.any():
    raise CoerceError(f"column {name!r} is null (dense features need a value; fill it in the "
                      "log)", first_row(nulls))
  if not pa.types.is_floating(t):
    log.add(name, f"{t} -> float")
  return arr.cast(pa.float64())


def labels(arr: pa.Array, name: str, log: Coercions) -> pa.Array:
  """0/1 labels as float64 with nulls kept (null = no label)."""
  t = arr.type
  if pa.types.is_boolean(t):
    log.add(name, "bool -> 0/1")
  elif not (pa.types.is_integer(t) or pa.types.is_floating(t)):
    raise CoerceError(f"column {name!r} has type {t}, expected 0/1 labels (bool or number)")
  out = arr.cast(pa.float64())
  x = out.fill_null(0).to_numpy(zero_copy_only=False)
  bad = (x != 0) & (x != 1)
  if bad.any():
    i = first_row(bad)
    raise CoerceError(f"column {name!r} has value {float(x[i])!r}; labels must be 0 or 1 (or "
                      "null = not labelled)", i)
  return out


def id_lists(arr: pa.Array, name: str, log: Coercions) -> tuple[pa.Array, bool]:
  """Sparse feature -> ``(list<int64> ids, hashed)``."""
  t = arr.type
  if _is_list(t):
    vt = t.value_type
    flat = arr.flatten()
    if pa.types.is_integer(vt):
      return arr.cast(pa.large_list(pa.int64())), False
    if pa.types.is_string(vt) or pa.types.is_large_string(vt):
      log.add(name, "list<string> -> stable 63-bit hashes (hashed feature)")
      offs = np.asarray(arr.offsets) - arr.offsets[0].as_py()
      return pa.LargeListArray.from_arrays(offs.astype(np.int64),
                                           pa.array(hash_strings(flat.cast(pa.string())))), True
    raise CoerceError(f"column {name!r} has type {t}, expected list<integer> or list<string>")
  nulls = _nulls(arr)
  lens = (~nulls).astype(np.int64)
  offs = np.concatenate([[0], np.cumsum(lens)])
  hashed = False
  if pa.types.is_integer(t):
    log.add(name, f"{t} scalars -> one-id lists (null -> empty)")
    vals = arr.drop_null().to_numpy(zero_copy_only=False).astype(np.int64)
  elif pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_dictionary(t):
    log.add(name, "string scalars -> one stable 63-bit hash per row (hashed feature)")
    vals, hashed = hash_strings(arr.drop_null().cast(pa.string())), True
  else:
    raise CoerceError(f"column {name!r} has type {t}, expected integer or string ids (scalar or "
                      "list)")
  return pa.LargeListArray.from_arrays(offs, pa.array(vals, pa.int64())), hashed


def event_list(arr: pa.Array, name: str, is_ts: bool, unit: str, log: Coercions) -> pa.Array:
  """An ``events.<s>.<c>`` list column -> list<int64> (ts in seconds)."""
  t = arr.type
  if not _is_list(t):
    raise CoerceError(f"column {name!r} has type {t}, expected a list per row (events oldest "
                      "first)")
  nulls = _nulls(arr)
  if nulls.any():
    raise CoerceError(f"column {name!r} is null (use an empty list)", first_row(nulls))
  vt = t.value_type
  offs = np.asarray(arr.offsets, np.int64)
  offs = offs - offs[0]
  flat = arr.flatten()
  if is_ts:
    vals = timestamps(flat, name, unit, log)
  elif pa.types.is_integer(vt):
    vals = flat.to_numpy(zero_copy_only=False).astype(np.int64)
  else:
    raise CoerceError(f"column {name!r} has type {t}, expected list<integer>")
  return pa.LargeListArray.from_arrays(offs, pa.array(vals, pa.int64()))


def truncate_lists(arr: pa.Array, max_len: int) -> pa.Array:
  """Keeps the last ``max_len`` values of every list (the most recent events)."""
  offs = np.asarray(arr.offsets, np.int64)
  lens = np.diff(offs)
  keep = np.minimum(lens, max_len)
  start = offs[1:] - keep
  new = np.concatenate([[0], np.cumsum(keep)])
  take = np.arange(new[-1]) + np.repeat(start - new[:-1], keep)
  vals = arr.values.to_numpy(zero_copy_only=False)[take] if len(take) else np.zeros(0, np.int64)
  return pa.LargeListArray.from_arrays(new, pa.array(vals, arr.type.value_type))


def hash_mod(x: np.ndarray, vocab: int) -> np.ndarray:
  """Ids -> ``[0, vocab)`` with the pipeline's multiplicative hash (``data.hashing.hash_ids``)."""
  return hash_ids(np.asarray(x, np.int64), vocab).astype(np.int64)
