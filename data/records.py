"""Record serialisation and sharded ArrayRecord storage.

One record = one example = a dict of numpy arrays, serialised as::

    b"KR" version:u8 n_fields:u8
    per field: name_len:u8 name:utf8 dtype:u8 ndim:u8 dims:u32[ndim]
    payload: the arrays' raw little-endian C-order bytes, in header order

The record fields of one example (``record_spec`` checks them, see ``data.verify``)::

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
def writer_options(records_per_chunk: int = 1) -> str:
  """ArrayRecord writer options: ``records_per_chunk`` records per Riegeli chunk (the unit of a
  random read and of a hash check), no codec (snappy costs 2.5x the CPU of the write for ~25%
  less disk on these small-int records)."""
  return f"group_size:{int(records_per_chunk)},uncompressed"


WRITER_OPTIONS = writer_options(1)               # one record per chunk
INGEST_RECORDS_PER_CHUNK = 8    # data.ingest's default: the writer's cost is per chunk (half of
# it at 8: bench/results/ingest.json), a random read of an uncompressed 8-record chunk costs no
# more than of a 1-record one, and a damaged chunk makes its 8 records unreadable (reported as
# their range, data.shards)
MAX_RECORDS_PER_CHUNK = 1024   # a random read decodes its whole chunk: beyond this, one read
# of a record holds a thousand others in memory
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
  """
  ranges = {k: (v, np.asarray(o, np.int64)[:-1], np.asarray(o, np.int64)[1:])
            for k, (v, o) in ragged.items()}
  return encode_ranges(fixed, ranges).to_pylist()


_VIEW_MAX = (1 << 31) - 1        # an Arrow binary view addresses its buffer with int32 offsets
_BATCH = 1 << 16                 # records per binary-view gather


def _little(a) -> np.ndarray:
  a = np.asarray(a)
  return np.ascontiguousarray(a, a.dtype.newbyteorder("<"))


