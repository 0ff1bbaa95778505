"""Dense vs sparse row-wise Adagrad on one embedding table, per step (the table side of
``config.train.sparse_embedding_update``), and the optimizer's bytes of one compiled train step
with every table at 10^5 / 10^7 rows (``--step_bytes``: compiled, not run).
  JAX_PLATFORMS=cpu python -m bench.embedding_update [--rows 65536,262144,1048576] [--dim 64]
      [--ids 4096] [--reps 10] [--quick] [--train_step tiny --batch_size 64]
  JAX_PLATFORMS=cpu python -m bench.embedding_update --step_bytes 100000,10000000 [--batch_size 64]
Notes: docs/guides/benchmarks.md, ``bench/embedding_update.py``."""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from bench.output import at_least, int_list
from bench.profiling import hlo_stats, roofline
from bench.train_step import load_config
from data.fake import random_batch, tiny_schema
from kunlun.configs.types import seq_lens
from kunlun.models.build import build_model
from kunlun.train import optim, step
from kunlun.train.optim import rowwise_adagrad
from kunlun.train.sparse_update import make_sparse_update
from kunlun.utils import atomic
from sharding import mesh as mesh_lib
from sharding import partition
from sharding import rules as rules_lib
from sharding.embedding import sparse_adagrad_update


def _zipf_ids(rng, n, rows, a=1.2):
  return ((rng.zipf(a, n) - 1) % rows).astype(np.int32)


def bench_one(rows: int, dim: int, n_ids: int, reps: int, lr: float = 0.05) -> dict:
  rng = np.random.default_rng(0)
  ids = jnp.asarray(_zipf_ids(rng, n_ids, rows))
  g = jnp.asarray(rng.normal(size=(n_ids, dim)).astype(np.float32))
  tx = rowwise_adagrad(lr)

  def dense(table, acc, ids, g):
    grad = jnp.zeros_like(table).at[ids].add(g)
    upd, st = tx.update(grad, type(tx.init(table))(acc))
    return optax.apply_updates(table, upd), st.acc

  def sparse(table, acc, ids, g):
    return sparse_adagrad_update(table, acc, ids, g, lr)

  out = {"rows": rows, "dim": dim, "ids": n_ids, "touched": int(np.unique(np.asarray(ids)).size),
         "table_mb": rows * dim * 4 / 2 ** 20}
  results, table0 = {}, rng.normal(size=(rows, dim)).astype(np.float32)
  for name, fn in (("dense", dense), ("sparse", sparse)):
    table = jnp.asarray(table0)
    acc = jnp.zeros((rows,), jnp.float32)
    f = jax.jit(fn, donate_argnums=(0, 1))
    compiled = f.lower(table, acc, ids, g).compile()
    mem = compiled.memory_analysis()
    table, acc = f(table, acc, ids, g)                      # warm-up
    jax.block_until_ready(table)
    times = []
    for _ in range(reps):
      t0 = time.perf_counter()
      table, acc = f(table, acc, ids, g)
      jax.block_until_ready((table, acc))
      times.append(time.perf_counter() - t0)
    results[name] = (table, acc)
    out[f"{name}_ms"] = 1e3 * float(np.median(times))
    out[f"{name}_temp_mb"] = (mem.temp_size_in_bytes / 2 ** 20) if mem is not None else None
  # same start, same updates: the two variants must agree (sanity, not a test)
  (td, ad), (ts, as_) = results["dense"], results["sparse"]
  out["max_abs_diff"] = float(jnp.max(jnp.abs(td - ts)))
  out["acc_max_abs_diff"] = float(jnp.max(jnp.abs(ad - as_)))
  out["speedup"] = out["dense_ms"] / out["sparse_ms"]
  return out


