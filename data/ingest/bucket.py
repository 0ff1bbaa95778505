"""Pass 3 of the DuckDB runner (also Beam's ``Convert``): one bucket of rows (or one scan part)
-> ArrayRecord shards. ``convert_task(task) -> {counts, pos, lab, files, log, cpu_s}``: the
bucket ordered by (user, time), history counts by numpy prefix sums (``HistoryColumns``), records
encoded ``CHUNK`` rows at a time and written by ``PartWriter``. Design: data/README.md.
"""

from __future__ import annotations

import collections
import hashlib
import os
import time

import numpy as np
import pyarrow as pa

from data.ingest.coerce import INT32_MAX, CoerceError, Coercions, hash_mod
from data.ingest.history import hide_labels
from data.ingest.infer import Spec
from data.ingest.layout import finalize
from data.ingest.parquet import table_to_records
from data.ingest.sql import ad_counts, bucket_sql, connect, read_ipc, stat_names
from data.records import writer_options
from data.schema import Schema

CHUNK = 50_000                  # rows encoded at a time


def _np(tbl, name, dtype=None):
  a = tbl.column(name).to_numpy()
  return a if dtype is None else a.astype(dtype, copy=False)


def _rate(pos, valid):
  return ((pos + 1.0) / (valid + 2.0)).astype(np.float32).astype(np.float64)


def surface_index(tbl: pa.Table, schema) -> np.ndarray:
  """i32[N]: each row's index into ``schema.surfaces`` (an unknown name is an error)."""
  surfaces = {s: i for i, s in enumerate(schema.surfaces)}
  surf = tbl.column("surface").combine_chunks().dictionary_encode()
  names = surf.dictionary.to_pylist()
  bad = sorted(s for s in names if s not in surfaces)
  if bad:
    raise ValueError(f"column 'surface' has unknown surface(s) {bad}; schema has "
                     f"{schema.surfaces}")
  lut = np.array([surfaces[s] for s in names] or [0], np.int32)
  return lut[surf.indices.to_numpy(zero_copy_only=False)] if tbl.num_rows else \
      np.zeros(0, np.int32)


def _earlier_sums(flag: np.ndarray | None, start: np.ndarray, bound: np.ndarray):
  """Per row: ``(count, end)`` of the rows ``j`` in ``[start, bound)`` with ``flag[j]`` (all
  rows for None); ``end`` = that count's position in the flagged rows (``cumsum``)."""
  cum = np.arange(len(start) + 1) if flag is None else np.concatenate(
      [[0], np.cumsum(flag, dtype=np.int64)])
  end = cum[bound]
  return end - cum[start], end


def _delayed_bounds(user: np.ndarray, ts: np.ndarray, first: np.ndarray, bound: np.ndarray):
  """``delay -> i64[N]``: per row (sorted by user, time), the end of the same user's rows
  with ``ts + delay < ts(row)`` (``bound`` for 0)."""
  n = len(ts)
  if not n:
    return lambda delay: bound
  ts = np.asarray(ts, np.int64)
  t0, span = int(ts.min()), int(ts.max() - ts.min()) + 2
  rank = np.cumsum(np.isin(np.arange(n), first)) - 1
  comb = rank * span + (ts - t0)
  cache = {0: bound}

  def at(delay):
    if delay not in cache:
      cache[delay] = np.searchsorted(comb, rank * span + np.maximum(ts - delay - t0, 0),
                                     side="left")
    return cache[delay]
  return at


