"""Throughput, memory and structure of the real train step for one config / backend / mesh / batch.

  python -m bench.train_step --config mid --backend triton --batch 1024          # GPU
  python -m bench.train_step --config mid --batch 4096 --set train.remat=full --compile_only
  python -m bench.train_step --small                                            # CPU smoke run
  python -m bench.train_step --table bench/results/train_step_*.json            # compare runs
  python -m bench.train_step --config mid --batch 256 --target h200 --jagged    # packed towers
  python -m bench.train_step --config mid --backend pallas --batch 256 --target h200   # GPU
      program compiled here without a GPU (run with .venv-gpu/bin/python, which
      bash scripts/setup.sh --gpu-compile makes; bench/profiling/gpu_target.py): kernels, bytes,
      FLOPs, peak memory, roofline

Builds the model, optimizer and train step with ``kunlun.train.step.build``, as train.py does
(parameter / optimizer-state / batch shardings on the mesh, donated state), feeds a synthetic
in-memory batch (``data.fake.random_batch``; sequence lengths drawn like the synthetic data
preset's, see ``--lengths``) and reports:

  compile_s           lower + compile of the step (AOT; the timed steps reuse it); compile_cpu_s:
                      the process CPU time of it (all threads; steadier on a shared machine)
  step_ms             median of per-step times (each step blocked), and ``pipelined_ms``: N steps
                      dispatched back to back / N (what a loop with lagged metrics sees)
  examples_per_s      global batch / pipelined step time
  mfu_analytic        ``kunlun.models.flops`` train FLOPs at the padded kept lengths (issue 11)
                      / (step time x devices x peak bf16); ``mfu_actual_lengths``: model FLOPs at
                      the batch's actual lengths (``kunlun.models.flops.batch_flops``, as train.py)
  mfu_xla             XLA's compiled cost analysis (per device, after partitioning; counts remat
                      recomputation, and custom calls (Pallas / Triton kernels) as 0 unless they
                      carry a cost estimate) / (step time x peak)
  memory              compiled memory analysis per device (argument, output, temp, alias, peak
                      estimate, peak per example) and, on GPU, the allocator's live peak
  hlo                 HLO instructions, top-level ops, fusions, kernel launches (bench/hlo_stats)
  roofline            bytes read + written and FLOPs of every launched op, by named scope x tower,
                      with a second "kernel" column where a GPU kernel replaces a scope (GDPA, the
                      fused softmax attention; analytic kernel bytes), FLOP/byte, launches and the
                      lower bound max(FLOPs / peak, bytes / bandwidth) + launches x launch cost
                      (``--peak_flops``, ``--bandwidth``, ``--launch_us``; H200 defaults),
                      and each group's compulsory bytes beside its compiled ones (the floor:
                      ``roofline.group_floors``: what it receives and hands on, once per pass);
                      bench/profiling/roofline.py says what is counted. On CPU the compiled
                      program is a
                      stand-in for the GPU's (the table says so)
  param_casts         parameter leaves the model casts to a 16-bit compute dtype and at how many
                      sites (bench/profiling/param_casts.py; one site each = cast once per step),
                      and how many of them the optimizer state holds 16-bit copies of (the step
                      reads those: no cast; ``train.param_copies``)
  useful              padded vs packed like for like (``--jagged``: the batch packed by
                      ``data.pipeline.pack_batch`` at train.py's capacity rule or stream=N,...):
                      tokens, real events, useful (actual-length) / compiled FLOPs, roofline bytes
                      per real event, useful-MFU bound; ``--table`` pairs them (issue #28 targets)
  profile             (--profile) device time per named-scope group (GDPA, PFFN, HSP, attention,
                      MoWE, embeddings, optimizer, ...) and the top ops, from a short trace
                      (kept for a profiler in ``--trace_dir``, default a new temp folder; its
                      path is ``profile.trace_dir``)

``--target h200`` / ``h100`` compiles the step deviceless for that GPU (XLA:GPU's scheduled
program, its memory analysis, Pallas kernels through Triton and ptxas; no autotuning) and
reports the same tables for it; ``--dump_dir`` adds the thunk sequence's kernel count as a
cross-check (deviceless sorts fall back to multi-kernel sorts).
``--compile_only`` stops after compilation (memory and structure without running: how the CPU
shows the memory of a GPU-sized batch). JSON goes to ``bench/results/train_step_<name>.json``;
a table is printed. Timings on a shared CPU are noisy: compare counts and bytes there.
"""

from __future__ import annotations

import argparse
import ast
import glob
import importlib
import json
import math
import os
import platform
import re
import statistics
import sys
import time

from kunlun.configs.fields import BACKENDS

_HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(_HERE, "results")


def config_presets() -> list[str]:
  """The modules of ``kunlun/configs`` that define ``get_config`` (``--config`` NAME)."""
  folder = importlib.util.find_spec("kunlun.configs").submodule_search_locations[0]
  out = []
  for f in sorted(glob.glob(os.path.join(folder, "*.py"))):
    with open(f) as fh:
      if re.search(r"^def get_config\(", fh.read(), re.M):
        out.append(os.path.basename(f)[:-3])
  return out


