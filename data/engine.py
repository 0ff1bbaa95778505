"""``data.ingest`` out of core on an embedded engine (DuckDB), on all cores.

Why DuckDB: an in-process SQL engine (one pip wheel, no server, no JVM) that runs sorts, window
functions and joins on all cores, spills them to disk under a memory limit it lets us set
(``memory_limit``, ``temp_directory``), and exchanges data with Arrow without copies (it scans
Arrow tables and datasets, and hands results over as Arrow streams). The alternatives weighed:
Polars (fast in memory, but a memory cap and spilling of ordered window aggregates are not what
its streaming engine offers), DataFusion (spills too, but its Python bindings are younger and
far less used), SQLite (row-wise and single-threaded). Between passes the rows live in Arrow IPC
files: written and read back at memory speed, where Parquet spent more CPU encoding and decoding
them than any query. Measured costs: bench/results/ingest.json (``cpu_s_by_stage``).

Three passes (``data.ingest.run`` drives them):

1. **scan** (``Staging``): each input batch is renamed and coerced (``data.layout.canonical``:
   row-local Arrow compute, the same code as the in-memory path) and written as an IPC part
   with its source and row number; the scan statistics are gathered on the way.
2. **engine, whole log** (``split_times``, ``partition``): the split quantiles (an exact
   ``ORDER BY .. OFFSET``), a hash partition of the rows by user into buckets of about
   ``rows_per_bucket`` rows, and the ad-side history statistics (``ad_sql``: per row the same
   ad's strictly earlier rows, ``rank() - 1``, and their labelled / positive counts, window sums
   over a frame without the row's second, on the few columns they need) partitioned the same
   way. The engine streams both results into Arrow's partitioned dataset writer (a batch at a
   time, a bounded number of open files); its sorts spill to ``work_dir``.
3. **per bucket, in parallel** (``data.bucket.convert_task`` in a process pool, one DuckDB
   thread each): the engine orders a narrow copy of the bucket's rows by (user, time, input,
   row) and gives each row ``rank() - 1`` over the user's rows by time (the number of strictly
   earlier ones) and its stream flags (``bucket_sql``); numpy counts each stream's earlier events
   with prefix sums in that order and the record encoder reads each row's last ``max_len`` of
   them in place (``data.records.encode_ranges``); ``data.layout.finalize`` and
   ``data.parquet.table_to_records`` encode ``CHUNK`` rows at a time, and each task writes its
   own ArrayRecord shards.

Without ``--history`` the tasks are runs of the scan's parts, in input order. Memory is bounded
by the engine's limit plus, per worker, one bucket's rows (their coerced columns and the events
of its streams) and one chunk of records: a single user with more rows than a bucket makes that
bucket larger.
Output records are byte-equal to the in-memory path's (``tests/data/test_ingest_engine.py``);
within a split and surface they come bucket by bucket, each in (user, time) order.
"""

from __future__ import annotations

import concurrent.futures
import glob
import multiprocessing
import os

import numpy as np
import pyarrow as pa

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
    import pyarrow.dataset as pds
    schema = pa.unify_schemas(self.schemas, promote_options="permissive") if self.schemas \
        else None
    return pds.dataset(files or self.files, format="ipc", schema=schema)


def write_ipc(t: pa.Table, path: str) -> None:
  with pa.OSFile(path, "wb") as f, pa.ipc.new_file(f, t.schema) as w:
    w.write_table(t)


def read_ipc(files) -> pa.Table:
  """The rows of Arrow IPC files, in order."""
  parts = []
  for p in files:
    with pa.memory_map(p) as f:
      parts.append(pa.ipc.open_file(f).read_all())
  return pa.concat_tables(parts, promote_options="permissive") if len(parts) != 1 else parts[0]


def split_times(con, staging: Staging, kind: str, vals) -> tuple[float, float]:
  """``data.ingest.cut_times`` as engine queries: exact order statistics of request_ts."""
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


# ---- the history plan: what the streams are, in the schema's terms ---------------------------

def stat_names(tasks) -> list[str]:
  """The dense statistics ``--history_stats`` adds, in order (as ``data.history.stats``)."""
  return [n for side in ("user", "ad") for n in
          [f"{side}_count"] + [f"{side}_{t}_rate" for t in tasks]]


def _sel(sel: str) -> str:
  """SQL: true when the row is an event of a stream with selector column ``sel``."""
  return f"(coalesce({_q(sel)}, 0) > 0.5)"


def _valid(t) -> str:
  return f"({_q('label.' + t)} IS NOT NULL)::BIGINT"