class HistoryColumns:
  """Built streams and statistics of one bucket's rows, sorted by (user, time, input, row).

  ``events[s] = (values i32[E_s, 4], count i64[N], end i64[N])``: the stream's events (item,
  action, surface, ts of its rows, in order), and per row the number of the user's strictly
  earlier events and where they end. ``stats``: the dense statistics, f64[N] each."""

  def __init__(self, tbl: pa.Table, plan: dict, schema, surface: np.ndarray):
    self.plan = plan
    n = tbl.num_rows
    ev = {"surface": surface}
    ad = _np(tbl, "_ad_feature", np.int64)
    if plan["hash_items"]:
      ev["item"] = hash_mod(ad, plan["item_vocab"])
    else:
      ev["item"] = ad
    labels = {t: tbl.column(f"label.{t}") for t in plan["tasks"]}
    y = {t: c.fill_null(0).to_numpy() > 0.5 for t, c in labels.items()}
    if plan["action"]:
      ev["action"] = _np(tbl, "_action", np.int64)
    else:
      bits = np.zeros(n, np.int64)
      for k, t in enumerate(plan["tasks"]):
        bits |= y[t].astype(np.int64) << k
      ev["action"] = bits
    ev["ts"] = _np(tbl, "request_ts", np.int64)
    user = _np(tbl, "user_id", np.int64)
    first = np.flatnonzero(np.concatenate([[True], user[1:] != user[:-1]])) if n else \
        np.zeros(0, np.int64)
    start = np.repeat(first, np.diff(np.concatenate([first, [n]])))
    bound = start + _np(tbl, "_earlier", np.int64)        # rows [start, bound): earlier
    delayed = _delayed_bounds(user, ev["ts"], first, bound)   # delay -> rows seen that late
    stacked = np.stack([np.asarray(ev[c], np.int32) for c in ("item", "action", "surface",
                                                              "ts")], 1)
    self._raw = {c: ev[c] for c in ("item", "action", "surface", "ts")}
    self.bit_delays = None if plan["action"] else [plan.get("delays", {}).get(t, 0)
                                                     for t in plan["tasks"]]
    self.events = {}
    for s, sel in plan["streams"].items():
      keep = None if sel is None else _np(tbl, f"_keep.{s}", bool)
      count, end = _earlier_sums(keep, start, delayed(plan.get("stream_delays", {}).get(s, 0)))
      self.events[s] = (stacked if keep is None else stacked[keep], count, end,
                        None if keep is None else np.flatnonzero(keep))
    if plan["stats"]:
      self.stats = {"user_count": (bound - start).astype(np.float64),
                    "ad_count": _np(tbl, "_ad_count", np.float64)}
      have = set(tbl.column_names)
      for t in plan["tasks"]:
        valid = ~np.asarray(labels[t].is_null().to_numpy(zero_copy_only=False), bool)
        seen = delayed(plan.get("delays", {}).get(t, 0))
        uv, _ = _earlier_sums(valid, start, seen)
        up, _ = _earlier_sums(valid & y[t], start, seen)
        self.stats[f"user_{t}_rate"] = _rate(up, uv)
        av = _np(tbl, f"_av.{t}" if f"_av.{t}" in have else "_ad_count", np.float64)
        self.stats[f"ad_{t}_rate"] = _rate(_np(tbl, f"_ap.{t}", np.float64), av)

  def check(self, schema, max_lens: dict):
    """The record checks of the events (``data.ingest.parquet.check_columns``), once per source row
    that some row's history holds: ``(event's row, field, message)`` of the first bad value,
    or None. (Their time order and strictly-earlier times hold by construction.)"""
    S = len(schema.surfaces)
    found = []
    for st in schema.streams:
      if st.name not in self.events:
        continue
      vals, count, end, rows = self.events[st.name]
      L = max_lens[st.name]
      m = len(vals) + 1                               # events in some history: coverage
      used = np.bincount(end - np.minimum(count, L), minlength=m) - np.bincount(end, minlength=m)
      used = np.cumsum(used[:-1]) > 0
      hi = np.array([st.item_vocab, st.action_vocab, S, INT32_MAX], np.int64)
      cols = ("item", "action", "surface", "ts")
      for c, col in enumerate(cols):
        raw = np.asarray(self._raw[col], np.int64)
        raw = raw if rows is None else raw[rows]
        bad = used & ((raw < 0) | (raw >= hi[c]))
        if bad.any():
          e = int(np.argmax(bad))
          found.append((e if rows is None else int(rows[e]), f"events/{st.name}/{col}",
                        f"value {raw[e]} outside [0, {hi[c]})"))
    return min(found) if found else None

  def columns(self, idx: np.ndarray, max_lens: dict) -> tuple[dict, dict]:
    """``(dense statistic columns, {stream: (events i32[E, 4], start i64[M], stop i64[M])})``
    of the rows ``idx`` (positions in the sorted table): each row's last ``max_len`` strictly
    earlier events of the same user, oldest first, as ranges of the stream's events."""
    out, built = {}, {}
    for s, L in max_lens.items():
      vals, count, end, _ = self.events[s]
      e = end[idx]
      built[s] = (vals, e - np.minimum(count[idx], L), e)
      if self.bit_delays and any(self.bit_delays):     # labels seen late: per request
        b = built[s][1]
        lens = e - b
        offs = np.concatenate([[0], np.cumsum(lens)])
        g = vals[np.arange(offs[-1]) + np.repeat(b - offs[:-1], lens)]
        act = g[:, 1].astype(np.int64)
        hide_labels(act, g[:, 3], np.repeat(np.asarray(self._raw["ts"])[idx], lens),
                    self.bit_delays)
        g[:, 1] = act
        built[s] = (g, offs[:-1], offs[1:])
    if self.plan["stats"]:
      for k in stat_names(self.plan["tasks"]):
        out[f"dense.{k}"] = pa.array(self.stats[k][idx])
    return out, built


