"""Record validation against the schema; errors name file, record index and field.

Nothing is coerced: a record either matches ``data.records`` field layout exactly (dtype, rank,
sizes, id ranges, finite dense values, consistent timestamps, known surface, 0/1 labels) or it is
rejected with an ``InvalidRecordError``. Under ``skip_invalid`` the pipeline counts rejections in
an ``InvalidCounter`` instead of raising.
"""

from __future__ import annotations

import math
import threading

import numpy as np
from absl import logging

from data import records
from data.schema import Schema

KINDS = ("bytes", "missing", "dtype", "shape", "id_range", "non_finite", "timestamp", "surface",
         "label")


class InvalidRecordError(ValueError):
  """A record that does not satisfy the schema. ``kind`` is one of ``KINDS``."""

  def __init__(self, kind: str, file: str, index: int, field: str, msg: str):
    self.kind, self.file, self.index, self.field = kind, file, index, field
    super().__init__(f"{file}: record {index}: field {field!r}: {msg} [{kind}]")


class InvalidCounter:
  """Thread-safe count of skipped records per kind (``skip_invalid=True``)."""

  def __init__(self, log_first: int = 10):
    self._lock = threading.Lock()
    self.counts: dict[str, int] = {}
    self.log_first = log_first

  def __getstate__(self):   # picklable for mp_prefetch workers (each keeps its own count)
    return {"counts": dict(self.counts), "log_first": self.log_first}

  def __setstate__(self, d):
    self.__dict__.update(d)
    self._lock = threading.Lock()

  def add(self, err: InvalidRecordError) -> None:
    with self._lock:
      self.counts[err.kind] = self.counts.get(err.kind, 0) + 1
      n = self.total
    if n <= self.log_first:
      logging.warning("skipping invalid record (%d so far): %s", n, err)

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


class Validator:
  """``Validator(schema)(raw_bytes_or_dict, file=, index=, surface=None) -> dict of arrays``."""

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
  """One-off validation (the pipeline keeps one ``Validator`` per schema)."""
  return Validator(schema)(rec, file=file, index=index, surface=surface)