def bench_train_step(config: str, batch_size: int, reps: int) -> dict:
  """Step time of the whole train step, dense vs sparse embedding update (one device)."""
  cfg, schema = load_config(config, []), tiny_schema()
  model = build_model(cfg, schema)
  batch = random_batch(schema, batch_size, seq_lens(cfg), seed=1, min_len=1)
  params = nn.meta.unbox(jax.jit(lambda k: model.init(k, batch, train=False))(
      jax.random.key(0))["params"])
  tx = optim.make_optimizer(cfg.train, 1000)
  out = {"config": config, "batch_size": batch_size, "schema": "tiny",
         "table_rows": sum(int(x.shape[0]) for k, x in jax.tree_util.tree_leaves_with_path(params)
                           if "embedding" in jax.tree_util.keystr(k))}
  for name, su in (("dense", None), ("sparse", make_sparse_update(cfg.train, 1000))):
    f = step.make_train_step(model, tx, sparse_update=su)
    p, o = jax.tree.map(np.asarray, params), tx.init(params)
    t0 = time.perf_counter()
    p, o, s = f(p, o, batch, jax.random.key(1), 0)
    jax.block_until_ready(p)
    out[f"{name}_compile_s"] = time.perf_counter() - t0
    times = []
    for i in range(reps):
      t0 = time.perf_counter()
      p, o, s = f(p, o, batch, jax.random.key(1), i + 1)
      jax.block_until_ready((p, o))
      times.append(time.perf_counter() - t0)
    out[f"{name}_ms"] = 1e3 * float(np.median(times))
  return out


def _schema_with_rows(rows: int):
  """``tiny_schema`` with every table (sparse features, event items) at ``rows`` rows."""
  s = tiny_schema()
  return dataclasses.replace(
      s, sparse=tuple(dataclasses.replace(f, vocab_size=rows) for f in s.sparse),
      streams=tuple(dataclasses.replace(st, item_vocab=rows) for st in s.streams))


def step_bytes(config: str, rows: int, sparse: bool, batch_size: int) -> dict:
  """Bytes of one train step of ``config`` with every table at ``rows`` rows, compiled (not run)
  on one device: the ``optimizer`` scope's and the whole step's by ``bench.profiling.roofline``'s
  accounting (the ops' read + written bytes; an in-place scatter into a donated table or its
  state charged the rows it touches), XLA's cost analysis of the whole step, and the compiled
  temp bytes."""
  cfg = load_config(config, [])
  cfg.train.sparse_embedding_update = sparse
  schema = _schema_with_rows(rows)
  model = build_model(cfg, schema)
  batch = random_batch(schema, batch_size, seq_lens(cfg), seed=1, min_len=1)
  mesh = mesh_lib.make_mesh({"data": 1}, devices=jax.devices()[:1])
  rules = rules_lib.get_rules(cfg.sharding.rules)
  ts, params, opt_state = step.build(cfg, model, batch, mesh, rules, jax.random.key(0),
                                     abstract=True)
  with partition.activate(mesh, rules):
    compiled = ts.fn.lower(params, opt_state, batch, jax.random.key(1),
                           jnp.asarray(0, jnp.int32)).compile()
  text = compiled.as_text()
  costs = roofline.op_costs(text)
  nbytes = lambda c: (c["bytes_in"] + c["bytes_out"]) * c["times"]
  opt = [c for c in costs if hlo_stats.scope_group(c["op_name"]) == "optimizer"]
  cost = compiled.cost_analysis()
  cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
  mem = compiled.memory_analysis()
  tables = [x for k, x in jax.tree_util.tree_leaves_with_path(params)
            if "embedding" in jax.tree_util.keystr(k)]
  return {"rows": rows, "update": "sparse" if sparse else "dense", "tables": len(tables),
          "table_mb": sum(x.size * x.dtype.itemsize for x in tables) / 2 ** 20,
          "optimizer_mb": sum(map(nbytes, opt)) / 2 ** 20, "optimizer_ops": len(opt),
          "step_mb": sum(map(nbytes, costs)) / 2 ** 20,
          "xla_bytes_accessed_mb": float(cost.get("bytes accessed", 0.0)) / 2 ** 20,
          "temp_mb": mem.temp_size_in_bytes / 2 ** 20 if mem is not None else None}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--rows", type=int_list(1), default=[65536, 262144, 1048576])
  ap.add_argument("--dim", type=at_least(1), default=64)
  ap.add_argument("--ids", type=at_least(1), default=4096,
                  help="looked-up ids per step (batch x slots)")
  ap.add_argument("--reps", type=at_least(1), default=10)
  ap.add_argument("--quick", action="store_true", help="small tables, 3 reps (smoke run)")
  ap.add_argument("--train_step", default=None, metavar="CONFIG",
                  help="also time the whole train step of this config (e.g. tiny; tiny schema)")
  ap.add_argument("--batch_size", type=at_least(1), default=64, help="batch for --train_step")
  ap.add_argument("--step_bytes", type=int_list(1), default=None, metavar="ROWS,ROWS",
                  help="only: the optimizer's bytes of one compiled --config train step with "
                       "every table at these rows, dense vs sparse update")
  ap.add_argument("--config", default="tiny", help="config of --step_bytes (tiny schema)")
  ap.add_argument("--out", default=None,
                  help="JSON (default bench/results/embedding_update[_step_bytes].json)")
  a = ap.parse_args(argv)
  for name in {a.config, a.train_step} - {None}:
    load_config(name, [])                   # an unknown preset: one line, before the work
  results_dir = os.path.join(os.path.dirname(__file__), "results")
  if a.step_bytes:
    run_step_bytes(a, a.step_bytes,
                   a.out or os.path.join(results_dir, "embedding_update_step_bytes.json"))
    return
  a.out = a.out or os.path.join(results_dir, "embedding_update.json")
  rows = [4096, 16384] if a.quick else a.rows
  reps = 3 if a.quick else a.reps

  res = [bench_one(r, a.dim, a.ids, reps) for r in rows]
  hdr = (f"{'rows':>9} {'table MB':>9} {'touched':>8} {'dense ms':>9} {'sparse ms':>10} "
         f"{'speedup':>8} {'dense tmp MB':>13} {'sparse tmp MB':>14} {'max |diff|':>10}")
  print(f"device {jax.devices()[0].platform}, dim {a.dim}, {a.ids} ids/step (Zipf 1.2), "
        f"median of {reps}")
  print(hdr)
  for r in res:
    print(f"{r['rows']:>9} {r['table_mb']:>9.1f} {r['touched']:>8} {r['dense_ms']:>9.2f} "
          f"{r['sparse_ms']:>10.2f} {r['speedup']:>8.1f} {r['dense_temp_mb'] or 0:>13.1f} "
          f"{r['sparse_temp_mb'] or 0:>14.1f} {r['max_abs_diff']:>10.1e}")
  step_res = None
  if a.train_step:
    step_res = bench_train_step(a.train_step, a.batch_size, reps)
    print(f"train step {a.train_step} (batch {a.batch_size}, {step_res['table_rows']} table rows): "
          f"dense {step_res['dense_ms']:.1f} ms, sparse {step_res['sparse_ms']:.1f} ms "
          f"(compile {step_res['dense_compile_s']:.0f} s / {step_res['sparse_compile_s']:.0f} s)")
  meta = {"device": jax.devices()[0].platform, "cpus": os.cpu_count(),
          "machine": platform.machine(), "load_avg": list(os.getloadavg()), "quick": a.quick,
          "dim": a.dim, "ids_per_step": a.ids, "reps": reps, "results": res,
          "train_step": step_res}
  atomic.write_json(a.out, meta)
  print(f"wrote {a.out}")


