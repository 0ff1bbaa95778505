"""Knowledge-transfer experiment (issue 7, spec g): FM -> VM via KD, LoopFM, both.

  python bench/experiments/transfer.py [--quick] [--out bench/results/transfer.json]
Notes: docs/guides/benchmarks.md, ``bench/experiments/transfer.py``."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _ROOT)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench import output  # noqa: E402
from data import pipeline, synthetic  # noqa: E402
from data.schema import Schema  # noqa: E402
from kunlun.configs import tiny, vm_tiny  # noqa: E402
from kunlun.configs.types import seq_lens as get_seq_lens  # noqa: E402
from kunlun.train import optim  # noqa: E402
from kunlun.train.metrics import surface_task_metrics  # noqa: E402
from kunlun.transfer import adapter as adapter_lib  # noqa: E402
from kunlun.transfer import experiment as ex  # noqa: E402
from kunlun.transfer import export  # noqa: E402
from kunlun.transfer.join import AsOfIndex, EmbeddingLog, pair_key  # noqa: E402
from kunlun.transfer.loopfm import build_loopfm  # noqa: E402


def _log(msg):
  print(f"[transfer {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _host_batches(data_cfg, data_dir, split, seq_lens):
  ds = pipeline.make_dataset(data_cfg, data_dir, split, seq_lens, train=False, shard_index=0,
                             shard_count=1)
  return list(ds)


def _ne_table(per_surface, overall):
  t = {s: {k: v["ne"] for k, v in d.items()} for s, d in per_surface.items()}
  t["overall"] = {k: v["ne"] for k, v in overall.items()}
  return t


def _ratio(vm, var, fm):
  if None in (vm, var, fm) or abs(vm - fm) < 1e-9:
    return None
  return (vm - var) / (vm - fm)


def warnings(ne, surfaces, tasks) -> list[str]:
  """Cells where the transfer ratio is not meaningful (the FM is not better than the VM)."""
  bad = [f"{s}/{t}" for s in [*surfaces, "overall"] for t in tasks
         if ne["fm"][s][t] is None or ne["vm_alone"][s][t] is None
         or ne["fm"][s][t] >= ne["vm_alone"][s][t]]
  if not bad:
    return []
  return [f"FM eval NE >= VM-alone eval NE in {bad}: the transfer ratio denominator is <= 0 "
          "there, so those ratios are not meaningful (the FM is under-trained or over-fitted)."]


def _cat(batches, k):
  return np.concatenate([np.asarray(b[k])[b["example_mask"] > 0] for b in batches])


def run(args) -> dict:
  t_start = time.perf_counter()
  work = args.workdir or tempfile.mkdtemp(prefix="kunlun_transfer_")
  data_dir, fm_dir, emb_dir = (os.path.join(work, d) for d in ("data", "fm", "emb"))
  timings = {}

  # 1. data: pretrain | train | eval windows
  t0 = time.perf_counter()
  if not os.path.exists(os.path.join(data_dir, "manifest.json")):
    schema = synthetic.generate(data_dir, "tiny", num_examples=args.num_examples, seed=args.seed,
                                pretrain_examples=args.fm_examples)
  else:
    schema = Schema.load(data_dir)
  timings["data_s"] = time.perf_counter() - t0
  surfaces, tasks = schema.surfaces, schema.task_names
  _log(f"data: {args.fm_examples} pretrain + {args.num_examples} train examples in {data_dir}")

  # 2. FM on the pretrain window via train.py (the real training path; resumes if it exists)
  t0 = time.perf_counter()
  env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
  cmd = [sys.executable, os.path.join(_ROOT, "train.py"),
         f"--config={os.path.join(_ROOT, 'kunlun/configs/tiny.py')}", f"--workdir={fm_dir}",
         f"--data_dir={data_dir}", f"--steps={args.fm_steps}", "--mesh=data=1,fsdp=-1",
         "--config.data.train_split=pretrain",
         f"--config.train.log_every={max(args.fm_steps // 4, 1)}",
         f"--config.train.checkpoint_every={args.fm_steps}", f"--config.seed={args.seed}"]
  _log("FM: " + " ".join(cmd[1:]))
  subprocess.run(cmd, check=True, env=env, cwd=_ROOT)
  timings["fm_train_s"] = time.perf_counter() - t0

  # 3. the FM's serving log: pooled embeddings + logits of the train and eval windows
  t0 = time.perf_counter()
  man = export.export(fm_dir, emb_dir, splits=("train", "eval"), quantize_mode="int8",
                      shard_batches=100, mesh_flag="data=1,fsdp=-1", log=_log)
  rec = export.read_records(emb_dir)
  timings["export_s"] = time.perf_counter() - t0
  log = EmbeddingLog(rec["user_id"], rec["ad_id"], rec["request_ts"], rec["emb"])
  logit_index = AsOfIndex(pair_key(rec["user_id"], rec["ad_id"]), rec["request_ts"],
                          rec["logits"])
  vm_cfg = vm_tiny.get_config()
  vm_cfg.data.batch_size = args.batch_size
  vm_cfg.train.steps = args.vm_steps
  vm_cfg.train.warmup_steps = max(args.vm_steps // 10, 1)
  vm_cfg.seed = args.seed
  vm_lens = get_seq_lens(vm_cfg)
  streams = list(vm_lens)
  eval_batches = _host_batches(vm_cfg.data, data_dir, "eval", vm_lens)
  cat = lambda k: _cat(eval_batches, k)

  # FM metrics on eval from its logged logits (same examples, same order as the eval batches)
  ev_keys, ev_ts = pair_key(cat("user_id"), cat("ad_id")), cat("request_ts").astype(np.int64)
  ev_lg, present, _ = logit_index.lookup(ev_keys, ev_ts, max_age=0)
  assert present.all(), "every eval example must have its logged FM logits"
  fm_prob = 1 / (1 + np.exp(-ev_lg.astype(np.float64)))
  fm_ps, fm_all = surface_task_metrics(fm_prob, cat("labels"), cat("label_mask"), cat("surface"),
                                       surfaces, tasks, cat("true_prob"))

  # 4. student adapter on the freshest quarter of the VM's training window
  t0 = time.perf_counter()
  train_batches = _host_batches(vm_cfg.data, data_dir, "train", vm_lens)
  tb = {k: _cat(train_batches, k)
        for k in ("user_id", "ad_id", "request_ts", "surface", "labels", "label_mask")}
  del train_batches
  tb_ts = tb["request_ts"].astype(np.int64)
  fm_cutoff = int(tb_ts.min())            # the FM's training window ends where train begins
  fresh = tb_ts >= np.quantile(tb_ts, 0.75)
  t_lg, t_p, _ = logit_index.lookup(pair_key(tb["user_id"], tb["ad_id"]), tb_ts, max_age=0)
  sel = fresh & t_p
  age = lambda ts: np.maximum(np.asarray(ts, np.int64) - fm_cutoff, 0).astype(np.float32)
  ad_mod, ad_params = adapter_lib.fit_adapter(
      t_lg[sel], tb["surface"][sel], age(tb_ts[sel]), tb["labels"][sel], tb["label_mask"][sel],
      num_surfaces=len(surfaces), steps=args.adapter_steps, lr=1e-2, seed=args.seed, hidden=8,
      emb_dim=2)
  timings["adapter_s"] = time.perf_counter() - t0
  feats = ex.FMFeatures(log, logit_index, (ad_mod, ad_params), join_key=args.join_key,
                        fm_cutoff=fm_cutoff)
  # the eval window's LoopFM inputs, joined once (logged embeddings as of each request / event)
  eval_lf = [{**b, **feats.loopfm(b, streams)} for b in eval_batches]
  ad_prob = np.asarray(adapter_lib.soft_targets(ad_mod, ad_params, ev_lg, cat("surface"),
                                                age(ev_ts)), np.float64)
  _, ad_all = surface_task_metrics(ad_prob, cat("labels"), cat("label_mask"), cat("surface"),
                                   surfaces, tasks)

  # 5. VM variants (same seed, data order and step count)
  variants = {"vm_alone": (0.0, False), "vm_kd": (args.kd_lambda, False),
              "vm_loopfm": (0.0, True), "vm_both": (args.kd_lambda, True)}
  models = {lf: build_loopfm(vm_cfg, schema, use_ctx=lf, use_events=lf) for lf in (False, True)}
  steps = {lf: None for lf in models}
  predicts = {lf: ex.make_predict(m) for lf, m in models.items()}
  inits = {lf: ex.make_init(m) for lf, m in models.items()}
  results, train_losses, vm_params = {}, {}, {}
  for name, (lam, lf) in variants.items():
    t0 = time.perf_counter()
    model = models[lf]
    ds = pipeline.make_dataset(vm_cfg.data, data_dir, "train", vm_lens, train=True,
                               shard_index=0, shard_count=1)
    it = iter(ds)
    first = next(it)
    drop_rng = np.random.default_rng(args.seed)
    fm_train = ((lambda b, r=drop_rng: feats.loopfm(b, streams, args.ctx_dropout, r))
                if lf else None)
    params = inits[lf]({**first, **(fm_train(first) if lf else {})}, args.seed)
    tx = optim.make_optimizer(vm_cfg.train, args.vm_steps)
    opt = tx.init(params)
    if steps[lf] is None:
      steps[lf] = ex.make_vm_step(model, tx)
    losses = []
    b = first
    for _ in range(args.vm_steps):
      inp = {**b, **fm_train(b)} if lf else b
      soft, soft_mask = feats.soft(b)
      params, opt, loss = steps[lf](params, opt, inp, soft, soft_mask, np.float32(lam))
      losses.append(float(loss))
      b = next(it)
    ps, ov = ex.evaluate(predicts[lf], params, eval_lf if lf else eval_batches, surfaces, tasks)
    results[name], vm_params[name] = (ps, ov), params
    train_losses[name] = float(np.mean(losses[-max(len(losses) // 10, 1):]))
    timings[f"{name}_s"] = time.perf_counter() - t0
    _log(f"{name}: NE {_ne_table(ps, ov)['overall']} ({timings[name + '_s']:.0f}s)")

  # 6. tables and transfer ratios
  ne = {"fm": _ne_table(fm_ps, fm_all), **{n: _ne_table(*r) for n, r in results.items()}}
  ratio = {n: {s: {t: _ratio(ne["vm_alone"][s][t], ne[n][s][t], ne["fm"][s][t]) for t in tasks}
               for s in [*surfaces, "overall"]} for n in ("vm_kd", "vm_loopfm", "vm_both")}

  # 7. serving the eval window through the speculative cache (context embedding only; history
  #    embeddings are logs joined as of each event, no FM inference at request time)
  t0 = time.perf_counter()
  ev_emb, _, _ = log.join_current({"user_id": cat("user_id"), "ad_id": cat("ad_id"),
                                   "request_ts": ev_ts}, max_age=0)
  real = [np.asarray(b["example_mask"]) > 0 for b in eval_batches]   # cat() order: real rows
  start = np.cumsum([0] + [int(m.sum()) for m in real])
  serving = {}
  for frac in args.cache_budgets:
    c_emb, c_present, _, c_stats = ex.serve_through_cache(
        cat("user_id"), cat("ad_id"), ev_ts, ev_emb, budget_frac=frac, seed=args.seed)
    served = []                      # eval_lf with the context embedding as the cache serves it
    for b, m, i in zip(eval_lf, real, start, strict=False):
      hit, emb = np.zeros(m.shape, bool), np.zeros_like(b["fm_ctx"], np.float32)
      hit[m] = c_present[i:i + m.sum()]
      emb[m] = np.where(hit[m][:, None], c_emb[i:i + m.sum()], 0)
      served.append({**b, "fm_ctx": emb, "fm_ctx_present": hit})

    row = {"cache": c_stats}
    for name in ("vm_loopfm", "vm_both"):
      ps, ov = ex.evaluate(predicts[True], vm_params[name], served, surfaces, tasks)
      row[name] = _ne_table(ps, ov)["overall"]
    serving[str(frac)] = row
    _log(f"cache budget {frac}: hit rate {c_stats['hit_rate']:.3f}, staleness "
         f"{c_stats['staleness_mean_s']:.0f}s, NE loopfm {row['vm_loopfm']}")
  timings["serving_s"] = time.perf_counter() - t0

  out = {
      "bench": "transfer", "quick": args.quick, "seed": args.seed,
      "setup": {"fm_examples": args.fm_examples, "num_examples": args.num_examples,
                "fm_window": "pretrain (before train)", "fm_config": "tiny",
                "vm_config": "vm_tiny", "fm_steps": args.fm_steps, "vm_steps": args.vm_steps,
                "batch_size": args.batch_size, "kd_lambda": args.kd_lambda,
                "ctx_dropout": args.ctx_dropout, "join_key": args.join_key,
                "quantize": man["quantize"], "fm_seq_lens": get_seq_lens(tiny.get_config()),
                "vm_seq_lens": vm_lens, "eval_examples": int(len(fm_prob))},
      "ne": ne,
      "bayes_ne": {s: {t: fm_ps[s][t]["bayes_ne"] for t in tasks} for s in surfaces},
      "transfer_ratio": ratio,
      "auc": {"fm": {t: fm_all[t]["auc"] for t in tasks},
              **{n: {t: r[1][t]["auc"] for t in tasks} for n, r in results.items()}},
      "adapter": {"eval_ne_raw_fm": {t: fm_all[t]["ne"] for t in tasks},
                  "eval_ne_adapted": {t: ad_all[t]["ne"] for t in tasks},
                  "eval_calibration_raw_fm": {t: fm_all[t]["calibration"] for t in tasks},
                  "eval_calibration_adapted": {t: ad_all[t]["calibration"] for t in tasks},
                  "fit_examples": int(sel.sum())},
      "loopfm_present_rate": feats.present_rates(),
      "serving_through_cache": serving,
      "train_loss_last10pct": train_losses,
      "timings_s": {**timings, "total": time.perf_counter() - t_start},
      "device": str(jax.devices()[0].platform),
  }
  out["warnings"] = warnings(ne, surfaces, tasks)
  for w in out["warnings"]:
    _log("WARNING: " + w)
  _log("NE (overall): " + json.dumps({n: ne[n]["overall"] for n in ne}))
  _log("transfer ratio (overall): " + json.dumps({n: ratio[n]["overall"] for n in ratio}))
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--quick", action="store_true", help="small CI-sized run")
  ap.add_argument("--out", default=None,
                  help="JSON path (default bench/results/transfer[_quick].json)")
  ap.add_argument("--workdir", default=None, help="keeps data/FM/export here (default: a temp dir)")
  ap.add_argument("--num_examples", type=output.at_least(1), default=None,
                  help="VM training window size")
  ap.add_argument("--fm_examples", type=output.at_least(1), default=None,
                  help="FM (pretrain) window size")
  ap.add_argument("--fm_steps", type=output.at_least(1), default=None)
  ap.add_argument("--vm_steps", type=output.at_least(1), default=None)
  ap.add_argument("--batch_size", type=output.at_least(1), default=64)
  ap.add_argument("--adapter_steps", type=output.at_least(1), default=None)
  ap.add_argument("--kd_lambda", type=float, default=0.5)
  ap.add_argument("--ctx_dropout", type=float, default=0.2,
                  help="fraction of FM context embeddings masked while training LoopFM VMs")
  ap.add_argument("--cache_budgets", type=float, nargs="+", default=[0.0, 0.5, 1.0, 2.0],
                  help="cache budgets, as multiples of the requests per refresh interval")
  ap.add_argument("--join_key", default="user", choices=("user", "user_item"))
  ap.add_argument("--seed", type=output.at_least(0), default=0)
  args = ap.parse_args(argv)
  output.make_folder("--workdir", args.workdir)
  q = args.quick
  args.num_examples = args.num_examples or (2000 if q else 20000)
  args.fm_examples = args.fm_examples or (4000 if q else 80000)
  args.fm_steps = args.fm_steps or (10 if q else 2500)       # quick: every stage runs, briefly
  args.vm_steps = args.vm_steps or (10 if q else 1000)
  args.adapter_steps = args.adapter_steps or (20 if q else 300)
  out = run(args)
  path = output.result_path("transfer", q, args.out)
  output.write_json(path, out)
  _log(f"wrote {path} ({out['timings_s']['total']:.0f}s)")
  return out


if __name__ == "__main__":
  main()
