"""``data.ingest`` out of core on an embedded engine (DuckDB), on all cores.

Why DuckDB: an in-process SQL engine (one pip wheel, no server, no JVM) that reads and writes
Parquet, runs sorts, window functions and hash-partitioned writes on all cores, spills them to
disk under a memory limit it lets us set (``memory_limit``, ``temp_directory``), and hands
results to Python as Arrow. The alternatives weighed: Polars (fast in memory, but a memory cap
and spilling of ordered window aggregates are not what its streaming engine offers), DataFusion
(spills too, but its Python bindings are younger and far less used), SQLite (row-wise and
single-threaded). Measured costs are in bench/results/ingest.json (``cpu_s_by_stage``).

Three passes (``data.ingest.run`` drives them):

1. **scan** (``Staging``): each input batch is renamed and coerced (``data.layout.canonical``:
   row-local Arrow compute, the same code as the in-memory path) and written as a Parquet part
   with its source and row number; the scan statistics are gathered on the way.
2. **engine, whole log** (``split_times``, ``partition``): the split quantiles (an exact
   ``ORDER BY .. OFFSET``), a hash partition of the rows by user into buckets of about
   ``rows_per_bucket`` rows (Parquet, written in parallel), and the ad-side history statistics
   (window aggregates partitioned by ad over strictly earlier seconds, on the few columns they
   need) partitioned the same way. DuckDB spills to ``work_dir``.
3. **engine, per bucket, in parallel** (``convert_task`` in a process pool, one DuckDB
   thread each): a narrow query gives every row, per stream, the number of the same user's
   strictly earlier events (window aggregates over a frame that ends one second before the
   row) and the user-side statistic counts, in (user, time, row) order; the wide rows come
   sorted by (split, input, user, time, row). numpy then copies the last ``max_len`` events into
   the rows' lists, ``data.layout.finalize`` and ``data.parquet.table_to_records`` encode them
   (chunks of ``CHUNK`` rows), and each task writes its own ArrayRecord shards.

Without ``--history`` the buckets are the scan's parts, in input order. Memory is bounded by the
engine's limit plus, per worker, one bucket's rows (their coerced columns and the events of its
streams) and one chunk of records: a single user with more rows than a bucket makes that bucket
larger.
Output records are byte-equal to the in-memory path's (``tests/data/test_ingest_engine.py``);
within a split and surface they come bucket by bucket, each in (user, time) order.
"""

from __future__ import annotations

import concurrent.futures
import glob
import hashlib
import multiprocessing
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from data.coerce import CoerceError, Coercions

CHUNK = 50_000                  # rows encoded at a time
ROWS_PER_BUCKET = 250_000


def _q(name: str) -> str:
  return '"' + name.replace('"', '""') + '"'


def connect(work_dir: str, threads: int, memory_limit: str):
  import duckdb
  con = duckdb.connect()
  tmp = os.path.join(work_dir, "duckdb_tmp")
  os.makedirs(tmp, exist_ok=True)
  con.execute(f"SET threads={int(threads)}")
  con.execute(f"SET memory_limit='{memory_limit}'")
  con.execute(f"SET temp_directory='{tmp}'")
  con.execute("SET preserve_insertion_order=false")
  return con


class Staging:
  """Pass 1's output: the canonical columns of every input batch as Parquet parts."""

  def __init__(self, work_dir: str):
    self.dir = os.path.join(work_dir, "canon")
    os.makedirs(self.dir, exist_ok=True)
    self.files: list[str] = []
    self.schema = None
    self.rows = 0

  def add(self, cols: dict, src: int, first: int, split: int) -> None:
    n = len(cols["request_ts"])
    t = pa.table({**cols, "_src": pa.array(np.full(n, src, np.int32)),
                  "_row": pa.array(np.arange(first, first + n, dtype=np.int64)),
                  "_split": pa.array(np.full(n, split, np.int8))})
    if self.schema is None:
      self.schema = t.schema
    elif t.schema.names == self.schema.names and t.schema != self.schema:
      try:
        t = t.cast(self.schema)
      except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        pass                    # read back by name (union_by_name)
    path = os.path.join(self.dir, f"part-{len(self.files):06d}.parquet")
    pq.write_table(t, path, compression="none")
    self.files.append(path)
    self.rows += n

  @property
  def glob(self) -> str:
    return os.path.join(self.dir, "*.parquet")