def encode_ranges(fixed: dict[str, np.ndarray],
                  ragged: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]):
  """Vectorised ``encode`` of N records: a ``pyarrow.ChunkedArray`` (large_binary) whose
  element i is byte-identical to ``encode`` of record i's dict (fixed fields first, then the
  ragged ones, each group in order).

  fixed:  {name: array[N, ...]} (row i is record i's field).
  ragged: {name: (values[E, ...], start i64[N], stop i64[N])}: record i's field is
          ``values[start[i]:stop[i]]``. The ranges may overlap and come in any order (each
          row's history as a window into one array of events, never copied per row).

  A record is a constant-width prefix (magic, field headers with its ragged lengths patched
  in, the fixed fields' bytes) followed by one byte range per ragged field. The pieces of all
  records become one Arrow ``binary_view`` array (a view: length, buffer, offset); its cast to
  ``large_binary`` copies them into one buffer in record order, in C++.
  """
  import pyarrow as pa
  if len(fixed) + len(ragged) > 255:
    raise ValueError("a record holds at most 255 fields")
  fixed = {k: _little(v) for k, v in fixed.items()}
  n = len(next(iter(fixed.values()))) if fixed else (
      len(next(iter(ragged.values()))[1]) if ragged else 0)
  head = b"KR" + struct.pack("<BB", _VERSION, len(fixed) + len(ragged))
  head += b"".join(_field_header(k, v.dtype, v.shape[1:]) for k, v in fixed.items())
  rows = []                 # (u32 length position in the prefix, values as bytes [E, B], ...)
  for k, (vals, start, stop) in ragged.items():
    vals = _little(vals)
    start, stop = np.asarray(start, np.int64), np.asarray(stop, np.int64)
    if len(start) != n or len(stop) != n:
      raise ValueError(f"record field {k!r}: {len(start)} ranges for {n} records")
    if n and ((stop < start).any() or start.min() < 0 or stop.max() > len(vals)):
      raise ValueError(f"record field {k!r}: ranges outside its {len(vals)} values")
    at = len(head) + 1 + len(k.encode()) + 2
    head += _field_header(k, vals.dtype, (0,) + vals.shape[1:])
    row_bytes = vals.dtype.itemsize * math.prod(vals.shape[1:])
    rows.append((at, vals.reshape(-1).view(np.uint8).reshape(len(vals), row_bytes), start,
                 stop))
  if not n:
    return pa.chunked_array([], pa.large_binary())
  sizes = [v[0].nbytes for v in fixed.values()]
  width = len(head) + sum(sizes)
  prefix = np.empty((n, width), np.uint8)
  prefix[:] = np.frombuffer(head + bytes(sum(sizes)), np.uint8)
  at = len(head)
  for v, size in zip(fixed.values(), sizes, strict=True):
    prefix[:, at:at + size] = v.reshape(-1).view(np.uint8).reshape(n, size)
    at += size
  for at, _, start, stop in rows:
    lens = stop - start
    if lens.max() > 0xFFFFFFFF:
      raise ValueError("record field longer than 2**32 rows")
    prefix[:, at:at + 4] = lens.astype("<u4").view(np.uint8).reshape(n, 4)
  chunks, a = [], 0
  while a < n:                   # batches whose buffers fit the views' int32 offsets
    b = min(n, a + _BATCH)
    while True:
      spans = [(int(s[a:b].min()), int(e[a:b].max())) for _, _, s, e in rows]
      if (b - a) * width <= _VIEW_MAX and all(
          (hi - lo) * r[1].shape[1] <= _VIEW_MAX for (lo, hi), r in zip(spans, rows,
                                                                       strict=True)):
        break
      b = a + max(1, (b - a) // 2)
    chunks.append(_gather(prefix[a:b], [(r[1], r[2][a:b], r[3][a:b]) for r in rows], spans))
    a = b
  return pa.chunked_array(chunks, pa.large_binary())


def _gather(prefix: np.ndarray, rows, spans):
  """The records of one batch: ``prefix`` u8[M, W], per ragged field ``(values as bytes u8[E,
  B], start[M], stop[M])`` and the ``(lo, hi)`` of the value rows the batch uses."""
  import pyarrow as pa
  m, width = prefix.shape
  k = 1 + len(rows)
  views = np.zeros((m, k, 4), np.int32)     # Arrow's view: i32 length, then 12 inline bytes or
  buffers = [pa.py_buffer(prefix)]          # 4 bytes of prefix, i32 buffer index, i32 offset
  pieces = [(prefix.reshape(-1), np.arange(m, dtype=np.int64) * width,
             np.full(m, width, np.int64))]
  for (b, start, stop), (lo, hi) in zip(rows, spans, strict=True):
    w = b.shape[1]
    buffers.append(pa.py_buffer(b[lo:hi]))
    pieces.append((b[lo:hi].reshape(-1), (start - lo) * w, (stop - start) * w))
  for j, (flat, off, length) in enumerate(pieces):
    views[:, j, 0] = length
    if not len(flat):
      continue                              # every piece empty: all zeros
    long = length > 12
    if j == 0 and long.all():               # the prefixes: same first 4 bytes
      views[:, 0, 1], views[:, 0, 2], views[:, 0, 3] = flat[:4].view("<i4")[0], 0, off
      continue
    short = np.flatnonzero(~long)
    views[:, j, 1], views[:, j, 2], views[:, j, 3] = _first_words(flat, off, 1)[:, 0], j, off
    if len(short):                          # up to 12 bytes: inline, zero-padded
      keep = np.arange(12) < length[short, None]
      inline = _first_words(flat, off[short], 3).view(np.uint8).reshape(len(short), 12)
      views[short, j, 1:] = np.where(keep, inline, 0).astype(np.uint8).view("<i4")
  arr = pa.Array.from_buffers(pa.binary_view(), m * k, [None, pa.py_buffer(views)] + buffers)
  joined = arr.cast(pa.large_binary())
  offs = np.frombuffer(joined.buffers()[1], np.int64)[:m * k + 1:k]
  return pa.LargeBinaryArray.from_buffers(pa.large_binary(), m,
                                          [None, pa.py_buffer(np.ascontiguousarray(offs)),
                                           joined.buffers()[2]])


def _first_words(flat: np.ndarray, off: np.ndarray, c: int) -> np.ndarray:
  """i32[M, c]: the ``4 * c`` bytes of ``flat`` from each byte offset (zeros past its end)."""
  if len(flat) % 4 == 0 and not (off % 4).any():
    words = flat.view("<i4")
    idx = off[:, None] // 4 + np.arange(c)
    return np.where(idx < len(words), words[np.minimum(idx, len(words) - 1)], 0)
  idx = off[:, None] + np.arange(4 * c)
  got = np.where(idx < len(flat), flat[np.minimum(idx, len(flat) - 1)], 0).astype(np.uint8)
  return got.view("<i4")


# ---- files -----------------------------------------------------------------------------------

def shard_name(surface: str, i: int, n: int) -> str:
  return f"{surface}-{i:05d}-of-{n:05d}.arrayrecord"


class DatasetWriter:
  """Writes records per (split, surface) into rotated ArrayRecord shards, then the manifest.

  ``write(split, surface, records)`` appends serialised records; ``close()`` renames the shards
  to ``<surface>-0000i-of-0000N.arrayrecord`` and writes ``schema.json`` and ``manifest.json``.
  """

  def __init__(self, out_dir: str, schema: Schema, records_per_shard: int = 200_000,
               records_per_chunk: int = 1):
    from array_record.python import array_record_module
    self._mod, self._opts = array_record_module, writer_options(records_per_chunk)
    self.out_dir, self.schema, self.per_shard = out_dir, schema, records_per_shard
    self._open: dict[tuple[str, str], tuple[object, int]] = {}
    self._done: dict[tuple[str, str], list[tuple[str, int]]] = {}
    os.makedirs(out_dir, exist_ok=True)

  def _new(self, split, surface):
    shards = self._done.setdefault((split, surface), [])
    os.makedirs(os.path.join(self.out_dir, split), exist_ok=True)
    tmp = os.path.join(self.out_dir, split, f".{surface}-{len(shards):05d}.tmp")
    self._open[(split, surface)] = (self._mod.ArrayRecordWriter(tmp, self._opts), 0)
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


def label_delay_note(data_dir: str) -> str:
  """One line for train.py's start-up: the label delays the dataset's built histories and
  statistics were made with (``ingest.json``, written by data.ingest), or why there are none."""
  if os.path.exists(os.path.join(data_dir, "synthetic.json")):
    return ("data: label delays: none needed (synthetic data: its event streams are drawn apart "
            "from the labelled requests)")
  path = os.path.join(data_dir, "ingest.json")
  if not os.path.exists(path):
    return f"data: label delays: unknown (no ingest.json in {data_dir}: not written by data.ingest)"
  try:
    with open(path) as f:
      report = json.load(f)
  except (OSError, ValueError) as e:
    return f"data: label delays: unknown ({path} unreadable: {e})"
  if "label_delays" not in report:
    return (f"data: label delays: not recorded ({path} predates them; ingest again to record "
            "them)")
  delays = report["label_delays"]
  if delays is None:
    return ("data: label delays: none applied (no built histories: the event streams came with "
            "the log)")
  return "data: label delays (ingest.json): " + ", ".join(
      f"{t} {show_duration(int(d))}" for t, d in delays.items())


def show_duration(seconds: int) -> str:
  """A label delay in words: ``immediate`` or the largest whole unit (``1d``, ``2h``, ``5m``,
  ``90s``; data.ingest.infer.duration reads them back)."""
  for unit, n in (("d", 86_400), ("h", 3600), ("m", 60), ("s", 1)):
    if seconds and seconds % n == 0:
      return f"{seconds // n}{unit}"
  return "immediate"


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
