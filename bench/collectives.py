"""Per-step collective bytes per device, from the compiled HLO of one train step, per preset.

  JAX_PLATFORMS=cpu python -m bench.collectives --config mid [--presets fsdp,5d] [--layers 1]

Compiles (never runs) ``value_and_grad`` + SGD of the Kunlun model on 8 CPU devices for each rule
preset and sums, per collective kind, the bytes one device sends (ring estimates from
``sharding.checks.collectives``). Next to it: the analytic minimum of the *parameter* traffic for
the same layout (sharding/checks.py conventions):

  * a parameter (b bytes, n shards) sharded ZeRO-style over axes of total size g (every shard
    axis except ``tensor`` and an expert dimension's ``expert``) must be all-gathered and its
    gradient reduce-scattered: 2 (g - 1) b / n;
  * a parameter replicated over batch axes of size r needs a gradient all-reduce:
    2 (r - 1) / r * b / n;
  * embedding tables (rows on every device) and activation traffic (TP / CP / EP) are not in the
    minimum: the tables need only the looked-up rows, activations depend on the layout.

Notes: XLA:CPU lowers gradient reductions as all-reduce (+ slice) where GPU emits
reduce-scatter, so measured FSDP bytes on CPU exceed the minimum by about the gradient half;
compute dtype bf16 gathers may also be cast before the gather. Results go to
``bench/results/collectives_<config>.json``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import time

DEFAULT_MESH = {"dp": "data=2,fsdp=4", "fsdp": "fsdp=8", "fsdp_tp": "fsdp=4,tensor=2",
                "fsdp_cp": "fsdp=4,context=2", "fsdp_ep": "fsdp=4,expert=2",
                "5d": "fsdp=2,tensor=2,expert=2"}


def analytic_param_bytes(params, mesh, rules) -> dict:
  """Minimum per-device parameter traffic of one step (see module doc), split by kind.

  A parameter is gathered over every axis that shards it except ``tensor`` (the compute is split
  there too) and ``expert`` on a leading expert dimension; its gradient is all-reduced over the
  batch axes that do not shard it.
  """
  import jax

  from sharding.partition import batch_spec
  bx = batch_spec(rules)[0]
  bx = set(() if bx is None else (bx,) if isinstance(bx, str) else bx)
  as_t = lambda e: (e,) if isinstance(e, str) else (e or ())
  fsdp = replica = 0.0
  for path, x in jax.tree_util.tree_leaves_with_path(params):
    if "embedding" in jax.tree_util.keystr(path):
      continue
    b = x.size * x.dtype.itemsize
    spec = tuple(x.sharding.spec)
    axes = {a for e in spec for a in as_t(e)}
    n = math.prod(mesh.shape[a] for a in axes)
    gather = axes - {"tensor"} - ({"expert"} if spec and as_t(spec[0]) == ("expert",) else set())
    g = math.prod(mesh.shape[a] for a in gather)
    r = math.prod(mesh.shape[a] for a in bx - axes)
    fsdp += 2 * (g - 1) * b / n
    replica += 2 * (r - 1) / r * b / n
  return {"fsdp_gather_scatter": fsdp, "grad_allreduce": replica, "total": fsdp + replica}


def bench(config_name: str, presets, batch_size: int, layers: int | None) -> dict:
  import jax
  jax.config.update("jax_num_cpu_devices", 8)
  import optax

  from data.fake import random_batch
  from data.synthetic import PRESETS, preset_schema
  from kunlun.config import seq_lens
  from kunlun.losses import masked_bce
  from kunlun.model import build_model
  from sharding import checks, partition
  from sharding import mesh as M
  from sharding import rules as R

  cfg = importlib.import_module(f"kunlun.configs.{config_name}").get_config()
  if layers is not None:   # stand-in: fewer layers, tower depths clipped to match
    cfg.model.num_layers = layers
    for t in list(cfg.model.towers.keys()):
      cfg.model.towers[t].depth = min(cfg.model.towers[t].depth, layers)
    if "oneseq" in cfg.model and cfg.model.oneseq is not None and "depth" in cfg.model.oneseq:
      cfg.model.oneseq.depth = min(cfg.model.oneseq.depth, layers)
  cfg.model.backend = "xla"
  schema = preset_schema(PRESETS[cfg.data.preset])
  model = build_model(cfg, schema)
  batch = random_batch(schema, batch_size, seq_lens(cfg), seed=0, min_len=1)
  tx = optax.sgd(0.1)

  def step(params, opt, batch):
    def loss_fn(p):
      logits = model.apply({"params": p}, batch, train=True)
      return masked_bce(logits, batch["labels"], batch["label_mask"], None)[0]
    loss, g = jax.value_and_grad(loss_fn)(params)
    u, opt = tx.update(g, opt, params)
    return optax.apply_updates(params, u), opt, loss

  out = {"config": config_name, "num_layers": int(cfg.model.num_layers),
         "global_batch": batch_size, "devices": 8, "presets": {}}
  for name in presets:
    t0 = time.time()
    mesh, rules = M.make_mesh(M.parse_mesh_flag(DEFAULT_MESH[name])), R.get_rules(name)
    params = partition.abstract_params(model, jax.random.key(0), batch, mesh, rules)
    opt = jax.eval_shape(tx.init, params)
    bs = partition.batch_sharding(mesh, rules)
    b = jax.tree.map(lambda x, bs=bs: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=bs), batch)
    with partition.activate(mesh, rules):
      compiled = jax.jit(step).lower(params, opt, b).compile()
    summary = checks.collective_summary(compiled.as_text())
    measured = sum(v["wire_bytes"] for v in summary.values())
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    out["presets"][name] = {
        "mesh": DEFAULT_MESH[name],
        "param_bytes": param_bytes,
        "replicated_fraction": checks.replicated_fraction(params),
        "collectives": summary,
        "measured_wire_bytes_per_device": measured,
        "analytic_min_param_bytes_per_device": analytic_param_bytes(params, mesh, rules),
        "memory_per_device": checks.memory_per_device(compiled),
        "compile_s": round(time.time() - t0, 1),
    }
    pmin = out["presets"][name]["analytic_min_param_bytes_per_device"]["total"]
    print(f"{name:8s} {DEFAULT_MESH[name]:28s} measured {measured / 2**20:9.2f} MiB/device  "
          f"param-min {pmin / 2**20:9.2f} MiB  "
          f"({time.time() - t0:.0f}s)", flush=True)
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--config", default="mid", help="a module of kunlun.configs (tiny, dev, mid)")
  ap.add_argument("--presets", default=",".join(DEFAULT_MESH), help="comma-separated presets")
  ap.add_argument("--batch", type=int, default=64, help="global batch (static shapes only)")
  ap.add_argument("--layers", type=int, default=None, help="override num_layers (stand-in)")
  ap.add_argument("--out", default=None)
  a = ap.parse_args(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  presets = [p for p in a.presets.split(",") if p]
  bad = [p for p in presets if p not in DEFAULT_MESH]
  if bad:
    raise SystemExit(f"unknown presets {bad}; allowed: {list(DEFAULT_MESH)}")
  res = bench(a.config, presets, a.batch, a.layers)
  suffix = f"_L{a.layers}" if a.layers is not None else ""
  path = a.out or os.path.join(os.path.dirname(__file__), "results",
                               f"collectives_{a.config}{suffix}.json")
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    json.dump(res, f, indent=1)
  print("wrote", path)


if __name__ == "__main__":
  main()