def _scan(files) -> str:
  lst = ", ".join("'" + f.replace("'", "''") + "'" for f in files)
  return f"read_parquet([{lst}], union_by_name=true)"


def split_times(con, staging: Staging, kind: str, vals) -> tuple[float, float]:
  """``data.ingest.cut_times`` as engine queries: exact order statistics of request_ts."""
  src = _scan(staging.files)
  n = staging.rows
  if kind == "ts":
    return vals
  at = lambda k: float(con.execute(f"SELECT request_ts FROM {src} ORDER BY request_ts LIMIT 1 "
                                   f"OFFSET {k}").fetchone()[0]) if k < n else float("inf")
  k1, k2 = int(np.ceil(vals[0] * n)), int(np.ceil((vals[0] + vals[1]) * n))
  t1, t2 = at(k1), at(k2)
  if vals[1] == 0:
    t2 = t1
  first = float(con.execute(f"SELECT min(request_ts) FROM {src}").fetchone()[0])
  if not n or t1 <= first:
    raise ValueError(f"--split=time:...: no train rows (the earliest {vals[0]:.0%} of the rows all "
                     "have the first request_ts); use --split ts:T1,T2 or none")
  return t1, t2


# ---- the history plan: what the streams are, in the schema's terms ---------------------------

def stat_names(tasks) -> list[str]:
  """The dense statistics ``--history_stats`` adds, in order (as ``data.history.stats``)."""
  return [n for side in ("user", "ad") for n in
          [f"{side}_count"] + [f"{side}_{t}_rate" for t in tasks]]


def _sel(sel: str | None) -> str:
  """SQL: 1 when the row is an event of a stream with selector ``sel`` (None: every row)."""
  return "1" if sel is None else f"(coalesce({_q(sel)}, 0) > 0.5)::BIGINT"


def _valid(t) -> str:
  return f"({_q('label.' + t)} IS NOT NULL)::BIGINT"


def _pos(t) -> str:
  return f"(coalesce({_q('label.' + t)}, 0) > 0.5)::BIGINT"


_BEFORE = ("OVER (PARTITION BY {part} ORDER BY request_ts RANGE BETWEEN UNBOUNDED PRECEDING "
           "AND 1 PRECEDING)")


def _earlier(expr: str, part: str) -> str:
  """SQL: the sum of ``expr`` over the rows of the same ``part`` key with a strictly earlier
  request_ts (integer seconds: a frame that ends one second before the row's)."""
  return f"coalesce(sum({expr}) {_BEFORE.format(part=part)}, 0)::BIGINT"


def _count_earlier(part: str) -> str:
  return f"count(*) {_BEFORE.format(part=part)}"


def ad_columns(plan: dict) -> list[str]:
  """SQL: the ad-side statistic counts (strictly earlier rows of the same ad)."""
  if not plan["stats"]:
    return []
  out = [f"{_count_earlier('_ad_feature')} AS _ad_count"]
  for t in plan["tasks"]:
    out.append(f"{_earlier(_valid(t), '_ad_feature')} AS {_q('_av.' + t)}")
    out.append(f"{_earlier(_pos(t), '_ad_feature')} AS {_q('_ap.' + t)}")
  return out