def _pos(t) -> str:
  return f"(coalesce({_q('label.' + t)}, 0) > 0.5)::BIGINT"


_BITS = 40                        # per count packed into a HUGEINT sum (3 per sum)
_AD = "PARTITION BY _ad_feature ORDER BY request_ts"
_EARLIER = f"({_AD} RANGE BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW EXCLUDE GROUP)"


def ad_counts(plan: dict) -> list[tuple[str, str]]:
  """``[(column, SQL 0/1 of a row)]``: the ad-side counts summed over strictly earlier rows;
  a task whose labels the scan found never null has its valid count equal to ``_ad_count``
  (not computed)."""
  out = [(f"_ap.{t}", _pos(t)) for t in plan["tasks"]]
  return out + [(f"_av.{t}", _valid(t)) for t in plan["tasks"]
                if t not in plan.get("null_free", ())]


def ad_sql(plan: dict, src: str, keep: list[str]) -> str:
  """SQL: ``keep`` and the ad-side statistic counts of every row of ``src``: ``_ad_count`` =
  the same ad's rows with a strictly earlier request_ts (``rank() - 1``), and ``ad_counts``
  summed over them (a window frame that ends before the row's peers: ``EXCLUDE GROUP``).
  With ``plan["pack"]`` three counts share one window: ``_BITS``-bit fields of a HUGEINT sum
  (exact while an ad has fewer than 2**40 rows; ``pack`` is set only for logs that small)."""
  counts = ad_counts(plan)
  step = 3 if plan.get("pack") else 1
  inner, outer, packs = [f"rank() OVER ({_AD}) - 1 AS _ad_count"], [], []
  for g in range(0, len(counts), step):
    part = counts[g:g + step]
    if step == 1:
      inner.append(f"coalesce(sum({part[0][1]}) OVER {_EARLIER}, 0)::BIGINT AS {_q(part[0][0])}")
      continue
    packed = " + ".join(f"({e}::HUGEINT << {_BITS * i})" for i, (_, e) in enumerate(part))
    inner.append(f"coalesce(sum({packed}) OVER {_EARLIER}, 0::HUGEINT) AS _s{g}")
    packs.append(f"_s{g}")
    mask = (1 << _BITS) - 1
    outer += [f"((_s{g} >> {_BITS * i}) & {mask})::BIGINT AS {_q(c)}"
              for i, (c, _) in enumerate(part)]
  sql = f"SELECT {', '.join(list(keep) + inner)} FROM {src}"
  if packs:
    sql = f"SELECT * EXCLUDE ({', '.join(packs)}), {', '.join(outer)} FROM ({sql})"
  return sql


BATCH_ROWS = 1 << 18             # rows per batch the engine hands to the partitioned writer


def _write_partitioned(con, sql: str, out: str) -> None:
  """The rows of ``sql`` into ``out/_bucket=<k>/part-<i>.arrow`` by their ``_bucket``:
  Arrow's dataset writer, streaming (a batch at a time, a bounded number of open files)."""
  import pyarrow.dataset as pds
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


ORDER = "ORDER BY user_id, request_ts, _src, _row"


def bucket_sql(src: str, plan: dict, key: str, keep: list[str]) -> str:
  """The order of one bucket's rows by (user, time, input, row) (``ORDER``): per row, in that
  order, ``keep`` (where the row is stored), ``_key`` (split and input) and what the histories
  need from the engine: ``_earlier`` = the number of the same user's rows with a strictly earlier
  request_ts (``rank() - 1``: in this order, the rows just before the row's own second) and,
  per stream with a selector, ``_keep.<s>`` (the row is an event of the stream). A narrow
  result: numpy then gathers the rows, counts and copies (``data.bucket.HistoryColumns``)."""
  cols = keep + [f"{key} AS _key",
                 "rank() OVER (PARTITION BY user_id ORDER BY request_ts) - 1 AS _earlier"]
  cols += [f"{_sel(sel)} AS {_q('_keep.' + s)}" for s, sel in plan["streams"].items()
           if sel is not None]
  return f"SELECT {', '.join(cols)} FROM {src} {ORDER}"


_ONE_THREAD = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def _worker_init():
  import gc
  gc.freeze()                     # the imports: never scanned again by the cycle collector


def run_tasks(tasks: list[dict], workers: int, progress=None) -> list[dict]:
  """``data.bucket.convert_task`` over ``tasks`` in ``workers`` processes (in-process for one
  worker)."""
  from data.bucket import close_connection, convert_task
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
                                                initializer=_worker_init) as pool:
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