def load_config(name: str, overrides: list[str]):
  """A preset module name (``mid``) or a path to a config file, then ``a.b=value`` overrides;
  a name that is neither, or an override of a field the config lacks, is a one-line error."""
  if name.endswith(".py"):
    if not os.path.isfile(name):
      raise SystemExit(f"--config {name}: no such file")
    spec = importlib.util.spec_from_file_location("bench_cfg", name)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if not hasattr(mod, "get_config"):
      raise SystemExit(f"--config {name}: the file defines no get_config()")
  elif name in config_presets():
    mod = importlib.import_module(f"kunlun.configs.{name}")
  else:
    raise SystemExit(f"--config {name}: not a preset of kunlun/configs "
                     f"({', '.join(config_presets())}) nor a .py file")
  cfg = mod.get_config()
  for o in overrides:
    key, _, raw = o.partition("=")
    if not _:
      raise SystemExit(f"--set {o!r}: expected key=value")
    try:
      val = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
      val = raw
    *path, last = key.split(".")
    parent = cfg
    try:
      for p in path:
        parent = parent[p]
      parent[last]
    except (KeyError, TypeError, AttributeError):
      raise SystemExit(f"--set {o}: the config has no field {key}") from None
    with parent.ignore_type():
      parent[last] = val
  return cfg


def clip_layers(cfg, layers: int) -> None:
  """Stand-in with fewer Kunlun layers: tower depths clipped to match."""
  cfg.model.num_layers = layers
  for t in list(cfg.model.towers.keys()):
    cfg.model.towers[t].depth = min(cfg.model.towers[t].depth, layers)
  if "oneseq" in cfg.model and cfg.model.oneseq is not None:
    cfg.model.oneseq.depth = min(cfg.model.oneseq.depth, layers)


def synthetic_batch(schema, batch_size: int, seq_lens: dict, lengths: str, seed: int = 0):
  """``data.fake.random_batch`` with stream lengths ``draw_lengths(..., seed + 1)``."""
  import numpy as np

  from data.fake import random_batch
  b = random_batch(schema, batch_size, seq_lens, seed=seed, min_len=1)
  if lengths == "uniform":
    return b
  for s, L in draw_lengths(schema, seq_lens, batch_size, lengths, seed + 1).items():
    ev = b["events"][s]
    valid = np.arange(ev["item"].shape[1])[None, :] < L[:, None]
    for k in ev:
      if k != "length":
        ev[k] = np.where(valid, ev[k], 0).astype(ev[k].dtype)
    ev["length"] = L
  return b


def draw_lengths(schema, seq_lens: dict, n: int, lengths: str, seed: int) -> dict:
  """{stream: i32[n]} lengths ``full`` (= kept length T), ``uniform`` (1..T) or ``preset``
  (lognormal around the synthetic data preset's median, as ``data.synthetic`` draws them,
  truncated to 1..T)."""
  import numpy as np
  rng = np.random.default_rng(seed)
  medians = _preset_medians(schema)
  out = {}
  for s in schema.streams:
    T = seq_lens.get(s.name, s.max_len)
    if lengths == "full":
      L = np.full(n, T)
    elif lengths == "uniform":
      L = rng.integers(1, T + 1, n)
    else:
      med = medians.get(s.name, T / 4)
      L = np.clip(np.floor(rng.lognormal(np.log(med), 1.0, n)), 1, T)
    out[s.name] = L.astype(np.int32)
  return out


def jagged_capacity(spec: str | None, schema, seq_lens: dict, batch_size: int, lengths: str,
                    seed: int, shards: int = 1, buckets: int = 1) -> dict | None:
  """``--jagged``: None (padded), or {stream: N} from ``stream=N,...`` or ``auto`` (train.py's
  rule, ``kunlun.train.capacity.capacity_from_lengths``, on ``auto_capacity_sample`` lengths
  drawn like the batch's with another seed), in ``shards`` blocks (batch x context shards);
  ``auto`` with ``buckets`` K > 1 (``data.jagged_buckets``): {stream: (N_0, ..., N_{K-1})}."""
  from data.pipeline import check_jagged_buckets, check_jagged_capacity
  from kunlun.configs.fields import parse_capacity
  from kunlun.train import capacity
  if spec is None:
    return None
  try:
    value = parse_capacity(spec)
    if buckets > 1 and value != "auto":
      raise ValueError(f"--jagged_buckets {buckets} needs --jagged auto")
    if value == "auto":
      sample = draw_lengths(schema, seq_lens, capacity.auto_capacity_sample(batch_size), lengths,
                            seed + 7)
      value = capacity.capacity_from_lengths(sample, batch_size, shards, buckets)
    if buckets > 1:
      return check_jagged_buckets(seq_lens, value, shards)
    return check_jagged_capacity(seq_lens, value, shards) if value else None
  except ValueError as e:
    raise SystemExit(f"--jagged {spec}: {e}") from None


def bucket_batch(schema, batch_size: int, seq_lens: dict, lengths: str, seed: int, buckets: dict,
                 bucket: int, shards: int, tries: int = 10_000):
  """``(seed, batch)``: the first ``synthetic_batch`` from ``seed`` on that the pipeline would
  pack at ``bucket`` of ``buckets`` {stream: (N_0, ...)} (``data.jagged.pick_bucket``)."""
  from data import jagged
  for s in range(seed, seed + tries):
    L = draw_lengths(schema, seq_lens, batch_size, lengths, s + 1)   # synthetic_batch's lengths
    if jagged.pick_bucket({k: L[k] for k in buckets}, buckets, shards) == bucket:
      return s, synthetic_batch(schema, batch_size, seq_lens, lengths, seed=s)
  raise SystemExit(f"--jagged_bucket {bucket}: no batch of seeds {seed}..{seed + tries - 1} "
                   "takes that bucket")