def partition(con, staging: Staging, plan: dict, work_dir: str, buckets: int) -> list[dict]:
  """The hash partition of the rows by user, and the ad-side statistics (a window query over
  the whole log, on the few columns it needs) partitioned the same way: one task per bucket,
  ``{"files": [...], "ad_files": [...] or None}``."""
  bucket = f"hash(user_id) % {int(buckets)} AS _bucket"
  src = _scan(staging.files)
  dirs = {"files": os.path.join(work_dir, "buckets")}
  con.execute(f"COPY (SELECT *, {bucket} FROM {src}) TO '{dirs['files']}' "
              "(FORMAT parquet, PARTITION_BY (_bucket), COMPRESSION uncompressed)")
  if plan["stats"]:
    dirs["ad_files"] = os.path.join(work_dir, "ad_stats")
    con.execute(f"COPY (SELECT _src, _row, {bucket}, {', '.join(ad_columns(plan))} FROM {src}) "
                f"TO '{dirs['ad_files']}' (FORMAT parquet, PARTITION_BY (_bucket), "
                "COMPRESSION uncompressed)")
  tasks = []
  for k in range(buckets):
    t = {key: sorted(glob.glob(os.path.join(d, f"_bucket={k}", "*.parquet")))
         for key, d in dirs.items()}
    if t["files"]:
      tasks.append({"files": t["files"], "ad_files": t.get("ad_files")})
  return tasks


ORDER = "ORDER BY user_id, request_ts, _src, _row"


def bucket_sql(src: str, plan: dict) -> str:
  """The history counts of one bucket's rows, in (user, time, row) order (``ORDER``): per
  stream ``s``, ``_n.s`` = the user's events of ``s`` strictly earlier than the row; with
  statistics the user's strictly earlier rows, labelled rows and positives per task. A narrow
  query (the keys and labels only): the wide rows come sorted by the same unique key."""
  keep = ["user_id", "request_ts", "surface", "_ad_feature", "_src", "_row", "_split"]
  keep += [f"label.{t}" for t in plan["tasks"]] + (["_action"] if plan["action"] else [])
  keep += [sel for sel in plan["streams"].values() if sel is not None]
  if plan["stats"]:
    keep += ["_ad_count"] + [f"_a{x}.{t}" for t in plan["tasks"] for x in "vp"]
  cols = [_q(c) for c in dict.fromkeys(keep)]
  for s, sel in plan["streams"].items():
    cols.append(f"{_count_earlier('user_id') if sel is None else _earlier(_sel(sel), 'user_id')}"
                f" AS {_q('_n.' + s)}")
  if plan["stats"]:
    cols.append(f"{_count_earlier('user_id')} AS _user_count")
    for t in plan["tasks"]:
      cols.append(f"{_earlier(_valid(t), 'user_id')} AS {_q('_uv.' + t)}")
      cols.append(f"{_earlier(_pos(t), 'user_id')} AS {_q('_up.' + t)}")
  return f"SELECT {', '.join(cols)} FROM {src} {ORDER}"


# ---- one task: a bucket (or a scan part) -> shards ----------------------------------------

def _np(tbl, name, dtype=None):
  a = tbl.column(name).to_numpy()
  return a if dtype is None else a.astype(dtype, copy=False)


def _rate(pos, valid):
  return ((pos + 1.0) / (valid + 2.0)).astype(np.float32).astype(np.float64)


