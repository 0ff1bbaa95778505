"""Column layer of ``data.ingest``: your columns -> role columns (renamed, coerced) -> the
``data/ingest/parquet.py`` layout for a schema (optional event columns filled, wide ids hashed, list
lengths checked or truncated). Errors are ``CoerceError`` with the table row."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import data.ingest.coerce as coerce
import data.ingest.vocab as V
from data import records
from data.ingest.coerce import CoerceError, Coercions
from data.ingest.infer import Spec, role
from data.schema import Schema


def canonical(table: pa.Table, spec: Spec, log: Coercions) -> tuple[dict, dict]:
  """Renames to roles and coerces types (``data.ingest.coerce``).

  Returns ``(columns {role name: pa.Array}, facts)``; facts: ``hashed`` (sparse features turned
  into hashes), ``strings`` ({sparse column: (hashes, strings)}: the distinct values of string
  columns, for exact vocabularies), ``unknown`` (input columns with no role). A scalar sparse
  column also gets ``_null.<column>`` (bool: the row's value is null; its list is empty).
  """
  names = table.column_names
  dup = sorted({c for c in names if names.count(c) > 1})
  if dup:
    raise CoerceError(f"column name(s) {dup} appear more than once in the input; every column "
                      "needs its own name")
  action = (spec.history or {}).get("action")
  named = {**spec.columns, **({"history action": action} if action is not None else {})}
  absent = [f"{c!r} (as {r})" for r, c in named.items() if c not in table.column_names]
  if absent:
    have = table.column_names
    raise CoerceError(f"column(s) {', '.join(absent)} named by the spec (--rename / --schema / "
                      f"--history_action) not in the input; it has {have[:20]}"
                      + (f" and {len(have) - 20} more" if len(have) > 20 else ""))
  to_role = {v: k for k, v in spec.columns.items()}
  shown = {r: (f"{c} (as {r})" if c != r else r) for c, r in to_role.items()}
  cols, unknown = {}, []
  for name in table.column_names:
    r = to_role.get(name, name)
    if r == action and action is not None:
      cols["_action"] = coerce._arr(table.column(name))     # event action of built histories
      continue
    if role(r) is None:
      unknown.append(name)
      continue
    if r in cols:
      raise CoerceError(f"two columns play the role {r!r} ({spec.columns.get(r)!r} and {r!r})")
    cols[r] = coerce._arr(table.column(name))
  disp = lambda r: shown.get(r, r)
  out, hashed, strings = {}, set(), {}
  n = table.num_rows
  for r in ("request_ts", "user_id", "ad_id"):
    if r not in cols:
      raise CoerceError(f"missing column {r!r} (rename yours with --rename {r}=<column>)")
  out["request_ts"] = pa.array(coerce.timestamps(cols["request_ts"], disp("request_ts"),
                                                 spec.ts_unit, log))
  feats, hashed_keys = {}, []
  for r in ("user_id", "ad_id"):
    key, feats[r] = coerce.keys(cols[r], disp(r), log, r in spec.hash_keys)
    out[r] = pa.array(key)
    t = cols[r].type
    if not pa.types.is_integer(t) or (len(key) and not np.array_equal(
        key, cols[r].to_numpy(zero_copy_only=False))):
      hashed_keys.append(r)
  if "surface" in cols:
    s = cols["surface"]
    if pa.types.is_integer(s.type):
      log.add(disp("surface"), "integers -> surface names (their decimal text)")
    elif not (pa.types.is_string(s.type) or pa.types.is_large_string(s.type)
              or pa.types.is_dictionary(s.type)):
      raise CoerceError(f"column {disp('surface')!r} has type {s.type}, expected names")
    if s.null_count:
      raise CoerceError(f"column {disp('surface')!r} is null", coerce.first_row(coerce._nulls(s)))
    out["surface"] = s.cast(pa.string())
  else:
    out["surface"] = pa.array([spec.surface] * n, pa.string())
  for c, a in cols.items():
    rr = role(c)
    if rr == "dense":
      out[c] = coerce.dense(a, disp(c), log)
    elif rr == "sparse":
      out[c], h = coerce.id_lists(a, disp(c), log)
      if not coerce._is_list(a.type):
        out[f"_null.{c}"] = a.is_null()
      if h:
        hashed.add(c)
        flat = a.flatten() if coerce._is_list(a.type) else a
        u = pc.unique(flat.drop_null().cast(pa.string()))
        strings[c] = (coerce.hash_strings(u), u.to_pylist())
    elif rr == "events":
      out[c] = coerce.event_list(a, disp(c), c.endswith(".ts"), spec.ts_unit, log)
    elif rr in ("label", "true_prob"):
      out[c] = coerce.labels(a, disp(c), log) if rr == "label" else a.cast(pa.float64())
  if spec.ids_as_features:
    for r, fname in (("user_id", "sparse.user_id"), ("ad_id", "sparse.ad_id")):
      if fname not in out:
        offs = np.arange(n + 1, dtype=np.int64)
        out[fname] = pa.LargeListArray.from_arrays(offs, pa.array(feats[r], pa.int64()))
        log.add(fname, f"{r} duplicated as a one-id sparse feature (--ids_as_features)")
  out["_ad_feature"] = pa.array(feats["ad_id"], pa.int64())
  if "_action" in cols:
    a = cols["_action"]
    if not pa.types.is_integer(a.type) or a.null_count:
      raise CoerceError(f"history action column {action!r} must be integers without nulls "
                        f"(has type {a.type}, {a.null_count} nulls)")
    out["_action"] = a.cast(pa.int64())
  return out, {"hashed": hashed, "strings": strings, "unknown": unknown,
               "hashed_keys": hashed_keys}


def finalize(cols: dict, schema: Schema, spec: Spec, hashed_events, log: Coercions,
             built=()) -> pa.Table:
  """Canonical columns -> the ``data/ingest/parquet.py`` layout for ``schema``: fills optional event
  columns, hashes wide event ids, checks / truncates list lengths. Streams in ``built`` are
  left out (their events come already encoded: ``table_to_records(prebuilt=...)``)."""
  shown = lambda c: f"{spec.columns[c]} (as {c})" if c in spec.columns else c
  out = {k: cols[k] for k in ("surface", "request_ts", "user_id", "ad_id")}
  for d in schema.dense:
    out[f"dense.{d}"] = _need(cols, f"dense.{d}")
  for f in schema.sparse:
    c = f"sparse.{f.name}"
    a = _need(cols, c)
    lens = np.diff(np.asarray(a.offsets, np.int64))
    if len(lens) and lens.max() > f.max_len:
      i = int(np.argmax(lens > f.max_len))
      raise CoerceError(f"column {shown(c)!r} has {lens[i]} ids > max_len {f.max_len} of sparse "
                        f"feature {f.name!r}", i)
    if f.vocab is not None:
      out[c] = _vocab_ids(a, cols.get(f"_null.{c}"), f.vocab)
    else:
      out[c] = a
  for s in schema.streams:
    if s.name in built:
      continue
    item = _need(cols, f"events.{s.name}.item")
    offs = np.asarray(item.offsets, np.int64)
    for col in records.event_columns(s):
      c = f"events.{s.name}.{col}"
      a = cols.get(c)
      if a is None and col in ("action", "surface"):
        if col == "surface" and len(schema.surfaces) > 1:
          raise CoerceError(f"missing column {c!r} (the surface of each event; needed with more "
                            "than one surface)")
        log.add(c, "missing -> 0 for every event")
        a = pa.LargeListArray.from_arrays(offs, pa.array(np.zeros(offs[-1] - offs[0], np.int64)))
      a = _need({c: a}, c)
      if c in hashed_events:
        vocab = s.item_vocab if col == "item" else (
            s.action_vocab if col == "action" else
            {e.name: e.vocab_size for e in s.extra_fields}[col])
        ao = np.asarray(a.offsets, np.int64)
        vals = a.values.to_numpy(zero_copy_only=False)[ao[0]:ao[-1]]
        log.add(c, f"ids hashed into [0, {vocab})")
        a = pa.LargeListArray.from_arrays(ao - ao[0], pa.array(coerce.hash_mod(vals, vocab)))
      lens = np.diff(np.asarray(a.offsets, np.int64))
      if len(lens) and lens.max() > s.max_len:
        if not spec.truncate_history:
          i = int(np.argmax(lens > s.max_len))
          raise CoerceError(f"column {shown(c)!r} has {lens[i]} events > max_len {s.max_len} of "
                            f"stream {s.name!r}; pass --truncate_history to keep the most recent "
                            f"{s.max_len}", i)
        log.add(f"events.{s.name}", f"histories longer than {s.max_len} truncated to the most "
                "recent (--truncate_history)")
        a = coerce.truncate_lists(a, s.max_len)
      out[c] = a
  for t in schema.tasks:
    out[f"label.{t.name}"] = _need(cols, f"label.{t.name}")
    if f"true_prob.{t.name}" in cols:
      out[f"true_prob.{t.name}"] = cols[f"true_prob.{t.name}"]
  return pa.table(out)


_LOOKUPS: dict = {}


def _vocab_ids(a: pa.Array, null_mask, vocab) -> pa.Array:
  """Raw id lists -> exact-vocabulary ids (``data.ingest.vocab``); a null scalar -> [NULL_ID]."""
  look = _LOOKUPS.get(id(vocab))
  if look is None or look[0] is not vocab:
    look = _LOOKUPS[id(vocab)] = (vocab, V.Lookup(vocab))
  offs = np.asarray(a.offsets, np.int64)
  vals = a.values.to_numpy(zero_copy_only=False)[offs[0]:offs[-1]]
  ids = look[1](vals)
  offs = offs - offs[0]
  if null_mask is not None:
    nul = np.asarray(null_mask.to_numpy(zero_copy_only=False), bool)
    if nul.any():                       # a null scalar's empty list -> one NULL_ID
      lens = np.diff(offs) + nul
      pos = np.repeat(np.arange(len(lens)), np.diff(offs))
      new = np.full(int(lens.sum()), V.NULL_ID, np.int64)
      starts = np.concatenate([[0], np.cumsum(lens)])
      new[starts[pos] + (np.arange(len(ids)) - offs[pos])] = ids
      ids, offs = new, starts
  return pa.LargeListArray.from_arrays(offs, pa.array(ids, pa.int64()))


def _need(cols, c):
  if c not in cols or cols[c] is None:
    raise CoerceError(f"missing column {c!r} (named by the schema)")
  return cols[c]
