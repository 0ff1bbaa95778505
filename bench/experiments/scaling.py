"""Scaling laws: NE against training FLOPs for Kunlun, InterFormer and DLRM (spec e.7, f.1, h-17).

  python bench/experiments/scaling.py [--quick] [--ladder cpu|gpu] [--seeds 0 1] [--out PATH]
Notes: docs/guides/benchmarks.md, ``bench/experiments/scaling.py``."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _ROOT)

import flax  # noqa: E402
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jaxlib  # noqa: E402
import numpy as np  # noqa: E402
from scipy.optimize import curve_fit  # noqa: E402

from bench import output  # noqa: E402
from data import pipeline, synthetic  # noqa: E402
from data.schema import Schema  # noqa: E402
from kunlun.configs.common import base_config  # noqa: E402
from kunlun.configs.types import default_model, seq_lens, tower  # noqa: E402
from kunlun.models import flops as F  # noqa: E402
from kunlun.models.build import build_model  # noqa: E402
from kunlun.train import devices, optim  # noqa: E402
from kunlun.train import step as step_lib  # noqa: E402
from kunlun.train.capacity import jagged_capacity  # noqa: E402
from kunlun.train.metrics import EvalAccumulator  # noqa: E402

ARCHS = ("kunlun", "interformer", "dlrm")
TASKS = ("click", "conversion")
HIGH_VALUE = ("click", "conversion")   # streams with the large tower (spec h-10); others small

# Model sizes (spec h-17: depth and width together, plus kept length and experts). L: layers
# (Kunlun's high-value towers run all L; low-value towers L - 2, min 1; with spec d.1 / d.4
# dataflow a depth-1 tower is embedding + HSP only), d: high-value tower width (low-value d / 2),
# T: kept events (high, low value), M: MoWE experts, n_sum: summary tokens (high value), hidden:
# Wukong / DHEN MLP width, dlrm: (seq_dim, MLP widths).
LADDERS = {
    "cpu": (dict(L=1, d=8, d_ns=4, n_ns=2, T=(8, 8), M=1, n_sum=1, hidden=8,
                 dlrm=(4, (16, 8))),
            dict(L=1, d=8, d_ns=8, n_ns=4, T=(16, 16), M=1, n_sum=1, hidden=16,
                 dlrm=(8, (32, 16))),
            dict(L=2, d=16, d_ns=8, n_ns=4, T=(32, 32), M=1, n_sum=2, hidden=32,
                 dlrm=(12, (64, 32))),
            dict(L=3, d=16, d_ns=16, n_ns=4, T=(32, 32), M=1, n_sum=2, hidden=32,
                 dlrm=(16, (128, 64))),
            dict(L=3, d=32, d_ns=16, n_ns=8, T=(48, 48), M=2, n_sum=4, hidden=64,
                 dlrm=(32, (256, 128)))),
    "gpu": (dict(L=1, d=32, d_ns=16, n_ns=8, T=(64, 128), M=1, n_sum=4, hidden=32,
                 dlrm=(16, (64, 32))),
            dict(L=3, d=64, d_ns=32, n_ns=8, T=(64, 128), M=2, n_sum=4, hidden=64,
                 dlrm=(32, (128, 64))),
            dict(L=3, d=128, d_ns=64, n_ns=16, T=(128, 256), M=2, n_sum=8, hidden=128,
                 dlrm=(64, (256, 128))),
            dict(L=5, d=128, d_ns=64, n_ns=16, T=(256, 512), M=2, n_sum=8, hidden=256,
                 dlrm=(96, (512, 256))),
            dict(L=7, d=256, d_ns=128, n_ns=32, T=(256, 512), M=4, n_sum=16, hidden=512,
                 dlrm=(128, (1024, 512))),
            dict(L=9, d=256, d_ns=128, n_ns=32, T=(256, 1024), M=4, n_sum=16, hidden=512,
                 dlrm=(192, (2048, 1024)))),
}
QUICK_LADDER = LADDERS["cpu"][:1]


def _log(msg):
  print(f"[scaling {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def size_config(arch: str, size: dict, preset: str, schema, *, batch_size: int, lr: float,
                warmup: int, seed: int, emb_lr: float = 0.2, jagged_capacity: str = ""):
  """The full config (``kunlun/configs/common.py`` + model) of ``arch`` at ``size``
  (``jagged_capacity``: ``data.jagged_capacity``, "" = padded towers)."""
  c = base_config()
  m = default_model()
  m.arch, m.final_hsp = arch, False
  m.d_ns, m.n_ns, m.num_layers, m.n_dense_tokens = size["d_ns"], size["n_ns"], size["L"], 1
  m.hsp_rank = 2
  m.mowe.update(num_experts=size["M"], layers_per_expert=1, rank=4, mlp_hidden=size["hidden"])
  d, L = size["d"], size["L"]
  for st in schema.streams:
    hi = st.name in HIGH_VALUE
    w = d if hi else max(d // 2, 8)
    heads = max(2, w // 16)
    n_sum = size["n_sum"] if hi else max(size["n_sum"] // 2, 1)
    T = min(size["T"][0 if hi else 1], st.max_len)
    m.towers[st.name] = tower(width=w, heads=heads, n_kv=8, window=8, kept_len=T,
                              n_seed=4 * n_sum, n_sum=n_sum, depth=L if hi else max(L - 2, 1))
  m.heads.update(top_mlp=(max(16, 2 * d),), tower_hidden=max(8, d // 2))
  m.dlrm.update(seq_dim=size["dlrm"][0], mlp=tuple(size["dlrm"][1]))
  c.model = m
  c.seed = seed
  c.data.preset = preset
  c.data.batch_size = batch_size
  c.data.shuffle_seed = seed
  c.data.num_threads = 1
  c.data.jagged_capacity = jagged_capacity
  c.train.lr, c.train.emb_lr, c.train.warmup_steps = lr, emb_lr, warmup
  c.train.schedule = "cosine"
  return c


SPLIT_COUNT = {"train": "num_train", "eval": "num_eval", "pretrain": "num_pretrain"}


def _eval_batches(data_dir, config, eval_examples: int, cache: dict, split: str = "eval"):
  """Host eval batches (padded layout) for the config's kept lengths: a uniform subset (every
  K-th record) of ``split`` with about ``eval_examples`` examples; cached per split and lengths."""
  lens = seq_lens(config)
  key = (split, tuple(sorted(lens.items())))
  if key not in cache:
    with open(os.path.join(data_dir, "synthetic.json")) as f:
      n_split = json.load(f)[SPLIT_COUNT[split]]
    K = max(1, n_split // eval_examples)
    dc = config.data.copy_and_resolve_references()
    dc.batch_size = 256 * K
    cache[key] = list(pipeline.make_dataset(dc, data_dir, split, lens, train=False,
                                            shard_index=0, shard_count=K))
  return cache[key]


def _evaluate(predict, params, batches, schema) -> dict:
  """Overall and per-surface NE / AUC / Bayes NE of ``predict`` on host ``batches``."""
  acc = EvalAccumulator(schema.surfaces, schema.task_names)
  for eb in batches:
    acc.add(np.asarray(predict(params, eb)), eb)
  per, overall = acc.result()
  return {"ne": {k: overall[k]["ne"] for k in TASKS}, "auc": {k: overall[k]["auc"] for k in TASKS},
          "bayes_ne": {k: overall[k]["bayes_ne"] for k in TASKS}, "examples": acc.examples,
          "ne_per_surface": {s: {k: per[s][k]["ne"] for k in TASKS} for s in per},
          "bayes_ne_per_surface": {s: {k: per[s][k]["bayes_ne"] for k in TASKS} for s in per}}


def train_eval(config, schema, data_dir, num_examples: int, eval_cache: dict, built=None,
               log_every: int = 0, holdout_split: str | None = None,
               holdout_examples: int = 0, eval_examples: int | None = None) -> dict:
  """Trains ``config`` on the first ``num_examples`` of the training stream (one pass) with the
  project's train step (packed towers when ``config.data.jagged_capacity`` is set), evaluates on
  the eval subset and, with ``holdout_split``, on that split too (``"holdout"`` in the result).
  ``built`` caches the model, its init / predict (per model config) and train steps (per train
  config) across seeds and LRs. Returns metrics, FLOPs and timings."""
  B = int(config.data.batch_size)
  steps = max(num_examples // B, 1)
  lens = seq_lens(config)
  capacity = jagged_capacity(config.data, data_dir, "train", lens, 1)
  ds = pipeline.make_dataset(config.data, data_dir, "train", lens, train=True, shard_index=0,
                             shard_count=1, jagged_capacity=capacity)
  it = iter(ds)
  first = next(it)
  mkey = json.dumps(config.model.to_dict(), sort_keys=True, default=str)
  tkey = json.dumps([config.train.to_dict(), steps, capacity], sort_keys=True, default=str)
  built = {} if built is None else built
  t0 = time.perf_counter()
  if built.get("model_key") != mkey:                     # one model's executables at a time
    model = build_model(config, schema)
    built.clear()
    built.update(model_key=mkey, model=model, init=jax.jit(model.init),
                 predict=step_lib.make_predict_step(model), train={})
  model = built["model"]
  if tkey not in built["train"]:
    tx = optim.make_optimizer(config.train, steps)
    built["train"] = {tkey: {"tx": tx, "train": step_lib.make_train_step(model, tx)}}
  b = built["train"][tkey]
  tx = b["tx"]
  init_key = jax.random.key(config.seed, impl="unsafe_rbg")          # cheaper init to compile
  params = nn.meta.unbox(built["init"](init_key, first, False))["params"]
  opt = tx.init(params)
  rng = jax.random.key(config.seed + 1)
  if "compiled" not in b:
    b["compiled"] = b["train"].lower(params, opt, first, rng, np.int32(0)).compile()
    cost = b["compiled"].cost_analysis()
    b["executed"] = float((cost[0] if isinstance(cost, list) else cost).get("flops", 0.0)) / B
  compile_s = time.perf_counter() - t0
  meter, times, losses = F.FlopMeter(config, schema), [], []
  batch = first
  t_train = time.perf_counter()
  for s in range(steps):
    meter.add(batch)
    t = time.perf_counter()
    params, opt, stats = b["compiled"](params, opt, batch, rng, np.int32(s))
    loss = float(stats["loss"])                          # waits for the step
    times.append(time.perf_counter() - t)
    losses.append(loss)
    if log_every and (s + 1) % log_every == 0:
      _log(f"  step {s + 1}/{steps} loss {np.mean(losses[-log_every:]):.4f}")
    if s + 1 < steps:
      batch = next(it)
  train_s = time.perf_counter() - t_train
  flops_actual = meter.per_step() / B                     # per example, training step
  t = time.perf_counter()
  ev = _evaluate(built["predict"], params,
                 _eval_batches(data_dir, config, eval_examples or EVAL_EXAMPLES, eval_cache),
                 schema)
  extra = {}
  if holdout_split:
    extra["holdout"] = _evaluate(built["predict"], params, _eval_batches(
        data_dir, config, holdout_examples, eval_cache, holdout_split), schema)
    extra["holdout"]["split"] = holdout_split
  eval_s = time.perf_counter() - t
  model_fl = F.model_flops(config, schema)
  return {
      "ne": ev["ne"], "auc": ev["auc"], "bayes_ne": ev["bayes_ne"],
      "ne_per_surface": ev["ne_per_surface"], "bayes_ne_per_surface": ev["bayes_ne_per_surface"],
      "eval_examples": ev["examples"], **extra,
      "jagged_capacity": capacity,
      "train_flops_per_example": flops_actual,
      "train_flops_per_example_padded": model_fl["train_step"],
      "executed_flops_per_example": b["executed"],
      "forward_per_module": model_fl["per_module"],
      "params": int(sum(x.size for x in jax.tree.leaves(params))),
      "steps": steps, "examples": steps * B,
      "train_loss_last10pct": float(np.mean(losses[-max(steps // 10, 1):])),
      "step_time_ms_median": 1e3 * float(np.median(times[min(2, len(times) - 1):])),
      "timings_s": {"compile": compile_s, "train": train_s, "eval": eval_s},
  }


EVAL_EXAMPLES = 20_000


# ---- fits ----------------------------------------------------------------------------------------
def r_squared(y, yhat) -> float:
  y, yhat = np.asarray(y, np.float64), np.asarray(yhat, np.float64)
  ss = float(np.sum((y - y.mean()) ** 2))
  return 1.0 - float(np.sum((y - yhat) ** 2)) / ss if ss > 0 else float("nan")


def fit_loglinear(C, dne) -> dict | None:
  """``dNE%(C) = a + eta log10(C)`` by least squares; None with fewer than 3 points."""
  x, y = np.log10(np.asarray(C, np.float64)), np.asarray(dne, np.float64)
  if len(x) < 3:
    return None
  eta, a = np.polyfit(x, y, 1)
  return {"a": float(a), "eta": float(eta), "r2": r_squared(y, a + eta * x)}


def fit_power(C, ne) -> dict | None:
  """``NE(C) = NE_inf + A C^-alpha`` (least squares over ``NE_inf in [0, min NE)``, ``A > 0``,
  ``alpha in (0, 3]``; C in FLOPs); None with fewer than 4 points or no convergence."""
  C, y = np.asarray(C, np.float64), np.asarray(ne, np.float64)
  if len(C) < 4:
    return None
  c0 = float(np.exp(np.mean(np.log(C))))                 # fit in C / c0 for conditioning
  f = lambda c, e, a, al: e + a * (c / c0) ** (-al)
  best = None
  for al0 in (0.05, 0.2, 0.5, 1.0):                       # a few starts; keep the best
    e0 = max(float(y.min()) - 0.05, 0.0)
    try:
      p, _ = curve_fit(f, C, y, p0=(e0, max(float(y.mean()) - e0, 1e-3), al0),
                       bounds=([0.0, 0.0, 1e-4], [float(y.min()), 10.0, 3.0]), maxfev=20000)
    except (RuntimeError, ValueError):
      continue
    r2 = r_squared(y, f(C, *p))
    if best is None or r2 > best[1]:
      best = (p, r2)
  if best is None:
    return None
  (e, a, al), r2 = best
  return {"ne_inf": float(e), "A": float(a * c0 ** al), "alpha": float(al), "r2": float(r2)}


def power_ne(fit, C):
  return fit["ne_inf"] + fit["A"] * np.asarray(C, np.float64) ** (-fit["alpha"])


def flops_to_reach(ne_target: float, power: dict | None, loglin: dict | None,
                   ne_ref: float) -> dict:
  """Training FLOPs per example at which a fit reaches ``ne_target`` (inf if never)."""
  out = {"power": None, "loglinear": None}
  if power:
    gap = ne_target - power["ne_inf"]
    out["power"] = (float((power["A"] / gap) ** (1 / power["alpha"])) if gap > 0
                    else float("inf"))
  if loglin and loglin["eta"] > 0:
    dne = 100 * (ne_ref - ne_target) / ne_ref
    out["loglinear"] = float(10 ** ((dne - loglin["a"]) / loglin["eta"]))
  return out


def select_lr(runs: list[dict], seeds) -> tuple[list[dict], dict]:
  """Per (arch, size), the runs of the learning rate with the lowest seed-mean click NE among
  the LRs that ran every seed (spec h-15: LR tuned per model size). Returns (runs, choices)."""
  ladder = [r for r in runs if r["kind"] == "ladder"]
  choice, keep = {}, []
  for arch, size in sorted({(r["arch"], r["size"]) for r in ladder}):
    cand = {}
    for r in ladder:
      if (r["arch"], r["size"]) == (arch, size):
        cand.setdefault(r["lr"], []).append(r)
    full = {lr: rs for lr, rs in cand.items() if {r["seed"] for r in rs} >= set(seeds)}
    if not full:
      continue
    ne = {lr: float(np.mean([r["ne"]["click"] for r in rs])) for lr, rs in full.items()}
    lr = min(ne, key=ne.get)
    choice[f"{arch}/{size}"] = {"lr": lr, "click_ne_by_lr": {str(k): v for k, v in ne.items()}}
    keep += [r for r in full[lr] if r["seed"] in seeds]
  return keep, choice


def summarize(runs: list[dict], seeds, n_sizes: int) -> dict:
  """Fits, scaling-efficiency ratios and the InterFormer FLOPs to match Kunlun (docstring 4),
  on the runs of the LR chosen per (arch, size) (``select_lr``)."""
  main, lr_choice = select_lr(runs, seeds)
  by = lambda arch, seed=None: sorted(
      [r for r in main if r["arch"] == arch and (seed is None or r["seed"] == seed)],
      key=lambda r: r["size"])

  def curve(arch, task, seed=None):
    rs = by(arch, seed)
    sizes = sorted({r["size"] for r in rs})
    C = [np.mean([r["train_flops_per_example"] for r in rs if r["size"] == s]) for s in sizes]
    ne = [np.mean([r["ne"][task] for r in rs if r["size"] == s]) for s in sizes]
    return np.asarray(C), np.asarray(ne), sizes

  out = {"lr_choice": lr_choice, "ne_ref": {}, "fits": {}, "per_seed": {},
         "scaling_efficiency_ratio": {}, "interformer_flops_to_match_kunlun_best": {}}
  for task in TASKS:
    _, ne_i, _ = curve("interformer", task)
    if not len(ne_i):
      continue
    ne_ref = float(ne_i[0])
    out["ne_ref"][task] = ne_ref
    dne = lambda ne, ref=ne_ref: 100 * (ref - np.asarray(ne)) / ref
    fits = {}
    for arch in ARCHS:
      C, ne, sizes = curve(arch, task)
      if not len(C):
        continue
      fits[arch] = {"sizes": sizes, "flops": C.tolist(), "ne": ne.tolist(),
                    "dne_pct": dne(ne).tolist(), "power": fit_power(C, ne),
                    "loglinear": fit_loglinear(C, dne(ne))}
    out["fits"][task] = fits
    per_seed = {}
    for seed in seeds:
      row = {}
      for arch in ARCHS:
        C, ne, _ = curve(arch, task, seed)
        if len(C) == n_sizes:
          row[arch] = {"loglinear": fit_loglinear(C, dne(ne)), "power": fit_power(C, ne)}
      per_seed[str(seed)] = row
    out["per_seed"][task] = per_seed
    ratios = {"eta": [], "alpha": []}
    for row in per_seed.values():
      k, i = row.get("kunlun"), row.get("interformer")
      if k and i and k["loglinear"] and i["loglinear"] and i["loglinear"]["eta"] != 0:
        ratios["eta"].append(k["loglinear"]["eta"] / i["loglinear"]["eta"])
      if k and i and k["power"] and i["power"] and i["power"]["alpha"] > 0:
        ratios["alpha"].append(k["power"]["alpha"] / i["power"]["alpha"])
    ratio = {}
    for name, v in ratios.items():
      ratio[name] = {"per_seed": v, "mean": float(np.mean(v)) if v else None,
                     "std": float(np.std(v, ddof=1)) if len(v) > 1 else None,
                     "min": float(np.min(v)) if v else None, "max": float(np.max(v)) if v else None}
    fk, fi = fits.get("kunlun"), fits.get("interformer")
    if fk and fi and fk["loglinear"] and fi["loglinear"] and fi["loglinear"]["eta"] != 0:
      ratio["eta_seed_mean_curve"] = fk["loglinear"]["eta"] / fi["loglinear"]["eta"]
    out["scaling_efficiency_ratio"][task] = ratio
    if fk and fi:
      j = int(np.argmin(fk["ne"]))
      need = flops_to_reach(fk["ne"][j], fi["power"], fi["loglinear"], ne_ref)
      out["interformer_flops_to_match_kunlun_best"][task] = {
          "kunlun_best_ne": fk["ne"][j], "kunlun_flops": fk["flops"][j],
          "interformer_best_ne": float(np.min(fi["ne"])),
          "interformer_flops": need,
          "ratio_to_kunlun_flops": {k: (v / fk["flops"][j] if v is not None else None)
                                    for k, v in need.items()}}
  return out


# ---- plot ----------------------------------------------------------------------------------------
COLORS = {"kunlun": "tab:red", "interformer": "tab:blue", "dlrm": "tab:gray"}


def plot(runs: list[dict], summary: dict, bayes: dict, path: str, title: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  sweep = [r for r in runs if r["kind"] == "data"]
  fig, axes = plt.subplots(1, 3 if sweep else 2, figsize=(15 if sweep else 10, 4.2))
  for ax, task in zip(axes, TASKS, strict=False):
    for arch in ARCHS:
      rs = [r for r in runs if r["kind"] == "ladder" and r["arch"] == arch]
      if not rs:
        continue
      ax.scatter([r["train_flops_per_example"] for r in rs], [r["ne"][task] for r in rs],
                 s=10, alpha=0.4, color=COLORS[arch])
      f = summary["fits"].get(task, {}).get(arch)
      if not f:
        continue
      ax.plot(f["flops"], f["ne"], "o", color=COLORS[arch], label=arch)
      if f["power"]:
        xs = np.geomspace(min(f["flops"]) / 1.5, max(f["flops"]) * 1.5, 100)
        lbl = f"NE_inf {f['power']['ne_inf']:.3f}, alpha {f['power']['alpha']:.2f}, " \
              f"R2 {f['power']['r2']:.2f}"
        ax.plot(xs, power_ne(f["power"], xs), "-", color=COLORS[arch], lw=1, alpha=0.8,
                label=lbl)
    if task in bayes:
      ax.axhline(bayes[task], color="k", ls="--", lw=1, label=f"Bayes NE {bayes[task]:.3f}")
    ax.set(xscale="log", xlabel="training FLOPs per example (actual lengths)", ylabel="eval NE",
           title=f"{task}")
    ax.legend(fontsize=7)
  if sweep:
    ax = axes[2]
    for task, mk in zip(TASKS, ("o-", "s--"), strict=True):
      xs = sorted({r["examples"] for r in sweep})
      ys = [np.mean([r["ne"][task] for r in sweep if r["examples"] == x]) for x in xs]
      ax.plot(xs, ys, mk, color="tab:red", label=f"{task} (Kunlun size {sweep[0]['size']})")
      if task in bayes:
        ax.axhline(bayes[task], color="k", ls=":", lw=0.8)
    ax.set(xscale="log", xlabel="training examples (one pass)", ylabel="eval NE",
           title="data-size sweep")
    ax.legend(fontsize=7)
  fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


# ---- driver --------------------------------------------------------------------------------------
def _environment() -> dict:
  d = jax.devices()[0]
  return {"device": f"{d.platform}:{d.device_kind}", "device_count": jax.device_count(),
          "cpu_count": os.cpu_count(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
          "flax": flax.__version__, "python": platform.python_version(),
          "load_avg_start": os.getloadavg()}


def finite(x):
  """JSON-safe copy: non-finite floats (e.g. an unreachable FLOP target) become None."""
  if isinstance(x, dict):
    return {k: finite(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [finite(v) for v in x]
  if isinstance(x, (float, np.floating)):
    return float(x) if math.isfinite(x) else None
  if isinstance(x, np.integer):
    return int(x)
  return x


def _read_runs(path) -> list[dict]:
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def run(args) -> dict:
  t_start = time.perf_counter()
  env = _environment()
  work = args.workdir or tempfile.mkdtemp(prefix="kunlun_scaling_")
  os.makedirs(work, exist_ok=True)
  devices.enable_compilation_cache(os.path.join(work, "xla_cache"))   # resumed: no compiles
  ladder = QUICK_LADDER if args.quick else LADDERS[args.ladder]
  preset = args.preset or ("dev" if args.ladder == "gpu" else "tiny")
  n_max = int(args.num_examples * max(args.data_sizes or [1.0]))
  data_dir = os.path.join(work, f"data_{preset}_{n_max}")
  if not os.path.exists(os.path.join(data_dir, "synthetic.json")):
    _log(f"generating {preset} data: {n_max} train examples into {data_dir}")
    synthetic.generate(data_dir, preset, n_max, seed=args.data_seed)
  schema = Schema.load(data_dir)
  with open(os.path.join(data_dir, "synthetic.json")) as f:
    syn = json.load(f)

  # sizes in increasing cost; the seeds of one model back to back (one compilation)
  top = len(ladder) - 1
  lrs = lambda k: args.lrs_top if (k == top and args.lrs_top) else args.lrs
  plan = [("ladder", arch, k, seed, args.num_examples, lr)
          for k in range(len(ladder)) for arch in ARCHS for lr in lrs(k) for seed in args.seeds]
  sweep_size = top if args.sweep_size is None else args.sweep_size
  for f in args.data_sizes or []:
    if f != 1.0:
      plan.append(("data", "kunlun", sweep_size, args.seeds[0], int(args.num_examples * f),
                   min(lrs(sweep_size))))
  log_path = os.path.join(work, "runs.jsonl")
  done_runs = _read_runs(log_path)
  done = {(r["kind"], r["arch"], r["size"], r["seed"], r["num_examples"], r["lr"]): r
          for r in done_runs}
  eval_cache, built = {}, {}
  runs = []
  for i, key in enumerate(plan):
    kind, arch, k, seed, n, lr = key
    if key in done:
      runs.append(done[key])
      continue
    if (args.archs and arch not in args.archs) or (args.sizes and k not in args.sizes):
      continue                                   # another process's share of the plan
    cfg = size_config(arch, ladder[k], preset, schema, batch_size=args.batch_size, lr=lr,
                      emb_lr=args.emb_lr, warmup=max(int(0.05 * n / args.batch_size), 1),
                      seed=seed)
    _log(f"run {i + 1}/{len(plan)}: {kind} {arch} size {k} seed {seed} examples {n} lr {lr}")
    r = train_eval(cfg, schema, data_dir, n, eval_cache, built, log_every=args.log_every,
                   eval_examples=args.eval_examples)
    r.update(kind=kind, arch=arch, size=k, seed=seed, num_examples=n, lr=lr,
             size_knobs=ladder[k], load_avg=os.getloadavg()[0])
    runs.append(r)
    with open(log_path, "a") as f:
      f.write(json.dumps(r) + "\n")
    _log(f"  NE click {r['ne']['click']:.4f} conversion {r['ne']['conversion']:.4f} | "
         f"{r['train_flops_per_example'] / 1e6:.2f} MFLOP/ex (padded "
         f"{r['train_flops_per_example_padded'] / 1e6:.2f}, executed "
         f"{r['executed_flops_per_example'] / 1e6:.2f}) | step {r['step_time_ms_median']:.1f} ms"
         f" | {sum(r['timings_s'].values()):.0f}s")
  # runs outside the plan (e.g. an LR abandoned at the largest size) stay in the record
  planned = set(plan)
  extra = [r for r in done_runs if (r["kind"], r["arch"], r["size"], r["seed"],
                                    r["num_examples"], r["lr"]) not in planned]
  # the data sweep's full-size point is the ladder run of the same size, seed and LR
  for r in list(runs):
    if r["kind"] == "ladder" and r["arch"] == "kunlun" and r["size"] == sweep_size \
        and r["seed"] == args.seeds[0] and r["lr"] == min(lrs(sweep_size)) and args.data_sizes:
      runs.append({**r, "kind": "data"})
  summary = summarize(runs, args.seeds, len(ladder))
  bayes = {t: runs[0]["bayes_ne"][t] for t in TASKS} if runs else {}
  best = {t: {a: (min(f["ne"]) if (f := summary["fits"].get(t, {}).get(a)) else None)
              for a in ARCHS} for t in TASKS}          # seed-mean NE at the chosen LRs
  out = {
      "bench": "scaling", "quick": args.quick, "ladder": "quick" if args.quick else args.ladder,
      "setup": {"preset": preset, "num_examples": args.num_examples, "seeds": args.seeds,
                "batch_size": args.batch_size, "lrs": args.lrs, "lrs_top": args.lrs_top,
                "emb_lr": args.emb_lr,
                "schedule": "cosine, 5% warm-up",
                "eval_examples": runs[0]["eval_examples"] if runs else None,
                "data_sizes": args.data_sizes, "data_sweep_size": sweep_size,
                "ladder": list(ladder), "final_hsp": False,
                "flops": "training FLOPs per example (3x forward) at actual lengths, "
                         "kunlun.models.flops.batch_flops, mean over the training batches"},
      "environment": env,
      "bayes_ne": bayes, "bayes_ne_per_surface": syn["stats"]["eval"],
      "best_ne": best,
      "gap_to_bayes": {t: {a: (None if best[t][a] is None else best[t][a] - bayes[t])
                           for a in ARCHS} for t in TASKS} if bayes else {},
      "summary": summary,
      "runs": runs,
      "runs_outside_plan": extra,
      "seconds": time.perf_counter() - t_start,        # this invocation (resumed runs: ~0)
      "run_seconds": sum(sum(r["timings_s"].values()) for r in runs if r["kind"] == "ladder"
                         or r["num_examples"] != args.num_examples),   # every run's own time
  }
  out["environment"]["load_avg_end"] = os.getloadavg()
  return out


def table(out: dict) -> str:
  rows = [f"{'arch':<12} {'size':>4} {'seed':>4} {'MFLOP/ex':>9} {'NE click':>9} "
          f"{'NE conv':>8} {'AUC clk':>8} {'step ms':>8}"]
  for r in sorted(out["runs"], key=lambda r: (r["kind"], r["arch"], r["size"], r["seed"])):
    if r["kind"] != "ladder":
      continue
    rows.append(f"{r['arch']:<12} {r['size']:>4} {r['seed']:>4} "
                f"{r['train_flops_per_example'] / 1e6:>9.2f} {r['ne']['click']:>9.4f} "
                f"{r['ne']['conversion']:>8.4f} {r['auc']['click']:>8.4f} "
                f"{r['step_time_ms_median']:>8.1f}")
  for r in sorted((r for r in out["runs"] if r["kind"] == "data"), key=lambda r: r["examples"]):
    rows.append(f"data sweep (kunlun size {r['size']}): {r['examples']:>7} examples: NE click "
                f"{r['ne']['click']:.4f} conversion {r['ne']['conversion']:.4f}")
  s = out["summary"]
  for task, ratio in s["scaling_efficiency_ratio"].items():
    rows.append(f"{task}: scaling-efficiency ratio eta_K/eta_I per seed {ratio['eta']['per_seed']}"
                f" (mean {ratio['eta']['mean']}, std {ratio['eta']['std']})")
    for arch, f in s["fits"][task].items():
      p, ll = f["power"], f["loglinear"]
      rows.append(f"  {arch:<12} power: " + (f"NE_inf {p['ne_inf']:.4f} alpha {p['alpha']:.3f} "
                                             f"R2 {p['r2']:.3f}" if p else "n/a")
                  + " | loglinear: " + (f"eta {ll['eta']:.3f} R2 {ll['r2']:.3f}" if ll else "n/a"))
  return "\n".join(rows)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--quick", action="store_true", help="two small sizes, one seed (the test)")
  ap.add_argument("--ladder", default="cpu", choices=sorted(LADDERS))
  ap.add_argument("--preset", default=None, help="synthetic preset (default tiny; dev for gpu)")
  ap.add_argument("--num_examples", type=output.at_least(1), default=None,
                  help="training examples per run")
  ap.add_argument("--data_sizes", type=float, nargs="*", default=None,
                  help="data-sweep factors of --num_examples (Kunlun, --sweep_size)")
  ap.add_argument("--sweep_size", type=output.at_least(0), default=None,
                  help="ladder index of the data sweep")
  ap.add_argument("--seeds", type=output.at_least(0), nargs="+", default=None)
  ap.add_argument("--batch_size", type=output.at_least(1), default=128)
  ap.add_argument("--lrs", type=float, nargs="+", default=[5e-3, 2e-3],
                  help="AdamW peak LRs tried per size (the best seed-mean click NE is fitted)")
  ap.add_argument("--lrs_top", type=float, nargs="*", default=[2e-3],
                  help="LRs for the largest size (default 2e-3: on the CPU ladder 5e-3 was already "
                       "worse at the size below for InterFormer and at the top for Kunlun; give "
                       "no value to use --lrs)")
  ap.add_argument("--archs", nargs="*", default=None, choices=ARCHS,
                  help="run only these architectures' share of the plan (parallel workers)")
  ap.add_argument("--sizes", type=output.at_least(0), nargs="*", default=None,
                  help="run only these sizes")
  ap.add_argument("--emb_lr", type=float, default=0.2, help="row-wise Adagrad LR (tables)")
  ap.add_argument("--eval_examples", type=output.at_least(1), default=None)
  ap.add_argument("--data_seed", type=output.at_least(0), default=0)
  ap.add_argument("--log_every", type=output.at_least(0), default=0)
  ap.add_argument("--workdir", default=None, help="data and runs.jsonl (resumable)")
  ap.add_argument("--out", default=None, help="JSON path (PNG beside it)")
  args = ap.parse_args(argv)
  output.make_folder("--workdir", args.workdir)
  q = args.quick
  args.num_examples = args.num_examples or (512 if q else 200_000)
  args.seeds = args.seeds or ([0] if q else [0, 1])
  args.data_sizes = args.data_sizes if args.data_sizes is not None else (
      [] if q else [0.25, 0.5, 1.0, 2.0])
  args.eval_examples = args.eval_examples or (512 if q else 20_000)
  if q:
    args.batch_size = min(args.batch_size, 64)
    args.lrs = args.lrs[:1]
    args.lrs_top = None
  out = run(args)
  path = output.result_path("scaling", q, args.out)
  png = os.path.splitext(path)[0] + ".png"
  title = (f"{out['setup']['preset']} synthetic data, {args.num_examples} examples one pass, "
           f"seeds {args.seeds}, batch {args.batch_size}; {out['environment']['device']}")
  plot(out["runs"], out["summary"], out["bayes_ne"], png, title)
  out["png"] = os.path.relpath(png, _ROOT) if png.startswith(_ROOT) else png
  output.write_json(path, finite(out))
  print(table(out))
  _log(f"wrote {path} and {png} ({out['seconds']:.0f}s)")
  return out


if __name__ == "__main__":
  main()