class HistoryColumns:
  """The built ``events.<s>.*`` and ``dense.*`` statistic columns of a sorted bucket table."""

  def __init__(self, tbl: pa.Table, plan: dict, schema):
    self.plan, self.tbl = plan, tbl
    n = tbl.num_rows
    surfaces = {s: i for i, s in enumerate(schema.surfaces)}
    surf = tbl.column("surface").combine_chunks().dictionary_encode()
    names = surf.dictionary.to_pylist()
    bad = sorted(s for s in names if s not in surfaces)
    if bad:
      raise ValueError(f"column 'surface' has unknown surface(s) {bad}; schema has "
                       f"{schema.surfaces}")
    lut = np.array([surfaces[s] for s in names] or [0], np.int32)
    ev = {"surface": lut[surf.indices.to_numpy(zero_copy_only=False)] if n else
          np.zeros(0, np.int32)}
    ad = _np(tbl, "_ad_feature", np.int64)
    if plan["hash_items"]:
      from data.coerce import hash_mod
      ev["item"] = hash_mod(ad, plan["item_vocab"])
    else:
      ev["item"] = ad
    if plan["action"]:
      ev["action"] = _np(tbl, "_action", np.int64)
    else:
      bits = np.zeros(n, np.int64)
      for k, t in enumerate(plan["tasks"]):
        y = tbl.column(f"label.{t}").fill_null(0).to_numpy()
        bits |= (y > 0.5).astype(np.int64) << k
      ev["action"] = bits
    ev["ts"] = _np(tbl, "request_ts", np.int32)
    user = _np(tbl, "user_id", np.int64)
    first = np.flatnonzero(np.concatenate([[True], user[1:] != user[:-1]])) if n else \
        np.zeros(0, np.int64)
    user_start = np.repeat(first, np.diff(np.concatenate([first, [n]])))
    self.events = {}
    for s, sel in plan["streams"].items():
      keep = None if sel is None else tbl.column(sel).fill_null(0).to_numpy() > 0.5
      before = np.concatenate([[0], np.cumsum(keep)]) if keep is not None else np.arange(n + 1)
      # the row's earlier events end where the user's events start plus their count
      hi = before[user_start] + _np(tbl, f"_n.{s}", np.int64)
      stacked = np.stack([np.asarray(ev[c], np.int32) for c in ("item", "action", "surface",
                                                                "ts")], 1)
      self.events[s] = (stacked if keep is None else stacked[keep],
                        _np(tbl, f"_n.{s}", np.int64), hi)

    if plan["stats"]:
      g = lambda c: _np(tbl, c, np.float64)
      self.stats = {"user_count": g("_user_count"), "ad_count": g("_ad_count")}
      for t in plan["tasks"]:
        self.stats[f"user_{t}_rate"] = _rate(g(f"_up.{t}"), g(f"_uv.{t}"))
        self.stats[f"ad_{t}_rate"] = _rate(g(f"_ap.{t}"), g(f"_av.{t}"))

  def columns(self, idx: np.ndarray, max_lens: dict) -> tuple[dict, dict]:
    """``(dense statistic columns, {stream: (events i32[E, 4], offsets)})`` of the rows
    ``idx`` (positions in the sorted table): each row's last ``max_len`` strictly earlier
    events of the same user, oldest first."""
    out, built = {}, {}
    for s, L in max_lens.items():
      vals, n_all, hi_all = self.events[s]
      n, hi = n_all[idx], hi_all[idx]
      lens = np.minimum(n, L)
      offs = np.concatenate([[0], np.cumsum(lens)])
      take = np.arange(offs[-1]) + np.repeat(hi - lens - offs[:-1], lens)
      built[s] = (vals[take], offs)
    if self.plan["stats"]:
      for k in stat_names(self.plan["tasks"]):
        out[f"dense.{k}"] = pa.array(self.stats[k][idx])
    return out, built


