"""Kunlun module ablations (spec f.1): NE, step-time and FLOP deltas of each switch at one size.

  python bench/experiments/ablations.py [--quick] [--size 3] [--seeds 0 1] [--out PATH]
Notes: docs/guides/benchmarks.md, ``bench/experiments/ablations.py``."""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _ROOT)

import numpy as np  # noqa: E402

from bench import output  # noqa: E402
from bench.experiments import scaling as S  # noqa: E402
from data import synthetic  # noqa: E402
from data.schema import Schema  # noqa: E402
from kunlun.configs.types import tower  # noqa: E402
from kunlun.models.flops import model_flops  # noqa: E402
from kunlun.nn.oneseq import equal_flops_config  # noqa: E402
from kunlun.train.devices import enable_compilation_cache  # noqa: E402

VARIANTS = ("base", "pma", "sumkron_rank1", "full_attention", "block_attention", "no_compskip",
            "shared_tower", "oneseq", "mowe_experts", "final_hsp", "kunlun_ablated")


def _log(msg):
  print(f"[ablations {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def variant_config(name: str, base, schema):
  """``base`` (a Kunlun config) with switch ``name`` flipped (module docstring)."""
  c = copy.deepcopy(base)
  m = c.model
  if name == "base":
    pass
  elif name == "pma":
    m.pooling = "pma"
  elif name == "sumkron_rank1":
    m.hsp_rank = 1
  elif name == "full_attention":
    m.attention.kind = "full"
  elif name == "block_attention":
    m.attention.kind = "block"
    m.attention.block_size = 2 * m.towers[S.HIGH_VALUE[0]].window
  elif name == "no_compskip":
    m.comp_skip = False
  elif name == "shared_tower":
    hi = m.towers[S.HIGH_VALUE[0]]
    for s in m.towers.keys():
      m.towers[s] = tower(**{**hi.to_dict(), "kept_len": m.towers[s].kept_len})
  elif name == "oneseq":
    hi = m.towers[S.HIGH_VALUE[0]]
    m.oneseq = tower(**{**hi.to_dict(),
                        "kept_len": sum(m.towers[s].kept_len for s in m.towers.keys())})
    m.seq_mode = "oneseq"
    c, _ = equal_flops_config(c, lambda x: model_flops(x, schema)["forward"])
  elif name == "mowe_experts":
    m.mowe.num_experts = 1 if m.mowe.num_experts > 1 else 2
  elif name == "final_hsp":
    m.final_hsp = True
  elif name == "kunlun_ablated":
    m.arch = "kunlun_ablated"
  else:
    raise ValueError(f"unknown variant {name!r}; allowed: {VARIANTS}")
  return c


def _pct(a, b):
  return 100.0 * (a - b) / b


def summarize(runs: list[dict], seeds) -> dict:
  """Per variant: NE mean / std, paired NE delta % vs base, step time and FLOP deltas %."""
  get = lambda v, s: next((r for r in runs if r["variant"] == v and r["seed"] == s), None)
  table = {}
  for v in VARIANTS:
    rs = [r for r in runs if r["variant"] == v]
    if not rs:
      continue
    row = {"ne": {}, "ne_delta_pct": {}, "seeds": sorted(r["seed"] for r in rs)}
    for t in S.TASKS:
      ne = [r["ne"][t] for r in rs]
      row["ne"][t] = {"mean": float(np.mean(ne)),
                      "std": float(np.std(ne, ddof=1)) if len(ne) > 1 else None}
      d = [100 * (get("base", r["seed"])["ne"][t] - r["ne"][t]) / get("base", r["seed"])["ne"][t]
           for r in rs if get("base", r["seed"])]
      row["ne_delta_pct"][t] = {"per_seed": d, "mean": float(np.mean(d)) if d else None,
                                "std": float(np.std(d, ddof=1)) if len(d) > 1 else None}
    if "experts" in rs[0]:
      row["experts"] = rs[0]["experts"]
    mean = lambda key, rr=rs: float(np.mean([r[key] for r in rr]))
    row.update(step_time_ms=mean("step_time_ms_median"),
               train_flops_per_example=mean("train_flops_per_example"),
               train_flops_per_example_padded=mean("train_flops_per_example_padded"),
               executed_flops_per_example=mean("executed_flops_per_example"),
               params=rs[0]["params"])
    table[v] = row
  base = table.get("base")
  if base:
    for row in table.values():
      row["delta_pct"] = {k: _pct(row[k], base[k]) for k in
                          ("step_time_ms", "train_flops_per_example",
                           "train_flops_per_example_padded", "executed_flops_per_example")}
  return table


def format_table(table: dict) -> str:
  head = (f"{'variant':<15} {'dNE% click':>14} {'dNE% conv':>14} {'step ms':>8} {'dstep%':>7} "
          f"{'dFLOP% model':>12} {'dFLOP% exec':>11}")
  rows = [head, "-" * len(head)]
  pm = lambda d: ("n/a" if d["mean"] is None else
                  f"{d['mean']:+.2f}" + ("" if d["std"] is None else f"+-{d['std']:.2f}"))
  for v, r in table.items():
    dl = r.get("delta_pct", {})
    if v == "mowe_experts" and "experts" in r:
      v = f"mowe_{r['experts']}"
    rows.append(f"{v:<15} {pm(r['ne_delta_pct']['click']):>14} "
                f"{pm(r['ne_delta_pct']['conversion']):>14} {r['step_time_ms']:>8.1f} "
                f"{dl.get('step_time_ms', float('nan')):>+7.1f} "
                f"{dl.get('train_flops_per_example', float('nan')):>+12.1f} "
                f"{dl.get('executed_flops_per_example', float('nan')):>+11.1f}")
  return "\n".join(rows)


def run(args) -> dict:
  t_start = time.perf_counter()
  env = S._environment()
  work = args.workdir or tempfile.mkdtemp(prefix="kunlun_ablations_")
  os.makedirs(work, exist_ok=True)
  enable_compilation_cache(os.path.join(work, "xla_cache"))
  size = S.QUICK_LADDER[0] if args.quick else S.LADDERS["cpu"][args.size]
  data_dir = args.data_dir or os.path.join(work, f"data_tiny_{args.num_examples}")
  if not os.path.exists(os.path.join(data_dir, "synthetic.json")):
    _log(f"generating tiny data: {args.num_examples} train examples into {data_dir}")
    synthetic.generate(data_dir, "tiny", args.num_examples, seed=args.data_seed)
  schema = Schema.load(data_dir)
  log_path = os.path.join(work, "runs.jsonl")
  done = {(r["variant"], r["seed"]): r for r in S._read_runs(log_path)}
  runs, eval_cache, built = [], {}, {}
  variants = args.variants or VARIANTS
  for i, (v, seed) in enumerate((v, s) for v in variants for s in args.seeds):
    if (v, seed) in done:
      runs.append(done[(v, seed)])
      continue
    base = S.size_config("kunlun", size, "tiny", schema, batch_size=args.batch_size, lr=args.lr,
                         emb_lr=args.emb_lr,
                         warmup=max(int(0.05 * args.num_examples / args.batch_size), 1),
                         seed=seed)
    cfg = variant_config(v, base, schema)
    _log(f"run {i + 1}/{len(variants) * len(args.seeds)}: {v} seed {seed}")
    r = S.train_eval(cfg, schema, data_dir, args.num_examples, eval_cache, built,
                     eval_examples=args.eval_examples)
    r.update(variant=v, seed=seed, load_avg=os.getloadavg()[0], experts=cfg.model.mowe.num_experts,
             model=json.loads(json.dumps(cfg.model.to_dict(), default=list)))
    runs.append(r)
    with open(log_path, "a") as f:
      f.write(json.dumps(r) + "\n")
    _log(f"  NE click {r['ne']['click']:.4f} conversion {r['ne']['conversion']:.4f} | "
         f"{r['train_flops_per_example'] / 1e6:.2f} MFLOP/ex | step "
         f"{r['step_time_ms_median']:.1f} ms | {sum(r['timings_s'].values()):.0f}s")
  table = summarize(runs, args.seeds)
  out = {"bench": "ablations", "quick": args.quick,
         "setup": {"preset": "tiny", "size": "quick" if args.quick else args.size,
                   "size_knobs": size, "num_examples": args.num_examples, "seeds": args.seeds,
                   "batch_size": args.batch_size, "lr": args.lr, "emb_lr": args.emb_lr,
                   "eval_examples": runs[0]["eval_examples"] if runs else None,
                   "ne_delta": "100 (NE_base - NE_variant) / NE_base, paired by seed; "
                               "positive = variant better",
                   "flops": "training FLOPs per example: model (actual lengths), executed "
                            "(XLA compiled train step)",
                   "step_time": "median train-step time; 2 shared CPU cores, noisy"},
         "environment": {**env, "load_avg_end": os.getloadavg()},
         "bayes_ne": runs[0]["bayes_ne"] if runs else None,
         "table": table, "runs": runs, "seconds": time.perf_counter() - t_start,
         "run_seconds": sum(sum(r["timings_s"].values()) for r in runs)}
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--quick", action="store_true", help="smallest size, two variants, one seed")
  ap.add_argument("--size", type=output.at_least(0), default=3,
                  help="index in bench/experiments/scaling.py's CPU ladder")
  ap.add_argument("--variants", nargs="*", default=None, choices=VARIANTS)
  ap.add_argument("--num_examples", type=output.at_least(1), default=None)
  ap.add_argument("--seeds", type=output.at_least(0), nargs="+", default=None)
  ap.add_argument("--batch_size", type=output.at_least(1), default=128)
  ap.add_argument("--lr", type=float, default=5e-3)
  ap.add_argument("--emb_lr", type=float, default=0.2)
  ap.add_argument("--eval_examples", type=output.at_least(1), default=None)
  ap.add_argument("--data_seed", type=output.at_least(0), default=0)
  ap.add_argument("--workdir", default=None, help="data and runs.jsonl (resumable)")
  ap.add_argument("--data_dir", default=None,
                  help="synthetic tiny data to use (e.g. the scaling sweep's; default: generate)")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  output.make_folder("--workdir", args.workdir)
  q = args.quick
  args.num_examples = args.num_examples or (512 if q else 200_000)
  args.seeds = args.seeds or ([0] if q else [0, 1])
  args.eval_examples = args.eval_examples or (512 if q else 20_000)
  if q:
    args.variants = args.variants or ["base", "mowe_experts"]
    args.batch_size = min(args.batch_size, 64)
  out = run(args)
  path = output.result_path("ablations", q, args.out)
  output.write_json(path, S.finite(out))
  print(format_table(out["table"]))
  _log(f"wrote {path} ({out['seconds']:.0f}s)")
  return out


if __name__ == "__main__":
  main()
