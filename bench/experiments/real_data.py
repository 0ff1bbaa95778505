"""Real-data benchmark: MovieLens-100K ratings as clicks, Kunlun vs InterFormer vs DLRM vs LR.

  nice -n 10 python bench/experiments/real_data.py         # full: 3 seeds, up to 4 epochs (~1 h)
  python bench/experiments/real_data.py --quick --inter F  # CI-sized: 1 seed, 1 epoch, small file
Notes: docs/guides/benchmarks.md, ``bench/experiments/real_data.py``."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

import numpy as np

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _ROOT)

import flax  # noqa: E402
import jax  # noqa: E402
import jaxlib  # noqa: E402

from bench import output  # noqa: E402
from data import verify  # noqa: E402
from data.ingest.public import movielens  # noqa: E402
from data.schema import Schema  # noqa: E402
from kunlun.train import metrics  # noqa: E402

CACHE = os.path.join(_ROOT, "bench", ".cache")
WHEEL = "recbole==1.2.1"
MEMBER = "recbole/dataset_example/ml-100k/ml-100k.inter"
ARCHS = ("kunlun", "interformer", "dlrm")


PROG = "bench/experiments/real_data.py"


def _log(msg):
  print(f"[real_data] {msg}", flush=True)


def _fail(msg: str):
  """Bad input: one line on stderr, exit status 2 (as argparse)."""
  print(f"{PROG}: error: {' '.join(str(msg).split())}", file=sys.stderr, flush=True)
  sys.exit(2)


def sha256(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def fetch(cache: str = CACHE) -> str:
  """ml-100k.inter from the recbole wheel (downloaded once, never installed)."""
  out = os.path.join(cache, "ml-100k.inter")
  if os.path.exists(out):
    return out
  wheels = os.path.join(cache, "wheels")
  os.makedirs(wheels, exist_ok=True)
  _log(f"pip download --no-deps {WHEEL} -> {wheels}")
  p = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", WHEEL,
                      "-d", wheels])
  if p.returncode:
    _fail(f"pip download {WHEEL} failed (no network?); pass --inter FILE (ml-100k.inter, u.data "
          "or a ratings file) instead")
  whl = [f for f in os.listdir(wheels) if f.startswith("recbole-") and f.endswith(".whl")]
  if not whl:
    raise RuntimeError(f"no recbole wheel in {wheels}")
  with zipfile.ZipFile(os.path.join(wheels, sorted(whl)[-1])) as z:
    data = z.read(MEMBER)
  with open(out + ".tmp", "wb") as f:
    f.write(data)
  os.replace(out + ".tmp", out)
  return out


def _env(cache_dir: str) -> dict:
  env = dict(os.environ)
  env.setdefault("KUNLUN_COMPILATION_CACHE", cache_dir)
  env["PYTHONPATH"] = _ROOT + os.pathsep + env.get("PYTHONPATH", "")
  return env


def _run(cmd, env, log_path):
  with open(log_path, "w") as log:
    p = subprocess.run(cmd, cwd=_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
  if p.returncode:
    tail = open(log_path).read()[-3000:]
    raise RuntimeError(f"{' '.join(cmd[:3])} failed ({p.returncode}); log {log_path}:\n{tail}")


def train_eval(arch: str, seed: int, data_dir: str, work: str, args, env) -> dict:
  """train.py (epochs, per-epoch validation, keep-best) then eval.py --best; the eval metrics."""
  wd = os.path.join(work, f"{arch}_s{seed}")
  shutil.rmtree(wd, ignore_errors=True)
  os.makedirs(wd)
  t0 = time.perf_counter()
  _run([sys.executable, "train.py", "--config=kunlun/configs/tiny.py", f"--workdir={wd}",
        f"--data_dir={data_dir}", f"--config.model.arch={arch}", f"--config.seed={seed}",
        f"--config.data.shuffle_seed={seed}", f"--config.train.epochs={args.max_epochs}",
        "--config.train.keep_best=True", f"--config.data.batch_size={args.batch_size}",
        f"--config.train.lr={args.lr}", "--config.train.log_every=100",
        "--config.train.checkpoint_every=1000000"], env, os.path.join(wd, "train.log"))
  t_train = time.perf_counter() - t0
  _run([sys.executable, "eval.py", f"--workdir={wd}", "--best",
        f"--out={os.path.join(wd, 'eval.json')}",
        f"--predictions={os.path.join(wd, 'predictions.parquet')}"], env,
       os.path.join(wd, "eval.log"))
  res = json.load(open(os.path.join(wd, "eval.json")))
  best = json.load(open(os.path.join(wd, "best", "best.json")))
  curve = {}
  for line in open(os.path.join(wd, "metrics.jsonl")):
    r = json.loads(line)
    if "valid_ne" in r and r["valid_ne"].get("click") is not None:
      curve[f"{r['epoch']:.2f}"] = r["valid_ne"]["click"]
  m = res["overall"]["click"]
  return {"ne": m["ne"], "auc": m["auc"], "calibration": m["calibration"],
          "best_step": best["step"], "best_epoch": float(min(curve, key=curve.get)) if curve
          else None, "valid_ne_by_epoch": curve, "train_s": round(t_train, 1),
          "examples": res["examples"]}


def _features(data_dir: str, split: str, schema):
  """LR design of one split: one-hot user / movie ids, dense history statistics, labels."""
  users, items, dense, y = [], [], [], []
  for _, _, r in verify.read_split(data_dir, split, schema):
    users.append(int(r["sparse/user_id"][0]))
    items.append(int(r["sparse/ad_id"][0]))
    dense.append(r["dense"])
    y.append(r["labels"][0])
  d = np.asarray(dense, np.float64)
  return (np.asarray(users), np.asarray(items), np.sign(d) * np.log1p(np.abs(d)),
          np.asarray(y, np.float64))


def logistic_regression(data_dir: str, Cs) -> dict:
  """One-hot ids + standardised history statistics; C chosen by validation NE."""
  from scipy import sparse
  from sklearn.linear_model import LogisticRegression

  schema = Schema.load(data_dir)
  sets = {s: _features(data_dir, s, schema) for s in ("train", "valid", "eval")}
  nu = 1 + max(int(v[0].max()) for v in sets.values())
  ni = 1 + max(int(v[1].max()) for v in sets.values())
  mu, sd = sets["train"][2].mean(0), sets["train"][2].std(0) + 1e-6

  def design(s):
    u, i, d, _ = sets[s]
    n = len(u)
    oh = lambda ids, k: sparse.csr_matrix((np.ones(n), (np.arange(n), ids)), shape=(n, k))
    return sparse.hstack([oh(u, nu), oh(i, ni), sparse.csr_matrix((d - mu) / sd)]).tocsr()

  X = {s: design(s) for s in sets}
  y = {s: sets[s][3] for s in sets}
  t0 = time.perf_counter()
  curve, fits = {}, {}
  for C in Cs:
    m = LogisticRegression(C=C, max_iter=2000).fit(X["train"], y["train"])
    curve[str(C)] = metrics.ne(m.predict_proba(X["valid"])[:, 1], y["valid"])
    fits[str(C)] = m
  best = min(curve, key=curve.get)
  p = fits[best].predict_proba(X["eval"])[:, 1]
  return {"ne": metrics.ne(p, y["eval"]), "auc": metrics.auc(p, y["eval"]),
          "calibration": metrics.calibration(p, y["eval"]), "best_C": float(best),
          "valid_ne_by_C": curve, "fit_s": round(time.perf_counter() - t0, 1),
          "examples": int(len(p)), "features": {"users": nu, "movies": ni,
                                                "dense": list(schema.dense)}}


def _summary(runs: dict) -> dict:
  out = {}
  for k in ("ne", "auc", "calibration"):
    v = np.asarray([r[k] for r in runs.values()], np.float64)
    out[k] = {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0}
  out["best_epoch"] = [r["best_epoch"] for r in runs.values()]
  return out


def table(res: dict) -> str:
  head = f"{'model':<12} {'NE':>15} {'AUC':>15} {'calibration':>15}  best epoch(s)"
  rows = [head, "-" * len(head)]
  for name, m in res["models"].items():
    s = m["summary"]
    cell = lambda k, s=s: f"{s[k]['mean']:.4f} ± {s[k]['std']:.4f}"
    rows.append(f"{name:<12} {cell('ne'):>15} {cell('auc'):>15} {cell('calibration'):>15}  "
                f"{s.get('best_epoch', '-')}")
  return "\n".join(rows)


def run(args) -> dict:
  t_start = time.perf_counter()
  inter = args.inter or fetch()
  work = args.workdir or tempfile.mkdtemp(prefix="real_data_")
  os.makedirs(work, exist_ok=True)
  data_dir = os.path.join(work, "ml100k")
  _log(f"ingest {inter} -> {data_dir}")
  with open(os.path.join(work, "ingest.log"), "w") as log:
    try:
      rep = movielens.convert(inter, data_dir, max_len=args.max_len, overwrite=True,
                              out=log, err=log)
    except (ValueError, OSError) as e:      # a malformed ratings file: named, one line
      if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
      _fail(e)
  env = _env(os.path.join(CACHE, "xla"))
  models = {}
  for arch in args.archs:
    if arch == "lr":
      continue
    runs = {}
    for seed in args.seeds:
      _log(f"{arch} seed {seed}: train {args.max_epochs} epoch(s), keep best on valid, eval")
      runs[str(seed)] = train_eval(arch, seed, data_dir, work, args, env)
      _log(f"{arch} seed {seed}: {json.dumps({k: runs[str(seed)][k] for k in ('ne', 'auc')})}")
    models[arch] = {"seeds": runs, "summary": _summary(runs)}
  if "lr" in args.archs:
    _log("logistic regression")
    lr = logistic_regression(data_dir, args.Cs)
    models["logreg"] = {"seeds": {"all": lr}, "summary": {
        **{k: {"mean": lr[k], "std": 0.0} for k in ("ne", "auc", "calibration")},
        "best_epoch": "-"}}
  res = {
      "bench": "real_data", "quick": bool(args.quick),
      "dataset": {"source": args.inter or f"{WHEEL}:{MEMBER}", "sha256": sha256(inter),
                  "examples": rep["examples"], "positive_rate": rep["positive_rate"],
                  "split": rep["split"], "label": "click = rating >= 4",
                  "schema": rep["spec"]["schema"]},
      "setup": {"config": "kunlun/configs/tiny.py", "max_epochs": args.max_epochs,
                "batch_size": args.batch_size, "lr": args.lr, "seeds": args.seeds,
                "history_max_len": args.max_len, "logreg_C": args.Cs,
                "epoch_choice": "keep-best by validation NE after each epoch"},
      "models": models,
      "device": f"{jax.devices()[0].platform} ({jax.devices()[0].device_kind}), "
                f"{os.cpu_count()} cpus",
      "versions": {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
                   "flax": flax.__version__, "python": platform.python_version()},
      "timings_s": {"total": round(time.perf_counter() - t_start, 1)},
  }
  if not args.workdir:
    shutil.rmtree(work, ignore_errors=True)
  return res


def main(argv=None):
  ap = argparse.ArgumentParser(prog=PROG, description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--quick", action="store_true", help="CI-sized: 1 seed, 1 epoch, batch 32")
  ap.add_argument("--inter", help="a local .inter / u.data / ratings file instead of the fetch")
  ap.add_argument("--archs", default=",".join(ARCHS + ("lr",)),
                  help="comma list of kunlun, interformer, dlrm, lr")
  ap.add_argument("--seeds", default=None, help="comma list (default 0,1,2; quick: 0)")
  ap.add_argument("--max_epochs", type=float, default=None, help="default 4 (quick: 1)")
  ap.add_argument("--batch_size", type=output.at_least(1), default=None,
                  help="default 256 (quick: 32)")
  ap.add_argument("--lr", type=float, default=2e-3)
  ap.add_argument("--max_len", type=output.at_least(1), default=50,
                  help="history events per stream")
  ap.add_argument("--Cs", default="0.01,0.03,0.1,0.3,1,3", help="LR inverse L2 strengths")
  ap.add_argument("--workdir", help="keep data and runs here (default: a temp dir, removed)")
  ap.add_argument("--out", help="JSON (default bench/results/real_data[_quick].json)")
  args = ap.parse_args(argv)
  output.make_folder("--workdir", args.workdir)
  q = args.quick
  args.archs = [a.strip() for a in args.archs.split(",") if a.strip()]
  bad = [a for a in args.archs if a not in ARCHS + ("lr",)]
  if bad:
    ap.error(f"--archs: unknown {bad}")
  if "lr" in args.archs:
    try:
      import sklearn  # noqa: F401
    except ImportError:
      ap.error("--archs lr needs scikit-learn: pip install -e '.[bench]' (or drop lr from --archs)")
  def numbers(flag, text, kind):
    try:
      vals = [kind(x) for x in text.split(",")]
    except ValueError:
      ap.error(f"--{flag}={text}: expected comma-separated {kind.__name__}s")
    if flag == "Cs" and min(vals) <= 0:
      ap.error(f"--Cs={text}: inverse L2 strengths must be > 0")
    return vals
  args.seeds = numbers("seeds", args.seeds or ("0" if q else "0,1,2"), int)
  args.Cs = numbers("Cs", args.Cs, float)
  for flag in ("max_epochs", "batch_size", "lr", "max_len"):
    v = getattr(args, flag)
    if v is not None and not v > 0:
      ap.error(f"--{flag}={v:g} must be > 0")
  args.max_epochs = args.max_epochs or (1 if q else 4)
  args.batch_size = args.batch_size or (32 if q else 256)
  if args.inter:                                   # fail fast: before any jax import or training
    if not os.path.isfile(args.inter):
      ap.error(f"--inter={args.inter}: no such file")
    try:
      movielens.detect(args.inter)
    except (ValueError, OSError) as e:
      ap.error(str(e))
  res = run(args)
  print(table(res))
  path = output.result_path("real_data", q, args.out)
  output.write_json(path, res)
  _log(f"wrote {path} ({res['timings_s']['total']:.0f}s)")
  return res


if __name__ == "__main__":
  main()