class PartWriter:
  """One task's ArrayRecord shards per (split, surface), rotated at ``per_shard`` records."""

  def __init__(self, out_dir: str, task: int, per_shard: int):
    from array_record.python import array_record_module

    from data.records import WRITER_OPTIONS
    self._mod, self._opts = array_record_module, WRITER_OPTIONS
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
      for r in take:
        w[0].write(r)
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
  ``task``: ``files`` (Parquet) or ``table`` (Arrow) rows; ``emit(split, surface, records)``
  instead of writing shards (Beam)."""
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


def _convert(task: dict, emit=None) -> dict:
  import time
  c0 = time.process_time()
  from data.infer import Spec
  from data.layout import finalize
  from data.parquet import table_to_records
  from data.schema import Schema
  ctx = task["ctx"]
  schema = Schema.from_dict(ctx["schema"])
  full = Spec.from_dict(ctx["spec"])
  plan = ctx["plan"]
  con = connect(task["work_dir"], 1, ctx["worker_memory"])
  if "table" in task:
    con.register("bucket", task["table"])
    src = "bucket"
  else:
    src = _scan(task["files"])
  narrow_src = src
  if task.get("ad_files"):
    narrow_src = (f"(SELECT * FROM {src} AS r JOIN {_scan(task['ad_files'])} AS a "
                  "USING (_src, _row))")
  key = f"{_split_sql(ctx)} * {len(ctx['sources'])} + _src"
  hist, perm = None, None
  if plan:
    narrow = con.sql(f"SELECT {key} AS _key, * FROM ({bucket_sql(narrow_src, plan)})"
                     ).to_arrow_table()
    hist = HistoryColumns(narrow, plan, schema)
    # the wide rows by (split, input, user, time, row): the stable sort of the narrow order
    perm = np.argsort(_np(narrow, "_key"), kind="stable")
    keys = _np(narrow, "_key", np.int64)[perm]
    del narrow
    tbl = con.sql(f"SELECT * FROM {src} ORDER BY {key}, user_id, request_ts, _row"
                  ).to_arrow_table()
  else:
    tbl = con.sql(f"SELECT {key} AS _key, * FROM {src}").to_arrow_table()
    keys = _np(tbl, "_key", np.int64)
  con.close()
  c1 = time.process_time()
  max_lens = {s.name: s.max_len for s in schema.streams}
  if plan:
    max_lens = {s: L for s, L in max_lens.items() if s in plan["streams"]}
  log = Coercions()
  writer = PartWriter(task["out_dir"], task["id"], ctx["records_per_shard"]) if emit is None \
      else None
  names, splits = ctx["sources"], ctx["splits"]
  used = ctx["used"]
  counts = {s: {} for s in used}
  pos = {s: [0.0] * len(schema.tasks) for s in used}
  lab = {s: [0.0] * len(schema.tasks) for s in used}
  base = tbl.drop_columns([c for c in ("_key", "_bucket") if c in tbl.column_names])
  n = tbl.num_rows
  rows_all = _np(tbl, "_row", np.int64)
  cuts = np.flatnonzero(np.diff(keys)) + 1 if n else np.zeros(0, np.int64)
  for lo, hi in zip(np.concatenate([[0], cuts]).tolist(), np.concatenate([cuts, [n]]).tolist(),
                    strict=True):
    k = int(keys[lo]) if n else 0
    sp, s_i = splits[k // len(names)], k % len(names)
    for a in range(lo, hi, CHUNK):
      b = min(hi, a + CHUNK)
      sl = base.slice(a, b - a)
      cols = {c: sl.column(c).combine_chunks() for c in sl.column_names}
      built = {}
      if hist is not None:
        dense, built = hist.columns(perm[a:b], max_lens)
        cols.update(dense)
      rows = rows_all[a:b]
      try:
        fin = finalize(cols, schema, full, ctx["hashed_events"], log, built)
      except CoerceError as e:
        where = f"{names[s_i]}: row {rows[e.row]}: " if e.row is not None else f"{names[s_i]}: "
        raise ValueError(where + e.msg) from None
      for surface, recs in table_to_records(fin, schema, names[s_i], rows=rows,
                                            prebuilt=built).items():
        if recs:
          (emit or writer.write)(sp, surface, recs)
          counts[sp][surface] = counts[sp].get(surface, 0) + len(recs)
      for j, t in enumerate(schema.tasks):
        y = fin.column(f"label.{t.name}").to_numpy(zero_copy_only=False)
        pos[sp][j] += float(np.nansum(y))
        lab[sp][j] += float(np.sum(~np.isnan(y)))
  files = writer.close() if writer is not None else {}
  return {"id": task["id"], "rows": n, "files": files, "counts": counts, "pos": pos,
          "lab": lab, "log": log.done,
          "cpu_s": {"queries": c1 - c0, "records": time.process_time() - c1}}


def run_tasks(tasks: list[dict], workers: int, progress=None) -> list[dict]:
  """``convert_task`` over ``tasks`` in ``workers`` processes (in-process for one worker)."""
  if workers <= 1 or len(tasks) <= 1:
    out = []
    for t in tasks:
      out.append(convert_task(t))
      if progress:
        progress(out[-1]["rows"])
    return out
  ctx = multiprocessing.get_context("spawn")
  results = []
  with concurrent.futures.ProcessPoolExecutor(min(workers, len(tasks)), mp_context=ctx) as pool:
    futs = [pool.submit(convert_task, t) for t in tasks]
    try:
      for f in concurrent.futures.as_completed(futs):
        results.append(f.result())
        if progress:
          progress(results[-1]["rows"])
    except BaseException:
      for f in futs:
        f.cancel()
      raise
  return sorted(results, key=lambda r: r["id"])
