"""Export compact FM embeddings for LoopFM (spec g.3): run a trained FM over a dataset.
``python -m kunlun.transfer.export --workdir FM_WORKDIR --out E [--data_dir D] [--split ...]
[--quantize int8|bf16|none] [--summaries] [--batch_size N] ...``.
Output format and options: docs/architecture.md, ``kunlun/transfer/export.py``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import ml_dtypes
import numpy as np
from jax.experimental import multihost_utils

from data import pipeline, records
from kunlun.configs import types as model_config
from kunlun.train import checkpoint, devices, run_info, startup
from kunlun.train.capacity import jagged_capacity, local_blocks
from kunlun.train.model import fit_and_build_model
from kunlun.train.plan import load_schema
from kunlun.train.startup import FatalError
from kunlun.train.workdir import check_output, check_outputs
from kunlun.transfer.join import EmbeddingLog
from kunlun.utils import atomic
from sharding import partition

FORMAT = "kunlun-fm-embeddings-v1"
QUANT = ("int8", "bf16", "none")


# ---- quantisation ----------------------------------------------------------------------------
def quantize(x, mode: str) -> dict[str, np.ndarray]:
  """``x f32[N, d]`` -> ``{"q": ..., "scale": f32[N]}`` (scale only for int8)."""
  x = np.asarray(x, np.float32)
  if mode == "int8":
    scale = np.abs(x).max(-1) / 127.0
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = np.clip(np.rint(x / scale[:, None]), -127, 127).astype(np.int8)
    return {"q": q.view(np.uint8), "scale": scale}
  if mode == "bf16":
    return {"q": x.astype(ml_dtypes.bfloat16).view(np.int16)}
  if mode == "none":
    return {"q": x}
  raise ValueError(f"--quantize={mode!r}; allowed: {QUANT}")


def dequantize(q, mode: str, scale=None) -> np.ndarray:
  """Inverse of ``quantize`` (up to rounding), float32."""
  q = np.asarray(q)
  if mode == "int8":
    return q.view(np.int8).astype(np.float32) * np.asarray(scale, np.float32)[..., None]
  if mode == "bf16":
    return q.view(ml_dtypes.bfloat16).astype(np.float32)
  if mode == "none":
    return q.astype(np.float32)
  raise ValueError(f"quantisation mode {mode!r}; allowed: {QUANT}")


def encode_batch(reps: dict, batch: dict, mode: str, keep) -> list[bytes]:
  """One record per kept row from ``representations`` output and the batch's keys."""
  fields = {"pooled": np.asarray(reps["pooled"], np.float32)[keep]}
  for name, s in reps.get("summaries", {}).items():
    fields[f"sum_{name}"] = np.asarray(s, np.float32)[keep].mean(1)
  coded = {k: quantize(v, mode) for k, v in fields.items()}
  logits = np.asarray(reps["logits"], np.float32)[keep]
  cols = {k: np.asarray(batch[k])[keep] for k in ("user_id", "ad_id", "request_ts", "surface")}
  out = []
  for i in range(len(logits)):
    r = {"user_id": np.int64(cols["user_id"][i]), "ad_id": np.int64(cols["ad_id"][i]),
         "request_ts": np.int64(cols["request_ts"][i]), "surface": np.int32(cols["surface"][i]),
         "logits": logits[i]}
    for k, c in coded.items():
      r[k] = c["q"][i]
      if "scale" in c:
        r[f"{k}_scale"] = c["scale"][i]
    out.append(records.encode(r))
  return out


# ---- reading back -----------------------------------------------------------------------------
def load_manifest(out_dir: str) -> dict:
  return records.load_manifest(out_dir, FORMAT, "an export directory")


