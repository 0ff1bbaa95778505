"""The devices a program runs on: the multi-host start, the persistent compilation cache, the
mesh (``--mesh`` / ``--dcn_mesh``) and sharding rules (``config.sharding.rules``), and batch sizes
checked against the mesh's batch shards. Problems are one-line FatalErrors."""

from __future__ import annotations

import os

import jax

from kunlun.configs.fields import MAX_BATCH
from kunlun.train.startup import fail
from sharding import mesh as mesh_lib
from sharding import rules as rules_lib
from sharding.partition import batch_shard_count


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


def open_mesh(config, mesh_flag: str, dcn_flag: str | None, batch_sizes: dict,
              compilation_cache: str | None):
  """Compilation cache, then the mesh and sharding rules, each ``{what: batch size}`` checked
  against the mesh's batch shards; problems are FatalErrors."""
  enable_compilation_cache(compilation_cache)
  mesh = build_mesh(mesh_flag, dcn_flag)
  rules = get_rules(config.sharding.rules)
  for what, size in batch_sizes.items():
    check_batch_size(size, mesh, rules, what)
  return mesh, rules


def enable_compilation_cache(cache_dir: str | None) -> None:
  """Persistent XLA compilation cache (re-runs and resumes skip compilation); "" disables it."""
  if cache_dir:
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def build_mesh(mesh_flag: str, dcn_flag: str | None):
  """The 5-axis mesh from ``--mesh`` / ``--dcn_mesh``; a bad flag is a FatalError naming it."""
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
  """The sharding rules named ``name`` (``config.sharding.rules``); an unknown name is a
  FatalError."""
  try:
    return rules_lib.get_rules(name)
  except ValueError as e:
    fail(f"config.sharding.rules: {e}")


def check_batch_size(batch_size: int, mesh, rules, what: str) -> None:
  """``batch_size`` at most ``MAX_BATCH`` and a multiple of the mesh's batch shards and of the
  processes (one-line FatalError naming ``what``)."""
  if batch_size > MAX_BATCH:
    fail(f"{what}={batch_size}: allowed at most {MAX_BATCH} (a larger batch does not fit in host "
         "memory)")
  n = batch_shard_count(mesh, rules)
  procs = jax.process_count()
  if batch_size % n or batch_size % procs:
    fail(f"{what}={batch_size} must be a multiple of the {n} batch shards of the mesh "
         f"(and of the {procs} processes)")

