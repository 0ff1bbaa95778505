"""A run's plan, its settings and data checked once: train.py's data directory (given, or the
config's synthetic preset generated into the workdir), its schema, the train split's shards,
``config.train.task_weights`` against the tasks, the surface weights, epochs -> steps and the
validation period (the config fields: kunlun/train/settings.py). The data checks serve eval.py
and the exports too. Problems are one-line FatalErrors."""

from __future__ import annotations

import dataclasses
import math
import os

import jax
from jax.experimental import multihost_utils

from data import records, synthetic
from data.schema import Schema
from data.shards import DataError
from kunlun.configs.fit import fit_surface_weights
from kunlun.train.startup import fail


@dataclasses.dataclass
class Plan:
  """What a run trains on and for how long (``train_plan``; ``schedule`` alone: the length and
  validation of a given schema and data directory)."""
  total: int                 # training steps
  steps_per_epoch: int
  every: int                 # validation period in steps (0: no validation)
  split: str | None          # validation split
  weights: dict              # resolved surface weights
  train_records: dict | None = None   # train records per surface (the data's fingerprint)
  data_dir: str | None = None         # train.py's data (train_plan)
  schema: object = None               # its schema
  task_weights: tuple = ()            # config.train.task_weights, one per task (or none)


def train_plan(config, workdir: str, data_dir: str | None, steps_flag: int | None) -> Plan:
  """train.py's plan: the data directory (``data_dir``, or the synthetic preset generated into
  ``workdir``), its schema, ``config.train.task_weights`` (one per task), the train split's
  shards, the labels' delays (printed), then ``schedule``."""
  data_dir = data_dir or synthetic_data_dir(workdir, config)
  schema = load_schema(data_dir)
  task_w = tuple(config.train.get("task_weights", ()) or ())
  if task_w and len(task_w) != len(schema.tasks):
    fail(f"config.train.task_weights={task_w} needs one weight per task {schema.task_names}")
  check_data_files(data_dir, config.data.train_split)
  print(records.label_delay_note(data_dir), flush=True)   # what the histories' labels waited
  plan = schedule(config, schema, data_dir, steps_flag)   # surfaces, epochs, validation
  return dataclasses.replace(plan, data_dir=data_dir, schema=schema, task_weights=task_w)


def schedule(config, schema, data_dir: str, steps_flag: int | None, say=print) -> Plan:
  """Resolves surface weights, epochs -> steps (``ceil(epochs * steps_per_epoch)``, an epoch =
  ``ceil(train records of the surfaces with weight > 0 / batch_size)`` steps) and the validation
  period (writes the resolved ``train.steps`` / ``data.surface_weights`` into ``config``).
  Mismatches are FatalErrors."""
  split = config.data.get("train_split", "train")
  try:
    files = records.split_files(data_dir, split, schema)
  except (ValueError, FileNotFoundError) as e:
    fail(f"config.data.train_split={split!r}: {e}")
  counts = {s: sum(c for _, c in files.get(s, [])) for s in schema.surfaces}
  try:
    weights, notes = fit_surface_weights(config, schema, counts)
  except ValueError as e:
    fail(str(e))
  main = jax.process_index() == 0
  for n in notes:
    if main:
      say(f"config: {n}")
  n = sum(counts[s] for s in schema.surfaces if weights[s] > 0)
  B = int(config.data.batch_size)
  spe = max(1, math.ceil(n / B))
  epochs = config.train.get("epochs", 0) or 0     # types / ranges: kunlun.train.settings
  if epochs > 0:
    if steps_flag is not None:
      fail(f"--steps={steps_flag} and config.train.epochs={epochs:g} both set: give one")
    total = max(1, math.ceil(epochs * spe))
    config.train.steps = total
    if main:
      say(f"epochs {epochs:g} x {spe} steps ({n:,} train records, batch {B}) = {total} steps")
  else:
    total = int(config.train.steps)
  vsplit = config.data.get("valid_split", "valid") or None
  has = bool(vsplit) and vsplit in records.load_manifest(data_dir)["splits"]
  ve = config.train.get("validate_every", 0)
  if ve > 0 and not has:
    fail(f"config.train.validate_every={ve}: the data has no split {vsplit!r} "
         "(config.data.valid_split; data.ingest --split time:... writes 'valid')")
  every = 0 if ve < 0 or not has else (ve or spe)
  if config.train.get("keep_best", False) and not every:
    fail("config.train.keep_best needs validation, but " + (
        "config.train.validate_every=-1" if ve < 0 else
        f"the data has no split {vsplit!r} (config.data.valid_split)"))
  if every:
    check_data_files(data_dir, vsplit)           # shards present and whole (one-line errors)
  bt = config.train.get("best_task", "") or ""
  if bt and bt not in schema.task_names:
    fail(f"config.train.best_task={bt!r}: not a task of the data {schema.task_names}")
  return Plan(total, spe, every, vsplit if every else None, weights, counts)


def synthetic_data_dir(workdir: str, config) -> str:
  """Generates the config's synthetic preset into ``<workdir>/data`` once (process 0), reuses it."""
  out = os.path.join(workdir, "data")
  done = os.path.join(out, ".complete")
  if not os.path.exists(done):
    if jax.process_index() == 0:
      n = config.data.get("num_examples", None)
      print(f"generating synthetic preset {config.data.preset!r} ({n} examples) into {out}",
            flush=True)
      try:
        synthetic.generate(out, config.data.preset, n, config.data.get("synthetic_seed", 0))
        open(done, "w").close()
      except ValueError as e:
        fail(f"config.data.preset: {e}")
      except OSError as e:
        fail(f"cannot generate the synthetic data into {out} ({e.strerror or e}); give "
             "--data_dir or free space")
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices("synthetic_data")
  return out


def load_schema(data_dir: str):
  """The schema of ``data_dir`` (a FatalError naming ``--data_dir``: no such directory, no or a
  bad schema.json)."""
  if not os.path.isdir(data_dir):
    fail(f"--data_dir={data_dir}: no such directory")
  try:
    return Schema.load(data_dir)
  except (FileNotFoundError, ValueError) as e:
    fail(f"--data_dir={data_dir}: {e}")


def check_data_files(data_dir: str, split: str) -> None:
  """Every shard of ``split`` exists and has the byte size the manifest records (one-line error
  naming the file otherwise); manifests without sizes (older) get existence checks and a note."""
  try:
    records.split_files(data_dir, split, load_schema(data_dir))
    unsized = records.unsized_files(data_dir, split)
  except (DataError, ValueError, FileNotFoundError) as e:
    fail(f"--data_dir={data_dir}: {e}" if not str(e).startswith(data_dir) else str(e))
  if unsized and jax.process_index() == 0:
    print(f"note: {data_dir}/manifest.json records no file sizes (older format): only the "
          f"existence of the {split!r} shards was checked at start-up; `python -m data.verify "
          f"{data_dir} --deep --update_manifest` checks every record and records them",
          flush=True)
