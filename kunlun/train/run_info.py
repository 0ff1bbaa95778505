"""What train.py records in its workdir, ``run_info.json`` (JSON, no pickle, written
atomically: the exact config, the data directory, the schema's surface / task names, the train
data's fingerprint), and what is read back from it: the resume check, the config and data
directory of eval-like programs, the data's schema in the order the run was trained with."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pickle
import sys

import jax
import ml_collections
import numpy as np

from kunlun.configs.types import upgrade_stored, with_defaults
from kunlun.train.startup import FatalError, check_settings, fail
from kunlun.utils import atomic

RUN_INFO = "run_info.json"
RUN_INFO_FORMAT = "kunlun-run-info-v1"


def config_to_plain(x, path: str = "config"):
  """A ConfigDict as JSON-able plain types; tuples become ``{"__tuple__": [...]}`` so they come
  back as tuples. Anything else (objects, callables) raises ``TypeError`` naming the field."""
  if isinstance(x, (ml_collections.ConfigDict, ml_collections.FrozenConfigDict)):
    x = x.to_dict()
  if isinstance(x, dict):
    return {str(k): config_to_plain(v, f"{path}.{k}") for k, v in x.items()}
  if isinstance(x, tuple):
    return {"__tuple__": [config_to_plain(v, f"{path}[{i}]") for i, v in enumerate(x)]}
  if isinstance(x, list):
    return [config_to_plain(v, f"{path}[{i}]") for i, v in enumerate(x)]
  if x is None or isinstance(x, (bool, int, float, str)):
    return x
  raise TypeError(f"{path} = {x!r} ({type(x).__name__}) cannot be stored in {RUN_INFO}")


def config_from_plain(x):
  """Inverse of ``config_to_plain``: a ``ml_collections.ConfigDict``."""

  def dec(v):
    if isinstance(v, dict):
      if set(v) == {"__tuple__"}:
        return tuple(dec(a) for a in v["__tuple__"])
      return {k: dec(a) for k, a in v.items()}
    if isinstance(v, list):
      return [dec(a) for a in v]
    return v
  return ml_collections.ConfigDict(dec(x))


def schema_names(schema) -> dict:
  """What the heads and surface embeddings are bound to: surfaces and tasks by name, in order."""
  return {"surfaces": list(schema.surfaces), "tasks": list(schema.task_names)}


def save_run_info(workdir: str, config, data_dir: str, schema=None, data=None) -> None:
  """``run_info.json``: the exact config (``config_to_plain``), the data directory, the schema's
  surface / task names (``schema_names``: heads are matched by name) and the train data's
  fingerprint (``data``: records per surface); eval.py, the export and later resumes read it
  (no pickle: loading a workdir runs no code from it).

  ``config.model`` is stored with every default filled in, so a later change of a default
  (e.g. ``score_clip``) cannot change how an existing checkpoint is evaluated or exported.
  """
  if jax.process_index() != 0:
    return
  config = config.copy_and_resolve_references()
  if "model" in config:
    config.model = with_defaults(config.model)
  try:
    plain = config_to_plain(config)
  except TypeError as e:
    fail(str(e))
  path = os.path.join(workdir, RUN_INFO)
  try:
    info = {"format": RUN_INFO_FORMAT, "data_dir": os.path.abspath(data_dir), "config": plain}
    if schema is not None:
      info["schema"] = schema_names(schema)
    if data is not None:
      info["data"] = data
    atomic.write_json(path, info)
  except OSError as e:
    fail(f"--workdir={workdir}: cannot write {RUN_INFO} ({e.strerror or e})")


def saved_run_info(workdir: str) -> dict | None:
  """The raw ``run_info.json`` of ``workdir`` (None: none, or unreadable)."""
  try:
    with open(os.path.join(workdir, RUN_INFO)) as f:
      info = json.load(f)
  except (OSError, ValueError):
    return None
  return info if isinstance(info, dict) else None


def _diff(a, b, path: str) -> list[str]:
  if isinstance(a, dict) and isinstance(b, dict):
    return [d for k in sorted(set(a) | set(b), key=str)
            for d in _diff(a.get(k), b.get(k), f"{path}.{k}")]
  return [] if a == b else [f"{path}: {a!r} -> {b!r}"]


def check_schema_names(info: dict | None, schema, what: str) -> None:
  """FatalError when ``schema``'s surfaces / tasks differ (names or order) from those the run
  recorded (its heads and surface embeddings are indexed in that order)."""
  saved = (info or {}).get("schema")
  if saved and saved != schema_names(schema):
    fail(f"{what}: the data's schema has surfaces {list(schema.surfaces)}, tasks "
         f"{list(schema.task_names)}; the run was trained with surfaces {saved['surfaces']}, "
         f"tasks {saved['tasks']} (heads are matched by name and order: use that dataset)")


def schema_as_trained(info: dict | None, schema, what: str):
  """``(schema, remap)``: the data's ``schema`` with its surfaces and tasks in the order the
  run recorded (heads and surface embeddings are indexed in that order), and
  ``remap(batch) -> batch`` that re-indexes a batch of the data to it (None: same order).
  Different names are a FatalError; a run that recorded no names takes the data's order."""
  saved = (info or {}).get("schema")
  if not saved or saved == schema_names(schema):
    return schema, None
  if sorted(saved["surfaces"]) != sorted(schema.surfaces) or sorted(saved["tasks"]) != sorted(
      schema.task_names):
    check_schema_names(info, schema, what)
  tasks = {t.name: t for t in schema.tasks}
  trained = dataclasses.replace(schema, surfaces=tuple(saved["surfaces"]),
                                tasks=tuple(tasks[n] for n in saved["tasks"]))
  return trained, functools.partial(remap_batch, surface_to=np.array(
      [saved["surfaces"].index(x) for x in schema.surfaces], np.int32), task_from=np.array(
      [list(schema.task_names).index(n) for n in saved["tasks"]], np.int64))


