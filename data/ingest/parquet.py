"""Parquet with the documented column layout -> ArrayRecord: ``table_to_records`` (one table row
= one example, checked like the pipeline checks records; errors name file, row and column) and
``convert_parquet({split: [paths]}, out_dir, schema)``. The layout: data/README.md ("Parquet").
"""

from __future__ import annotations

import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from data import records
from data.schema import Schema
from data.verify import BatchValidator


def schema_columns(schema: Schema) -> set[str]:
  """Every column name the layout above reads for ``schema`` (true_prob.* optional)."""
  cols = {"surface", "request_ts", "user_id", "ad_id"}
  cols |= {f"dense.{d}" for d in schema.dense} | {f"sparse.{f.name}" for f in schema.sparse}
  cols |= {f"events.{s.name}.{c}" for s in schema.streams for c in records.event_columns(s)}
  cols |= {f"{p}.{t.name}" for t in schema.tasks for p in ("label", "true_prob")}
  return cols


def unknown_columns(names, schema: Schema) -> list[str]:
  """Columns of a table that the schema does not read (they would be ignored)."""
  known = schema_columns(schema)
  return [c for c in names if c not in known]


def _column(table: pa.Table, name: str, kind: str, path: str) -> pa.ChunkedArray:
  if name not in table.column_names:
    raise ValueError(f"{path}: missing column {name!r} (expected {kind})")
  col = table.column(name)
  t = col.type
  text = lambda t: pa.types.is_string(t) or pa.types.is_large_string(t)
  ok = {"string": text(t) or (pa.types.is_dictionary(t) and text(t.value_type)),
        "integer": pa.types.is_integer(t),
        "floating": pa.types.is_floating(t),
        "number": pa.types.is_integer(t) or pa.types.is_floating(t),
        "list<integer>": (pa.types.is_list(t) or pa.types.is_large_list(t))
        and pa.types.is_integer(t.value_type)}[kind]
  if not ok:
    raise ValueError(f"{path}: column {name!r} has type {t}, expected {kind}")
  if kind != "number" and col.null_count:
    row = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
    raise ValueError(f"{path}: column {name!r} has {col.null_count} null values (first: table "
                     f"row {row})")
  return col


def _ints(x: np.ndarray, name: str, path: str, dtype=np.int32) -> np.ndarray:
  info = np.iinfo(dtype)
  if len(x) and (x.min() < info.min or x.max() > info.max):
    raise ValueError(f"{path}: column {name!r} has values outside the {np.dtype(dtype)} range")
  return x.astype(dtype, copy=False)


