"""Checks a dataset directory against its manifest and schema, file by file.

  python -m data.verify DIR [--deep] [--split train,eval] [--json OUT] [--update_manifest]

Also the record rules the pipeline applies (``RecordChecker``, ``BatchValidator``; an
``InvalidRecordError`` names file, record and field). Details: data/README.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time

import numpy as np

from data import records, shards
from data.schema import Schema
from kunlun.utils import outputs

KINDS = ("bytes", "missing", "dtype", "shape", "id_range", "non_finite", "timestamp", "surface",
         "label")


class InvalidRecordError(shards.DataError):
  """A record that does not satisfy the schema. ``kind`` is one of ``KINDS``."""

  def __init__(self, kind: str, file: str, index: int, field: str, msg: str):
    self.kind, self.file, self.index, self.field = kind, file, index, field
    super().__init__(f"{file}: record {index}: field {field!r}: {msg} [{kind}]")


class InvalidCounter:
  """Thread-safe count of skipped records per kind (``skip_invalid=True``); the first
  ``log_first`` skips are printed to stderr, each naming file, record and reason."""

  def __init__(self, log_first: int = 10):
    self._lock = threading.Lock()
    self.counts: dict[str, int] = {}
    self.log_first = log_first

  def __getstate__(self):   # picklable for mp_prefetch workers (each keeps its own count)
    return {"counts": dict(self.counts), "log_first": self.log_first}

  def __setstate__(self, d):
    self.__dict__.update(d)
    self._lock = threading.Lock()

  def add(self, err: InvalidRecordError | shards.DamagedChunkError) -> None:
    with self._lock:
      self.counts[err.kind] = self.counts.get(err.kind, 0) + 1
      n = self.total
    if n <= self.log_first:
      print(f"warning: skipping invalid record ({n} so far"
            f"{', no more of these messages' if n == self.log_first else ''}): {err}",
            file=sys.stderr, flush=True)

  @property
  def total(self) -> int:
    return sum(self.counts.values())

  def report(self) -> str:
    return f"skipped {self.total} invalid records: {dict(sorted(self.counts.items()))}"


def record_spec(schema: Schema) -> dict[str, tuple[np.dtype, tuple]]:
  """{field: (dtype, shape)}; ``None`` in a shape is a variable size (bounded, see validation)."""
  K = len(schema.tasks)
  spec = {"dense": (np.float32, (len(schema.dense),)), "surface": (np.int32, ()),
          "labels": (np.float32, (K,)), "label_mask": (np.float32, (K,)),
          "true_prob": (np.float32, (K,)), "user_id": (np.int32, ()), "ad_id": (np.int32, ()),
          "request_ts": (np.int32, ())}
  for f in schema.sparse:
    spec[f"sparse/{f.name}"] = (np.int64, (None,))
  for s in schema.streams:
    spec[f"events/{s.name}"] = (np.int32, (None, len(records.event_columns(s))))
  return {k: (np.dtype(d), shp) for k, (d, shp) in spec.items()}


class RecordChecker:
  """``RecordChecker(schema)(raw_bytes_or_dict, file=, index=, surface=None) -> dict of arrays``."""

  def __init__(self, schema: Schema):
    self.schema = schema
    self.spec = record_spec(schema)
    S = len(schema.surfaces)
    self.ev_hi = {s.name: np.array([s.item_vocab, s.action_vocab, S, np.iinfo(np.int32).max]
                                   + [e.vocab_size for e in s.extra_fields], np.int64)
                  for s in schema.streams}
    self.cols = {s.name: records.event_columns(s) for s in schema.streams}
    self.always = [k for k, t in enumerate(schema.tasks) if t.always_valid]
    # (name, dtype, fixed shape or None, ndim, fixed trailing size or None)
    self.checks = [(k, dt, shp if None not in shp else None, len(shp),
                    shp[1] if len(shp) == 2 else None) for k, (dt, shp) in self.spec.items()]

  def __call__(self, rec, *, file: str, index: int, surface: int | None = None) -> dict:
    def bad(kind, field, msg):
      raise InvalidRecordError(kind, file, index, field, msg)

    if isinstance(rec, (bytes, bytearray, memoryview)):
      try:
        rec = records.decode(bytes(rec))
      except records.RecordFormatError as e:
        bad("bytes", "<record>", str(e))
    for name, dt, fixed, ndim, trail in self.checks:
      a = rec.get(name)
      if a is None:
        bad("missing", name, "missing from the record")
      if a.dtype != dt:
        bad("dtype", name, f"dtype {a.dtype}, expected {dt}")
      if (a.shape != fixed) if fixed is not None else (
          a.ndim != ndim or (trail is not None and a.shape[1] != trail)):
        shape = self.spec[name][1]
        want = "[" + ", ".join("n" if w is None else str(w) for w in shape) + "]"
        bad("shape", name, f"shape {list(a.shape)}, expected {want}")
    if len(rec) != len(self.spec):
      extra = sorted(set(rec) - set(self.spec))
      bad("missing", extra[0], f"unknown field(s) {extra}; expected {sorted(self.spec)}")

    S = len(self.schema.surfaces)
    surf = int(rec["surface"])
    if not 0 <= surf < S:
      bad("surface", "surface", f"surface index {surf} not in [0, {S}) {self.schema.surfaces}")
    if surface is not None and surf != surface:
      bad("surface", "surface", f"record of surface {self.schema.surfaces[surf]!r} in a file "
          f"of surface {self.schema.surfaces[surface]!r}")
    dense = rec["dense"]
    if not math.isfinite(dense.sum(dtype=np.float64)):     # NaN / inf propagate into the sum
      j = int(np.flatnonzero(~np.isfinite(dense))[0])
      bad("non_finite", f"dense/{self.schema.dense[j]}", f"value {dense[j]} is not finite")
    for f in self.schema.sparse:
      ids = rec[f"sparse/{f.name}"].tolist()
      if len(ids) > f.max_len:
        bad("shape", f"sparse/{f.name}", f"{len(ids)} ids, max_len is {f.max_len}")
      if ids and (min(ids) < 0 or (not f.hashed and max(ids) >= f.vocab_size)):
        bad("id_range", f"sparse/{f.name}", f"ids in [{min(ids)}, {max(ids)}] outside "
            f"[0, {'inf' if f.hashed else f.vocab_size})")
    req = int(rec["request_ts"])
    if req < 0:
      bad("timestamp", "request_ts", f"negative timestamp {req}")
    for s in self.schema.streams:
      ev = rec[f"events/{s.name}"]
      name = f"events/{s.name}"
      if len(ev) > s.max_len:
        bad("shape", name, f"{len(ev)} events, max_len is {s.max_len}")
      if not len(ev):
        continue
      lo, hi = ev.min(0), ev.max(0)
      if (lo < 0).any() or (hi >= self.ev_hi[s.name]).any():
        cols = self.cols[s.name]
        c = int(np.flatnonzero((lo < 0) | (hi >= self.ev_hi[s.name]))[0])
        if cols[c] == "ts":
          bad("timestamp", f"{name}/ts", f"negative event timestamp {lo[c]}")
        kind = "surface" if cols[c] == "surface" else "id_range"
        bad(kind, f"{name}/{cols[c]}", f"values in [{lo[c]}, {hi[c]}] outside "
            f"[0, {self.ev_hi[s.name][c]})")
      if hi[3] > req:
        bad("timestamp", f"{name}/ts", f"event at {hi[3]} after the request at {req}")
      ts = ev[:, 3]
      if len(ts) > 1 and (ts[1:] < ts[:-1]).any():
        bad("timestamp", f"{name}/ts", "events not in time order (oldest first)")
    for k in ("labels", "label_mask"):
      v = rec[k].tolist()
      if any(x != 0 and x != 1 for x in v):
        bad("label", k, f"values {v} must be 0 or 1")
    mask = rec["label_mask"].tolist()
    if any(mask[k] != 1 for k in self.always):
      bad("label", "label_mask", "an always-valid task has label_mask 0")
    p = rec["true_prob"].tolist()
    if any(x < 0 or x > 1 for x in p):                     # NaN compares False: allowed
      bad("label", "true_prob", f"values {p} outside [0, 1] (NaN = unknown)")
    return rec


def validate_record(rec, schema: Schema, *, file: str, index: int,
                    surface: int | None = None) -> dict:
  """One-off validation (the pipeline keeps one ``RecordChecker`` per schema)."""
  return RecordChecker(schema)(rec, file=file, index=index, surface=surface)


def read_split(data_dir: str, split: str, schema: Schema | None = None):
  """Yields ``(path, index, decoded_and_validated_record)`` for every record of a split."""
  schema = schema or Schema.load(data_dir)
  v = RecordChecker(schema)
  for surface, files in records.split_files(data_dir, split, schema).items():
    for path, count in files:
      src = records.RecordSource([(path, count)])
      for i in range(count):
        _, _, raw = src[i]
        yield path, i, v(raw, file=path, index=i, surface=schema.surfaces.index(surface))


class BatchValidator:
  """Vectorised decode + validation of a batch of raw records into padded columns.

  ``BatchValidator(schema, seq_lens)(raws, surface_i32[N], where) -> (cols, ok bool[N], errors)``

  Records written by one writer share a header layout up to the per-record sizes (number of ids,
  number of events). The first structurally valid header of the batch is the template; every
  record whose header bytes equal it (sizes aside) and whose length matches is decoded with numpy
  gathers over the concatenated batch and checked with the same rules as ``RecordChecker``, all
  records at once. Every other record, and every record failing a vectorised check, goes through
  the per-record ``RecordChecker``: it either raises (the exact kind / field / message; ``errors``
  collects ``(row, InvalidRecordError)``) or is valid with another layout and is filled in row by
  row. So a record is accepted only if it passes checks at least as strict as ``RecordChecker``'s.

  ``surface[i]``: the surface of record i's file (-1: unchecked). ``where(i) -> (file, index)``
  names record i in error messages. ``cols`` (N rows): ``dense``, ``surface``, ``labels``,
  ``label_mask``, ``true_prob``, ``user_id``, ``ad_id``, ``request_ts`` as in ``record_spec``;
  ``sparse/<f>`` i64[N, max_len] raw ids, -1 padded; ``events/<s>`` i32[N, T, C] the most recent
  ``T = seq_lens[s]`` events oldest first, 0 padded, ``length/<s>`` i32[N]. Invalid rows hold
  zeros / -1.
  """

  FIXED = ("dense", "surface", "labels", "label_mask", "true_prob", "user_id", "ad_id",
           "request_ts")

  def __init__(self, schema: Schema, seq_lens: dict[str, int]):
    self.schema, self.seq_lens = schema, dict(seq_lens)
    self.validator = RecordChecker(schema)
    self.spec = self.validator.spec
    self.ragged = {k for k, (_, shp) in self.spec.items() if None in shp}
    K, S = len(schema.tasks), len(schema.surfaces)
    self.S = S
    self.always = np.array(self.validator.always, np.int64)
    self.K = K

  # ---- output buffers ---------------------------------------------------------------------
  def empty(self, n: int) -> dict[str, np.ndarray]:
    cols = {k: np.zeros((n,) + shp, dt) for k, (dt, shp) in self.spec.items()
            if k not in self.ragged}
    for f in self.schema.sparse:
      cols[f"sparse/{f.name}"] = np.full((n, f.max_len), -1, np.int64)
    for s in self.schema.streams:
      if s.name in self.seq_lens:
        C = len(self.validator.cols[s.name])
        cols[f"events/{s.name}"] = np.zeros((n, self.seq_lens[s.name], C), np.int32)
        cols[f"length/{s.name}"] = np.zeros(n, np.int32)
    return cols

  def fill_row(self, cols: dict, i: int, rec: dict) -> None:
    """Writes one validated record dict into row ``i``."""
    for k in self.FIXED:
      cols[k][i] = rec[k]
    for f in self.schema.sparse:
      ids = rec[f"sparse/{f.name}"]
      cols[f"sparse/{f.name}"][i, :len(ids)] = ids
    for s, T in self.seq_lens.items():
      ev = rec[f"events/{s}"][-T:]
      cols[f"events/{s}"][i, :len(ev)] = ev
      cols[f"length/{s}"][i] = len(ev)

  # ---- template ---------------------------------------------------------------------------
  def _template(self, raw: bytes):
    """Header layout of ``raw`` if structurally valid for the schema, else None."""
    try:
      fields, H = records.parse_header(raw)
    except records.RecordFormatError:
      return None
    names = [f[0] for f in fields]
    if sorted(names) != sorted(self.spec) or len(set(names)) != len(names):
      return None
    for name, dt, shape, _ in fields:
      want_dt, want = self.spec[name]
      if dt != want_dt or len(shape) != len(want):
        return None
      if any(w is not None and w != d for w, d in zip(want, shape, strict=True)):
        return None
    return fields, H, raw[:H]

  # ---- batch ------------------------------------------------------------------------------
  def __call__(self, raws: list[bytes], surface: np.ndarray, where):
    n = len(raws)
    cols, ok = None, np.zeros(n, bool)
    if n:
      tmpl = None
      for raw in raws[:4]:
        tmpl = self._template(raw)
        if tmpl is not None:
          break
      if tmpl is not None:
        ok, cols = self._fast(raws, np.asarray(surface, np.int64), tmpl)
    if ok.all() and cols is not None:
      return cols, ok, []
    if cols is None or not ok.any():
      cols = self.empty(n)
    elif not ok.all():                                     # fast rows into full-size columns
      full = self.empty(n)
      for k, v in cols.items():
        full[k][ok] = v
      cols = full
    errors = []
    for i in np.flatnonzero(~ok).tolist():
      file, index = where(i)
      try:
        rec = self.validator(raws[i], file=file, index=index,
                             surface=None if surface[i] < 0 else int(surface[i]))
      except InvalidRecordError as e:
        errors.append((i, e))
        continue
      self.fill_row(cols, i, rec)
      ok[i] = True
    return cols, ok, errors

  def _fast(self, raws, surface, tmpl):
    """(ok bool[N], columns of the ok rows only) for the records laid out like ``tmpl``."""
    fields, H, head = tmpl
    n = len(raws)
    lens = np.fromiter(map(len, raws), np.int64, n)
    p0 = -H % 4                               # every payload starts 4-byte aligned in ``buf``
    tails = (-(p0 + lens)) % 4
    pads = (b"", b"\0", b"\0\0", b"\0\0\0")
    pre = pads[p0]
    buf = b"".join([x for r, t in zip(raws, tails.tolist(), strict=True)
                    for x in (pre, r, pads[t])])
    slot = p0 + lens + tails
    starts = np.cumsum(slot) - slot
    u8 = np.frombuffer(buf, np.uint8)
    i32 = np.frombuffer(buf, np.int32)
    lim = len(i32)
    hdr_idx = np.minimum((starts + p0)[:, None] + np.arange(H), len(u8) - 1)
    hdr = u8[hdr_idx]
    static = np.ones(H, bool)
    for name, _, _, off in fields:
      if name in self.ragged:
        static[off:off + 4] = False           # the first (variable) dim
    tmpl_u8 = np.frombuffer(head, np.uint8)
    ok = (lens >= H) & ((hdr == tmpl_u8) | ~static).all(1)
    # per-field sizes in 4-byte words and offsets into i32
    words = []
    dims = {}
    for name, dt, shape, off in fields:
      per_row = dt.itemsize * math.prod(shape[1:]) // 4 if name in self.ragged else None
      if name in self.ragged:
        b = hdr[:, off:off + 4].astype(np.int64)
        d = b[:, 0] | b[:, 1] << 8 | b[:, 2] << 16 | b[:, 3] << 24
        dims[name] = d
        words.append(d * per_row)
      else:
        words.append(np.full(n, dt.itemsize * math.prod(shape) // 4, np.int64))
    total = H + 4 * np.sum(words, axis=0)
    ok &= lens == total
    # size limits (records outside them are re-checked row by row; no gathers past a record)
    for f in self.schema.sparse:
      ok &= dims[f"sparse/{f.name}"] <= f.max_len
    for s in self.schema.streams:
      ok &= dims[f"events/{s.name}"] <= s.max_len
    base = (starts + p0 + H) // 4
    offs = {}
    acc = base.copy()
    for (name, *_), w in zip(fields, words, strict=True):
      offs[name] = acc
      acc = acc + np.where(ok, w, 0)
    for name in dims:
      dims[name] = np.where(ok, dims[name], 0)
    rows = np.flatnonzero(ok)
    if not len(rows):
      return ok, None
    m = len(rows)

    def fixed(name):
      dt, shape = self.spec[name]
      nw = math.prod(shape)
      v = i32[offs[name][rows][:, None] + np.arange(nw)]
      return v.view(dt).reshape((m,) + shape)

    fx = {k: fixed(k) for k in self.FIXED}
    good = np.isfinite(fx["dense"]).all(1)
    surf = fx["surface"]
    good &= (surf >= 0) & (surf < self.S)
    exp = surface[rows]
    good &= (exp < 0) | (surf == exp)
    good &= fx["request_ts"] >= 0
    for k in ("labels", "label_mask"):
      good &= ((fx[k] == 0) | (fx[k] == 1)).all(1)
    if len(self.always):
      good &= (fx["label_mask"][:, self.always] == 1).all(1)
    tp = fx["true_prob"]
    good &= ~((tp < 0) | (tp > 1)).any(1)

    sparse = {}
    for f in self.schema.sparse:
      name = f"sparse/{f.name}"
      L = dims[name][rows]
      j = np.arange(f.max_len)
      valid = j[None, :] < L[:, None]
      w = offs[name][rows][:, None] + 2 * np.minimum(j, np.maximum(L - 1, 0)[:, None])
      w = np.minimum(w, lim - 2)                      # empty rows read (masked) words in range
      lo = i32[w].astype(np.int64) & 0xFFFFFFFF
      ids = (i32[w + 1].astype(np.int64) << 32) | lo
      bad = valid & ((ids < 0) | (False if f.hashed else ids >= f.vocab_size))
      good &= ~bad.any(1)
      sparse[name] = np.where(valid, ids, -1)

    events = {}
    req = fx["request_ts"]
    for s in self.schema.streams:
      name = f"events/{s.name}"
      C = len(self.validator.cols[s.name])
      L = dims[name][rows]
      E = int(L.sum())
      ends = np.cumsum(L)
      # all events of the batch, record after record: contiguous copies of each payload
      flat = np.concatenate([i32[a:a + n * C] for a, n in zip(offs[name][rows].tolist(),
                                                               L.tolist(), strict=True) if n]
                            + [np.zeros(C, np.int32)]).reshape(E + 1, C)   # + a zero row
      if E:
        nz = np.flatnonzero(L)
        first = (ends - L)[nz]
        lo = np.minimum.reduceat(flat[:E], first, axis=0)        # per record with events
        hi = np.maximum.reduceat(flat[:E], first, axis=0)
        bad = np.zeros(m, bool)
        bad[nz] = ((lo < 0) | (hi >= self.validator.ev_hi[s.name])).any(1) | (hi[:, 3] > req[nz])
        ts = flat[:E, 3]
        drop = np.flatnonzero(ts[1:] < ts[:-1]) + 1               # usually empty
        if len(drop):
          start = np.zeros(E, bool)
          start[first] = True
          drop = drop[~start[drop]]                               # inside one record only
          bad[np.searchsorted(ends, drop, side="right")] = True
        good &= ~bad
      if s.name in self.seq_lens:
        T = self.seq_lens[s.name]
        kept = np.minimum(L, T)
        valid = np.arange(T)[None, :] < kept[:, None]
        row = np.where(valid, (ends - kept)[:, None] + np.arange(T)[None, :], E)   # E: zeros
        events[s.name] = (np.take(flat, row, axis=0), kept)

    out = {**fx, **sparse}
    for s_name, (ev, kept) in events.items():
      out[f"events/{s_name}"], out[f"length/{s_name}"] = ev, kept
    if not good.all():
      out = {k: v[good] for k, v in out.items()}
    ok[:] = False
    ok[rows[good]] = True
    return ok, out


# ---- the dataset check: python -m data.verify ------------------------------------------------

_BATCH = 1024      # records per read / validation batch
_SHOW = 3          # messages kept per file and kind of problem


class Bar:
  """A progress bar on stderr: redrawn in place on a terminal, else a line every 10 s."""

  def __init__(self, total: int, unit: str, label: str, stream=None):
    self.total, self.unit, self.label, self.n = max(int(total), 1), unit, label, 0
    self.stream = stream or sys.stderr
    self.tty = self.stream.isatty()
    self.t0 = self._last = time.perf_counter()

  def update(self, n: int) -> None:
    self.n += n
    now = time.perf_counter()
    if now - self._last >= (0.1 if self.tty else 10.0) or self.n >= self.total:
      self._last = now
      self._draw(now)

  def _draw(self, now):
    f = min(self.n / self.total, 1.0)
    rate = self.n / max(now - self.t0, 1e-9)
    eta = (self.total - self.n) / rate if rate > 0 else 0.0
    scale, unit = (1 << 20, "MB") if self.unit == "bytes" else (1, self.unit)
    line = (f"{self.label} [{'#' * int(30 * f):<30}] {100 * f:5.1f}% "
            f"{self.n / scale:,.0f}/{self.total / scale:,.0f} {unit}, "
            f"{rate / scale:,.0f} {unit}/s, ETA {eta:.0f}s")
    if self.tty:
      self.stream.write("\r" + line)
    else:
      self.stream.write(line + "\n")
    self.stream.flush()

  def close(self) -> None:
    if self.tty:
      self.stream.write("\n")
      self.stream.flush()


def _check_storage(e: dict, bar: Bar) -> dict:
  """Size, SHA-256, opening and record count of one manifest entry -> its report."""
  path, count = e["path"], int(e["count"])
  rep = {"file": e["file"], "count": count, "problems": [], "size": "not recorded",
         "sha256": "not recorded", "opens": False, "damaged": [], "invalid": {}}
  try:
    shards.check_entry(path, e)
  except shards.DataFileError as err:
    rep["problems"].append(str(err))
    rep["size"] = "missing" if not os.path.exists(path) else "mismatch"
    rep["sha256"] = "not checked" if "sha256" in e else rep["sha256"]
    bar.update(int(e.get("bytes", 0)))
    return rep
  if "bytes" in e:
    rep["size"] = "ok"
  if "sha256" in e:
    got = shards.sha256_file(path, bar.update)
    rep["sha256"] = "ok" if got == e["sha256"] else "mismatch"
    if got != e["sha256"]:
      rep["problems"].append(f"{path}: SHA-256 {got[:12]}.. differs from the manifest's "
                             f"{e['sha256'][:12]}.. (bytes changed)")
  try:
    shards.open_reader(path, count).close()
    rep["opens"] = True
  except shards.DataFileError as err:
    rep["problems"].append(str(err))
  return rep


def _scan_records(e: dict, rep: dict, surface: int, validator: BatchValidator, bar: Bar) -> None:
  """Reads every record of an entry (damaged chunks) and validates it; fills ``rep``."""
  path, count = e["path"], int(e["count"])
  src = records.RecordSource([(path, count)])
  damaged, invalid = {}, {}
  for lo in range(0, count, _BATCH):
    idx = np.arange(lo, min(lo + _BATCH, count))
    bad = []
    _, _, raws = src.read_many(idx, damaged=bad)
    for _, err in bad:
      damaged.setdefault((err.first, err.last), err.reason)
    keep = sorted(set(range(len(idx))) - {n for n, _ in bad})
    if keep:
      _, _, errors = validator([raws[n] for n in keep], np.full(len(keep), surface, np.int64),
                               lambda n, keep=keep, idx=idx: (path, int(idx[keep[n]])))
      for _, err in errors:
        n, msgs = invalid.setdefault(err.kind, [0, []])
        invalid[err.kind][0] += 1
        if len(msgs) < _SHOW:
          msgs.append(str(err))
    bar.update(len(idx))
  rep["damaged"] = [[a, b] for a, b in damaged]
  rep["invalid"] = {k: v[0] for k, v in invalid.items()}
  if damaged:
    n_bad = sum(b - a + 1 for a, b in damaged)
    ranges = ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in list(damaged)[:_SHOW])
    more = f" (+{len(damaged) - _SHOW} more)" if len(damaged) > _SHOW else ""
    rep["problems"].append(f"{path}: {n_bad} record(s) in {len(damaged)} damaged chunk(s) cannot "
                           f"be read: records {ranges}{more} ({next(iter(damaged.values()))})")
  for kind, (n, msgs) in invalid.items():
    rep["problems"].append(f"{n} invalid record(s) of kind {kind}, e.g. {msgs[0]}")


def verify(data_dir: str, deep: bool = False, splits=None, stream=None, bar_stream=None) -> dict:
  """Checks ``data_dir``; prints the per-file report to ``stream`` and returns it as a dict
  ``{"data_dir", "deep", "sized", "files": [...], "ok"}``."""
  stream = stream or sys.stdout
  schema = Schema.load(data_dir)
  m = records.load_manifest(data_dir)
  splits = list(splits or m["splits"])
  unknown = sorted(set(splits) - set(m["splits"]))
  if unknown:
    raise ValueError(f"unknown split(s) {unknown}; the manifest has {sorted(m['splits'])}")
  entries = [(split, s, e) for split in splits
             for s, es in records.split_entries(data_dir, split, schema, check=False).items()
             for e in es]
  sized = all("bytes" in e and "sha256" in e for *_, e in entries)
  if not sized:
    print(f"note: {data_dir}/manifest.json records no byte sizes / checksums for some files "
          "(written by an older version): those are checked for existence, opening and record "
          "count" + (", and every chunk and record is read (--deep)" if deep else
                     " only; --deep also reads every chunk and record"), file=stream)
  bar = Bar(sum(int(e.get("bytes", 0)) for *_, e in entries if "sha256" in e), "bytes",
            "checksums", bar_stream)
  reps = [_check_storage(e, bar) for *_, e in entries]
  bar.close()
  if deep:
    validator = BatchValidator(schema, {s.name: s.max_len for s in schema.streams})
    bar = Bar(sum(int(e["count"]) for *_, e in entries), "records", "records", bar_stream)
    for (_, s, e), rep in zip(entries, reps, strict=True):
      if rep["opens"]:
        _scan_records(e, rep, schema.surfaces.index(s), validator, bar)
      else:
        bar.update(int(e["count"]))
    bar.close()
  files = [dict(r, split=split, surface=s) for (split, s, _), r in zip(entries, reps, strict=True)]
  _print_report(files, deep, stream)
  return {"data_dir": data_dir, "deep": deep, "sized": sized, "files": files,
          "ok": not any(f["problems"] for f in files)}


def _print_report(files, deep, stream):
  w = max([len(f["file"]) for f in files] + [4])
  head = f"{'file':<{w}} {'records':>8} {'size':>12} {'sha256':>12} " + \
      ("{:>9} {:>8}  ".format("unreadable", "invalid") if deep else "") + "status"
  print(head, file=stream)
  print("-" * len(head), file=stream)
  for f in files:
    cells = f"{f['file']:<{w}} {f['count']:>8} {f['size']:>12} {f['sha256']:>12} "
    if deep:
      n_dmg = sum(b - a + 1 for a, b in f["damaged"])
      cells += f"{n_dmg:>10} {sum(f['invalid'].values()):>8}  "
    print(cells + ("DAMAGED" if f["problems"] else "ok"), file=stream)
  bad = [f for f in files if f["problems"]]
  for f in bad:
    for p in f["problems"]:
      print(f"  {f['file']}: {p}" if not p.startswith("/") else f"  {p}", file=stream)
  n = len(files)
  print(f"{n - len(bad)}/{n} files intact" + ("" if deep else " (files only; --deep reads "
                                                                 "every chunk and record)"),
        file=stream)


def update_manifest(data_dir: str) -> int:
  """Adds ``bytes`` / ``sha256`` to the manifest entries without them; returns how many."""
  path = os.path.join(data_dir, "manifest.json")
  m = records.load_manifest(data_dir)
  n = 0
  for split in m["splits"].values():
    for entries in split.values():
      for i, e in enumerate(entries):
        if "bytes" not in e or "sha256" not in e:
          entries[i] = dict(e, **{k: v for k, v in shards.file_entry(
              data_dir, e["file"], e["count"]).items() if k in ("bytes", "sha256")})
          n += 1
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(m, f, indent=1)
  os.replace(tmp, path)
  return n


def main(argv=None) -> int:
  prog = "python -m data.verify"
  ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
  ap.add_argument("data_dir")
  ap.add_argument("--deep", action="store_true",
                  help="read every chunk and validate every record against the schema")
  ap.add_argument("--split", default=None, help="comma-separated splits (default: all)")
  ap.add_argument("--json", default=None, help="also write the report as JSON here")
  ap.add_argument("--update_manifest", action="store_true",
                  help="after a clean --deep pass, add missing sizes / checksums to the manifest")
  a = ap.parse_args(argv)
  if a.update_manifest and not a.deep:
    ap.error("--update_manifest needs --deep (checksums are recorded only for verified files)")
  if a.json and not os.path.isdir(os.path.dirname(os.path.abspath(a.json))):
    ap.error(f"--json={a.json}: no such directory for the report")
  try:
    if not os.path.isdir(a.data_dir):
      raise FileNotFoundError(f"{a.data_dir}: " + (
          "not a directory" if os.path.exists(a.data_dir) else "no such directory"))
    why = outputs.problem([("--json", a.json)], inputs=[("DIR", a.data_dir)])  # docs/outputs.md
    if why:
      raise ValueError(why)
    rep = verify(a.data_dir, a.deep, a.split.split(",") if a.split else None)
    if a.json:
      with open(a.json, "w") as f:
        json.dump(rep, f, indent=1)
  except (OSError, ValueError) as e:
    print(f"{prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
    return 2
  if a.update_manifest and rep["ok"] and not rep["sized"]:
    print(f"recorded sizes and checksums of {update_manifest(a.data_dir)} files in "
          f"{a.data_dir}/manifest.json")
  elif a.update_manifest and not rep["ok"]:
    print("manifest not updated: some files are damaged", file=sys.stderr)
  return 0 if rep["ok"] else 1


if __name__ == "__main__":
  sys.exit(main())