def read_records(out_dir: str, splits=None, field: str = "pooled") -> dict[str, np.ndarray]:
  """All records of ``splits`` (default all): ``user_id, ad_id, request_ts, surface [N]``,
  ``emb f32[N, d]`` (dequantised ``field``), ``logits f32[N, K]``."""
  from array_record.python import array_record_module as arm
  m = load_manifest(out_dir)
  mode = m["quantize"]
  cols = {k: [] for k in ("user_id", "ad_id", "request_ts", "surface", "emb", "scale", "logits")}
  for split in splits or list(m["splits"]):
    if split not in m["splits"]:
      raise ValueError(f"{out_dir}: no split {split!r}; exported: {list(m['splits'])}")
    for shard in m["splits"][split]["files"]:
      rd = arm.ArrayRecordReader(os.path.join(out_dir, shard["file"]))
      for raw in rd.read_all():
        r = records.decode(raw)
        if field not in r:
          raise ValueError(f"{out_dir}: records have no field {field!r}; fields {sorted(r)}")
        for k in ("user_id", "ad_id", "request_ts", "surface", "logits"):
          cols[k].append(r[k])
        cols["emb"].append(r[field])
        cols["scale"].append(r.get(f"{field}_scale", np.float32(1)))
      rd.close()
  out = {k: np.stack(v) if v else np.zeros((0,)) for k, v in cols.items()}
  if len(cols["emb"]):
    out["emb"] = dequantize(out["emb"], mode, out["scale"])
  del out["scale"]
  return out


def load_log(out_dir: str, splits=None, field: str = "pooled") -> EmbeddingLog:
  """An ``EmbeddingLog`` of the exported embeddings (time = request_ts of each example)."""
  r = read_records(out_dir, splits, field)
  return EmbeddingLog(r["user_id"], r["ad_id"], r["request_ts"], r["emb"])


# ---- export -----------------------------------------------------------------------------------
_LAYOUT = "__layout__"       # progress key: what must not change between a run and its resume


def _progress_name(process: int, count: int) -> str:
  return "progress.json" if count == 1 else f"progress-p{process}.json"


def _shard_name(split: str, k: int, process: int, count: int) -> str:
  tag = f"{k:05d}" if count == 1 else f"p{process:03d}-{k:05d}"
  return os.path.join(split, f"emb-{tag}.arrayrecord")


class _Progress:
  """One process's ``{split: [{"file", "count"}, ...], "__layout__": {...}}``, atomic writes."""

  def __init__(self, out_dir, process: int = 0, count: int = 1):
    self.path = os.path.join(out_dir, _progress_name(process, count))
    self.state = json.load(open(self.path)) if os.path.exists(self.path) else {}

  def done(self, split) -> list[dict]:
    return self.state.get(split, [])

  def set(self, split, k: int, entry):
    """Records shard ``k`` as complete (dropping any entries from ``k`` on: recomputed shards)."""
    self.state[split] = self.state.get(split, [])[:k] + [entry]
    self._write()

  def set_layout(self, layout: dict):
    self.state[_LAYOUT] = layout
    self._write()

  def _write(self):
    atomic.write_json(self.path, self.state, indent=None)


def _check_layout(out_dir: str, layout: dict) -> None:
  """Every progress file in ``out_dir`` must come from a run with the same layout (process
  count, batch size, shards, coding), else resuming would mix incompatible shards."""
  for name in sorted(os.listdir(out_dir)):
    if not (name.startswith("progress") and name.endswith(".json")):
      continue
    old = json.load(open(os.path.join(out_dir, name))).get(_LAYOUT)
    if old is None:                                   # written before layouts were recorded
      old = {"process_count": 1} if name == "progress.json" else None
    diff = {k: ((old or {}).get(k), v) for k, v in layout.items()
            if old is None or (k in old and old[k] != v)}
    if diff:
      raise ValueError(f"{out_dir}/{name}: an export with another layout is in this directory "
                       f"({ {k: f'{a} there, {b} now' for k, (a, b) in diff.items()} }); "
                       "use a new --out or the same settings")


