"""NE effect of the per-head time-bucket embeddings (spec b.5-2, ``config.model.time_buckets``).

  nice -n 10 python bench/experiments/time_buckets.py [--seeds 0,1,2,3,4] [--steps 3000]
      [--num_examples 200000] [--kinds age,gap,position] [--workdir DIR] [--quick]

Trains the ``tiny`` preset on synthetic ``tiny`` data with the switch off and on (same seed, same
data order per pair: ``config.seed`` and ``data.shuffle_seed`` = the seed), evaluates each run on
the eval split (the following time window) with eval.py and reports the overall NE per task, the
paired delta ``NE_on - NE_off`` per seed, and its mean, standard deviation and standard error.
Negative deltas mean the bucket embeddings help. Runs that already have ``metrics.json`` in the
work directory are reused. Results JSON: ``bench/results/time_buckets.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _ROOT)

import flax  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench.output import at_least  # noqa: E402
from data import synthetic  # noqa: E402
from data.schema import Schema  # noqa: E402
from kunlun.utils import atomic  # noqa: E402


def _log(msg):
  print(f"[time_buckets {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _run_one(args, data_dir, seed, on) -> dict:
  work = os.path.join(args.workdir, f"seed{seed}_{'on' if on else 'off'}")
  out = os.path.join(work, "metrics.json")
  if not os.path.exists(out):
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, os.path.join(_ROOT, "train.py"),
                    f"--config={os.path.join(_ROOT, 'kunlun/configs/tiny.py')}",
                    f"--workdir={work}", f"--data_dir={data_dir}", f"--steps={args.steps}",
                    "--mesh=data=1,fsdp=-1", f"--config.seed={seed}",
                    f"--config.data.shuffle_seed={seed}",
                    f"--config.model.time_buckets.enabled={on}",
                    f"--config.model.time_buckets.kinds={args.kinds}",
                    f"--config.train.log_every={max(args.steps // 5, 1)}",
                    f"--config.train.checkpoint_every={args.steps}"],
                   check=True, env=env, cwd=_ROOT)
    subprocess.run([sys.executable, os.path.join(_ROOT, "eval.py"), f"--workdir={work}",
                    "--mesh=data=1,fsdp=-1", f"--out={out}"], check=True, env=env, cwd=_ROOT)
    _log(f"seed {seed} {'on' if on else 'off'}: {time.perf_counter() - t0:.0f} s")
  m = json.load(open(out))
  return {"overall": {t: v["ne"] for t, v in m["overall"].items()},
          "bayes": {t: v.get("bayes_ne") for t, v in m["overall"].items()},
          "per_surface": {s: {t: v["ne"] for t, v in d.items()} for s, d in m["metrics"].items()}}


def summarize(runs: dict, seeds, tasks) -> dict:
  """Paired deltas per task: ``{task: {"deltas", "mean", "std", "sem", "helps_in"}}``."""
  out = {}
  for t in tasks:
    d = np.array([runs[s]["on"]["overall"][t] - runs[s]["off"]["overall"][t] for s in seeds])
    std = float(d.std(ddof=1)) if len(d) > 1 else 0.0
    out[t] = {"deltas": [float(x) for x in d], "mean": float(d.mean()), "std": std,
              "sem": std / np.sqrt(len(d)) if len(d) else 0.0,
              "mean_rel_pct": float(np.mean([100 * (runs[s]["on"]["overall"][t]
                                                    / runs[s]["off"]["overall"][t] - 1)
                                             for s in seeds])),
              "helps_in": int((d < 0).sum()), "seeds": len(d)}
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--seeds", default="0,1,2,3,4")
  ap.add_argument("--steps", type=at_least(1), default=3000)
  ap.add_argument("--num_examples", type=at_least(1), default=200_000)
  ap.add_argument("--kinds", default="age,gap,position")
  ap.add_argument("--workdir", default="/tmp/kunlun_time_buckets")
  ap.add_argument("--out", default=os.path.join(_ROOT, "bench/results/time_buckets.json"))
  ap.add_argument("--quick", action="store_true", help="2 seeds, 60 steps, 5k examples (smoke)")
  args = ap.parse_args()
  if args.quick:
    args.seeds, args.steps, args.num_examples = "0,1", 60, 5000
  seeds = [int(s) for s in args.seeds.split(",")]
  data_dir = os.path.join(args.workdir, f"data_{args.num_examples}")
  if not os.path.exists(os.path.join(data_dir, "manifest.json")):
    synthetic.generate(data_dir, "tiny", num_examples=args.num_examples, seed=0)
  schema = Schema.load(data_dir)
  t0 = time.perf_counter()
  runs = {s: {v: _run_one(args, data_dir, s, v == "on") for v in ("off", "on")} for s in seeds}
  tasks = schema.task_names
  summary = summarize(runs, seeds, tasks)
  result = {
      "what": "overall eval NE, tiny preset, time_buckets off vs on (paired by seed)",
      "device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
      "versions": {"jax": jax.__version__, "jaxlib": jax.lib.__version__,
                   "flax": flax.__version__, "python": platform.python_version()},
      "config": {"preset": "tiny", "steps": args.steps, "batch_size": 64,
                 "num_examples": args.num_examples, "kinds": args.kinds, "seeds": seeds,
                 "num_buckets": 32, "age_horizon_days": 32.0},
      "runs": {str(s): r for s, r in runs.items()}, "delta_on_minus_off": summary,
      "seconds": time.perf_counter() - t0,
      "note": "machine shared with other jobs (2 CPU cores); NE does not depend on speed",
  }
  atomic.write_json(args.out, result)
  print(f"{'task':<12} {'NE off':>8} {'NE on':>8} {'delta':>9} {'std':>8} {'sem':>8} helps")
  for t in tasks:
    off = np.mean([runs[s]["off"]["overall"][t] for s in seeds])
    on = np.mean([runs[s]["on"]["overall"][t] for s in seeds])
    d = summary[t]
    print(f"{t:<12} {off:8.4f} {on:8.4f} {d['mean']:+9.4f} {d['std']:8.4f} {d['sem']:8.4f} "
          f"{d['helps_in']}/{d['seeds']}")
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
