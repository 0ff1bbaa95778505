"""Validation on the held-out split during training, every ``Plan.every`` steps
(kunlun/train/plan.py), with keep-best params in ``<workdir>/best`` (train.py; the config
fields: docs/guides/train.md, "Training length and validation", kunlun/train/settings.py)."""

from __future__ import annotations

import json
import os
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from data import pipeline
from kunlun.configs import types as model_config
from kunlun.train import checkpoint, metrics
from kunlun.train import step as step_lib
from kunlun.train.capacity import jagged_capacity, local_blocks
from kunlun.train.devices import get_rules
from kunlun.train.plan import Plan
from kunlun.utils import atomic

HOST_KEYS = ("labels", "label_mask", "surface", "true_prob", "example_mask")


def collect(predict, params, batches, batch_sharding, keys=()) -> dict[str, np.ndarray]:
  """Predictions over ``batches`` gathered from every process: host arrays of the real rows
  (example_mask 1): ``prob f[N, K]``, labels, label_mask, surface, true_prob and ``keys``."""
  parts = {k: [] for k in ("prob",) + HOST_KEYS[:-1] + tuple(keys)}
  for batch in batches:
    prob = predict(params, pipeline.device_put_batch(batch, batch_sharding))
    host = {k: batch[k] for k in HOST_KEYS + tuple(keys) if k in batch}
    if jax.process_count() > 1:
      prob = multihost_utils.process_allgather(prob, tiled=True)
      host = multihost_utils.process_allgather(host, tiled=True)
    keep = np.asarray(host.get("example_mask", np.ones(len(prob)))) > 0
    parts["prob"].append(np.asarray(prob, np.float64)[keep])
    for k in parts:
      if k != "prob":
        parts[k].append(np.asarray(host[k])[keep])
  return {k: np.concatenate(v) if v else np.zeros((0,)) for k, v in parts.items()}


class ValidSplitEvaluator:
  """``evaluator(step, params)`` after each train step: validates every ``plan.every`` steps and
  at the last step, logs NE / AUC (each normalised by the validation window's own positive rate;
  printed, ``valid_ne`` / ``valid_auc`` / ``epoch`` in metrics.jsonl, ``valid_ne/<task>`` in
  TensorBoard), keeps the best params (``keep_best``, by ``best_task`` or the mean NE)."""

  def __init__(self, config, data_dir, schema, model, run_plan: Plan, batch_sharding,
               workdir: str, prog, say=print):
    self.plan, self.on = run_plan, run_plan.every > 0
    self.schema, self.prog, self.say = schema, prog, say
    self.main = jax.process_index() == 0
    self.last, self._mngr = None, None
    self.disk_full: str | None = None          # a keep-best save found no space
    self.dir = os.path.join(workdir, "best")
    if not self.on:
      return
    self.predict = step_lib.make_predict_step(model)
    self.data_cfg = config.data.copy_and_resolve_references()
    self.data_cfg.batch_size = int(config.data.batch_size)      # the train batch: valid on the mesh
    self.data_dir, self.b_shard = data_dir, batch_sharding
    self.seq_lens = model_config.seq_lens(config)
    self.blocks = local_blocks(batch_sharding.mesh, get_rules(config.sharding.rules))
    self.capacity = jagged_capacity(self.data_cfg, data_dir, run_plan.split, self.seq_lens,
                                    jax.process_count(), self.blocks)
    self.best_task = config.train.get("best_task", "") or ""
    self.keep = bool(config.train.get("keep_best", False))
    self.best = None
    if self.keep and os.path.exists(os.path.join(self.dir, "best.json")):
      with open(os.path.join(self.dir, "best.json")) as f:
        self.best = json.load(f)

  def score(self, ne: dict) -> float:
    if self.best_task:
      v = ne.get(self.best_task)
      return float("nan") if v is None else v
    vals = [v for v in ne.values() if v is not None and np.isfinite(v)]
    return float(np.mean(vals)) if vals else float("nan")

  def evaluate(self, params) -> tuple[dict, dict]:
    """Overall (per task) NE and AUC on the validation split."""
    ds = pipeline.make_dataset(self.data_cfg, self.data_dir, self.plan.split, self.seq_lens,
                               train=False, shard_index=jax.process_index(),
                               shard_count=jax.process_count(), jagged_capacity=self.capacity,
                               jagged_shards=self.blocks)
    a = collect(self.predict, params, iter(ds), self.b_shard)
    _, overall = metrics.surface_task_metrics(
        a["prob"], a["labels"], a["label_mask"], a["surface"], self.schema.surfaces,
        self.schema.task_names)
    return ({t: m["ne"] for t, m in overall.items()}, {t: m["auc"] for t, m in overall.items()})

  def __call__(self, step: int, params) -> bool:
    """Validates when due; returns whether it did."""
    if not self.on or step == self.last:
      return False
    if step % self.plan.every and step != self.plan.total:
      return False
    self.last = step
    ne, auc = self.evaluate(params)
    value = self.score(ne)
    better = np.isfinite(value) and (self.best is None or value < self.best["value"])
    epoch = step / self.plan.steps_per_epoch
    if self.prog is not None:
      self.prog.log(step, {"valid_ne": ne, "valid_auc": auc, "epoch": epoch}, line=False)
    if self.main:
      fmt = lambda d: " ".join(f"{t}={'n/a' if v is None else f'{v:.4f}'}" for t, v in d.items())
      self.say(f"validation step {step} (epoch {epoch:.2f}): NE {fmt(ne)} | AUC {fmt(auc)}"
               + (" | best so far" if better and self.keep else ""), flush=True)
    if self.keep and better:
      try:
        self._save_best(step, params, value, ne, auc)
      except Exception as e:  # noqa: BLE001 -- orbax / OS errors: report in one line
        if checkpoint.is_disk_full(e):
          self.disk_full = checkpoint.space_error(e, self.dir)
        print(f"warning: keep-best params of step {step} could not be written to {self.dir} "
              f"({checkpoint.short_error(e)}); the previous best stays", file=sys.stderr,
              flush=True)
    return True

  def _save_best(self, step, params, value, ne, auc):
    """Params + a ``meta`` item with their checksums (``checkpoint.Checkpointer.restore_params``
    verifies them), one step kept."""
    if self._mngr is None:
      self._mngr = ocp.CheckpointManager(
          self.dir, item_names=("params", "meta"),
          options=ocp.CheckpointManagerOptions(max_to_keep=1, create=True,
                                               enable_async_checkpointing=False))
    meta = {"step": int(step), "digest": {"params": checkpoint.tree_digest(params)}}
    meta["check"] = checkpoint._meta_check(meta)
    self._mngr.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                                  meta=ocp.args.JsonSave(meta)), force=True)
    self._mngr.wait_until_finished()
    self.best = {"step": int(step), "value": float(value),
                 "task": self.best_task or "mean", "valid_ne": ne, "valid_auc": auc}
    if self.main:
      atomic.write_json(os.path.join(self.dir, "best.json"), self.best)

  def remove_tmp_dirs(self) -> list[str]:
    """Partial keep-best saves left by failed writes (process 0)."""
    return checkpoint.remove_tmp_dirs(self.dir) if self.main else []

  def close(self) -> None:
    if self._mngr is not None:
      try:
        self._mngr.close()
      except Exception:  # noqa: BLE001 -- a failed last save was reported already
        pass
      self._mngr = None