def local_rows(arr) -> tuple[np.ndarray, list[tuple[int, int]]]:
  """This process's rows of a global array sharded on its leading (batch) axis.

  Returns ``(rows [n_local, ...], [(start, stop), ...])``: the addressable shards' data in order
  of their global row ranges (replicas of a range taken once), which is the order in which
  ``jax.make_array_from_process_local_data`` places a process's local rows. Never gathers
  other processes' data.
  """
  by_start = {}
  for sh in arr.addressable_shards:
    sl = sh.index[0] if sh.index else slice(None)
    start, stop = sl.indices(arr.shape[0])[:2]
    if start not in by_start:
      by_start[start] = (stop, sh)
  ranges = [(st, by_start[st][0]) for st in sorted(by_start)]
  for (_, a_stop), (b_start, _) in zip(ranges, ranges[1:], strict=False):
    if b_start < a_stop:
      raise ValueError(f"overlapping batch shards {ranges} (leading axis not batch-sharded?)")
  return np.concatenate([np.asarray(by_start[st][1].data) for st, _ in ranges]), ranges


def _local_reps(reps: dict, put: dict, batch: dict) -> dict:
  """This process's rows of the global outputs ``reps``; asserts they are the rows of the local
  ``batch`` that ``device_put_batch`` placed (same global ranges, same keys in the same order)."""
  ids, ranges = local_rows(put["user_id"])
  if not (np.array_equal(ids, batch["user_id"]) and
          np.array_equal(local_rows(put["request_ts"])[0], batch["request_ts"])):
    raise AssertionError(f"process {jax.process_index()}: the addressable shards {ranges} of the "
                         "batch do not hold the process-local rows in order")

  def take(path, x):
    rows, r = local_rows(x)
    if r != ranges:
      raise AssertionError(f"output {jax.tree_util.keystr(path)}: addressable row ranges {r} != "
                           f"the batch's {ranges}")
    return rows
  return jax.tree_util.tree_map_with_path(take, reps)


def _agreed_done(counts: list[int]) -> list[int]:
  """Per split, the number of leading shards that every process has completed."""
  if jax.process_count() == 1:
    return counts
  g = multihost_utils.process_allgather(np.asarray(counts, np.int32))
  return [int(v) for v in np.asarray(g).reshape(jax.process_count(), -1).min(0)]