def run_step_bytes(a, rows: list[int], out: str) -> None:
  """``--step_bytes``: the table of ``step_bytes`` over rows x (dense, sparse) and its JSON."""
  res = [step_bytes(a.config, r, sparse, a.batch_size) for r in rows for sparse in (False, True)]
  print(f"{a.config}, batch {a.batch_size}, one device ({jax.devices()[0].platform}), compiled "
        "step; MB = 2^20 bytes; optimizer: read + written by its ops (bench/profiling/roofline; "
        "in-place scatters: their rows)")
  print(f"{'rows':>9} {'update':>6} {'tables MB':>10} {'optimizer MB':>13} "
        f"{'step MB':>9} {'XLA bytes MB':>13} {'temp MB':>8}")
  for r in res:
    print(f"{r['rows']:>9} {r['update']:>6} {r['table_mb']:>10.1f} {r['optimizer_mb']:>13.1f} "
          f"{r['step_mb']:>9.1f} "
          f"{r['xla_bytes_accessed_mb']:>13.1f} {r['temp_mb'] or 0:>8.1f}")
  ratio = {}
  for upd in ("dense", "sparse"):
    mb = [r["optimizer_mb"] for r in res if r["update"] == upd]
    ratio[upd] = mb[-1] / mb[0]
    print(f"{upd}: optimizer bytes at {rows[-1]} rows / at {rows[0]} rows = {ratio[upd]:.3f}")
  atomic.write_json(out, {
      "device": jax.devices()[0].platform, "target": "cpu (XLA:CPU compile)",
      "versions": {"jax": jax.__version__, "python": platform.python_version()},
      "config": a.config, "schema": "tiny, every table at rows", "batch_size": a.batch_size,
      "optimizer_bytes_ratio_largest_to_smallest": ratio, "results": res})
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
