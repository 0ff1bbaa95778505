"""Record serialisation and sharded ArrayRecord storage.

One record = one example = a dict of numpy arrays, serialised as::

    b"KR" version:u8 n_fields:u8
    per field: name_len:u8 name:utf8 dtype:u8 ndim:u8 dims:u32[ndim]
    payload: the arrays' raw little-endian C-order bytes, in header order

The record fields of one example (``record_spec`` checks them, see ``data.validate``)::

    dense          f32[F_dense]
    sparse/<name>  i64[n]          n in [0, max_len]; raw ids (any id >= 0 for hashed features)
    events/<s>     i32[L, 4 + E]   columns item, action, surface, ts (unix seconds), then the
                                   stream's extra fields; L >= 0 events, oldest first
    surface        i32[]           index into schema.surfaces
    labels         f32[K]          0/1; label_mask f32[K] 0/1; true_prob f32[K] (NaN = unknown)
    user_id        i32[]           ad_id i32[]; request_ts i32[] (unix seconds)

On disk (``DatasetWriter``)::

    DIR/schema.json
    DIR/manifest.json           {"format": ..., "splits": {split: {surface: [
                                    {"file", "count", "bytes", "sha256"}]}}}
    DIR/<split>/<surface>-00000-of-00002.arrayrecord   (group_size:1 -> random access)

``bytes`` and ``sha256`` (``data.shards``) are absent from manifests written before they existed;
readers then check only that the files exist (``split_files``) and ``python -m data.verify
DIR --deep`` reads every chunk.

ArrayRecord files smaller than 64 KB are fine with array-record 0.8.6: the writer pads every file
to at least 128 KB, and a shard holding zero records reads back as empty.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import struct

import numpy as np

from data import shards
from data.schema import Schema

FORMAT = "kunlun-records-v1"
_VERSION = 1
_CODES = {np.dtype(np.float32): 0, np.dtype(np.float64): 1, np.dtype(np.int32): 2,
          np.dtype(np.int64): 3, np.dtype(np.uint8): 4, np.dtype(np.bool_): 5,
          np.dtype(np.int16): 6, np.dtype(np.float16): 7}
_DTYPES = {c: d for d, c in _CODES.items()}
_UNPACK = {k: struct.Struct(f"<{k}I").unpack_from for k in range(1, 256)}
WRITER_OPTIONS = "group_size:1,uncompressed"   # one record per chunk (random access); no codec:
# snappy costs 2.5x the CPU of the write for ~25% less disk on these small-int records
EVENT_COLUMNS = ("item", "action", "surface", "ts")   # then the stream's extra fields


class RecordFormatError(ValueError):
  """Bytes that are not a well-formed record."""


def event_columns(stream) -> tuple[str, ...]:
  return EVENT_COLUMNS + tuple(e.name for e in stream.extra_fields)


def _field_header(name: str, dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
  b = name.encode()
  if len(b) > 255 or len(shape) > 255:
    raise ValueError(f"record field {name!r}: name or rank too long")
  if dtype not in _CODES:
    raise ValueError(f"record field {name!r}: unsupported dtype {dtype}")
  return struct.pack(f"<B{len(b)}sBB{len(shape)}I", len(b), b, _CODES[dtype], len(shape), *shape)


def encode(arrays: dict[str, np.ndarray]) -> bytes:
  """Serialises a dict of numpy arrays (dtypes in ``_CODES``) to bytes."""
  if len(arrays) > 255:
    raise ValueError("a record holds at most 255 fields")
  arrs = [(k, np.asarray(v)) for k, v in arrays.items()]
  arrs = [(k, np.asarray(a, a.dtype.newbyteorder("<"), order="C")) for k, a in arrs]
  head = [b"KR", struct.pack("<BB", _VERSION, len(arrs))]
  head += [_field_header(k, a.dtype, a.shape) for k, a in arrs]
  return b"".join(head + [a.tobytes() for _, a in arrs])


def parse_header(data: bytes) -> tuple[list[tuple[str, np.dtype, tuple, int]], int]:
  """Header of a record: ``([(name, dtype, shape, dims_offset), ...], header_len)``.

  ``dims_offset`` is the byte offset of the field's u32 dims inside the header (batch decoding
  reads per-record sizes there). Malformed bytes raise ``RecordFormatError``.
  """
  try:
    if data[:2] != b"KR" or data[2] != _VERSION:
      raise RecordFormatError("bad magic or version")
    n, pos = data[3], 4
    fields = []
    for _ in range(n):
      ln = data[pos]
      name = data[pos + 1:pos + 1 + ln].decode()
      pos += 1 + ln
      code, ndim = data[pos], data[pos + 1]
      shape = _UNPACK[ndim](data, pos + 2) if ndim else ()
      dt = _DTYPES.get(code)
      if dt is None:
        raise RecordFormatError(f"field {name!r}: unknown dtype code {code}")
      fields.append((name, dt, shape, pos + 2))
      pos += 2 + 4 * ndim
    return fields, pos
  except (IndexError, struct.error, UnicodeDecodeError, KeyError) as e:
    raise RecordFormatError(f"unreadable record bytes: {e}") from e


def decode(data: bytes) -> dict[str, np.ndarray]:
  """Inverse of ``encode``; malformed bytes raise ``RecordFormatError``."""
  fields, pos = parse_header(data)
  out = {}
  for name, dt, shape, _ in fields:
    count = math.prod(shape)
    end = pos + dt.itemsize * count
    if end > len(data):
      raise RecordFormatError(f"field {name!r}: truncated payload")
    out[name] = np.frombuffer(data, dt, count, pos).reshape(shape)
    pos = end
  if pos != len(data):
    raise RecordFormatError(f"{len(data) - pos} trailing bytes")
  return out


def encode_columns(fixed: dict[str, np.ndarray],
                   ragged: dict[str, tuple[np.ndarray, np.ndarray]]) -> list[bytes]:
  """Vectorised ``encode`` of N records given column-wise.

  fixed:  {name: array[N, ...]} (row i is record i's field).
  ragged: {name: (values[E, ...], offsets i64[N + 1])} (rows offsets[i]:offsets[i+1]).
  Returns the N records, byte-identical to ``encode`` of the row dicts (fixed fields first).

  Each record is a constant-width prefix (magic, field headers with the record's ragged lengths
  patched in, the fixed fields' bytes), then its slice of every ragged field's values; Arrow's
  ``binary_join_element_wise`` concatenates the pieces of all records in one C++ call.
  """
  import pyarrow as pa
  import pyarrow.compute as pc
  n = len(next(iter(fixed.values())))
  if not n:
    return []
  fixed = {k: np.ascontiguousarray(v) for k, v in fixed.items()}
  head = b"KR" + struct.pack("<BB", _VERSION, len(fixed) + len(ragged))
  head += b"".join(_field_header(k, v.dtype, v.shape[1:]) for k, v in fixed.items())
  parts, pieces = [np.frombuffer(head, np.uint8)[None].repeat(n, 0)], []
  for k, (vals, offs) in ragged.items():
    vals = np.ascontiguousarray(vals)
    offs = np.asarray(offs, np.int64)
    tmpl = np.frombuffer(_field_header(k, vals.dtype, (0,) + vals.shape[1:]), np.uint8)
    hdr = tmpl[None].repeat(n, 0)
    at = 1 + len(k.encode()) + 2                       # the u32 length: first dim
    hdr[:, at:at + 4] = (offs[1:] - offs[:-1]).astype("<u4").view(np.uint8).reshape(n, 4)
    parts.append(hdr)
    row = vals.dtype.itemsize * int(np.prod(vals.shape[1:], dtype=np.int64))
    data = pa.py_buffer(vals.astype(vals.dtype.newbyteorder("<"), copy=False).tobytes()
                        if vals.dtype.byteorder == ">" else vals)
    byte_offs = pa.py_buffer(((offs - offs[0]) * row).astype(np.int64))
    if offs[0]:
      data = data[int(offs[0]) * row:]
    pieces.append(pa.LargeBinaryArray.from_buffers(pa.large_binary(), n, [None, byte_offs, data]))
  parts += [v.reshape(n, -1).view(np.uint8) for v in fixed.values()]
  prefix = np.ascontiguousarray(np.concatenate(parts, axis=1))
  w = prefix.shape[1]
  first = pa.LargeBinaryArray.from_buffers(
      pa.large_binary(), n, [None, pa.py_buffer(np.arange(n + 1, dtype=np.int64) * w),
                             pa.py_buffer(prefix)])
  if not pieces:
    return first.to_pylist()
  return pc.binary_join_element_wise(first, *pieces, pa.scalar(b"", pa.large_binary())).to_pylist()


# ---- files -----------------------------------------------------------------------------------

def shard_name(surface: str, i: int, n: int) -> str:
  return f"{surface}-{i:05d}-of-{n:05d}.arrayrecord"


class DatasetWriter:
  """Writes records per (split, surface) into rotated ArrayRecord shards, then the manifest.

  ``write(split, surface, records)`` appends serialised records; ``close()`` renames the shards
  to ``<surface>-0000i-of-0000N.arrayrecord`` and writes ``schema.json`` and ``manifest.json``.
  """

  def __init__(self, out_dir: str, schema: Schema, records_per_shard: int = 200_000):
    from array_record.python import array_record_module
    self._mod = array_record_module
    self.out_dir, self.schema, self.per_shard = out_dir, schema, records_per_shard
    self._open: dict[tuple[str, str], tuple[object, int]] = {}
    self._done: dict[tuple[str, str], list[tuple[str, int]]] = {}
    os.makedirs(out_dir, exist_ok=True)

  def _new(self, split, surface):
    shards = self._done.setdefault((split, surface), [])
    os.makedirs(os.path.join(self.out_dir, split), exist_ok=True)
    tmp = os.path.join(self.out_dir, split, f".{surface}-{len(shards):05d}.tmp")
    self._open[(split, surface)] = (self._mod.ArrayRecordWriter(tmp, WRITER_OPTIONS), 0)
    shards.append((tmp, 0))

  def write(self, split: str, surface: str, records) -> None:
    if surface not in self.schema.surfaces:
      raise ValueError(f"unknown surface {surface!r}; schema has {self.schema.surfaces}")
    for r in records:
      key = (split, surface)
      if key not in self._open or self._open[key][1] >= self.per_shard:
        if key in self._open:
          self._close_one(key)
        self._new(split, surface)
      w, c = self._open[key]
      w.write(r)
      self._open[key] = (w, c + 1)

  def _close_one(self, key):
    w, c = self._open.pop(key)
    w.close()
    tmp, _ = self._done[key][-1]
    self._done[key][-1] = (tmp, c)

  def close(self, splits: tuple[str, ...] = ("train", "eval")) -> dict:
    for key in list(self._open):
      self._close_one(key)
    manifest = {"format": FORMAT, "splits": {}}
    for split in splits:
      for surface in self.schema.surfaces:
        if (split, surface) not in self._done:   # an empty surface still gets one (empty) shard
          self._new(split, surface)
          self._close_one((split, surface))
        files = self._done[(split, surface)]
        entries = []
        for i, (tmp, c) in enumerate(files):
          rel = os.path.join(split, shard_name(surface, i, len(files)))
          os.replace(tmp, os.path.join(self.out_dir, rel))
          entries.append(shards.file_entry(self.out_dir, rel, c))
        manifest["splits"].setdefault(split, {})[surface] = entries
    self.schema.save(self.out_dir)
    with open(os.path.join(self.out_dir, "manifest.json"), "w") as f:
      json.dump(manifest, f, indent=1)
    return manifest


def load_manifest(data_dir: str, fmt: str = FORMAT,
                  what: str = "a kunlun record directory") -> dict:
  """``manifest.json`` of ``data_dir``, checked to carry format ``fmt``."""
  path = os.path.join(data_dir, "manifest.json")
  if not os.path.exists(path):
    raise FileNotFoundError(f"no manifest.json in {data_dir} (not {what})")
  with open(path) as f:
    m = json.load(f)
  if m.get("format") != fmt:
    raise ValueError(f"{path}: format {m.get('format')!r}, expected {fmt!r}")
  return m


def split_entries(data_dir: str, split: str, schema: Schema, check: bool = True) -> dict:
  """{surface: [manifest entry with ``path`` (absolute) added]} for one split, checked against
  the schema; ``check``: every file exists and has the recorded size (``data.shards``), else a
  ``shards.DataFileError`` naming it."""
  m = load_manifest(data_dir)
  if split not in m["splits"]:
    raise ValueError(f"{data_dir}: unknown split {split!r}; manifest has {sorted(m['splits'])}")
  out = {}
  for surface, entries in m["splits"][split].items():
    if surface not in schema.surfaces:
      raise ValueError(f"{data_dir}/manifest.json: unknown surface {surface!r}; "
                       f"schema has {schema.surfaces}")
    out[surface] = [dict(e, path=os.path.join(data_dir, e["file"])) for e in entries]
    if check:
      for e in out[surface]:
        shards.check_entry(e["path"], e)
  return out


def split_files(data_dir: str, split: str, schema: Schema,
                check: bool = True) -> dict[str, list[tuple[str, int]]]:
  """{surface: [(absolute path, count), ...]} for one split (``split_entries``)."""
  return {s: [(e["path"], int(e["count"])) for e in es]
          for s, es in split_entries(data_dir, split, schema, check).items()}


def unsized_files(data_dir: str, split: str) -> int:
  """Number of the split's manifest entries without a recorded byte size (older manifests)."""
  return sum("bytes" not in e for es in load_manifest(data_dir)["splits"].get(split, {}).values()
             for e in es)


class RecordSource:
  """Random-access source over ArrayRecord files: ``src[i] -> (file_id, local_index, bytes)``;
  ``src.read_many(indices)`` reads a batch (one ``read`` call per file). A damaged chunk raises
  ``shards.DamagedChunkError`` (file and record range), a file that cannot be opened
  ``shards.DataFileError``.

  Picklable (readers open lazily per process), so it works under ``mp_prefetch``.
  """

  def __init__(self, files: list[tuple[str, int]]):
    self.paths = [p for p, _ in files]
    self.counts = [c for _, c in files]
    self.starts = np.cumsum([0] + self.counts).tolist()
    self._readers = None

  def __len__(self):
    return self.starts[-1]

  def __getstate__(self):
    return {"paths": self.paths, "counts": self.counts, "starts": self.starts, "_readers": None}

  def locate(self, i: int) -> tuple[int, int]:
    f = bisect.bisect_right(self.starts, i) - 1
    return f, i - self.starts[f]

  def _reader(self, f: int):
    if self._readers is None:
      self._readers = [None] * len(self.paths)
    if self._readers[f] is None:   # a racing second open is harmless (reads are positional)
      self._readers[f] = shards.open_reader(self.paths[f], self.counts[f])
    return self._readers[f]

  def __getitem__(self, i: int):
    i = int(i)
    f, j = self.locate(i)
    return f, j, shards.read_records(self._reader(f), self.paths[f], [j], self.counts[f])[0]

  def read_many(self, indices, damaged=None) -> tuple[np.ndarray, np.ndarray, list[bytes]]:
    """Global record indices i64[N] -> ``(file_id i64[N], local_index i64[N], [bytes] * N)``.

    ``damaged``: a list to collect ``(n, shards.DamagedChunkError)`` for the records that
    cannot be read (their bytes are ``b""``) instead of raising the first.
    """
    idx = np.asarray(indices, np.int64)
    if len(idx) and (idx.min() < 0 or idx.max() >= len(self)):
      raise IndexError(f"record index out of [0, {len(self)})")
    f = np.searchsorted(np.asarray(self.starts), idx, side="right") - 1
    local = idx - np.asarray(self.starts)[f]
    out: list[bytes] = [b""] * len(idx)
    for fid in np.unique(f).tolist():
      rows = np.flatnonzero(f == fid)
      bad = None if damaged is None else []
      got = shards.read_records(self._reader(fid), self.paths[fid], local[rows].tolist(),
                                self.counts[fid], bad)
      for r, raw in zip(rows.tolist(), got, strict=True):
        out[r] = raw
      if bad:
        damaged.extend((int(rows[pos]), err) for pos, err in bad)
    return f, local, out
