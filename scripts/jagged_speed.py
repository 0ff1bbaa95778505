"""CPU examples/second of padded vs packed (jagged) event towers (issue #28) on a preset's
synthetic data: loss + gradient and the whole train step (optimizer included, as train.py builds
it), both layouts on the same batches, interleaved repeat by repeat so load drifts hit both.
``python scripts/jagged_speed.py [tiny dev] --tag after``: prints a table and stores the run under
``runs[tag]`` of bench/results/jagged_speed_cpu.json (device, versions, shapes, fills, medians).
A measurement, not a test: targets live in bench/."""

import argparse
import contextlib
import itertools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import flax.linen as nn
import jax
import numpy as np

import pallas_kernels
from bench.output import result_path, write_json
from bench.train_step import build_step, versions
from data import pipeline, synthetic
from kunlun.configs import dev, tiny
from kunlun.configs.types import seq_lens
from kunlun.models.build import build_model
from kunlun.nn.losses import masked_bce
from kunlun.train.capacity import jagged_capacity
from kunlun.train.plan import load_schema
from sharding import mesh as mesh_lib
from sharding import partition
from sharding import rules as rules_lib

PRESETS = {"tiny": tiny, "dev": dev}
LAYOUTS = ("padded", "packed")


def first_batches(cfg, data_dir, lens, n, capacity):
  """The first ``n`` train batches in order (packed at ``capacity``; None: padded)."""
  return list(itertools.islice(pipeline.make_dataset(
      cfg.data, data_dir, "train", lens, train=False, shard_index=0, shard_count=1,
      jagged_capacity=capacity), n))


def loss_grad(cfg, schema, batches):
  """``run(batch)``: one jitted loss + gradient of the preset's model (parameters from the
  first batch)."""
  model = build_model(cfg, schema)
  params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), batches[0], False))["params"]

  def loss(p, b):
    return masked_bce(model.apply({"params": p}, b, True), b["labels"], b["label_mask"])[0]

  f = jax.jit(jax.value_and_grad(loss))
  return lambda b: f(params, b)


def train_step(cfg, batches):
  """``run(batch)``: train.py's step (``kunlun.train.step.build`` via bench.train_step), its
  parameters and optimizer state carried from call to call; batches placed as the step wants."""
  mesh = mesh_lib.make_mesh(mesh_lib.parse_mesh_flag("data=1,fsdp=-1"), devices=jax.devices()[:1])
  rules = rules_lib.get_rules(cfg.sharding.rules)
  fn, _, params, opt_state, first = build_step(cfg, mesh, rules, batches[0], abstract=False)
  placed = {id(b): jax.tree.map(lambda x, r: jax.device_put(x, r.sharding), b, first)
            for b in batches}
  state = {"p": params, "o": opt_state, "i": 0}

  def run(b):
    with partition.activate(mesh, rules):
      state["p"], state["o"], stats = fn(state["p"], state["o"], placed[id(b)],
                                         jax.random.key(state["i"]), np.int32(state["i"]))
    state["i"] += 1
    return stats
  return run


def measure(runs, batches, repeats):
  """Seconds per step of each ``runs[layout](batch)`` (first call compiles): the layouts take
  turns, each timing all its batches once per repeat. Returns ``{layout: [seconds]}``."""
  for layout, run in runs.items():
    jax.block_until_ready(run(batches[layout][0]))
  times = {layout: [] for layout in runs}
  for _ in range(repeats):
    for layout, run in runs.items():
      for b in batches[layout]:
        t = time.perf_counter()
        jax.block_until_ready(run(b))
        times[layout].append(time.perf_counter() - t)
  return times


def fills(cfg, lens, batches, cap):
  """Per stream: real events / padded B*T and / the packed capacity, over the measured batches."""
  out = {}
  for s, t in lens.items():
    real = sum(int(np.sum(np.minimum(b["events"][s]["length"], t))) for b in batches)
    n = len(batches) * cfg.data.batch_size
    out[s] = {"kept_len": t, "capacity": cap[s], "padded_fill": real / (n * t),
              "capacity_fill": real / (len(batches) * cap[s])}
  return out


def git_commit() -> str:
  """The commit of the tree the model code was imported from (PYTHONPATH may point elsewhere)."""
  here = os.path.dirname(os.path.abspath(pallas_kernels.__file__))
  r = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True,
                     text=True, check=False)
  return r.stdout.strip() or "?"


