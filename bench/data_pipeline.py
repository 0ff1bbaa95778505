"""Data benchmark: synthetic generation speed and whole-pipeline throughput on CPU.

For each preset (tiny, mid): generate a dataset (examples/s, wall and CPU time of this process),
time decode + validation of raw records per record (``RecordChecker``) and per batch
(``BatchValidator``), then iterate ``data.pipeline.make_dataset`` (train mode, mixing, read,
decode, validate, pad, batch) with in-process loader threads, and separately with ``mp_prefetch``
worker processes. ``ex/cpu-s`` = examples per CPU-second of this process (all its threads; the
parent only under mp_prefetch): steadier than wall-clock rates on a shared, loaded machine.
Prints a table and writes JSON to ``bench/results/data_pipeline.json``.

    python -m bench.data_pipeline            # full
    python -m bench.data_pipeline --quick    # smoke test (seconds)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

import grain
import ml_collections
import numpy as np
from absl import flags

from data import records, synthetic
from data.pipeline import make_dataset
from data.schema import Schema
from data.verify import BatchValidator
from kunlun.utils import atomic


def _cfg(batch_size, threads):
  return ml_collections.ConfigDict(dict(
      batch_size=batch_size, surface_weights={"feed": 0.5, "stories": 0.3, "reels": 0.2},
      shuffle_seed=0, num_threads=threads, prefetch=2 * threads + 2, skip_invalid=False,
      length_balance=False, length_balance_groups=0))


def _gen(out, preset, n):
  t, c = time.perf_counter(), time.process_time()
  synthetic.generate(out, preset, n, seed=0)
  wall, cpu = time.perf_counter() - t, time.process_time() - c
  with open(os.path.join(out, "synthetic.json")) as f:
    total = (lambda i: i["num_train"] + i["num_eval"])(json.load(f))
  return {"examples": total, "wall_s": wall, "ex_per_s_wall": total / wall,
          "ex_per_s_cpu": total / cpu}


def _pipe(data_dir, batch_size, batches, threads=2, workers=0):
  seq = {s.name: s.max_len for s in Schema.load(data_dir).streams}
  ds = make_dataset(_cfg(batch_size, threads), data_dir, "train", seq, train=True,
                    shard_index=0, shard_count=1)
  if workers:
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers,
                                                     per_worker_buffer_size=2))
  it = iter(ds)
  next(it)                                          # start-up (workers, first reads)
  t, c = time.perf_counter(), time.process_time()
  for _ in range(batches):
    next(it)
  wall, cpu = time.perf_counter() - t, time.process_time() - c
  n = batches * batch_size
  it.close()
  return {"threads": threads, "workers": workers, "batch_size": batch_size, "batches": batches,
          "ex_per_s": n / wall, "ex_per_cpu_s": n / cpu, "main_process_cpu_s": cpu,
          "seq_lens": seq}


def _decode(data_dir, batch_size, batches):
  """Records/s per CPU-second: per-record ``RecordChecker`` + padding vs ``BatchValidator``."""
  schema = Schema.load(data_dir)
  seq = {s.name: s.max_len for s in schema.streams}
  src = records.RecordSource(records.split_files(data_dir, "train", schema)[schema.surfaces[0]])
  rng = np.random.default_rng(0)
  raws = [src.read_many(rng.integers(0, len(src), batch_size))[2] for _ in range(batches)]
  bv = BatchValidator(schema, seq)
  surf = np.zeros(batch_size, np.int64)
  where = lambda i: ("bench", i)
  c = time.process_time()
  for rs in raws:
    cols = bv.empty(len(rs))
    for i, r in enumerate(rs):
      bv.fill_row(cols, i, bv.validator(r, file="bench", index=i, surface=0))
  per_record = time.process_time() - c
  c = time.process_time()
  for rs in raws:
    _, ok, _ = bv(rs, surf, where)
    assert ok.all()
  per_batch = time.process_time() - c
  n = batch_size * batches
  return {"records": n, "per_record_rec_per_cpu_s": n / per_record,
          "batch_rec_per_cpu_s": n / per_batch}


def main(argv=None):
  flags.FLAGS.mark_as_parsed()                      # mp_prefetch reads an absl flag
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                "data_pipeline.json"))
  a = ap.parse_args(argv)
  sizes = {"tiny": (2_000, 64, 10), "mid": (300, 16, 4)} if a.quick else \
      {"tiny": (50_000, 64, 200), "mid": (5_000, 64, 20)}
  rows, result = [], {"quick": a.quick, "cpus": os.cpu_count(), "python": sys.version.split()[0],
                      "machine": platform.machine(), "load_avg": os.getloadavg(), "presets": {}}
  with tempfile.TemporaryDirectory() as tmp:
    for preset, (n, bs, batches) in sizes.items():
      d = os.path.join(tmp, preset)
      g = _gen(d, preset, n)
      r = {"generate": g, "pipeline": []}
      rows.append((preset, "generate", "-", g["ex_per_s_wall"], g["ex_per_s_cpu"], ""))
      dec = _decode(d, bs, batches)
      r["decode"] = dec
      rows.append((preset, "validate/record", "-", float("nan"), dec["per_record_rec_per_cpu_s"],
                   "decode + validate + pad, one record at a time"))
      rows.append((preset, "validate/batch", "-", float("nan"), dec["batch_rec_per_cpu_s"],
                   f"BatchValidator, batch {bs}"))
      for threads, workers in ((1, 0), (2, 0), (4, 0), (2, 2)):
        p = _pipe(d, bs, batches, threads, workers)
        r["pipeline"].append(p)
        mode = f"mp_prefetch x{workers}" if workers else "threads"
        rows.append((preset, mode, threads, p["ex_per_s"], p["ex_per_cpu_s"], f"batch {bs}"))
      result["presets"][preset] = r
  print(f"{'preset':6s} {'stage':16s} {'threads':>7s} {'examples/s':>11s} {'ex/cpu-s':>9s}  note")
  for preset, stage, th, eps, epc, note in rows:
    print(f"{preset:6s} {stage:16s} {th!s:>7s} {eps:11.0f} {epc:9.0f}  {note}")
  print(f"(cpus {result['cpus']}, load average {result['load_avg'][0]:.1f})")
  atomic.write_json(a.out, result)
  print("wrote", a.out)
  return result


if __name__ == "__main__":
  main()