def remap_batch(batch: dict, surface_to, task_from) -> dict:
  """A host batch re-indexed: surface ``i`` -> ``surface_to[i]`` (candidate rows and the valid
  events of each stream; padding stays 0), per-task columns ``[:, task_from]``."""
  out = dict(batch)
  out["surface"] = surface_to[np.asarray(batch["surface"])]
  out["events"] = {}
  for name, ev in batch["events"].items():
    ev = dict(ev)
    x = np.asarray(ev["surface"])
    valid = np.arange(x.shape[1])[None, :] < np.asarray(ev["length"])[:, None]
    ev["surface"] = np.where(valid, surface_to[x], x).astype(x.dtype)
    out["events"][name] = ev
  for k in ("labels", "label_mask", "true_prob"):
    if k in batch:
      out[k] = np.asarray(batch[k])[:, task_from]
  return out


def check_resume(workdir: str, config, schema, data: dict | None, allow_config_change: bool,
                 log=print) -> None:
  """Before a resume writes anything: a changed model config or schema is a FatalError unless
  ``allow_config_change``; changed train data (records per surface) is stated in one line."""
  info = saved_run_info(workdir)
  if info is None:
    return
  plain = lambda c: config_to_plain(with_defaults(c.model.copy_and_resolve_references()),
                                    "config.model") if "model" in c else None
  saved = info.get("config")
  old = plain(_upgraded(config_from_plain(saved))) if isinstance(saved, dict) else None
  new = plain(config)
  diffs = _diff(old, new, "config.model") if old is not None and new is not None else []
  if diffs and not allow_config_change:
    more = f" (+{len(diffs) - 3} more)" if len(diffs) > 3 else ""
    fail(f"--workdir={workdir}: resuming with a changed model ({'; '.join(diffs[:3])}{more}); "
         "the checkpoint was trained with the recorded one: use a new --workdir, or pass "
         "--allow_config_change")
  if diffs:
    log(f"note: --allow_config_change: resuming with a changed model ({'; '.join(diffs)})",
        flush=True)
  if not allow_config_change:
    check_schema_names(info, schema, f"--workdir={workdir}: resume")   # no re-indexing in train
  if data is not None and info.get("data") is not None and info["data"] != data:
    log(f"note: the train data changed since this workdir's last run ({info['data']} -> {data} "
        "records per surface): the data iterator continues from its saved position in the new "
        "data", flush=True)


def load_run_info(workdir: str, trust_pickle: bool = False):
  """``(config, data_dir)`` recorded by train.py in ``workdir``: from ``run_info.json``; a
  workdir written by an older version holds only ``config.pkl``, which is unpickled only with
  ``trust_pickle`` (``--trust_workdir``), with a warning."""
  path = os.path.join(workdir, RUN_INFO)
  if os.path.exists(path):
    try:
      with open(path) as f:
        info = json.load(f)
      if not isinstance(info, dict) or info.get("format") != RUN_INFO_FORMAT:
        got = info.get("format") if isinstance(info, dict) else type(info).__name__
        raise ValueError(f"format {got!r}, expected {RUN_INFO_FORMAT!r}")
      plain = info.get("config")
      if not isinstance(plain, dict) or not plain:
        raise ValueError(f"config is {plain!r}, expected the config train.py stored (a mapping "
                         "with data, train and model sections)")
      config = _upgraded(config_from_plain(plain))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
      fail(f"{path}: unreadable run info ({type(e).__name__}: {e})")
    check_settings(config, where=path)       # the rules of a fresh run, before any work
    return config, info.get("data_dir")
  pkl = os.path.join(workdir, "config.pkl")
  if not os.path.exists(pkl):
    fail(f"--workdir={workdir}: no {RUN_INFO} (not a train.py workdir)")
  if not trust_pickle:
    fail(f"--workdir={workdir} holds only config.pkl (written by an older version); unpickling "
         "it can run arbitrary code from the file. Pass --trust_workdir if you trust where this "
         "workdir came from")
  print(f"warning: --trust_workdir: unpickling {pkl} (code in it runs with your rights)",
        file=sys.stderr, flush=True)
  with open(pkl, "rb") as f:
    config = pickle.load(f)
  config = _upgraded(config)
  check_settings(config, where=pkl)
  return config, _saved_data_dir(workdir)


def _upgraded(config):
  """Model fields added since the run was stored get the value that run was trained with
  (``kunlun.configs.types.upgrade_stored``: e.g. ``final_hsp`` on for runs stored before the
  switch)."""
  if "model" in config:
    with config.unlocked():
      config.model = upgrade_stored(config.model)
  return config


def _saved_data_dir(workdir: str) -> str | None:
  """The data directory recorded in ``workdir`` (run_info.json, or an older data_dir.txt)."""
  path = os.path.join(workdir, RUN_INFO)
  if os.path.exists(path):
    try:
      with open(path) as f:
        return json.load(f).get("data_dir")
    except ValueError:
      return None
  p = os.path.join(workdir, "data_dir.txt")
  return open(p).read().strip() if os.path.exists(p) else None


def run_config(workdir: str, config=None, trust_pickle: bool = False):
  """``(config, data_dir)`` for eval-like programs: the given ``--config`` (the workdir still
  supplies the data directory, read without unpickling) or the one recorded in ``workdir``."""
  if config is not None:
    check_settings(config)
    return config, _saved_data_dir(workdir)
  try:
    return load_run_info(workdir, trust_pickle)
  except FatalError as e:
    fail(f"{e}; or give --config")
