"""``--runner duckdb`` (the default): the ingest out of core on an embedded engine, on all cores.
Pass 1 stages each coerced batch as an Arrow IPC part (``Staging``); pass 2 runs whole-log queries
(``split_times``, ``partition``: user buckets and ad statistics); pass 3 converts the buckets in
``workers`` processes (``run_tasks`` -> ``bucket.convert_task``). Design: data/README.md.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import gc
import glob
import multiprocessing
import os
import signal
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pds

from data.ingest.bucket import close_connection, convert_task
from data.ingest.output import write_manifest
from data.ingest.runner import Runner
from data.ingest.sources import Progress
from data.ingest.sql import ad_sql, connect, history_plan, stat_names, write_ipc

ROWS_PER_BUCKET = 250_000


class Staging:
  """Pass 1's output: the canonical columns of every input batch as Arrow IPC parts (written
  and read back at memory speed; the engine scans them as one ``pyarrow.dataset``)."""

  def __init__(self, work_dir: str):
    self.dir = os.path.join(work_dir, "canon")
    os.makedirs(self.dir, exist_ok=True)
    self.files: list[str] = []
    self.counts: list[int] = []
    self.schema = None
    self.schemas: list = []
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
        pass                    # unified by name (``dataset``)
    if not any(t.schema == x for x in self.schemas):
      self.schemas.append(t.schema)
    path = os.path.join(self.dir, f"part-{len(self.files):06d}.arrow")
    write_ipc(t, path)
    self.files.append(path)
    self.counts.append(n)
    self.rows += n

  def dataset(self, files=None):
    """The parts (``files``: a subset) as one dataset; columns unified by name."""
    schema = pa.unify_schemas(self.schemas, promote_options="permissive") if self.schemas \
        else None
    return pds.dataset(files or self.files, format="ipc", schema=schema)


def split_times(con, staging: Staging, kind: str, vals) -> tuple[float, float]:
  """``splits.cut_times`` as engine queries: exact order statistics of request_ts."""
  con.register("staging", staging.dataset())
  n = staging.rows
  if kind == "ts":
    return vals
  at = lambda k: float(con.execute("SELECT request_ts FROM staging ORDER BY request_ts LIMIT 1 "
                                   f"OFFSET {k}").fetchall()[0][0]) if k < n else float("inf")
  k1, k2 = int(np.ceil(vals[0] * n)), int(np.ceil((vals[0] + vals[1]) * n))
  t1, t2 = at(k1), at(k2)
  if vals[1] == 0:
    t2 = t1
  first = float(con.execute("SELECT min(request_ts) FROM staging").fetchall()[0][0])
  if not n or t1 <= first:
    raise ValueError(f"--split=time:...: no train rows (the earliest {vals[0]:.0%} of the rows all "
                     "have the first request_ts); use --split ts:T1,T2 or none")
  return t1, t2


BATCH_ROWS = 1 << 18             # rows per batch the engine hands to the partitioned writer


def _write_partitioned(con, sql: str, out: str) -> None:
  """The rows of ``sql`` into ``out/_bucket=<k>/part-<i>.arrow`` by their ``_bucket``:
  Arrow's dataset writer, streaming (a batch at a time, a bounded number of open files)."""
  reader = con.sql(sql).to_arrow_reader(BATCH_ROWS)
  pds.write_dataset(reader, out, format="ipc", partitioning=["_bucket"],
                    partitioning_flavor="hive", existing_data_behavior="overwrite_or_ignore",
                    use_threads=True)


def partition(con, staging: Staging, plan: dict, work_dir: str, buckets: int) -> list[dict]:
  """The hash partition of the rows by user, and the ad-side statistics (a window query over
  the whole log, on the few columns it needs) partitioned the same way: one task per bucket,
  ``{"files": [...], "ad_files": [...] or None}`` (Arrow IPC)."""
  bucket = f"(hash(user_id) % {int(buckets)})::BIGINT AS _bucket"
  con.register("staging", staging.dataset())
  dirs = {"files": os.path.join(work_dir, "buckets")}
  _write_partitioned(con, f"SELECT *, {bucket} FROM staging", dirs["files"])
  if plan["stats"]:
    dirs["ad_files"] = os.path.join(work_dir, "ad_stats")
    _write_partitioned(con, ad_sql(plan, "staging", ["_src", "_row", bucket]), dirs["ad_files"])
  tasks = []
  for k in range(buckets):
    t = {key: sorted(glob.glob(os.path.join(d, f"_bucket={k}", "*.arrow")))
         for key, d in dirs.items()}
    if t["files"]:
      tasks.append({"files": t["files"], "ad_files": t.get("ad_files")})
  return tasks


def part_groups(staging: Staging, rows: int) -> list[dict]:
  """Without histories: tasks of consecutive scan parts, about ``rows`` rows each."""
  tasks, cur, n = [], [], 0
  for f, c in zip(staging.files, staging.counts, strict=True):
    cur.append(f)
    n += c
    if n >= rows:
      tasks.append({"files": cur})
      cur, n = [], 0
  return tasks + ([{"files": cur}] if cur else [])


