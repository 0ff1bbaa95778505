"""Serving throughput: the shared request-level path (``kunlun.serving.score``) vs naive
per-ad scoring.

  nice -n 10 python bench/serving.py [--config dev] [--candidates 16,128,1024] [--dtype float32]
      [--seconds 20] [--min_iters 3] [--max_iters 50] [--out bench/results/serving_cpu.json]

One request (one user, every stream at its full kept length: the heaviest request) with N candidate
ads, scored by (a) the shared path (event embeddings, layer-0 HSP and the PFFN query side once per
request) and (b) the naive path (N separate examples through the model). Both are jitted; after a
warm-up call the two are timed call by call, alternately (``--seconds`` per case, between
``--min_iters`` and ``--max_iters`` calls each) and reported as p50 / p99 latency, requests/s
and candidates/s (one request in flight), and the speed-up ``naive p50 / shared p50``. The
analytic bound from the FLOP model, ``total / (ad + request / N)`` (``score.flops_split``), is
printed beside it, and the ratio of the FLOPs XLA counts in the two compiled programs
(``xlaFLOP``, a count that machine load cannot blur). Parameters are random (speed does not
depend on their values). On CPU the default dtype is float32 (bfloat16 matmuls are emulated
there); on GPU it is the config's.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)

import flax  # noqa: E402
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench.output import at_least, int_list  # noqa: E402
from bench.train_step import load_config  # noqa: E402
from data.fake import random_batch  # noqa: E402
from data.synthetic import PRESETS, preset_schema  # noqa: E402
from kunlun.configs.types import seq_lens  # noqa: E402
from kunlun.models.build import build_model  # noqa: E402
from kunlun.serving import score  # noqa: E402
from kunlun.utils import atomic  # noqa: E402


def _timed(fns: dict, args, seconds, min_iters, max_iters) -> dict:
  """Times each function of ``fns`` call by call, alternating between them (so a change of
  machine load hits every path alike); the first call (compilation) is reported apart."""
  out, times = {}, {k: [] for k in fns}
  fns = dict(fns)
  for k, fn in fns.items():
    t0 = time.perf_counter()
    fns[k] = fn.lower(*args).compile()
    out[k] = {"compile_s": time.perf_counter() - t0}
    ca = fns[k].cost_analysis()
    ca = (ca[0] if isinstance(ca, list) else ca) or {}
    out[k]["xla_gflop"] = float(ca.get("flops", float("nan"))) / 1e9
    out[k]["xla_gbytes_accessed"] = float(ca.get("bytes accessed", float("nan"))) / 1e9
    jax.block_until_ready(fns[k](*args))              # first run
  start, i = time.perf_counter(), 0
  while i < max_iters and (i < min_iters or time.perf_counter() - start < seconds):
    for k, fn in fns.items():
      t = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times[k].append(time.perf_counter() - t)
    i += 1
  for k, ts in times.items():
    ms = np.array(ts) * 1e3
    out[k].update(p50_ms=float(np.percentile(ms, 50)), p99_ms=float(np.percentile(ms, 99)),
                  mean_ms=float(ms.mean()), iters=len(ms), requests_per_s=float(1e3 / ms.mean()))
  return out


def run(args) -> dict:
  config = load_config(args.config, [])
  on_cpu = jax.default_backend() == "cpu"
  config.model.dtype = args.dtype or ("float32" if on_cpu else config.model.dtype)
  schema = preset_schema(PRESETS[config.data.preset])
  model = build_model(config, schema)
  lens = seq_lens(config)
  req = random_batch(schema, 1, lens, seed=1, min_len=max(lens.values()))   # full histories
  shapes = nn.meta.unbox(jax.eval_shape(model.init, jax.random.key(0),
                                        random_batch(schema, 1, lens))["params"])
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda s: jax.device_put((0.05 * rng.normal(size=s.shape))
                                                 .astype(s.dtype)), shapes)
  shared, naive = score.make_scorer(model), score.make_scorer(model, shared=False)
  split = score.flops_split(config, schema)
  res = {
      "what": "one request (full-length streams) x N candidate ads; latency per request",
      "device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
      "versions": {"jax": jax.__version__, "jaxlib": jax.lib.__version__,
                   "flax": flax.__version__, "python": platform.python_version()},
      "config": args.config, "dtype": config.model.dtype, "backend_kernels": config.model.backend,
      "kept_len": lens, "comp_skip": bool(config.model.comp_skip),
      "flops_per_candidate": split, "load_avg_start": os.getloadavg(), "cases": {},
      "note": "CPU timings on a machine shared with other jobs (noisy); one request in flight",
  }
  print(f"{args.config} ({config.model.dtype}, {jax.default_backend()}): analytic FLOPs per "
        f"candidate {split['total'] / 1e6:.1f} M, request-level {split['request'] / 1e6:.1f} M "
        f"({100 * split['request'] / split['total']:.0f}%)", flush=True)
  head = (f"{'N':>5} {'path':<7} {'p50 ms':>9} {'p99 ms':>9} {'req/s':>8} {'cand/s':>9} "
          f"{'iters':>5} {'speed-up':>8} {'bound':>6} {'xlaFLOP':>7}")
  print(head + "\n" + "-" * len(head), flush=True)
  for n in args.candidates:
    ads = random_batch(schema, n, lens, seed=2)
    batch = jax.device_put(score.serving_batch(req["events"], ads))
    case = _timed({"shared": shared, "naive": naive}, (params, batch), args.seconds,
                  args.min_iters, args.max_iters)
    for name in ("shared", "naive"):
      case[name]["candidates_per_s"] = case[name]["requests_per_s"] * n
    case["speedup_p50"] = case["naive"]["p50_ms"] / case["shared"]["p50_ms"]
    case["xla_flops_ratio"] = case["naive"]["xla_gflop"] / case["shared"]["xla_gflop"]
    case["flops_bound"] = split["total"] / (split["ad"] + split["request"] / n)
    res["cases"][str(n)] = case
    for name in ("shared", "naive"):
      c = case[name]
      extra = (f"{case['speedup_p50']:8.2f} {case['flops_bound']:6.2f} "
               f"{case['xla_flops_ratio']:7.2f}" if name == "naive" else "")
      print(f"{n:>5} {name:<7} {c['p50_ms']:9.1f} {c['p99_ms']:9.1f} {c['requests_per_s']:8.2f} "
            f"{c['candidates_per_s']:9.0f} {c['iters']:>5} {extra}", flush=True)
  res["load_avg_end"] = os.getloadavg()
  return res


def _parse(argv=None):
  """The flags, each out of range a one-line error before any work."""
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--config", default="dev", help="preset under kunlun/configs")
  ap.add_argument("--candidates", type=int_list(1), default=[16, 128, 1024])
  ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                  help="default: see module doc")
  ap.add_argument("--seconds", type=float, default=20.0)
  ap.add_argument("--min_iters", type=at_least(1), default=3)
  ap.add_argument("--max_iters", type=at_least(1), default=50)
  ap.add_argument("--out", default=None, help="default bench/results/serving_<backend>.json")
  args = ap.parse_args(argv)
  load_config(args.config, [])                   # an unknown preset: one line, before the work
  if not args.seconds > 0 or args.max_iters < args.min_iters:
    raise SystemExit(f"--seconds {args.seconds} --min_iters {args.min_iters} --max_iters "
                     f"{args.max_iters}: need seconds > 0 and min_iters <= max_iters")
  return args


def main(argv=None):
  args = _parse(argv)
  res = run(args)
  out = args.out or os.path.join(_ROOT, "bench/results", f"serving_{res['backend']}.json")
  atomic.write_json(out, res)
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