def _list(col: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
  arr = col.combine_chunks()
  offs = np.asarray(arr.offsets, np.int64)
  vals = np.asarray(arr.values.slice(offs[0], offs[-1] - offs[0]).to_numpy(zero_copy_only=False))
  return vals, offs - offs[0]


def _first(mask: np.ndarray, offs: np.ndarray | None = None) -> int:
  """The first row with a True in ``mask`` (per value when ``offs`` maps values to rows)."""
  i = int(np.flatnonzero(mask)[0])
  return i if offs is None else int(np.searchsorted(offs, i, side="right") - 1)


def check_columns(fixed: dict, ragged: dict, schema: Schema, skip=()):
  """The record checks of ``data.verify.RecordChecker`` on the columns before encoding (same
  rules, vectorised over the whole table): ``(row, field, message)`` of the first failure, or
  None. Ragged fields named in ``skip`` were checked by the caller."""
  found = []
  S = len(schema.surfaces)
  dense = fixed["dense"]
  if dense.size and not np.isfinite(dense).all():
    i, j = np.argwhere(~np.isfinite(dense))[0]
    found.append((int(i), f"dense/{schema.dense[j]}", f"value {dense[i, j]} is not finite"))
  for f in schema.sparse:
    vals, offs = ragged[f"sparse/{f.name}"]
    lens = np.diff(offs)
    if len(lens) and lens.max() > f.max_len:
      i = _first(lens > f.max_len)
      found.append((i, f"sparse/{f.name}", f"{lens[i]} ids, max_len is {f.max_len}"))
    out = (vals < 0) | ((vals >= f.vocab_size) if not f.hashed else False)
    if np.any(out):
      i = _first(out, offs)
      v = vals[offs[i]:offs[i + 1]]
      found.append((i, f"sparse/{f.name}", f"ids in [{v.min()}, {v.max()}] outside "
                    f"[0, {'inf' if f.hashed else f.vocab_size})"))
  req = fixed["request_ts"].astype(np.int64)
  if len(req) and req.min() < 0:
    found.append((_first(req < 0), "request_ts", f"negative timestamp {req.min()}"))
  for s in schema.streams:
    name = f"events/{s.name}"
    if name in skip:
      continue
    ev, offs = ragged[name]
    lens = np.diff(offs)
    if len(lens) and lens.max() > s.max_len:
      i = _first(lens > s.max_len)
      found.append((i, name, f"{lens[i]} events, max_len is {s.max_len}"))
    if not len(ev):
      continue
    cols = records.event_columns(s)
    hi = np.array([s.item_vocab, s.action_vocab, S, np.iinfo(np.int32).max]
                  + [e.vocab_size for e in s.extra_fields], np.int64)
    out = (ev < 0) | (ev >= hi)
    if out.any():
      e, c = np.argwhere(out)[0]
      i = _first(np.arange(len(ev)) == e, offs)
      kind = f"{name}/{cols[c]}"
      found.append((i, kind, f"value {ev[e, c]} outside [0, {hi[c]})"))
    row = np.repeat(np.arange(len(lens)), lens)
    ts = ev[:, 3].astype(np.int64)
    late = ts > req[row]
    if late.any():
      e = int(np.flatnonzero(late)[0])
      found.append((int(row[e]), f"{name}/ts", f"event at {ts[e]} after the request at "
                    f"{req[row[e]]}"))
    back = np.zeros(len(ts), bool)
    back[1:] = (ts[1:] < ts[:-1]) & (row[1:] == row[:-1])
    if back.any():
      found.append((int(row[np.flatnonzero(back)[0]]), f"{name}/ts",
                    "events not in time order (oldest first)"))
  for k in ("labels", "label_mask"):
    v = fixed[k]
    out = (v != 0) & (v != 1)
    if out.any():
      i = int(np.argwhere(out)[0][0])
      found.append((i, k, f"values {v[i].tolist()} must be 0 or 1"))
  always = [k for k, t in enumerate(schema.tasks) if t.always_valid]
  if always and len(fixed["label_mask"]) and (fixed["label_mask"][:, always] != 1).any():
    i = int(np.argwhere(fixed["label_mask"][:, always] != 1)[0][0])
    found.append((i, "label_mask", "an always-valid task has label_mask 0"))
  p = fixed["true_prob"]
  out = (p < 0) | (p > 1)
  if out.any():
    i = int(np.argwhere(out)[0][0])
    found.append((i, "true_prob", f"values {p[i].tolist()} outside [0, 1] (NaN = unknown)"))
  return min(found, key=lambda x: x[0]) if found else None


def table_to_records(table: pa.Table, schema: Schema, path: str = "<table>",
                     row_offset: int = 0, rows=None, validate: str = "columns",
                     prebuilt: dict | None = None) -> dict[str, list[bytes]]:
  """Converts one table; returns ``{surface: [record bytes, ...]}`` in row order.

  ``row_offset``: index of the table's first row in its file (for error messages); ``rows``
  (i64[num_rows], optional) instead names each table row's row in its file. ``validate``:
  ``columns`` checks the values column-wise before encoding (``check_columns``), ``records``
  decodes and validates the encoded records (``data.verify.BatchValidator``, slower).
  ``prebuilt``: streams given as arrays rather than table columns: ``{stream: (events i32[E,
  4 + extras], offsets i64[N + 1])}`` (checked the same way), or ``(events, start i64[N], stop
  i64[N])``: row i's events are ``events[start[i]:stop[i]]`` (windows into one array, encoded in
  place: ``records.encode_ranges``), checked by the caller (``bucket``: once per event)."""
  n = table.num_rows
  row_of = (lambda i: int(rows[i])) if rows is not None else (lambda i: i + row_offset)
  surf_col = _column(table, "surface", "string", path).combine_chunks()
  surf_col = surf_col if pa.types.is_dictionary(surf_col.type) else surf_col.dictionary_encode()
  surf_names = surf_col.dictionary.to_pylist()
  index = {s: i for i, s in enumerate(schema.surfaces)}
  bad = sorted({s for s in surf_names if s not in index})
  if bad:
    raise ValueError(f"{path}: column 'surface' has unknown surface(s) {bad}; "
                     f"schema has {schema.surfaces}")
  surf = np.array([index[s] for s in surf_names] or [0], np.int32)[
      surf_col.indices.to_numpy(zero_copy_only=False)]
  ints = lambda name: _ints(_column(table, name, "integer", path).to_numpy(), name, path)
  dense = [_column(table, f"dense.{d}", "floating", path).to_numpy() for d in schema.dense]
  labels, mask, prob = [], [], []
  for t in schema.tasks:
    name = f"label.{t.name}"
    col = _column(table, name, "number", path)
    if t.always_valid and col.null_count:
      raise ValueError(f"{path}: column {name!r} has nulls but task {t.name!r} is always valid")
    valid = ~np.asarray(col.is_null().to_numpy(zero_copy_only=False), bool)
    labels.append(np.where(valid, col.fill_null(0).to_numpy(), 0))
    mask.append(valid)
    pname = f"true_prob.{t.name}"
    if pname in table.column_names:
      pc = _column(table, pname, "number", path)
      prob.append(pc.fill_null(np.nan).to_numpy().astype(np.float64))
    else:
      prob.append(np.full(n, np.nan))
  f32 = lambda xs: np.stack(xs, 1).astype(np.float32) if xs else np.zeros((n, 0), np.float32)
  fixed = {"dense": f32(dense), "surface": surf, "labels": f32(labels),
           "label_mask": f32(mask), "true_prob": f32(prob), "user_id": ints("user_id"),
           "ad_id": ints("ad_id"), "request_ts": ints("request_ts")}
  ragged, ranges = {}, {}
  for f in schema.sparse:
    name = f"sparse.{f.name}"
    vals, offs = _list(_column(table, name, "list<integer>", path))
    ragged[f"sparse/{f.name}"] = (_ints(vals, name, path, np.int64), offs)
  for s in schema.streams:
    if prebuilt and s.name in prebuilt and len(prebuilt[s.name]) == 3:
      ev, start, stop = prebuilt[s.name]
      ranges[f"events/{s.name}"] = (np.ascontiguousarray(ev, np.int32), start, stop)
      continue
    if prebuilt and s.name in prebuilt:
      ev, offs = prebuilt[s.name]
      ragged[f"events/{s.name}"] = (np.ascontiguousarray(ev, np.int32),
                                    np.asarray(offs, np.int64))
      continue
    cols, offs0 = [], None
    for c in records.event_columns(s):
      name = f"events.{s.name}.{c}"
      vals, offs = _list(_column(table, name, "list<integer>", path))
      if offs0 is None:
        offs0 = offs
      elif not np.array_equal(offs, offs0):
        row = int(np.flatnonzero(np.diff(offs) != np.diff(offs0))[0])
        raise ValueError(f"{path}: row {row_of(row)}: column {name!r} has a different "
                         f"number of events than events.{s.name}.item")
      cols.append(_ints(vals, name, path))
    ev = np.stack(cols, 1) if cols and len(cols[0]) else np.zeros((0, len(cols)), np.int32)
    ragged[f"events/{s.name}"] = (ev.astype(np.int32), offs0)
  order = [f"sparse/{f.name}" for f in schema.sparse] + [f"events/{s.name}"
                                                         for s in schema.streams]
  encode = lambda: records.encode_ranges(fixed, {
      k: ranges[k] if k in ranges else (ragged[k][0], ragged[k][1][:-1], ragged[k][1][1:])
      for k in order})
  if validate == "records":
    recs = encode().to_pylist() if n else []
    check = BatchValidator(schema, {})        # vectorised; per-record RecordChecker for the rest
    for a in range(0, n, 4096):
      _, _, errors = check(recs[a:a + 4096], surf[a:a + 4096],
                           lambda i, a=a: (path, row_of(a + i)))
      if errors:
        i, e = errors[0]
        raise ValueError(f"{path}: row {row_of(a + i)}: invalid value in the column(s) of "
                         f"field {e.field!r}: {e}") from e
  else:
    bad = check_columns(fixed, ragged, schema, skip=set(ranges))
    if bad is not None:
      i, field, msg = bad
      raise ValueError(f"{path}: row {row_of(i)}: invalid value in the column(s) of field "
                       f"{field!r}: {msg}")
    recs = encode() if n else []
  out: dict[str, list[bytes]] = {s: [] for s in schema.surfaces}
  if n and (surf == surf[0]).all():
    out[schema.surfaces[surf[0]]] = recs if isinstance(recs, list) else recs.to_pylist()
    return out
  if isinstance(recs, list):
    objs = np.empty(n, object)
    objs[:] = recs
  else:
    objs = recs.to_numpy(zero_copy_only=False)
  for k, s in enumerate(schema.surfaces):
    out[s] = objs[surf == k].tolist()
  return out


def convert_parquet(splits: dict[str, list[str]], out_dir: str, schema: Schema,
                    records_per_shard: int = 200_000) -> dict:
  """Converts Parquet files per split into ``out_dir`` (shards, schema.json, manifest.json)."""
  writer = records.DatasetWriter(out_dir, schema, records_per_shard)
  for split, paths in splits.items():
    for path in paths:
      pf = pq.ParquetFile(path)
      extra = unknown_columns(pf.schema_arrow.names, schema)
      if extra:
        print(f"warning: {path}: columns not in the schema, ignored: {extra}", file=sys.stderr)
      start = 0
      for rg in range(pf.num_row_groups):
        table = pf.read_row_group(rg)
        for surface, recs in table_to_records(table, schema, path, start).items():
          writer.write(split, surface, recs)
        start += table.num_rows
  return writer.close(tuple(splits))