def _preset_medians(schema) -> dict:
  from data.synthetic import PRESETS
  for p in PRESETS.values():
    names = {s.name: s for s in p.streams}
    if all(s.name in names and names[s.name].max_len == s.max_len for s in schema.streams):
      return {n: s.median_len for n, s in names.items()}
  return {}


def _cost(compiled) -> dict:
  c = compiled.cost_analysis()
  if isinstance(c, (list, tuple)):
    c = c[0] if c else {}
  c = c or {}
  get = lambda k: float(c.get(k, 0.0))
  return {"flops": get("flops"), "bytes_accessed": get("bytes accessed"),
          "transcendentals": get("transcendentals")}


def _actual_length_flops(config, schema, batch) -> float:
  """Model train FLOPs of the batch at its actual lengths (``kunlun.models.flops.batch_flops``)."""
  from kunlun.models.flops import batch_flops
  return float(batch_flops(config, schema, batch)["train_step"])


def versions() -> dict:
  import flax
  import jax
  import optax
  out = {"jax": jax.__version__, "jaxlib": jax.lib.__version__, "flax": flax.__version__,
         "optax": optax.__version__, "python": platform.python_version()}
  try:
    import jax_triton
    out["jax_triton"] = jax_triton.__version__
  except Exception:  # noqa: BLE001 - optional, GPU only
    pass
  from importlib import metadata
  for pkg in ("jax-cuda12-plugin", "jax-cuda12-pjrt", "nvidia-cuda-nvcc-cu12"):
    try:   # the deviceless GPU compiler (--target), when installed
      out[pkg] = metadata.version(pkg)
    except metadata.PackageNotFoundError:
      pass
  return out


def useful_figures(batch, seq_lens: dict, capacity, dropped: dict, flops_useful: float,
                   rl: dict) -> dict:
  """Padded vs packed like for like: tokens per stream (B x T padded, N packed), real (kept)
  events, events dropped over the capacity, useful FLOPs (model FLOPs at the actual lengths)
  over compiled FLOPs (the roofline's: HLO + Pallas kernel formulas), roofline bytes per real
  event, and the useful-MFU bound: useful FLOPs / (roofline bound x peak), XLA column."""
  import numpy as np
  B = len(batch["surface"])
  real = {s: int(np.sum(batch["events"][s]["length"])) for s in seq_lens}
  tokens = {s: (capacity or {}).get(s, B * T) for s, T in seq_lens.items()}
  n_real, x = sum(real.values()), rl["xla"]
  return {"tokens": tokens, "real_events": real, "dropped_events": dict(dropped),
          "fill": sum(real.values()) / max(sum(tokens.values()), 1),
          "flops_useful": flops_useful, "flops_compiled": rl["flops"],
          "useful_share": flops_useful / rl["flops"] if rl["flops"] else None,
          "bytes": x["bytes"], "bytes_per_real_event": x["bytes"] / max(n_real, 1),
          "bound_s": x["bound_s"],
          "useful_mfu_bound": flops_useful / (x["bound_s"] * rl["device"]["peak_flops"])}


def build_step(cfg, mesh, rules, batch_np, abstract: bool, remat_budget: int | None = None):
  """The real train step of ``cfg`` on ``mesh`` / ``rules`` as train.py builds it
  (``kunlun.train.step.build``), and its arguments: ``(jitted_step, model, params, opt_state,
  batch)``. ``abstract``: ShapeDtypeStructs with shardings (compile without initialising), else
  initialised arrays. ``train.remat=auto``: the policy ``step.pick_remat`` picks for
  ``remat_budget`` bytes per device (recorded as ``train.remat_picked`` / ``remat_peaks``)."""
  import jax

  from data.synthetic import PRESETS, preset_schema
  from kunlun.models.build import build_model
  from kunlun.train import step as step_lib

  schema = preset_schema(PRESETS[cfg.data.preset])
  model = build_model(cfg, schema)
  if cfg.train.get("remat", "none") == "auto":   # the least recompute that fits (train.py's)
    name, peaks = step_lib.pick_remat(lambda r: build_model(cfg, schema, r), cfg, batch_np, mesh,
                                      rules, jax.random.key(0), remat_budget)
    cfg.train.remat_picked = name
    cfg.train.remat_peaks = {k: int(v) for k, v in peaks.items()}
    model = build_model(cfg, schema, name)
  ts, params, opt_state = step_lib.build(cfg, model, batch_np, mesh, rules, jax.random.key(0),
                                         abstract=abstract)
  if abstract:
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                        sharding=ts.batch_sharding), batch_np)
  else:
    batch = jax.device_put(batch_np, ts.batch_sharding)
  return ts.fn, model, params, opt_state, batch


