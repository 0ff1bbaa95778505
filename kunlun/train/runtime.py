"""Shared start-up of train.py and eval.py: multi-host init, compilation cache, mesh, data
directory, config persistence, and a clean fatal-error exit."""

from __future__ import annotations

import os
import pickle
import sys

import jax

CLUSTER_ENV = ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "JAX_COORDINATOR_ADDRESS",
               "TPU_WORKER_HOSTNAMES")


class FatalError(Exception):
  """A user-facing error (bad flag, missing data, unusable checkpoint), printed without a
  traceback."""


def fail(msg: str):
  raise FatalError(msg)


def run_main(prog: str, fn, *args):
  """Runs ``fn(*args)``; FatalError exits with status 2 and ``<prog>: error: <msg>`` on stderr."""
  from absl import logging
  logging.set_verbosity(logging.ERROR)   # orbax logs every save (INFO) and read-only use (WARNING)
  try:
    return fn(*args)
  except FatalError as e:
    print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
    sys.exit(2)


def maybe_initialize_distributed(coordinator_address=None, num_processes=None, process_id=None):
  """``jax.distributed.initialize`` with explicit flags, or auto-detected from a cluster env
  (SLURM, Open MPI, ...); a no-op for a single process. Must run before any other JAX call."""
  if coordinator_address:
    if num_processes is None or process_id is None:
      fail("--coordinator_address needs --num_processes and --process_id")
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id)
    return True
  env_sizes = [os.environ.get(k) for k in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")]
  multi = any(s and int(s) > 1 for s in env_sizes if s and s.isdigit())
  if multi or os.environ.get("JAX_COORDINATOR_ADDRESS"):
    jax.distributed.initialize()
    return True
  return False


def enable_compilation_cache(cache_dir: str | None) -> None:
  """Persistent XLA compilation cache (re-runs and resumes skip compilation); "" disables it."""
  if cache_dir:
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def build_mesh(mesh_flag: str, dcn_flag: str | None):
  """The 5-axis mesh from ``--mesh`` / ``--dcn_mesh``; a bad flag is a FatalError naming it."""
  from sharding import mesh as mesh_lib
  try:
    ici = mesh_lib.parse_mesh_flag(mesh_flag)
  except ValueError as e:
    fail(f"--mesh={mesh_flag}: {e}")
  try:
    dcn = mesh_lib.parse_mesh_flag(dcn_flag) if dcn_flag else None
  except ValueError as e:
    fail(f"--dcn_mesh={dcn_flag}: {e}")
  try:
    return mesh_lib.make_mesh(ici, dcn)
  except ValueError as e:
    fail(f"--mesh={mesh_flag}" + (f" --dcn_mesh={dcn_flag}" if dcn_flag else "") + f": {e}")


def get_rules(name: str):
  from sharding.rules import get_rules as _get
  try:
    return _get(name)
  except ValueError as e:
    fail(f"config.sharding.rules: {e}")


def check_batch_size(batch_size: int, mesh, rules, what: str) -> None:
  from sharding.partition import batch_shard_count
  n = batch_shard_count(mesh, rules)
  procs = jax.process_count()
  if batch_size % n or batch_size % procs:
    fail(f"{what}={batch_size} must be a multiple of the {n} batch shards of the mesh "
         f"(and of the {procs} processes)")


def synthetic_data_dir(workdir: str, config) -> str:
  """Generates the config's synthetic preset into ``<workdir>/data`` once (process 0), reuses it."""
  from data import synthetic
  out = os.path.join(workdir, "data")
  done = os.path.join(out, ".complete")
  if not os.path.exists(done):
    if jax.process_index() == 0:
      n = config.data.get("num_examples", None)
      print(f"generating synthetic preset {config.data.preset!r} ({n} examples) into {out}",
            flush=True)
      try:
        synthetic.generate(out, config.data.preset, n, config.data.get("synthetic_seed", 0))
      except ValueError as e:
        fail(f"config.data.preset: {e}")
      open(done, "w").close()
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      multihost_utils.sync_global_devices("synthetic_data")
  return out


def load_schema(data_dir: str):
  from data.schema import Schema
  if not os.path.isdir(data_dir):
    fail(f"--data_dir={data_dir}: no such directory")
  try:
    return Schema.load(data_dir)
  except (FileNotFoundError, ValueError) as e:
    fail(f"--data_dir={data_dir}: {e}")


def build_model(config, schema):
  from kunlun.model import build_model as _build
  from kunlun.transfer.settings import parse_transfer
  try:
    tr = parse_transfer(config)
  except ValueError as e:
    fail(str(e))
  if tr.uses_fm:
    fail(f"config.transfer turns on FM inputs ({tr}); train.py/eval.py train and evaluate the "
         "plain model only and would silently ignore them. Set kd_lambda=0 and loopfm_*=False, "
         "or run the transfer path (kunlun.transfer.experiment, bench/transfer.py).")
  try:
    return _build(config, schema)
  except ValueError as e:
    fail(f"config does not fit the data schema: {e}")


def save_run_info(workdir: str, config, data_dir: str) -> None:
  """``config.pkl`` (exact, for eval.py), ``config.json`` (readable) and ``data_dir.txt``.

  ``config.model`` is stored with every default filled in, so a later change of a default
  (e.g. ``score_clip``) cannot change how an existing checkpoint is evaluated or exported.
  """
  if jax.process_index() != 0:
    return
  from kunlun.config import with_defaults
  config = config.copy_and_resolve_references()
  if "model" in config:
    config.model = with_defaults(config.model)
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "config.pkl"), "wb") as f:
    pickle.dump(config, f)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(config.to_json_best_effort(indent=1))
  with open(os.path.join(workdir, "data_dir.txt"), "w") as f:
    f.write(os.path.abspath(data_dir))


def load_run_info(workdir: str):
  """``(config, data_dir)`` recorded by train.py in ``workdir``."""
  path = os.path.join(workdir, "config.pkl")
  if not os.path.exists(path):
    fail(f"--workdir={workdir}: no config.pkl (not a train.py workdir); pass --config")
  with open(path, "rb") as f:
    config = pickle.load(f)
  if "model" in config:            # fields added since the run was stored keep the run's value
    from kunlun.config import upgrade_stored
    config.model = upgrade_stored(config.model)
  data_dir = None
  p = os.path.join(workdir, "data_dir.txt")
  if os.path.exists(p):
    data_dir = open(p).read().strip()
  return config, data_dir