class PartWriter:
  """One task's ArrayRecord shards per (split, surface), rotated at ``per_shard`` records."""

  def __init__(self, out_dir: str, task: int, per_shard: int, records_per_chunk: int = 1):
    from array_record.python import array_record_module

    self._mod, self._opts = array_record_module, writer_options(records_per_chunk)
    self.out_dir, self.task, self.per_shard = out_dir, task, per_shard
    self.open: dict = {}
    self.files: dict = {}

  def write(self, split: str, surface: str, recs) -> None:
    key = (split, surface)
    i = 0
    while i < len(recs):
      if key not in self.open:
        files = self.files.setdefault(key, [])
        os.makedirs(os.path.join(self.out_dir, split), exist_ok=True)
        rel = os.path.join(split, f".{surface}-t{self.task:05d}-{len(files):04d}.tmp")
        self.open[key] = [self._mod.ArrayRecordWriter(os.path.join(self.out_dir, rel),
                                                      self._opts), 0, rel]
      w = self.open[key]
      take = recs[i:i + self.per_shard - w[1]]
      collections.deque(map(w[0].write, take), maxlen=0)
      w[1] += len(take)
      i += len(take)
      if w[1] >= self.per_shard:
        self._close(key)

  def _close(self, key):
    w, c, rel = self.open.pop(key)
    w.close()
    path = os.path.join(self.out_dir, rel)
    h = hashlib.sha256()
    with open(path, "rb") as f:
      while chunk := f.read(1 << 22):
        h.update(chunk)
    self.files[key].append((rel, c, os.path.getsize(path), h.hexdigest()))

  def close(self) -> dict:
    for key in list(self.open):
      self._close(key)
    return self.files


def convert_task(task: dict, emit=None) -> dict:
  """Pass 3 for one bucket / part (runs in a worker process): shards, counts, coercions.
  ``task``: ``files`` (Parquet, with ``ad_files`` of their ad statistics) or ``table`` (Arrow,
  statistics joined) rows; ``emit(split, surface, records)`` instead of writing shards
  (Beam)."""
  try:
    return _convert(task, emit)
  except CoerceError as e:
    raise ValueError(e.msg) from None
  except ValueError as e:
    raise ValueError(str(e)) from None