def run(args) -> dict:
  import jax
  import jax.numpy as jnp

  from bench.profiling import gpu_target, hlo_stats, param_casts, roofline
  from data import pipeline
  from data.synthetic import PRESETS, preset_schema
  from kunlun.configs import types as model_config
  from kunlun.models.flops import model_flops
  from kunlun.train import optim, progress
  from sharding import checks, partition
  from sharding import mesh as mesh_lib
  from sharding import packed as packed_sharding
  from sharding import rules as rules_lib

  cfg = load_config(args.config, args.set)
  if args.backend:
    cfg.model.backend = args.backend
  if args.batch:
    cfg.data.batch_size = args.batch
  if args.layers:
    clip_layers(cfg, args.layers)
  if args.rules:
    cfg.sharding.rules = args.rules
  B = int(cfg.data.batch_size)
  schema = preset_schema(PRESETS[cfg.data.preset])
  gpu = args.target != "cpu"
  if gpu:   # deviceless XLA:GPU compile of the target (bench/profiling/gpu_target.py)
    devices = gpu_target.gpu_devices(args.target, args.devices or 1)
    target = gpu_target.target_info(args.target, args.devices or 1)
    args.compile_only = True
  else:
    devices = jax.devices()[:args.devices] if args.devices else None
    target = {"name": args.target, "file": None, "deviceless": False}
  try:                               # the flags' errors name the flag, in one line
    mesh = mesh_lib.make_mesh(mesh_lib.parse_mesh_flag(args.mesh), devices=devices)
  except ValueError as e:
    raise SystemExit(f"--mesh {args.mesh}: {e}") from None
  try:
    rules = rules_lib.get_rules(cfg.sharding.rules)
  except ValueError as e:
    raise SystemExit(f"--rules {cfg.sharding.rules}: {e}") from None
  n_dev = mesh.devices.size
  if B % partition.batch_shard_count(mesh, rules):
    raise SystemExit(f"--batch {B} is not a multiple of the mesh's batch shards")
  seq_lens = model_config.seq_lens(cfg)
  batch_np = synthetic_batch(schema, B, seq_lens, args.lengths, seed=args.seed)
  shards = partition.batch_shard_count(mesh, rules) * packed_sharding.blocks_per_batch_shard(
      mesh, rules)                    # one process: a block per batch (x context) shard
  capacity = jagged_capacity(args.jagged, schema, seq_lens, B, args.lengths, args.seed, shards,
                             args.jagged_buckets)
  buckets = None
  if capacity and args.jagged_buckets > 1:     # one bucket's program, on a batch that takes it
    buckets = {s: list(c) for s, c in capacity.items()}
    args.seed, batch_np = bucket_batch(schema, B, seq_lens, args.lengths, args.seed, capacity,
                                       args.jagged_bucket, shards)
    capacity = {s: c[args.jagged_bucket] for s, c in capacity.items()}
  dropped = {}
  if capacity:     # packed as the input pipeline packs it; the model takes the packed path
    batch_np, dropped = pipeline.pack_batch(batch_np, capacity, shards)
    cfg.data.jagged_capacity = ",".join(f"{s}={n}" for s, n in capacity.items())
  t0 = time.perf_counter()
  budget = None
  if cfg.train.get("remat", "none") == "auto":
    from kunlun.train.step import device_memory
    memory = target.get("memory") if gpu else device_memory()
    budget = None if memory is None else int(memory * float(cfg.train.remat_memory))
  _progress("building the step (parameters, optimizer state, batch)")
  train_step, model, params, opt_state, batch = build_step(cfg, mesh, rules, batch_np,
                                                           args.compile_only, budget)
  init_s = time.perf_counter() - t0
  rng = jax.random.key(1)
  step0 = jnp.asarray(0, jnp.int32)

  _progress(f"compiling the train step for {target['name']}"
            + (" without a device (about 1 to 3 minutes at mid and prod)"
               if target.get("deviceless") else ""))
  with partition.activate(mesh, rules), roofline.record_kernels() as kernel_calls:
    t0, c0 = time.perf_counter(), time.process_time()
    lowered = train_step.lower(params, opt_state, batch, rng, step0)
    compiled = lowered.compile()
    compile_s, compile_cpu_s = time.perf_counter() - t0, time.process_time() - c0
  _progress(f"compiled in {compile_s:.0f} s; counting bytes, FLOPs and floors")
  device = mesh.devices.flat[0]
  flops_analytic = model_flops(cfg, schema)["train_step"] * B
  flops_actual = _actual_length_flops(cfg, schema, batch_np)
  cost = _cost(compiled)
  mem = checks.memory_per_device(compiled)
  local_b = B // n_dev if n_dev > 1 else B
  mem["peak_per_example"] = mem["peak_estimate"] / max(local_b, 1)
  mem["temp_per_example"] = mem["temp"] / max(local_b, 1)
  text = compiled.as_text()
  hlo = hlo_stats.hlo_stats(text)
  op_names = hlo.pop("op_names")
  towers = list(cfg.model.towers.keys()) + ["oneseq"]
  costs = roofline.op_costs(text)
  rl = roofline.roofline(costs, kernel_calls, towers, examples=B,
                         peak_flops=args.peak_flops, bandwidth=args.bandwidth,
                         launch_s=args.launch_us * 1e-6,
                         repeat=int(cfg.train.get("microbatches", 1)),
                         note=roofline.gpu_note(args.target, target["autotune_results"])
                         if gpu else roofline.CPU_NOTE)
  roofline.add_floors(rl, roofline.group_floors(text, costs))
  rl["flops_xla_cost_analysis"] = cost["flops"]
  with partition.activate(mesh, rules):
    casts = param_casts.summary(
        lambda p, b: model.apply({"params": p}, b, train=True, rngs={"dropout": rng}),
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params), batch_np)
  casts["copies"] = sum(c is not None for c in optim.state_copies(opt_state))
  rl["bytes_xla_cost_analysis"] = cost["bytes_accessed"]
  res = {
      "name": args.name or default_name(args, cfg),
      "layout": "packed" if capacity else "padded",
      "useful": useful_figures(batch_np, seq_lens, capacity, dropped, flops_actual, rl),
      "config": args.config, "backend": cfg.model.backend, "dtype": cfg.model.dtype,
      "remat": cfg.train.get("remat_picked", cfg.train.get("remat", "none")),
      "remat_auto": ({"budget": budget, "peaks": dict(cfg.train.remat_peaks)}
                     if "remat_peaks" in cfg.train else None),
      "remat_scope": cfg.train.get("remat_scope", "layer"),
      "microbatches": int(cfg.train.get("microbatches", 1)),
      "sparse_embedding_update": bool(cfg.train.get("sparse_embedding_update", False)),
      "mesh": mesh_lib.describe(mesh), "rules": cfg.sharding.rules, "devices": n_dev,
      "device_kind": device.device_kind, "platform": device.platform,
      "global_batch": B, "lengths": args.lengths, "seed": args.seed,
      "jagged_buckets": ({"count": args.jagged_buckets, "bucket": args.jagged_bucket,
                          "capacities": buckets} if buckets else None),
      "num_layers": int(cfg.model.num_layers),
      "versions": versions(),
      "params": int(sum(x.size for x in jax.tree.leaves(params))),
      "init_s": round(init_s, 2), "compile_s": round(compile_s, 2),
      "compile_cpu_s": round(compile_cpu_s, 2),
      "flops": {"analytic_padded": flops_analytic, "analytic_actual_lengths": flops_actual,
                "xla_per_device": cost["flops"], "xla_bytes_accessed_per_device":
                cost["bytes_accessed"]},
      "memory": mem, "hlo": hlo, "roofline": rl, "param_casts": casts,
      "kernel_calls": kernel_calls, "overrides": list(args.set),
      "target": target,
  }
  if gpu and args.dump_dir:
    res["thunks"] = gpu_target.thunk_kernels(args.dump_dir)
  if args.dump_hlo:
    with open(args.dump_hlo, "w") as f:
      f.write(text)
  if args.compile_only:
    return res

  peak = progress.device_peak_flops(device)
  with partition.activate(mesh, rules):
    p, o = params, opt_state
    for i in range(args.warmup):
      p, o, stats = compiled(p, o, batch, rng, jnp.asarray(i, jnp.int32))
    jax.block_until_ready((p, o))
    times = []
    for i in range(args.steps):
      t = time.perf_counter()
      p, o, stats = compiled(p, o, batch, rng, jnp.asarray(i, jnp.int32))
      jax.block_until_ready((p, o, stats))
      times.append(time.perf_counter() - t)
    t = time.perf_counter()
    for i in range(args.steps):
      p, o, stats = compiled(p, o, batch, rng, jnp.asarray(i, jnp.int32))
    jax.block_until_ready((p, o, stats))
    pipelined = (time.perf_counter() - t) / args.steps
    ok = bool(jax.device_get(stats["ok"]))
    prof = None
    if args.profile:
      prof = _profile(compiled, p, o, batch, rng, args.profile_steps, op_names,
                      args.trace_dir)
  med = statistics.median(times)
  res.update({
      "steps": args.steps, "warmup": args.warmup, "last_step_ok": ok,
      "step_ms": round(1e3 * med, 3), "step_ms_min": round(1e3 * min(times), 3),
      "pipelined_ms": round(1e3 * pipelined, 3),
      "examples_per_s": round(B / pipelined, 1),
      "peak_flops_per_device": peak,
      "tflops_per_device_analytic": flops_analytic / pipelined / n_dev / 1e12,
      "mfu_analytic": progress.mfu(flops_analytic, pipelined, n_dev, peak),
      "mfu_actual_lengths": progress.mfu(flops_actual, pipelined, n_dev, peak),
      "mfu_xla": progress.mfu(cost["flops"] * n_dev, pipelined, n_dev, peak),
  })
  if device.platform != "cpu":
    ms = device.memory_stats() or {}
    res["memory"]["live_peak_bytes"] = ms.get("peak_bytes_in_use")
    res["memory"]["live_bytes_limit"] = ms.get("bytes_limit")
  if prof is not None:
    res["profile"] = prof
  return res


