"""Ingestion at log size: rows per second, CPU seconds and peak memory of ``python -m data.ingest``.

  nice -n 10 python bench/ingest.py                       # 1M and 10M rows (DuckDB engine)
  nice -n 10 python bench/ingest.py --sizes 50000000      # the 50M-row run
  python bench/ingest.py --sizes 1000000 --runner beam    # the Beam path (DirectRunner)
  python bench/ingest.py --sizes 1000000 --runner memory  # the in-memory path, for comparison
  python bench/ingest.py --quick                          # 100k rows, a smoke run

Each size: a flat Parquet log is generated (8 columns: time, user, ad, tab, click, conv, bid,
category; users with a skewed activity, ~20 rows per user on average, a few heavy ones; 3 tabs
as surfaces; conv labelled only on clicks), then ingested by a subprocess with the command of
issue #21: ``--history click=label.click,impression=all --history_len 64 --history_stats`` and a
time split 80 / 10 / 10. Measured for the ingest process tree (engine threads and worker
processes included): wall seconds, CPU seconds (user + sys, ``RUSAGE_CHILDREN``: robust to other
load, unlike wall time), peak resident memory (the sum over the tree, sampled every 0.2 s, and
the largest single process), output bytes, mean events per example. JSON:
``bench/results/ingest[_quick].json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)

from bench.output import result_path, write_json  # noqa: E402

RENAME = ("request_ts=time,user_id=user,ad_id=ad,surface=tab,label.click=click,label.conv=conv,"
          "dense.bid=bid,sparse.category=category")
HISTORY = ["--history", "click=label.click,impression=all", "--history_len", "64",
           "--history_stats", "--label_delay", "conv=1d", "--split", "time:0.8,0.1,0.1"]
CHUNK = 1_000_000


def generate(path: str, n: int, seed: int = 0) -> None:
  """A flat log of ``n`` rows in time order, written in chunks (bounded memory)."""
  import pyarrow as pa
  import pyarrow.parquet as pq
  rng = np.random.default_rng(seed)
  users = max(n // 20, 1)
  t0, span = 1_700_000_000, 30 * 86400
  cats = np.array([f"cat-{k:02d}" for k in range(40)])
  tabs = np.array(["feed", "stories", "reels"])
  w = None
  for a in range(0, n, CHUNK):
    m = min(CHUNK, n - a)
    ts = t0 + (np.sort(rng.random(m)) + a / CHUNK) * span * CHUNK / n
    user = (users * rng.random(m) ** 2).astype(np.int64)          # skewed: heavy low ids
    click = (rng.random(m) < 0.05).astype(np.int8)
    conv = np.where(click == 1, (rng.random(m) < 0.1).astype(np.float64), np.nan)
    t = pa.table({"time": ts.astype(np.int64), "user": user,
                  "ad": rng.integers(0, 50_000, m), "tab": tabs[rng.integers(0, 3, m)],
                  "click": click, "conv": pa.array(conv, from_pandas=True),
                  "bid": rng.gamma(2.0, 0.5, m), "category": cats[rng.integers(0, 40, m)]})
    if w is None:
      w = pq.ParquetWriter(path, t.schema)
    w.write_table(t, row_group_size=256 * 1024)
  w.close()


class TreeRSS(threading.Thread):
  """Peak of the summed RSS of a process and its descendants (sampled)."""

  def __init__(self, pid: int, every: float = 0.2):
    super().__init__(daemon=True)
    self.pid, self.every, self.peak, self.done = pid, every, 0, False

  def run(self):
    import psutil
    try:
      root = psutil.Process(self.pid)
    except psutil.NoSuchProcess:
      return
    while not self.done:
      try:
        procs = [root] + root.children(recursive=True)
        total = 0
        for p in procs:
          try:
            total += p.memory_info().rss
          except psutil.NoSuchProcess:
            pass
        self.peak = max(self.peak, total)
      except psutil.NoSuchProcess:
        return
      time.sleep(self.every)


MEMORY = """import sys
from data.ingest import cli
args = sys.argv[1:]
real = cli.run
cli.run = lambda *a, **k: real(*a, **{**k, "engine": "memory"})
sys.exit(cli.main(args))
"""


def ingest(log: str, out: str, runner: str, extra=()) -> dict:
  """One ``data.ingest`` run in a subprocess; ``runner`` memory is the in-memory reference
  (``run(engine="memory")``: today's path before the engine, for comparison)."""
  args = ["--input", log, "--out", out, "--rename", RENAME, *HISTORY, "--yes", *extra]
  if runner == "memory":
    cmd = [sys.executable, "-c", MEMORY, *args]
  elif runner == "beam":
    beam_py = os.path.join(_ROOT, ".venv-beam", "bin", "python")
    cmd = [beam_py, "-m", "data.ingest", *args, "--runner", "beam", "--buckets", "8"]
  else:
    cmd = [sys.executable, "-m", "data.ingest", *args, "--runner", runner]
  env = dict(os.environ, PYTHONPATH=_ROOT)
  r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
  t0 = time.perf_counter()
  p = subprocess.Popen(cmd, cwd=_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True)
  mon = TreeRSS(p.pid)
  mon.start()
  stdout, stderr = p.communicate()
  wall = time.perf_counter() - t0
  mon.done = True
  mon.join()
  r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
  if p.returncode:
    raise SystemExit(f"ingest failed ({p.returncode}):\n{stderr[-3000:]}")
  cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
  return {"wall_s": wall, "cpu_s": cpu, "peak_rss_tree_gb": mon.peak / 1e9,
          "max_rss_one_process_gb": r1.ru_maxrss / 1e6, "stdout_tail": stdout[-1500:]}


def dataset_facts(out: str) -> dict:
  m = json.load(open(os.path.join(out, "manifest.json")))
  files = [e for s in m["splits"].values() for es in s.values() for e in es]
  n = sum(e["count"] for e in files)
  size = sum(e["bytes"] for e in files)
  rep = json.load(open(os.path.join(out, "ingest.json")))
  return {"examples": n, "output_bytes": size, "shards": len(files),
          "bytes_per_example": size / max(n, 1), "encodings": rep.get("encodings"),
          "cpu_s_by_stage": rep.get("cpu_s")}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--sizes", default="1000000,10000000")
  ap.add_argument("--runner", default="duckdb", choices=("duckdb", "beam", "memory"),
                 help="memory: the in-memory reference (the path before the engine)")
  ap.add_argument("--quick", action="store_true", help="100k rows")
  ap.add_argument("--work", help="scratch directory (default: a temporary one)")
  ap.add_argument("--out", help="result JSON (default bench/results/ingest[_quick].json)")
  ap.add_argument("--merge", action="store_true", help="add to the existing result file")
  ap.add_argument("--note", default="", help="free text stored with the results")
  a = ap.parse_args(argv)
  sizes = [100_000] if a.quick else [int(x) for x in a.sizes.split(",")]
  work = a.work or tempfile.mkdtemp(prefix="kunlun-bench-ingest-")
  path = result_path("ingest", a.quick, a.out)
  res = json.load(open(path)) if a.merge and os.path.exists(path) else {"runs": []}
  import duckdb
  import pyarrow
  res.update({"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                          "python": platform.python_version(), "duckdb": duckdb.__version__,
                          "pyarrow": pyarrow.__version__},
              "command": "python -m data.ingest --input LOG --out DIR --rename ... "
                         + " ".join(HISTORY) + " --yes --runner RUNNER"})
  print(f"{'rows':>11} {'runner':>7} {'wall s':>8} {'cpu s':>8} {'rows/cpu-s':>11} "
        f"{'rows/s':>9} {'tree RSS GB':>12} {'B/example':>10}")
  for n in sizes:
    log = os.path.join(work, f"log_{n}.parquet")
    if not os.path.exists(log):
      generate(log, n)
    out = os.path.join(work, f"ds_{n}_{a.runner}")
    shutil.rmtree(out, ignore_errors=True)
    r = ingest(log, out, a.runner)
    r.update(dataset_facts(out), rows=n, runner=a.runner, note=a.note,
             rows_per_cpu_s=n / r["cpu_s"], rows_per_s=n / r["wall_s"],
             load_avg_after=os.getloadavg())
    shutil.rmtree(out, ignore_errors=True)
    print(f"{n:>11,} {a.runner:>7} {r['wall_s']:>8.1f} {r['cpu_s']:>8.1f} "
          f"{r['rows_per_cpu_s']:>11,.0f} {r['rows_per_s']:>9,.0f} "
          f"{r['peak_rss_tree_gb']:>12.2f} {r['bytes_per_example']:>10.0f}", flush=True)
    res["runs"] = [x for x in res["runs"] if (x["rows"], x["runner"]) != (n, a.runner)] + [r]
    write_json(path, res)
  if not a.work:
    shutil.rmtree(work, ignore_errors=True)
  print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
