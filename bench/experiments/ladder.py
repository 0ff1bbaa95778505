"""Data-scaled, resumable, multi-seed scaling ladder (issue #30): Kunlun, InterFormer, DLRM.

Sizes ``scaling.LADDERS``; examples per run n_k = n_0 sqrt(F_k / F_0) (F_k: Kunlun's padded
training FLOPs per example at size k; the same n_k for every architecture), one pass; the LR of
each (arch, size) chosen on a held-out split; one JSON per finished run under ``--out_dir``.
  python bench/experiments/ladder.py [--dry_run] [--resume] [--quick] [--out_dir DIR]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _ROOT)

import numpy as np  # noqa: E402

from bench import output  # noqa: E402
from bench.experiments import scaling as S  # noqa: E402
from data import synthetic  # noqa: E402
from data.schema import Schema  # noqa: E402
from kunlun.models import flops as F  # noqa: E402
from kunlun.train.startup import FatalError  # noqa: E402
from kunlun.utils import atomic  # noqa: E402
from kunlun.utils.lock import LockError, WorkdirLock  # noqa: E402

OUT_DIR = os.path.join(_ROOT, "bench", "results", "scaling_ladder")
REFERENCE = os.path.join(_ROOT, "bench", "results", "scaling.json")   # measured step times
HOLDOUT_SPLIT = "pretrain"   # the time window just before train: same stream, never trained on
QUICK = dict(sizes=2, seeds=[0, 1], n0=256, cap=512, batch_size=64, eval_examples=256,
             holdout_examples=256)
# the plan's fields a resumed ladder must match (one source: the frozen plan.json)
PLAN_KEYS = ("ladder", "preset", "seeds", "lrs", "batch_size", "n0", "cap", "examples",
             "eval_examples", "holdout_examples", "data_seed", "jagged_capacity", "jagged_archs",
             "emb_lr")


def _log(msg):
  print(f"[ladder {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def fail(msg):
  raise SystemExit(f"ladder.py: error: {msg}")


# ---- plan ----------------------------------------------------------------------------------------
def examples_rule(flops, n0: int, cap: int, batch: int) -> list[int]:
  """n_k = n0 sqrt(F_k / F_0), capped at ``cap``, rounded down to whole batches (>= 1 batch)."""
  f = np.asarray(flops, np.float64)
  n = np.minimum(n0 * np.sqrt(f / f[0]), cap)
  return [max(int(x) // batch, 1) * batch for x in n]


def run_name(arch: str, size: int, seed: int, lr: float) -> str:
  return f"{arch}_{size}_{seed}_lr{lr:g}"


def run_list(plan: dict) -> list[dict]:
  """Every run in order: sizes ascending; per (size, arch) the LR trials (seed ``seeds[0]``, each
  LR), then the other seeds at the LR chosen on the held-out split (``lr`` None until then)."""
  out = []
  for k, n in enumerate(plan["examples"]):
    for arch in S.ARCHS:
      for lr in plan["lrs"]:
        out.append(dict(arch=arch, size=k, seed=plan["seeds"][0], lr=lr, examples=n,
                        role="lr_trial"))
      for seed in plan["seeds"][1:]:
        out.append(dict(arch=arch, size=k, seed=seed, lr=None, examples=n, role="seed"))
  return out


def _plain(x):
  return json.loads(json.dumps(x))


def reference_costs(plan: dict, finished: list[dict]) -> dict:
  """Per (arch, size): ms per training example, compile and eval seconds. Finished runs of this
  ladder when there are any ("here"), else ``bench/results/scaling.json`` (the 200k-example
  ladder, same sizes and batch 128, a loaded 2-core machine), else None."""
  ref = []
  if os.path.exists(REFERENCE):
    with open(REFERENCE) as f:
      ref = [r for r in json.load(f)["runs"] if r["kind"] == "ladder"]
  out = {}
  for arch in S.ARCHS:
    for k, knobs in enumerate(plan["ladder"]):
      here = [r for r in finished if r["arch"] == arch and r["size"] == k]
      there = [r for r in ref if r["arch"] == arch and r["size_knobs"] == _plain(knobs)]
      src, rs = ("here", here) if here else ("scaling.json", there)
      if not rs:
        out[(arch, k)] = None
        continue
      out[(arch, k)] = {
          "source": src,
          "ms_per_example": float(np.median([1e3 * r["timings_s"]["train"] / r["examples"]
                                             for r in rs])),
          "compile_s": float(max(r["timings_s"]["compile"] for r in rs)),
          "eval_s": float(np.median([r["timings_s"]["eval"] for r in rs]))
                    * (1 if src == "here" else 2)}          # here: eval + held-out already
  return out


def estimate(plan: dict, costs: dict, runs: list[dict]) -> list[float | None]:
  """Seconds per run: examples x ms per example + eval, + compile for the first run of each
  (arch, size, LR) (the LR is part of the compiled step)."""
  seen, out = set(), []
  for r in runs:
    c = costs.get((r["arch"], r["size"]))
    if c is None:
      out.append(None)
      continue
    key = (r["arch"], r["size"], r["lr"])
    first = key not in seen
    seen.add(key)
    out.append(r["examples"] * c["ms_per_example"] / 1e3 + c["eval_s"]
               + (c["compile_s"] if first else 0.0))
  return out


def plan_table(plan: dict, costs: dict, runs: list[dict], est: list, finished: list) -> str:
  n = max(plan["examples"])                # train + eval + held-out at ~25k examples/s
  gen_s = (n * (1 + synthetic.PRESETS[plan["preset"]].eval_frac) + plan["holdout_examples"]) / 25e3
  rows = [f"examples per run: n_k = {plan['n0']} sqrt(F_k / F_0), cap {plan['cap']} (F_k: Kunlun "
          f"padded training FLOPs per example); one pass; seeds {plan['seeds']}; LRs tried "
          f"{plan['lrs']} at seed {plan['seeds'][0]}, chosen on {plan['holdout_examples']} "
          f"held-out examples (split {HOLDOUT_SPLIT!r}); batch {plan['batch_size']}; packed "
          f"towers: {plan['jagged_capacity'] or 'off'}"
          f"{' for ' + ','.join(plan['jagged_archs']) if plan['jagged_capacity'] else ''}",
          f"{'size':>4} {'Kunlun MF/ex':>12} {'examples':>9} "
          + " ".join(f"{a + ' ms/ex':>17}" for a in S.ARCHS) + f" {'hours':>6}"]
  for k, n in enumerate(plan["examples"]):
    cs = [costs.get((a, k)) for a in S.ARCHS]
    h = [e for r, e in zip(runs, est, strict=True) if r["size"] == k]
    rows.append(f"{k:>4} {plan['kunlun_flops'][k] / 1e6:>12.3f} {n:>9} "
                + " ".join(f"{c['ms_per_example']:>8.3f} ({c['source'][:4]:>4})" if c else
                           f"{'?':>17}" for c in cs)
                + f" {(sum(h) / 3600 if None not in h else float('nan')):>6.2f}")
  rows.append("ms/ex: median training time per example; (scal) = bench/results/scaling.json "
              "(200k-example runs of the same sizes at batch 128, a loaded 2-core machine), "
              "(here) = this ladder's finished runs; a run adds eval + held-out eval and, first "
              "per (arch, size, LR), its compile")
  known = [e for e in est if e is not None]
  left = [e for r, e in zip(runs, est, strict=True) if e is not None
          and not is_done(r, finished)]
  span = plan["kunlun_flops"][-1] / plan["kunlun_flops"][0]
  rows.append(f"Kunlun FLOPs per example span {span:.0f}x; {len(runs)} runs ({len(finished)} "
              f"finished); data generation ~{gen_s / 60:.0f} min")
  rows.append(f"estimated total {sum(known) / 3600 + gen_s / 3600:.2f} h on this machine "
              f"({len(est) - len(known)} runs without a measured step time); left "
              f"{sum(left) / 3600:.2f} h")
  return "\n".join(rows)


def is_done(spec: dict, finished: list[dict]) -> bool:
  """Whether ``spec`` (a ``run_list`` entry; a seed run's LR is open until chosen) finished."""
  return any((r["arch"], r["size"], r["seed"], r["role"]) ==
             (spec["arch"], spec["size"], spec["seed"], spec["role"])
             and (spec["lr"] is None or r["lr"] == spec["lr"]) for r in finished)


# ---- runs on disk --------------------------------------------------------------------------------
def read_runs(out_dir: str) -> list[dict]:
  runs = []
  for p in sorted(glob.glob(os.path.join(out_dir, "runs", "*.json"))):
    with open(p) as f:
      runs.append(json.load(f))
  return runs


def choose_lr(finished: list[dict], arch: str, size: int, plan: dict) -> dict | None:
  """The LR with the lowest held-out click NE among the finished LR trials of (arch, size); None
  until every trial has finished. Eval NE plays no part."""
  trials = {r["lr"]: r for r in finished if r["arch"] == arch and r["size"] == size
            and r["role"] == "lr_trial"}
  if set(trials) != set(plan["lrs"]):
    return None
  ne = {lr: trials[lr]["holdout"]["ne"]["click"] for lr in plan["lrs"]}
  best = min(ne, key=ne.get)
  return {"lr": best, "holdout_click_ne_by_lr": {f"{k:g}": v for k, v in ne.items()}}


def ladder_runs(finished: list[dict], plan: dict) -> list[dict]:
  """The runs at each (arch, size)'s chosen LR (seed-0 trial of that LR plus the other seeds)."""
  out = []
  for arch in S.ARCHS:
    for k in range(len(plan["examples"])):
      c = choose_lr(finished, arch, k, plan)
      if c:
        out += [r for r in finished if r["arch"] == arch and r["size"] == k and r["lr"] == c["lr"]]
  return out


# ---- fits with uncertainty -----------------------------------------------------------------------
def seed_means(points: dict) -> tuple[np.ndarray, np.ndarray]:
  """``points`` {size: [(C, NE) per seed]} -> (mean C, mean NE) per size, sizes ascending."""
  ks = sorted(points)
  return (np.array([np.mean([c for c, _ in points[k]]) for k in ks]),
          np.array([np.mean([y for _, y in points[k]]) for k in ks]))


def resample(points: dict, rng) -> dict:
  """One bootstrap draw: per size, the seeds drawn with replacement."""
  return {k: [v[i] for i in rng.integers(0, len(v), len(v))] for k, v in points.items()}


def _interval(xs) -> dict:
  xs = np.asarray(xs, np.float64)
  if not len(xs):
    return {"lo": None, "median": None, "hi": None, "n": 0}
  lo, med, hi = np.percentile(xs, [2.5, 50, 97.5], method="inverted_cdf")   # inf stays inf
  return {"lo": float(lo), "median": float(med), "hi": float(hi), "n": int(len(xs))}


def compute_multiple(target_ne: float, target_c: float, fit: dict | None) -> float | None:
  """Compute an architecture with power fit ``fit`` (NE vs total compute) needs to reach
  ``target_ne``, as a multiple of ``target_c`` (inf if its asymptote is above the target)."""
  if not fit:
    return None
  need = S.flops_to_reach(target_ne, fit, None, 1.0)["power"]
  return need / target_c


def fit_ladder(points: dict, bootstrap: int = 300, seed: int = 0) -> dict:
  """``points`` {arch: {size: [(total compute, NE) per seed]}} (one task). Per arch the power
  fit of the seed means (``scaling.fit_power``) with 95% bootstrap intervals over seeds (NE_inf,
  alpha, the seed-mean NE per size); per non-Kunlun arch and Kunlun size, the compute multiple it
  needs to reach Kunlun's seed-mean NE there (point estimate and interval; the Kunlun and other
  seeds drawn together). Percentile intervals; unreachable draws count as inf."""
  rng = np.random.default_rng(seed)
  archs = [a for a in S.ARCHS if points.get(a)]
  out = {"fits": {}, "compute_multiple_to_match_kunlun": {}, "bootstrap": bootstrap}
  point = {a: seed_means(points[a]) for a in archs}
  fit = {a: S.fit_power(*point[a]) for a in archs}
  draws = {a: {"ne_inf": [], "alpha": [], "ne": []} for a in archs}
  mult = {a: [] for a in archs if a != "kunlun"}
  for _ in range(bootstrap):
    drawn = {a: seed_means(resample(points[a], rng)) for a in archs}
    f = {a: S.fit_power(*drawn[a]) for a in archs}
    for a in archs:
      draws[a]["ne"].append(drawn[a][1])
      if f[a]:
        draws[a]["ne_inf"].append(f[a]["ne_inf"])
        draws[a]["alpha"].append(f[a]["alpha"])
    if "kunlun" in archs:
      kc, kn = drawn["kunlun"]
      for a in mult:
        if f[a]:
          mult[a].append([compute_multiple(y, c, f[a]) for c, y in zip(kc, kn, strict=True)])
  for a in archs:
    C, ne = point[a]
    ne_draws = np.asarray(draws[a]["ne"])
    out["fits"][a] = {
        "sizes": sorted(points[a]), "compute": C.tolist(), "ne": ne.tolist(),
        "ne_ci": [_interval(ne_draws[:, j]) for j in range(len(ne))],
        "seeds_per_size": [len(points[a][k]) for k in sorted(points[a])],
        "power": fit[a], "ne_inf_ci": _interval(draws[a]["ne_inf"]),
        "alpha_ci": _interval(draws[a]["alpha"])}
  if "kunlun" in archs:
    kc, kn = point["kunlun"]
    for a in mult:
      m = np.asarray(mult[a], np.float64).reshape(-1, len(kc))
      out["compute_multiple_to_match_kunlun"][a] = [
          {"kunlun_size": k, "kunlun_ne": float(y), "kunlun_compute": float(c),
           "multiple": compute_multiple(y, c, fit[a]), **_interval(m[:, j]),
           "unreachable_fraction": float(np.mean(~np.isfinite(m[:, j]))) if len(m) else None}
          for j, (k, c, y) in enumerate(zip(sorted(points["kunlun"]), kc, kn, strict=True))]
  return out


def bayes_gap(runs: list[dict]) -> dict | None:
  """Seed-mean NE, Bayes NE, ratio and gap per surface and task of the largest Kunlun size."""
  ks = [r for r in runs if r["arch"] == "kunlun"]
  if not ks:
    return None
  top = max(r["size"] for r in ks)
  rs = [r for r in ks if r["size"] == top]
  out = {"size": top, "seeds": sorted(r["seed"] for r in rs), "per_surface": {}, "overall": {}}
  def row(ne, b):                 # seed means; None where a surface had no labels of a task
    ne = [x for x in ne if x is not None]
    b = [x for x in b if x is not None]
    if not ne or not b:
      return None
    ne, b = float(np.mean(ne)), float(np.mean(b))
    return {"ne": ne, "bayes_ne": b, "ratio": ne / b, "gap": ne - b}

  for s in rs[0]["ne_per_surface"]:
    out["per_surface"][s] = {t: row([r["ne_per_surface"][s][t] for r in rs],
                                    [r["bayes_ne_per_surface"][s][t] for r in rs])
                             for t in S.TASKS}
  out["overall"] = {t: row([r["ne"][t] for r in rs], [r["bayes_ne"][t] for r in rs])
                    for t in S.TASKS}
  return out


def summarize(finished: list[dict], plan: dict, bootstrap: int) -> dict:
  runs = ladder_runs(finished, plan)
  out = {"lr_choice": {}, "tasks": {}, "bayes_gap": bayes_gap(runs),
         "runs_used": sorted(run_name(r["arch"], r["size"], r["seed"], r["lr"]) for r in runs)}
  for arch in S.ARCHS:
    for k in range(len(plan["examples"])):
      c = choose_lr(finished, arch, k, plan)
      if c:
        out["lr_choice"][f"{arch}/{k}"] = c
  for t in S.TASKS:
    pts = {}
    for r in runs:
      pts.setdefault(r["arch"], {}).setdefault(r["size"], []).append(
          (r["examples"] * r["train_flops_per_example"], r["ne"][t]))
    out["tasks"][t] = fit_ladder(pts, bootstrap)
    k = out["tasks"][t]["fits"].get("kunlun")
    if out["bayes_gap"] and out["bayes_gap"]["overall"][t] and k and k["power"]:
      # the fit's asymptote (unlimited compute along this ladder's data-and-model rule) vs Bayes
      b = out["bayes_gap"]["overall"][t]["bayes_ne"]
      out["bayes_gap"]["overall"][t]["kunlun_fit_ne_inf"] = {
          "ne_inf": k["power"]["ne_inf"], "ci": k["ne_inf_ci"],
          "ratio_to_bayes": k["power"]["ne_inf"] / b}
  return out


def plot(finished: list[dict], plan: dict, summary: dict, path: str, title: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  runs = ladder_runs(finished, plan)
  fig, axes = plt.subplots(1, len(S.TASKS), figsize=(11, 4.2))
  for ax, t in zip(axes, S.TASKS, strict=True):
    for arch in S.ARCHS:
      rs = [r for r in runs if r["arch"] == arch]
      if not rs:
        continue
      ax.scatter([r["examples"] * r["train_flops_per_example"] for r in rs],
                 [r["ne"][t] for r in rs], s=12, alpha=0.25, color=S.COLORS[arch])
      f = summary["tasks"][t]["fits"][arch]
      lo = [f["ne"][j] - (c["lo"] if c["lo"] is not None else f["ne"][j])
            for j, c in enumerate(f["ne_ci"])]
      hi = [(c["hi"] if c["hi"] is not None else f["ne"][j]) - f["ne"][j]
            for j, c in enumerate(f["ne_ci"])]
      ax.errorbar(f["compute"], f["ne"], yerr=[lo, hi], fmt="o", color=S.COLORS[arch], ms=5,
                  capsize=2, label=f"{arch} (seed mean, 95% CI)")
      if f["power"]:
        xs = np.geomspace(min(f["compute"]) / 1.5, max(f["compute"]) * 3, 100)
        p = f["power"]
        ax.plot(xs, S.power_ne(p, xs), "-", color=S.COLORS[arch], lw=1,
                label=f"{arch} fit: NE_inf {p['ne_inf']:.3f}, alpha {p['alpha']:.2f}")
    b = [r["bayes_ne"][t] for r in runs]
    if b:
      ax.axhline(float(np.mean(b)), color="k", ls="--", lw=1, label=f"Bayes NE {np.mean(b):.3f}")
    ax.set(xscale="log", xlabel="total training compute (FLOPs, actual lengths)",
           ylabel="eval NE", title=t)
    ax.legend(fontsize=7)
  fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def report(summary: dict) -> str:
  rows = []
  for t, s in summary["tasks"].items():
    for arch, f in s["fits"].items():
      p = f["power"]
      ci = f["ne_inf_ci"]
      rows.append(f"{t:<10} {arch:<12} NE " + " ".join(f"{y:.4f}" for y in f["ne"])
                  + (f" | NE_inf {p['ne_inf']:.4f} [{ci['lo']:.4f}, {ci['hi']:.4f}] alpha "
                     f"{p['alpha']:.3f}" if p and ci["lo"] is not None else " | no fit"))
    for arch, ms in s["compute_multiple_to_match_kunlun"].items():
      rows.append(f"{t:<10} {arch} compute to match Kunlun per size: " + "; ".join(
          f"{m['kunlun_size']}: {m['multiple']:.2f}x [{m['lo']:.2f}, {m['hi']:.2f}]"
          if m["multiple"] is not None and m["lo"] is not None else f"{m['kunlun_size']}: n/a"
          for m in ms))
  g = summary["bayes_gap"]
  if g:
    rows.append(f"Bayes gap, Kunlun size {g['size']} (seeds {g['seeds']}): " + "; ".join(
        f"{s}/{t} {v['ne']:.4f} vs {v['bayes_ne']:.4f} ({v['ratio']:.2f}x)"
        for s, d in g["per_surface"].items() for t, v in d.items() if v))
  return "\n".join(rows)


# ---- driver --------------------------------------------------------------------------------------
def make_plan(args) -> dict:
  """The ladder's settings and examples per size (``examples_rule``) from the arguments."""
  ladder = list(S.LADDERS["cpu"][:QUICK["sizes"]] if args.quick else S.LADDERS[args.ladder])
  schema = synthetic.preset_schema(synthetic.PRESETS[args.preset])
  kf = [F.model_flops(S.size_config("kunlun", knobs, args.preset, schema, lr=1e-3, warmup=1,
                                    batch_size=args.batch_size, seed=0), schema)["train_step"]
        for knobs in ladder]
  return {"ladder": ladder, "preset": args.preset, "seeds": args.seeds, "lrs": args.lrs,
          "batch_size": args.batch_size, "n0": args.n0, "cap": args.cap,
          "kunlun_flops": kf, "examples": examples_rule(kf, args.n0, args.cap, args.batch_size),
          "eval_examples": args.eval_examples, "holdout_examples": args.holdout_examples,
          "data_seed": args.data_seed, "jagged_capacity": args.jagged_capacity,
          "jagged_archs": args.jagged_archs, "emb_lr": args.emb_lr, "quick": args.quick}


def _frozen_plan(args, out_dir: str) -> dict:
  plan = make_plan(args)
  path = os.path.join(out_dir, "plan.json")
  if os.path.exists(path):
    with open(path) as f:
      frozen = json.load(f)
    diff = [k for k in PLAN_KEYS if _plain(plan[k]) != frozen.get(k)]
    if diff:
      fail(f"{path} was written with other settings ({', '.join(diff)}); rerun with the same "
           "arguments (--resume) or use another --out_dir")
    return frozen
  return plan


def _data_dir(work: str, plan: dict) -> str:
  n = max(plan["examples"])
  d = os.path.join(work, f"data_{plan['preset']}_{n}_h{plan['holdout_examples']}_"
                         f"s{plan['data_seed']}")
  if not os.path.exists(os.path.join(d, "synthetic.json")):
    _log(f"generating {plan['preset']} data: {n} train + {plan['holdout_examples']} held-out "
         f"examples into {d}")
    synthetic.generate(d, plan["preset"], n, seed=plan["data_seed"],
                       pretrain_examples=plan["holdout_examples"])
  return d


def train_one(spec: dict, plan: dict, schema, data_dir: str, eval_cache: dict, built: dict,
              log_every: int) -> dict:
  jag = plan["jagged_capacity"] if spec["arch"] in plan["jagged_archs"] else ""
  cfg = S.size_config(spec["arch"], plan["ladder"][spec["size"]], plan["preset"], schema,
                      batch_size=plan["batch_size"], lr=spec["lr"], emb_lr=plan["emb_lr"],
                      warmup=max(int(0.05 * spec["examples"] / plan["batch_size"]), 1),
                      seed=spec["seed"], jagged_capacity=jag)
  return S.train_eval(cfg, schema, data_dir, spec["examples"], eval_cache, built,
                      log_every=log_every, holdout_split=HOLDOUT_SPLIT,
                      holdout_examples=plan["holdout_examples"],
                      eval_examples=plan["eval_examples"])


def run(args) -> dict | None:
  out_dir = os.path.abspath(args.out_dir)
  plan = _frozen_plan(args, out_dir)
  finished = read_runs(out_dir)
  if finished and not (args.resume or args.dry_run):
    fail(f"{out_dir} holds {len(finished)} finished runs: pass --resume to continue the ladder "
         "or choose another --out_dir")
  runs = run_list(plan)
  costs = reference_costs(plan, finished)
  est = estimate(plan, costs, runs)
  print(plan_table(plan, costs, runs, est, finished), flush=True)
  if args.dry_run:
    return None
  try:
    os.makedirs(os.path.join(out_dir, "runs"), exist_ok=True)
  except OSError as e:
    fail(f"--out_dir={out_dir}: cannot create it ({e.strerror or e})")
  lock = WorkdirLock(out_dir, program="bench/experiments/ladder.py")
  try:
    lock.acquire()
  except LockError as e:
    fail(str(e))
  try:
    atomic.write_json(os.path.join(out_dir, "plan.json"), plan)
    work = os.path.abspath(args.workdir)
    os.makedirs(work, exist_ok=True)
    S.devices.enable_compilation_cache(os.path.join(work, "xla_cache"))
    data_dir = _data_dir(work, plan)
    schema = Schema.load(data_dir)
    env = S._environment()
    eval_cache, built = {}, {}
    t_session, est_session = time.perf_counter(), 0.0
    for i, (spec, e) in enumerate(zip(runs, est, strict=True)):
      spec = dict(spec)
      if spec["lr"] is None:
        c = choose_lr(finished, spec["arch"], spec["size"], plan)
        if c is None:
          continue                          # its LR trials did not finish (another worker's share)
        spec["lr"], spec["lr_choice"] = c["lr"], c
      if (is_done(spec, finished) or (args.archs and spec["arch"] not in args.archs)
          or (args.sizes and spec["size"] not in args.sizes)):
        continue
      name = run_name(spec["arch"], spec["size"], spec["seed"], spec["lr"])
      _log(f"run {i + 1}/{len(runs)} {name}: {spec['examples']} examples ({spec['role']})")
      r = train_one(spec, plan, schema, data_dir, eval_cache, built, args.log_every)
      r.update(spec, name=name, size_knobs=plan["ladder"][spec["size"]],
               environment=env, load_avg=os.getloadavg()[0],
               finished=time.strftime("%Y-%m-%d %H:%M:%S %z"))
      atomic.write_json(os.path.join(out_dir, "runs", name + ".json"), S.finite(r))
      finished.append(r)
      est_session += e or 0.0
      speed = (time.perf_counter() - t_session) / est_session if est_session else 1.0
      left = sum(x or 0.0 for s, x in zip(runs, est, strict=True) if not is_done(s, finished))
      _log(f"  NE click {r['ne']['click']:.4f} (held-out {r['holdout']['ne']['click']:.4f}) | "
           f"{sum(r['timings_s'].values()):.0f}s | {len(finished)}/{len(runs)} runs done, "
           f"ETA {left * speed / 3600:.2f} h (estimate x {speed:.2f} measured this session)")
  finally:
    lock.release()
  summary = summarize(finished, plan, args.bootstrap)
  result = {"bench": "scaling_ladder", "plan": plan, "environment": S._environment(),
            "runs_finished": len(finished), "runs_planned": len(runs),
            "run_seconds": sum(sum(r["timings_s"].values()) for r in finished),
            "summary": summary}
  png = os.path.join(out_dir, "ladder.png")
  plot(finished, plan, summary, png,
       f"{plan['preset']} synthetic data, examples {plan['examples']}, seeds {plan['seeds']}, "
       f"batch {plan['batch_size']}; {result['environment']['device']}")
  atomic.write_json(os.path.join(out_dir, "summary.json"), S.finite(result))
  print(report(summary), flush=True)
  _log(f"wrote {out_dir}/summary.json and ladder.png ({len(finished)}/{len(runs)} runs)")
  return result


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--quick", action="store_true",
                  help=f"2 sizes, 2 seeds, a few hundred examples ({QUICK})")
  ap.add_argument("--dry_run", action="store_true",
                  help="print the plan and its budget, run nothing")
  ap.add_argument("--resume", action="store_true", help="continue: skip the finished runs")
  ap.add_argument("--ladder", default="cpu", choices=sorted(S.LADDERS))
  ap.add_argument("--preset", default="tiny", help="synthetic preset")
  ap.add_argument("--seeds", type=output.at_least(0), nargs="+", default=[0, 1, 2])
  ap.add_argument("--lrs", type=float, nargs="+", default=[5e-3, 2e-3],
                  help="AdamW peak LRs tried per (arch, size) at the first seed")
  ap.add_argument("--n0", type=output.at_least(1), default=110_000,
                  help="examples per run at the smallest size")
  ap.add_argument("--cap", type=output.at_least(1), default=3_000_000, help="most examples per run")
  ap.add_argument("--batch_size", type=output.at_least(1), default=128)
  ap.add_argument("--eval_examples", type=output.at_least(1), default=20_000)
  ap.add_argument("--holdout_examples", type=output.at_least(0), default=20_000,
                  help=f"held-out examples (split {HOLDOUT_SPLIT!r}) that choose the LR")
  ap.add_argument("--emb_lr", type=float, default=0.2, help="row-wise Adagrad LR (tables)")
  ap.add_argument("--jagged_capacity", default="", choices=["", "auto"],
                  help="data.jagged_capacity for --jagged_archs (\"\", the default: padded; "
                       "on tiny data packed towers ran slower than padded on CPU: "
                       "docs/results/cpu_speed.md)")
  ap.add_argument("--jagged_archs", nargs="*", default=["kunlun"], choices=S.ARCHS,
                  help="architectures that take packed towers with --jagged_capacity")
  ap.add_argument("--archs", nargs="*", default=None, choices=S.ARCHS,
                  help="train only these architectures' runs this time (the rest stay planned)")
  ap.add_argument("--sizes", type=output.at_least(0), nargs="*", default=None,
                  help="train only these sizes' runs this time (the rest stay planned)")
  ap.add_argument("--data_seed", type=output.at_least(0), default=0)
  ap.add_argument("--bootstrap", type=output.at_least(0), default=300,
                  help="bootstrap draws over seeds")
  ap.add_argument("--log_every", type=output.at_least(0), default=1000,
                  help="steps between loss lines (0: none)")
  ap.add_argument("--workdir", default=None,
                  help="generated data and the XLA cache (default /tmp/kunlun_ladder[_quick])")
  ap.add_argument("--out_dir", default=None,
                  help=f"per-run JSONs, plan, summary (default {OUT_DIR})")
  args = ap.parse_args(argv)
  output.make_folder("--workdir", args.workdir)
  if args.quick:
    args.seeds, args.n0, args.cap = QUICK["seeds"], QUICK["n0"], QUICK["cap"]
    args.batch_size, args.eval_examples = QUICK["batch_size"], QUICK["eval_examples"]
    args.holdout_examples, args.log_every = QUICK["holdout_examples"], 0
  if args.preset not in synthetic.PRESETS:
    fail(f"--preset {args.preset!r}: choose from {sorted(synthetic.PRESETS)}")
  if min(args.n0, args.cap, args.batch_size, args.eval_examples, args.holdout_examples) <= 0:
    fail("--n0, --cap, --batch_size, --eval_examples and --holdout_examples must be positive")
  if args.sizes and not set(args.sizes) <= set(range(len(S.LADDERS[args.ladder]))):
    fail(f"--sizes {args.sizes}: the {args.ladder!r} ladder has sizes "
         f"0..{len(S.LADDERS[args.ladder]) - 1}")
  if len(set(args.seeds)) != len(args.seeds) or len(set(args.lrs)) != len(args.lrs):
    fail("--seeds and --lrs must not repeat a value")
  args.out_dir = args.out_dir or (OUT_DIR + "_quick" if args.quick else OUT_DIR)
  args.workdir = args.workdir or os.path.join("/tmp", "kunlun_ladder_quick" if args.quick
                                              else "kunlun_ladder")
  try:
    return run(args)
  except FatalError as e:
    fail(str(e))


if __name__ == "__main__":
  main()