def _profile(compiled, p, o, batch, rng, steps, op_names, trace_dir=None) -> dict:
  import tempfile

  import jax
  import jax.numpy as jnp

  from bench.profiling import hlo_stats
  if trace_dir:
    os.makedirs(trace_dir, exist_ok=True)
  d = tempfile.mkdtemp(prefix="train_step_trace_", dir=trace_dir or None)
  jax.profiler.start_trace(d)
  for i in range(steps):
    with jax.profiler.StepTraceAnnotation("train", step_num=i):
      p, o, _ = compiled(p, o, batch, rng, jnp.asarray(i, jnp.int32))
  jax.block_until_ready((p, o))
  jax.profiler.stop_trace()
  (path,) = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)[:1] or (None,)
  if path is None:
    return {"error": "no xplane.pb written"}
  out = hlo_stats.profile_groups(path, op_names, steps)
  out["trace_dir"] = d
  return out


def default_name(args, cfg) -> str:
  parts = [args.config.replace("/", "_").removesuffix(".py"), cfg.model.backend,
           f"b{cfg.data.batch_size}"]
  if args.layers:
    parts.append(f"L{args.layers}")
  remat = cfg.train.get("remat", "none")
  if remat != "none":
    parts.append(f"remat-{remat}")
    if cfg.train.get("remat_scope", "layer") != "layer":
      parts.append(cfg.train.remat_scope)
  if int(cfg.train.get("microbatches", 1)) > 1:
    parts.append(f"mb{cfg.train.microbatches}")
  if not cfg.train.sparse_embedding_update:             # the sparse table update is the default
    parts.append("dense-tables")
  if args.jagged is not None:
    parts.append("packed" if args.jagged_buckets == 1 else
                 f"packed-k{args.jagged_buckets}b{args.jagged_bucket}")
  if args.tag:
    parts.append(args.tag)
  return "_".join(parts)