def _split_sql(ctx) -> str:
  """SQL: the split index of a row (time windows, or the explicit split of its input)."""
  if ctx["explicit"]:
    return "_split"
  t1, t2 = (("'inf'::DOUBLE" if not np.isfinite(t) else repr(float(t))) for t in ctx["route"])
  return f"(CASE WHEN request_ts < {t1} THEN 0 WHEN request_ts < {t2} THEN 1 ELSE 2 END)"


_CONNECTION: dict = {}


def _connection(work_dir: str, memory: str):
  """The worker's engine connection (one DuckDB thread), kept from task to task."""
  key = (work_dir, memory)
  if key not in _CONNECTION:
    close_connection()
    _CONNECTION[key] = connect(work_dir, 1, memory)
  return _CONNECTION[key]


def close_connection() -> None:
  for con in _CONNECTION.values():
    con.close()
  _CONNECTION.clear()


def _query(task: dict, ctx: dict) -> tuple[pa.Table, pa.Table | None]:
  """The task's rows as stored, with ``_key`` = split * inputs + input; with histories, also
  the engine's order of them (``bucket_sql``; ``_pos``: the row's position in the first) and
  their ad-side statistics (joined by row)."""
  plan = ctx["plan"]
  wide = task["table"] if "table" in task else read_ipc(task["files"])
  con = _connection(task["work_dir"], ctx["worker_memory"])
  try:
    key = f"{_split_sql(ctx)} * {len(ctx['sources'])} + _src"
    if not plan:
      con.register("bucket", wide)
      return con.sql(f"SELECT *, {key} AS _key FROM bucket").to_arrow_table(), None
    con.register("bucket", wide.append_column("_pos", pa.array(np.arange(wide.num_rows))))
    order = con.sql(bucket_sql("bucket", plan, key, ["_pos"])).to_arrow_table()
  except BaseException:
    close_connection()
    raise
  finally:
    if _CONNECTION:
      con.unregister("bucket")
  if task.get("ad_files"):
    wide = _join_rows(wide, read_ipc(task["ad_files"]))
  return wide, order


def _join_rows(wide: pa.Table, other: pa.Table) -> pa.Table:
  """``wide`` with the columns of ``other`` (the same rows, any order) matched by (_src, _row)."""
  k = lambda t: (_np(t, "_src", np.int64) << 40) | _np(t, "_row", np.int64)
  kw, ko = k(wide), k(other)
  order = np.argsort(ko, kind="stable")
  at = np.minimum(np.searchsorted(ko[order], kw), len(ko) - 1) if len(ko) else \
      np.zeros(len(kw), np.int64)
  if len(kw) and (not len(ko) or (ko[order][at] != kw).any()):
    raise ValueError("internal error: ad statistics missing for some rows of a bucket")
  take = pa.array(order[at])
  for c in other.column_names:
    if c not in ("_src", "_row"):
      wide = wide.append_column(c, other.column(c).take(take))
  return wide