_ONE_THREAD = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def die_with_parent(parent: int | None = None) -> None:
  """Makes this process die with its parent (``kill -9`` / SIGTERM of an ingest leaves no
  workers behind): Linux's ``PR_SET_PDEATHSIG``, then a check that ``parent`` (if given) is
  still the parent, for a parent that died before."""
  if sys.platform.startswith("linux"):
    try:
      ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
      pass
  if parent is not None and os.getppid() != parent:
    os._exit(1)


_PR_SET_PDEATHSIG = 1


def _worker_init(parent: int | None = None):
  die_with_parent(parent)
  gc.freeze()                     # the imports: never scanned again by the cycle collector


def run_tasks(tasks: list[dict], workers: int, progress=None) -> list[dict]:
  """``data.ingest.bucket.convert_task`` over ``tasks`` in ``workers`` processes (in-process for one
  worker)."""
  if workers <= 1 or len(tasks) <= 1:
    out = []
    try:
      for t in tasks:
        out.append(convert_task(t))
        if progress:
          progress(out[-1]["rows"])
    finally:
      close_connection()
    return out
  ctx = multiprocessing.get_context("spawn")
  results = []
  # one process per core already: no BLAS thread pools in the workers (idle ones spin); the
  # workers start at the first submits and inherit the environment then
  env = {k: os.environ.get(k) for k in _ONE_THREAD}
  os.environ.update(dict.fromkeys(_ONE_THREAD, "1"))
  try:
    with concurrent.futures.ProcessPoolExecutor(min(workers, len(tasks)), mp_context=ctx,
                                                initializer=_worker_init,
                                                initargs=(os.getpid(),)) as pool:
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
  finally:
    for k, v in env.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v
  return sorted(results, key=lambda r: r["id"])


class EngineRunner(Runner):
  """``--runner duckdb``: the scan's batches staged as Arrow IPC parts, the whole-log passes as
  DuckDB queries (a connection opened once the schema is confirmed), the buckets converted by
  ``workers`` processes (``bucket.convert_task``)."""

  name = "duckdb"

  def __init__(self, tmp, spec, opts):
    super().__init__(tmp, spec, opts)
    self.work = os.path.join(tmp, ".work")
    os.makedirs(self.work)
    self.staging = Staging(self.work)
    self.plan, self.con = None, None

  def stage(self, sname, split_i, src_i, src, first, cols):
    self.staging.add(cols, src_i, first, split_i)

  def history(self, scan, surfaces, tasks, log, rows):
    null_free = [t for t in tasks
                 if f"label.{t}" in scan.stats and not scan.stats[f"label.{t}"].nulls]
    plan = self.plan = history_plan(self.spec, scan.first_cols, tasks, scan.ad, scan.act, log,
                                    null_free, rows)
    extra = [f"dense.{k}" for k in stat_names(tasks)] if plan["stats"] else []
    hs = {s: {"max_len": plan["max_len"], "item_vocab": plan["item_vocab"],
              "action_vocab": plan["action_vocab"]} for s in plan["streams"]}
    return hs, extra

  def connection(self):
    if self.con is None:
      self.con = connect(self.work, self.opts.workers, self.opts.memory_limit)
    return self.con

  def split_times(self, kind, vals):
    return split_times(self.connection(), self.staging, kind, vals)

  def convert(self, sources, full, schema, ctx, log, cpu):
    con, self.con = self.connection(), None
    return _convert(con, self.staging, self.tmp, schema, ctx, log, self.opts.workers,
                    self.opts.rows_per_bucket, self.opts.err, cpu)

  def close(self):
    if self.con is not None:
      self.con.close()
      self.con = None


def _convert(con, staging, tmp, schema, ctx, log, workers, rows_per_bucket, err, cpu):
  """Passes 2 and 3: the partition (``con`` is closed after it), the buckets in parallel, then
  the shards renamed and the manifest written; ``(counts, pos, lab, manifest)``."""
  work = os.path.join(tmp, ".work")
  c0 = time.process_time()
  if ctx["plan"] is not None:
    buckets = max(1, -(-staging.rows // rows_per_bucket))
    groups = partition(con, staging, ctx["plan"], work, buckets)
  else:
    groups = part_groups(staging, rows_per_bucket)
  con.close()
  cpu["partition"] = time.process_time() - c0
  tasks = [{"id": i, **g, "ctx": ctx, "out_dir": tmp, "work_dir": work}
           for i, g in enumerate(groups)]
  prog = Progress(f"convert ({min(workers, len(tasks))} workers)", staging.rows, err)
  results = run_tasks(tasks, workers, prog.add)
  prog.close()
  used = ctx["used"]
  counts = {s: {} for s in used}
  pos = {s: np.zeros(len(schema.tasks)) for s in used}
  lab = {s: np.zeros(len(schema.tasks)) for s in used}
  files = {}
  for k in ("queries", "history", "encode", "write"):
    cpu[f"tasks_{k}"] = sum(r["cpu_s"][k] for r in results)
  for r in results:
    for m, v in r["log"].items():
      log.add(m, v)
    for s in used:
      for surface, c in r["counts"][s].items():
        counts[s][surface] = counts[s].get(surface, 0) + c
      pos[s] += r["pos"][s]
      lab[s] += r["lab"][s]
    for key, fs in r["files"].items():
      files.setdefault(tuple(key), []).extend(fs)
  return counts, pos, lab, write_manifest(tmp, schema, used, files)