def export(workdir: str, out_dir: str, *, data_dir: str | None = None, splits=("train", "eval"),
           quantize_mode: str = "int8", summaries: bool = False, batch_size: int | None = None,
           shard_batches: int = 50, step: int | None = None, mesh_flag: str = "data=-1",
           dcn_mesh_flag: str | None = None, log=print, trust_workdir: bool = False) -> dict:
  """Runs the FM of ``workdir`` over ``splits`` and writes the export; returns the manifest.

  Under several JAX processes every process calls this (same arguments, ``out_dir`` shared);
  each writes its own rows, process 0 the manifest (returned by every process)."""
  from array_record.python import array_record_module as arm

  if quantize_mode not in QUANT:
    raise ValueError(f"--quantize={quantize_mode!r}; allowed: {QUANT}")
  if shard_batches < 1:
    raise ValueError(f"--shard_batches must be >= 1, got {shard_batches}")
  if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                 or batch_size < 1):
    raise ValueError(f"--batch_size={batch_size}: allowed an integer >= 1 (leave it out for the "
                     "FM's config.data.batch_size)")
  check_outputs(dirs=[("--out", out_dir, ("manifest.json", "progress*.json", *splits))],
                inputs=[("--data_dir", data_dir)], workdir=workdir)   # docs/outputs.md
  pid, nproc = jax.process_index(), jax.process_count()
  ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"), read_only=True)
  if not ckpt.all_steps():
    raise ValueError(f"--workdir={workdir}: no checkpoint found in {ckpt.directory}")
  config, saved_dir = run_info.load_run_info(workdir, trust_workdir)
  data_dir = data_dir or saved_dir
  if not data_dir:
    raise ValueError("no --data_dir given and none recorded in the workdir")
  schema = load_schema(data_dir)
  model = fit_and_build_model(config, schema)
  mesh = devices.build_mesh(mesh_flag, dcn_mesh_flag)
  rules = devices.get_rules(config.sharding.rules)
  data_cfg = config.data.copy_and_resolve_references()
  data_cfg.batch_size = batch_size or config.data.batch_size
  devices.check_batch_size(data_cfg.batch_size, mesh, rules, "--batch_size")
  seq_lens = model_config.seq_lens(config)
  if pid == 0:
    check_output(os.path.join(out_dir, "manifest.json"), "--out")   # before the model
  os.makedirs(out_dir, exist_ok=True)
  layout = {"process_count": nproc, "batch_size": int(data_cfg.batch_size),
            "shard_batches": shard_batches, "quantize": quantize_mode, "summaries": summaries}
  _check_layout(out_dir, layout)
  prog = _Progress(out_dir, pid, nproc)
  b_shard = partition.batch_sharding(mesh, rules)

  def reps_fn(p, b):
    r = model.apply({"params": p}, b, method="representations")
    if not summaries:
      r = {k: v for k, v in r.items() if k != "summaries"}
    return r
  reps_fn = jax.jit(reps_fn, out_shardings=b_shard)     # batch-sharded like the input rows

  agreed = _agreed_done([len(prog.done(s)) for s in splits])
  prog.set_layout(layout)
  params, used_step = None, None
  blocks = local_blocks(mesh, rules)   # packed: a block per batch (x context) shard
  for split, n_done in zip(splits, agreed, strict=True):
    capacity = jagged_capacity(data_cfg, data_dir, split, seq_lens, nproc, blocks)
    if capacity:
      log(f"[export] {split}: packed towers at {capacity} tokens per batch ({blocks} blocks)")
    ds = pipeline.make_dataset(data_cfg, data_dir, split, seq_lens, train=False,
                               shard_index=pid, shard_count=nproc, jagged_capacity=capacity,
                               jagged_shards=blocks)
    n_batches = pipeline.num_eval_batches(data_dir, split, data_cfg.batch_size, nproc)
    n_shards = -(-n_batches // shard_batches)
    os.makedirs(os.path.join(out_dir, split), exist_ok=True)
    it = iter(ds)
    t0 = time.perf_counter()
    for k in range(n_shards):
      nb = min(shard_batches, n_batches - k * shard_batches)
      if k < n_done:                          # completed earlier by all: skip without the model
        for _ in range(nb):
          next(it)
        continue
      if params is None:
        first_batch = next(it)
        abstract = partition.abstract_params(model, jax.random.key(0), first_batch, mesh, rules)
        used_step, params = ckpt.restore_params(abstract, step)
        pending = [first_batch]
      else:
        pending = []
      rel = _shard_name(split, k, pid, nproc)
      tmp = os.path.join(out_dir, os.path.dirname(rel), "." + os.path.basename(rel) + ".tmp")
      w = arm.ArrayRecordWriter(tmp, records.WRITER_OPTIONS)
      count = 0
      with partition.activate(mesh, rules):
        for _ in range(nb):
          batch = pending.pop() if pending else next(it)
          put = pipeline.device_put_batch(batch, b_shard)
          if put["user_id"].shape[0] != data_cfg.batch_size:
            raise ValueError(f"--mesh={mesh_flag}: the batch axis is not split over the {nproc} "
                             f"processes (global batch {put['user_id'].shape[0]}, want "
                             f"{data_cfg.batch_size}); shard the batch across hosts")
          reps = _local_reps(reps_fn(params, put), put, batch)
          keep = np.asarray(batch["example_mask"]) > 0
          for r in encode_batch(reps, batch, quantize_mode, keep):
            w.write(r)
          count += int(keep.sum())
      w.close()
      _fsync(tmp)
      os.replace(tmp, os.path.join(out_dir, rel))
      prog.set(split, k, {"file": rel, "count": count})
      dt = time.perf_counter() - t0
      who = f" process {pid}/{nproc}" if nproc > 1 else ""
      log(f"[export]{who} {split}: shard {k + 1}/{n_shards} ({count} records) {dt:.1f}s")
    drops = pipeline.dropped_counter(ds)
    if drops is not None and drops.total:
      log(f"[export] {split}: {drops.report()}")
  ckpt.close()
  if used_step is None:                       # everything was done before: the recorded step
    used_step = _recorded_step(out_dir)
  if nproc > 1:
    multihost_utils.sync_global_devices("kunlun_export_shards_written")
  manifest_splits = {}
  for split in splits:
    files = []
    for p in range(nproc):                    # every process's progress, on the shared filesystem
      done = _Progress(out_dir, p, nproc).done(split)
      files += [{**e, "process": p} if nproc > 1 else e for e in done]
    manifest_splits[split] = {"files": files, "count": sum(e["count"] for e in files)}
  manifest = {
      "format": FORMAT, "quantize": quantize_mode, "source_workdir": os.path.abspath(workdir),
      "step": used_step, "data_dir": os.path.abspath(data_dir), "splits": manifest_splits,
      "process_count": nproc,
      "record": {"user_id": "int64[]", "ad_id": "int64[]", "request_ts": "int64[] (seconds)",
                 "surface": "int32[]", "logits": f"float32[{len(schema.tasks)}]",
                 "pooled": {"int8": "uint8[d] (int8 bits) + pooled_scale float32[]",
                            "bf16": "int16[d] (bfloat16 bits)",
                            "none": "float32[d]"}[quantize_mode],
                 **({f"sum_{t}": "as pooled, mean HSP summary token of the tower"
                     for t in schema.stream_names} if summaries else {})},
      "tasks": list(schema.task_names), "surfaces": list(schema.surfaces),
  }
  if pid == 0:
    atomic.write_json(os.path.join(out_dir, "manifest.json"), manifest)   # written last
    log(f"[export] wrote {out_dir}/manifest.json: "
        f"{ {s: v['count'] for s, v in manifest_splits.items()} }")
  if nproc > 1:
    multihost_utils.sync_global_devices("kunlun_export_manifest_written")
  return manifest


def _fsync(path: str) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _recorded_step(out_dir: str):
  path = os.path.join(out_dir, "manifest.json")
  return json.load(open(path)).get("step") if os.path.exists(path) else None


def main(argv=None):
  ap = argparse.ArgumentParser(prog="python -m kunlun.transfer.export", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--workdir", required=True, help="train.py workdir of the FM")
  ap.add_argument("--out", required=True, help="output directory")
  ap.add_argument("--data_dir", default=None, help="dataset (default: the FM's training data)")
  ap.add_argument("--split", default="train,eval", help="comma-separated splits")
  ap.add_argument("--quantize", default="int8", choices=QUANT)
  ap.add_argument("--summaries", action="store_true", help="also store one HSP token per tower")
  ap.add_argument("--batch_size", type=int, default=None)
  ap.add_argument("--shard_batches", type=int, default=50)
  ap.add_argument("--step", type=int, default=None)
  ap.add_argument("--mesh", default="data=-1")
  ap.add_argument("--dcn_mesh", default=None, help="mesh axis sizes across hosts (e.g. data=2)")
  ap.add_argument("--coordinator_address", default=None, help="multi-host: coordinator host:port")
  ap.add_argument("--num_processes", type=int, default=None, help="multi-host: process count")
  ap.add_argument("--process_id", type=int, default=None, help="multi-host: this process's index")
  ap.add_argument("--trust_workdir", action="store_true",
                  help="load an older workdir's config.pkl (pickle: runs code from the file)")
  a = ap.parse_args(argv)
  startup.quiet_checkpoint_logs()
  try:
    devices.maybe_initialize_distributed(a.coordinator_address, a.num_processes, a.process_id)
    export(a.workdir, a.out, data_dir=a.data_dir, splits=tuple(a.split.split(",")),
           quantize_mode=a.quantize, summaries=a.summaries, batch_size=a.batch_size,
           shard_batches=a.shard_batches, step=a.step, mesh_flag=a.mesh,
           dcn_mesh_flag=a.dcn_mesh, trust_workdir=a.trust_workdir)
  except (ValueError, OSError, FatalError) as e:
    msg = f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.strerror else str(e)
    print(f"error: {' '.join(msg.split())}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:                    # Ctrl-C: one line, status 130 (as train / eval)
    startup.interrupted("kunlun.transfer.export")
  return 0


if __name__ == "__main__":
  sys.exit(main())