COLUMNS = (("name", "{}", 34), ("compile_s", "{:.1f}", 8), ("step_ms", "{:.1f}", 8),
           ("examples_per_s", "{:.0f}", 9), ("mfu_analytic", "{:.1%}", 7),
           ("mfu_actual_lengths", "{:.1%}", 18), ("mfu_xla", "{:.1%}", 7),
           ("peak_GiB", "{:.2f}", 9), ("MiB/ex", "{:.2f}", 7), ("fusions", "{}", 7),
           ("launches", "{}", 8), ("hlo_ops", "{}", 7), ("GB/step", "{:.1f}", 7),
           ("krn_GB", "{:.1f}", 7), ("krn_F/B", "{:.1f}", 7), ("layout", "{}", 6),
           ("tokens", "{}", 7), ("real_ev", "{}", 7), ("fill", "{:.2f}", 5),
           ("useful_TF", "{:.3f}", 9), ("compiled_TF", "{:.3f}", 11), ("useful", "{:.2f}", 6),
           ("MB/event", "{:.3f}", 8), ("bound_ms", "{:.2f}", 8), ("useful_MFU_bound", "{:.1%}", 16))

# Issue #28's targets for packed towers (mid, H200 program): packed useful share, padded / packed
# bytes per real event, and the packed useful-MFU bound by global batch.
JAGGED_TARGETS = {"useful_share": 0.85, "bytes_per_event_ratio": 2.5,
                  "useful_mfu_bound": {256: 0.08, 1024: 0.12}}


# Issue #38's targets (fused tower layers; deviceless H200 program, 3 buckets over 2,000 batches,
# `auto`), by (config, global batch): useful-MFU bound, bytes per real event, launches per step;
# and every scope group within FLOOR_RATIO x its compulsory bytes (roofline.group_floors).
FUSED_TARGETS = {("mid", 256): {"useful_mfu_bound": 0.15, "launches_per_batch": 1200},
                 ("mid", 1024): {"useful_mfu_bound": 0.20, "bytes_per_real_event": 0.12e6},
                 ("prod", 1024): {"useful_mfu_bound": 0.35}}
FLOOR_RATIO = 2.5


def _row(r: dict) -> dict:
  m, h = r.get("memory", {}), r.get("hlo", {})
  live = m.get("live_peak_bytes")
  rl = r.get("roofline") or {}
  gb = lambda col: rl[col]["bytes"] / 1e9 if col in rl else None
  u = r.get("useful") or {}
  tf = lambda k: u[k] / 1e12 if k in u else None
  useful = {"tokens": sum(u["tokens"].values()) if u else None,
            "real_ev": sum(u["real_events"].values()) if u else None, "fill": u.get("fill"),
            "useful_TF": tf("flops_useful"), "compiled_TF": tf("flops_compiled"),
            "useful": u.get("useful_share"),
            "MB/event": u["bytes_per_real_event"] / 1e6 if u else None,
            "bound_ms": u["bound_s"] * 1e3 if u else None,
            "useful_MFU_bound": u.get("useful_mfu_bound")}
  return {**r, **useful, "peak_GiB": (live or m.get("peak_estimate", 0)) / 2**30,
          "GB/step": gb("xla"), "krn_GB": gb("kernel"),
          "krn_F/B": rl.get("kernel", {}).get("flop_per_byte"),
          "MiB/ex": m.get("peak_per_example", 0) / 2**20, "fusions": h.get("fusions"),
          "launches": h.get("kernel_launches"), "hlo_ops": h.get("hlo_instructions")}


def print_table(results, stream=None) -> None:
  stream = stream or sys.stdout
  head = " ".join(f"{c:>{w}}" if i else f"{c:<{w}}" for i, (c, _, w) in enumerate(COLUMNS))
  print(head, file=stream)
  for r in results:
    row = _row(r)
    cells = []
    for i, (c, fmt, w) in enumerate(COLUMNS):
      v = row.get(c)
      s = "-" if v is None else fmt.format(v)
      cells.append(f"{s:<{w}}" if i == 0 else f"{s:>{w}}")
    print(" ".join(cells), file=stream)
  print_layout_pairs(results, stream)
  for r in results:
    if "profile" in r and "by_group_ms" in r["profile"]:
      g = ", ".join(f"{k} {v:.2f}" for k, v in r["profile"]["by_group_ms"].items())
      print(f"{r['name']}: device ms/step by scope: {g}", file=stream)