def main(argv):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("presets", nargs="*", default=["tiny", "dev"], choices=sorted(PRESETS))
  ap.add_argument("--batch", type=int, default=64)
  ap.add_argument("--steps", type=int, default=5, help="distinct batches per layout")
  ap.add_argument("--repeats", type=int, default=5, help="interleaved passes over the batches")
  ap.add_argument("--what", default="loss_grad,train_step",
                  help="comma list of loss_grad, train_step")
  ap.add_argument("--tag", default="latest", help="key of this run in the JSON's runs")
  ap.add_argument("--out", default=None, help="JSON (default bench/results/jagged_speed_cpu.json)")
  a = ap.parse_args(argv)
  what = [w for w in a.what.split(",") if w]
  bad = [w for w in what if w not in ("loss_grad", "train_step")]
  if bad or not what:
    ap.error(f"--what: unknown {bad or what}; allowed: loss_grad, train_step")
  path = result_path("jagged_speed_cpu", False, a.out)
  try:
    with open(path) if os.path.exists(path) else contextlib.nullcontext(None) as f:
      doc = json.load(f) if f else {}
  except ValueError as e:
    ap.error(f"--out {path}: not a JSON file of this script ({e})")
  run_doc = {"commit": git_commit(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
             "device": {"platform": jax.devices()[0].platform, "kind": jax.devices()[0].device_kind,
                        "cpus": os.cpu_count(), "machine": platform.machine(),
                        "load_avg_1m_start": os.getloadavg()[0]},
             "versions": versions(), "batch": a.batch, "steps": a.steps, "repeats": a.repeats,
             "presets": {}}
  print(f"{'preset':7} {'what':10} {'batch':>5} {'padded ex/s':>12} {'packed ex/s':>12} "
        f"{'speed-up':>8}  fills (real / B*T)")
  for name in a.presets:
    cfg = PRESETS[name].get_config()
    cfg.data.batch_size = a.batch
    with tempfile.TemporaryDirectory() as d:
      synthetic.generate(d, cfg.data.preset, num_examples=max(4096, a.batch * (a.steps + 1)))
      schema, lens = load_schema(d), seq_lens(cfg)
      cfg.data.jagged_capacity = "auto"
      cap = jagged_capacity(cfg.data, d, "train", lens, 1)
      batches = {layout: first_batches(cfg, d, lens, a.steps, c)
                 for layout, c in (("padded", None), ("packed", cap))}
    entry = {"capacity": dict(cap), "kept_len": dict(lens),
             "fills": fills(cfg, lens, batches["padded"], cap)}
    for w in what:
      if w == "loss_grad":
        runs = {layout: loss_grad(cfg, schema, batches[layout]) for layout in LAYOUTS}
      else:
        runs = {}
        for layout in LAYOUTS:
          c = PRESETS[name].get_config()
          c.data.batch_size = a.batch
          c.data.jagged_capacity = ",".join(f"{s}={n}" for s, n in cap.items()) if (
              layout == "packed") else ""
          runs[layout] = train_step(c, batches[layout])
      times = measure(runs, batches, a.repeats)
      med = {layout: float(np.median(t)) for layout, t in times.items()}
      entry[w] = {f"{layout}_median_s": med[layout] for layout in LAYOUTS}
      entry[w].update({f"{layout}_ex_per_s": a.batch / med[layout] for layout in LAYOUTS})
      entry[w]["speedup"] = med["padded"] / med["packed"]
      entry[w]["steps_timed"] = len(times["padded"])
      print(f"{name:7} {w:10} {a.batch:5d} {a.batch / med['padded']:12.1f} "
            f"{a.batch / med['packed']:12.1f} {entry[w]['speedup']:8.2f}  "
            + ", ".join(f"{s} {f['padded_fill']:.2f}" for s, f in entry["fills"].items()),
            flush=True)
    run_doc["presets"][name] = entry
  run_doc["device"]["load_avg_1m_end"] = os.getloadavg()[0]
  doc.setdefault("runs", {})[a.tag] = run_doc
  write_json(path, doc)
  print(f"wrote {path} (runs[{a.tag!r}])")


if __name__ == "__main__":
  main(sys.argv[1:])