def _convert(task: dict, emit=None) -> dict:
  cpu = {}
  c0 = time.process_time()
  ctx = task["ctx"]
  schema = Schema.from_dict(ctx["schema"])
  full = Spec.from_dict(ctx["spec"])
  plan = ctx["plan"]
  wide, order = _query(task, ctx)
  c1 = time.process_time()
  cpu["queries"] = c1 - c0
  names, splits = ctx["sources"], ctx["splits"]
  surf = surface_index(wide, schema)
  if order is None:
    tbl, where = wide, None
  else:                            # the columns the histories read, in the engine's order
    where = _np(order, "_pos", np.int64)
    need = ["user_id", "request_ts", "_ad_feature", "_action", "_src", "_row"]
    need += [f"label.{t}" for t in plan["tasks"]] + ["_ad_count"]
    need += [c[0] for c in ad_counts(plan)]
    tbl = wide.select([c for c in need if c in wide.column_names]).take(pa.array(where))
    for c in order.column_names:
      if c not in tbl.column_names:
        tbl = tbl.append_column(c, order.column(c))
    surf = surf[where]
  n = tbl.num_rows
  rows_all = _np(tbl, "_row", np.int64)
  src_all = _np(tbl, "_src", np.int64)
  max_lens = {s.name: s.max_len for s in schema.streams}
  hist = None
  if plan:
    max_lens = {s: L for s, L in max_lens.items() if s in plan["streams"]}
    hist = HistoryColumns(tbl, plan, schema, surf)
    bad = hist.check(schema, max_lens)
    if bad is not None:
      r, field, msg = bad
      raise ValueError(f"{names[src_all[r]]}: row {rows_all[r]}: invalid value in the "
                       f"column(s) of field {field!r}: {msg}")
  # histories: by (split, input, surface), each in (user, time) order; else by (split, input)
  # in input order (so the first bad row in a chunk is the first in its input)
  S = len(schema.surfaces) if plan else 1
  group = _np(tbl, "_key", np.int64) * S + (surf if plan else 0)
  perm = np.argsort(group, kind="stable")
  group = group[perm]
  base = wide.select([c for c in wide.column_names if not c.startswith("_")
                      or c.startswith("_null.")])
  if "surface" in base.column_names:    # taken per chunk: as indices into the names
    base = base.set_column(base.column_names.index("surface"), "surface",
                           base.column("surface").dictionary_encode())
  cpu["history"] = time.process_time() - c1
  cpu["encode"] = cpu["write"] = 0.0
  log = Coercions()
  writer = PartWriter(task["out_dir"], task["id"], ctx["records_per_shard"],
                      ctx.get("records_per_chunk", 1)) if emit is None else None
  used = ctx["used"]
  counts = {s: {} for s in used}
  pos = {s: [0.0] * len(schema.tasks) for s in used}
  lab = {s: [0.0] * len(schema.tasks) for s in used}
  cuts = np.flatnonzero(np.diff(group)) + 1 if n else np.zeros(0, np.int64)
  for lo, hi in zip(np.concatenate([[0], cuts]).tolist(), np.concatenate([cuts, [n]]).tolist(),
                    strict=True):
    if lo == hi:
      continue
    k, si = divmod(int(group[lo]), S)
    sp, s_i = splits[k // len(names)], k % len(names)
    for a in range(lo, hi, CHUNK):
      c2 = time.process_time()
      b = min(hi, a + CHUNK)
      idx = perm[a:b]
      sl = base.take(pa.array(idx if where is None else where[idx]))
      cols = {c: sl.column(c).combine_chunks() for c in sl.column_names}
      built = {}
      if hist is not None:
        dense, built = hist.columns(idx, max_lens)
        cols.update(dense)
      rows = rows_all[idx]
      try:
        fin = finalize(cols, schema, full, ctx["hashed_events"], log, built)
      except CoerceError as e:
        where = f"{names[s_i]}: row {rows[e.row]}: " if e.row is not None else f"{names[s_i]}: "
        raise ValueError(where + e.msg) from None
      out = table_to_records(fin, schema, names[s_i], rows=rows, prebuilt=built)
      for j, t in enumerate(schema.tasks):
        y = fin.column(f"label.{t.name}").to_numpy(zero_copy_only=False)
        pos[sp][j] += float(np.nansum(y))
        lab[sp][j] += float(np.sum(~np.isnan(y)))
      c3 = time.process_time()
      cpu["encode"] += c3 - c2
      for surface, recs in out.items():
        if recs:
          (emit or writer.write)(sp, surface, recs)
          counts[sp][surface] = counts[sp].get(surface, 0) + len(recs)
      cpu["write"] += time.process_time() - c3
  c4 = time.process_time()
  files = writer.close() if writer is not None else {}
  cpu["write"] += time.process_time() - c4
  return {"id": task["id"], "rows": n, "files": files, "counts": counts, "pos": pos,
          "lab": lab, "log": log.done, "cpu_s": cpu}