def print_layout_pairs(results, stream) -> None:
  """Padded vs packed runs of the same config / backend / batch / target: the ratios against
  ``JAGGED_TARGETS``."""
  key = lambda r: (r.get("config"), r.get("backend"), r.get("global_batch"),
                   (r.get("target") or {}).get("name"), r.get("num_layers"))
  by = {(key(r), r.get("layout")): r for r in results if r.get("useful")}
  rows = [(k, by[(k, "padded")], by[(k, "packed")]) for k, lay in by if lay == "padded"
          and (k, "packed") in by]
  if not rows:
    return
  t = JAGGED_TARGETS
  print("\npadded -> packed (targets: issue #28)", file=stream)
  ok = lambda c: "met" if c else "MISSED"
  for (config, backend, B, target, _), rp, rq in rows:
    p, q = rp["useful"], rq["useful"]
    share, ratio = q["useful_share"], p["bytes_per_real_event"] / q["bytes_per_real_event"]
    mfu_t = t["useful_mfu_bound"].get(B)
    mfu = q["useful_mfu_bound"]
    print(f"{config} {backend} b{B} {target}: useful share {p['useful_share']:.2f} -> {share:.2f}"
          f" (>= {t['useful_share']}: {ok(share >= t['useful_share'])}); bytes per real event "
          f"{p['bytes_per_real_event'] / 1e6:.3f} -> {q['bytes_per_real_event'] / 1e6:.3f} MB, "
          f"{ratio:.2f}x lower (>= {t['bytes_per_event_ratio']}x: "
          f"{ok(ratio >= t['bytes_per_event_ratio'])}); useful-MFU bound "
          f"{p['useful_mfu_bound']:.1%} -> {mfu:.1%}"
          + (f" (>= {mfu_t:.0%}: {ok(mfu >= mfu_t)})" if mfu_t else ""), file=stream)
    gp, gq = rp["roofline"]["groups"], rq["roofline"]["groups"]
    for what, k, unit in (("GB", "bytes", 1e9), ("TFLOP", "flops", 1e12)):
      top = sorted(gq, key=lambda g: -gq[g][k])[:8]
      print(f"  {what} by scope group, padded -> packed: " + ", ".join(
          f"{g} {gp.get(g, {}).get(k, 0) / unit:.2f} -> {gq[g][k] / unit:.2f}" for g in top),
          file=stream)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--config", default=None,
                  help="kunlun.configs module (tiny, dev, mid, prod) or file (default: mid on a "
                       "GPU or a --target GPU; on a CPU host without --config, the --small run)")
  ap.add_argument("--backend", default=None, choices=BACKENDS, help="model.backend")
  ap.add_argument("--batch", type=int, default=None, help="global batch (default: the config's)")
  ap.add_argument("--mesh", default="data=1,fsdp=-1", help="mesh axis sizes (train.py --mesh)")
  ap.add_argument("--rules", default=None, help="sharding rule preset (default: the config's)")
  ap.add_argument("--devices", type=int, default=None, help="use the first N devices (default all)")
  ap.add_argument("--layers", type=int, default=None, help="fewer Kunlun layers (stand-in)")
  ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                  help="config override, e.g. train.remat=full (repeatable)")
  ap.add_argument("--lengths", default="preset", choices=("preset", "uniform", "full"))
  ap.add_argument("--jagged", nargs="?", const="auto", default=None, metavar="CAPACITY",
                  help="packed (jagged) event towers (data.jagged_capacity): auto (default: "
                       "train.py's rule on the lengths' distribution) or stream=N,...")
  ap.add_argument("--jagged_buckets", type=int, default=1, choices=(1, 2, 3, 4),
                  help="with --jagged auto: data.jagged_buckets (K static capacities); the step "
                       "is built for --jagged_bucket's, on the first batch from --seed on that "
                       "takes it (bench/jagged_buckets.py combines the K programs)")
  ap.add_argument("--jagged_bucket", type=int, default=0, help="which of the K buckets (0..K-1)")
  ap.add_argument("--steps", type=int, default=16)
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--compile_only", action="store_true")
  ap.add_argument("--profile", action="store_true", help="trace a few steps, group by scope")
  ap.add_argument("--profile_steps", type=int, default=3)
  ap.add_argument("--trace_dir", default=None,
                  help="--profile keeps its trace in a new folder under this one (default: the "
                       "system's temp folder)")
  ap.add_argument("--small", action="store_true",
                  help="CPU smoke run: tiny config, batch 16, one device")
  ap.add_argument("--name", default=None)
  ap.add_argument("--tag", default=None, help="suffix of the result name")
  ap.add_argument("--out_dir", default=RESULTS)
  ap.add_argument("--dump_hlo", default=None, help="write the compiled HLO text here")
  ap.add_argument("--table", nargs="*", default=None, help="print a table of result JSONs")
  ap.add_argument("--merge", nargs=2, default=None, metavar=("DIR", "OUT"),
                  help="write DIR's train_step_*.json as one JSON {runs: {name: run}} to OUT")
  ap.add_argument("--target", default="cpu",
                  help="compile for: cpu (this host, the stand-in) or h200 / h100 / a "
                       "GpuTargetConfig .txtpb (deviceless XLA:GPU compile; implies "
                       "--compile_only)")
  ap.add_argument("--dump_dir", default=None,
                  help="GPU target: --xla_dump_to folder (thunk-sequence kernel cross-check)")
  ap.add_argument("--peak_flops", type=float, default=None,
                  help="roofline target: peak FLOP/s (default the target's bf16 dense; H200)")
  ap.add_argument("--bandwidth", type=float, default=None,
                  help="roofline target: memory bandwidth, B/s (default the target's; H200)")
  ap.add_argument("--launch_us", type=float, default=roofline_defaults()["launch_s"] * 1e6,
                  help="roofline target: cost of one kernel launch, us (default: a CUDA-graph "
                       "launch)")
  args = ap.parse_args(argv)
  _check_numbers(args)
  dev = roofline_defaults(args.target)
  args.peak_flops = args.peak_flops or dev["peak_flops"]
  args.bandwidth = args.bandwidth or dev["bandwidth"]
  if args.target != "cpu":
    from bench.profiling import gpu_target
    msg = gpu_target.missing()
    if msg:
      raise SystemExit(msg)
    gpu_target.target_file(args.target)
    gpu_target.set_flags(args.dump_dir, args.target)
  if args.merge:
    return merge_runs(*args.merge)
  if args.table is not None:
    files = [f for pat in args.table for f in sorted(glob.glob(pat))]
    if not files:
      raise SystemExit(f"--table: no file matches {' '.join(args.table)}")
    print_table([json.load(open(f)) for f in files])
    return None
  note = default_config(args, local_platform())
  if note:
    print(note, file=sys.stderr)
  if args.small:
    args.config = "tiny" if args.config == "mid" else args.config
    args.batch = args.batch or 16
    args.devices = args.devices or 1
    args.steps = min(args.steps, 3)
    args.warmup = min(args.warmup, 1)
    args.tag = args.tag or "small"
  _make_folders(args)
  res = run(args)
  path = os.path.join(args.out_dir, f"train_step_{res['name']}.json")
  with open(path, "w") as f:
    json.dump(res, f, indent=1, default=_json_default)
  print_table([res])
  from bench.profiling.roofline import print_roofline
  print_roofline(res["roofline"])
  print("wrote", path, flush=True)
  return res


