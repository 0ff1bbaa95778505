"""The demo (scripts/demo.sh: kunlun/configs/demo.py, tiny's model, one pass) trained padded and
packed (``--config.data.jagged_capacity=auto``, issue #28) on the same examples and seed, each
evaluated by eval.py: train wall time, examples/s and eval NE per task, written to
bench/results/jagged_demo_cpu.json under ``runs["<examples>_<first>_first"]``.
``python scripts/jagged_demo.py [--examples N] [--first packed]``."""

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

from bench.output import result_path, write_json
from bench.train_step import versions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUTS = {"padded": [], "packed": ["--config.data.jagged_capacity=auto"]}


def run(cmd, log):
  """Runs ``cmd`` (output to ``log``); its wall seconds. A failure ends the script in one line."""
  t = time.perf_counter()
  with open(log, "w") as f:
    r = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, check=False)
  if r.returncode:
    sys.exit(f"jagged_demo: {' '.join(cmd[1:3])} failed (exit {r.returncode}); see {log}")
  return time.perf_counter() - t


def logged_rate(workdir):
  """Median of the examples/s train.py logged (metrics.jsonl; compile and data start excluded)."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  rates = [r["examples_per_s"] for r in rows if r.get("examples_per_s")]
  return float(np.median(rates)) if rates else None


def main(argv):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--examples", type=int, default=100_000, help="train examples (demo: 100000)")
  ap.add_argument("--dir", default="/tmp/kunlun_jagged_demo", help="data and workdirs")
  ap.add_argument("--first", default="padded", choices=sorted(LAYOUTS),
                  help="layout trained first (the other follows; load drifts favour neither)")
  ap.add_argument("--out", default=None, help="JSON (default bench/results/jagged_demo_cpu.json)")
  a = ap.parse_args(argv)
  if a.examples < 128:
    ap.error(f"--examples {a.examples}: at least one batch of 128")
  py, data = sys.executable, os.path.join(a.dir, "data")
  os.makedirs(a.dir, exist_ok=True)
  have = None
  if os.path.exists(os.path.join(data, "synthetic.json")):
    with open(os.path.join(data, "synthetic.json")) as f:
      have = json.load(f).get("num_train")
  elif os.path.exists(data):            # never remove a folder this script did not write
    sys.exit(f"jagged_demo: --dir {a.dir} holds a data/ folder that is not synthetic data "
             "(no synthetic.json): choose another --dir")
  if have != a.examples:
    shutil.rmtree(data, ignore_errors=True)
    run([py, "-m", "data.synthetic", "--out", data, "--preset", "tiny", "--num_examples",
         str(a.examples)], os.path.join(a.dir, "generate.log"))
  doc = {"what": "scripts/demo.sh's train.py + eval.py, padded vs packed towers",
         "examples": a.examples, "config": "kunlun/configs/demo.py", "cpus": os.cpu_count(),
         "load_avg_1m_start": os.getloadavg()[0], "versions": versions(), "layouts": {}}
  for layout in sorted(LAYOUTS, key=lambda x: x != a.first):
    extra = LAYOUTS[layout]
    work = os.path.join(a.dir, f"work_{layout}")
    shutil.rmtree(work, ignore_errors=True)
    wall = run([py, "train.py", "--config=kunlun/configs/demo.py", f"--workdir={work}",
                f"--data_dir={data}", "--config.train.epochs=1"] + extra,
               os.path.join(a.dir, f"train_{layout}.log"))
    out = os.path.join(a.dir, f"metrics_{layout}.json")
    eval_wall = run([py, "eval.py", f"--workdir={work}", f"--out={out}"],
                    os.path.join(a.dir, f"eval_{layout}.log"))
    with open(out) as f:
      m = json.load(f)
    doc["layouts"][layout] = {
        "train_wall_s": wall, "train_examples_per_s_wall": a.examples / wall,
        "train_examples_per_s_logged_median": logged_rate(work), "eval_wall_s": eval_wall,
        "eval_examples": m["examples"], "step": m["step"],
        "ne": {t: v["ne"] for t, v in m["overall"].items()},
        "auc": {t: v["auc"] for t, v in m["overall"].items()},
        "bayes_ne": {t: v.get("bayes_ne") for t, v in m["overall"].items()}}
    r = doc["layouts"][layout]
    print(f"{layout:7} train {wall:7.1f} s ({r['train_examples_per_s_wall']:7.1f} ex/s wall, "
          f"{r['train_examples_per_s_logged_median'] or float('nan'):7.1f} logged)  NE "
          + "  ".join(f"{t} {v:.4f}" for t, v in r["ne"].items()), flush=True)
  p, j = doc["layouts"]["padded"], doc["layouts"]["packed"]
  doc["speedup_train_wall"] = p["train_wall_s"] / j["train_wall_s"]
  doc["load_avg_1m_end"] = os.getloadavg()[0]
  path = result_path("jagged_demo_cpu", False, a.out)
  with open(path) if os.path.exists(path) else contextlib.nullcontext(None) as f:
    runs = json.load(f)["runs"] if f else {}
  key = f"{a.examples}_{a.first}_first"
  runs[key] = doc
  write_json(path, {"runs": runs})
  print(f"speed-up (train wall) {doc['speedup_train_wall']:.2f}x; wrote {path} "
        f"(runs[{key!r}])")


if __name__ == "__main__":
  main(sys.argv[1:])