def _check_numbers(args) -> None:
  """Counts and roofline figures out of range stop the run at once, in one line."""
  for flag, low in (("batch", 1), ("devices", 1), ("layers", 1), ("steps", 1), ("warmup", 0),
                    ("profile_steps", 1), ("launch_us", 0)):
    v = getattr(args, flag)
    if v is not None and v < low:
      raise SystemExit(f"--{flag} {v}: must be at least {low}")
  for flag in ("peak_flops", "bandwidth"):
    v = getattr(args, flag)
    if v is not None and not v > 0:
      raise SystemExit(f"--{flag} {v}: must be positive")
  if not 0 <= args.jagged_bucket < args.jagged_buckets:
    raise SystemExit(f"--jagged_bucket {args.jagged_bucket}: must be 0 to "
                     f"{args.jagged_buckets - 1} (--jagged_buckets {args.jagged_buckets})")


def _progress(msg: str) -> None:
  """One line of progress on stderr (the compile takes minutes; the table goes to stdout)."""
  print(f"train_step: {msg}", file=sys.stderr, flush=True)


def _make_folders(args) -> None:
  """``--out_dir`` and ``--dump_hlo``'s folder, made before the compile (minutes at mid), so a
  path that cannot be written stops the run at once, in one line."""
  for flag, path, folder in (("--out_dir", args.out_dir, args.out_dir),
                             ("--dump_hlo", args.dump_hlo, os.path.dirname(args.dump_hlo or ""))):
    try:
      if folder:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
      raise SystemExit(f"{flag} {path}: cannot make its folder ({e.strerror})") from None


def merge_runs(directory: str, out: str) -> dict:
  """``directory``'s ``train_step_*.json`` as one JSON ``{"runs": {name: run}}`` at ``out`` (the
  GPU scripts' merged result)."""
  from bench.output import write_json
  runs = {}
  files = sorted(glob.glob(os.path.join(directory, "train_step_*.json")))
  if not files:
    raise SystemExit(f"--merge: no train_step_*.json in {directory}")
  for f in files:
    with open(f) as fh:
      r = json.load(fh)
    runs[r["name"]] = r
  write_json(out, {"runs": runs})
  print("wrote", out, "with", len(runs), "runs")
  return runs


def local_platform() -> str:
  import jax
  return jax.devices()[0].platform


def default_config(args, platform: str) -> str | None:
  """Sets ``args.config`` when it was not given: ``mid`` for a GPU (this host's or a deviceless
  ``--target``), and on a CPU host the ``--small`` run (``mid`` at its batch asks ~100 GB there);
  returns the line that says so, or None."""
  if args.config is not None:
    return None
  args.config = "mid"
  if args.target != "cpu" or platform != "cpu" or args.small:
    return None
  args.small = True
  return ("bench.train_step: no --config on a CPU host: the smoke run (--small: tiny, batch 16, "
          "one device); for the benchmark sizes pass --config mid --batch N [--compile_only], or "
          "--target h200 for the GPU program compiled here")


def roofline_defaults(target: str = "h200") -> dict:
  """Peak FLOP/s, bandwidth and launch cost of a roofline target (the CPU stand-in's: H200)."""
  from bench.profiling import gpu_target, roofline
  return {**roofline.H200, **gpu_target.DEVICE.get(target, {})}


def _json_default(x):
  if isinstance(x, float) and not math.isfinite(x):
    return None
  try:
    return float(x)
  except (TypeError, ValueError):
    return str(x)


if __name__ == "__main__":
  main()
