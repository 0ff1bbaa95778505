"""Shared start-up of train.py and eval.py: settings checks, the workdir (its lock, writable
outputs), multi-host init, compilation cache, mesh, data directory and its integrity, run info
(JSON, no pickle, written atomically), and a clean fatal-error exit."""

from __future__ import annotations

import functools
import itertools
import json
import os
import sys

import jax
import numpy as np

from data import jagged, pipeline
from kunlun.configs.fields import MAX_BATCH, parse_capacity
from kunlun.train.startup import FatalError, check_settings, fail
from sharding import partition
from sharding.packed import blocks_per_batch_shard

CLUSTER_ENV = ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "JAX_COORDINATOR_ADDRESS",
               "TPU_WORKER_HOSTNAMES")


def check_output(path: str, what: str) -> None:
  """An output file can be written at ``path`` (a one-line FatalError naming the flag otherwise:
  a directory there, read-only, full, no permission); run before the work that fills it."""
  from kunlun.utils.atomic import check_writable
  why = check_writable(path, what) if jax.process_index() == 0 else None
  if why:
    fail(why)


def check_outputs(files=(), *, dirs=(), inputs=(), workdir: str | None = None) -> None:
  """Before any work: the run's outputs by the rules every program follows
  (``kunlun.utils.outputs.problem``: ``files`` ``[(flag, path)]``, ``dirs`` ``[(flag, path,
  names)]``, ``inputs`` ``[(flag, path)]``; ``workdir``: a train.py workdir, whose own entries
  no output is and whose recorded data directory is an input), then each file output writable
  (``check_output``, process 0); one-line FatalErrors."""
  from kunlun.utils import outputs
  owned = []
  if workdir:
    owned = [("the train.py workdir", workdir, outputs.TRAIN_WORKDIR)]
    recorded = (saved_run_info(workdir) or {}).get("data_dir")
    inputs = [*inputs, ("the data directory recorded in the workdir", recorded)]
  why = outputs.problem(files, dirs=dirs, inputs=inputs, owned=owned)
  if why:
    fail(why)
  for flag, path in files:
    if path:
      check_output(path, flag)


def prepare_workdir(workdir: str):
  """train.py's workdir: a directory (created), writable, and locked for this run (process 0;
  ``kunlun.utils.lock``). Returns the held lock; problems are one-line FatalErrors."""
  from kunlun.utils import lock
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    fail(f"--workdir={workdir}: exists and is not a directory")
  if jax.process_index() == 0:
    try:
      os.makedirs(workdir, exist_ok=True)
    except OSError as e:
      fail(f"--workdir={workdir}: cannot create it ({e.strerror or e})")
  try:
    return lock.acquire_all(workdir)
  except lock.LockError as e:
    fail(str(e))


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
  """``batch_size`` at most ``MAX_BATCH`` and a multiple of the mesh's batch shards and of the
  processes (one-line FatalError naming ``what``)."""
  from sharding.partition import batch_shard_count
  if batch_size > MAX_BATCH:
    fail(f"{what}={batch_size}: allowed at most {MAX_BATCH} (a larger batch does not fit in host "
         "memory)")
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
        open(done, "w").close()
      except ValueError as e:
        fail(f"config.data.preset: {e}")
      except OSError as e:
        fail(f"cannot generate the synthetic data into {out} ({e.strerror or e}); give "
             "--data_dir or free space")
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


def check_data_files(data_dir: str, split: str) -> None:
  """Every shard of ``split`` exists and has the byte size the manifest records (one-line error
  naming the file otherwise); manifests without sizes (older) get existence checks and a note."""
  from data import records
  from data.shards import DataError
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


def fit_and_build_model(config, schema, remat: str | None = None):
  """Fits ``config.model.towers`` to the schema's streams (kunlun/configs/fit.py, in place) and
  builds the model (``remat``: ``build_model``'s); a config / schema mismatch is a FatalError."""
  from kunlun.configs.transfer import parse_transfer
  from kunlun.models.build import build_model as _build
  try:
    tr = parse_transfer(config)
  except ValueError as e:
    fail(str(e))
  if tr.uses_fm:
    fail(f"config.transfer turns on FM inputs ({tr}); train.py/eval.py train and evaluate the "
         "plain model only and would silently ignore them. Set kd_lambda=0 and loopfm_*=False, "
         "or run the transfer path (kunlun.transfer.experiment, bench/experiments/transfer.py).")
  from kunlun.configs.fit import fit_towers
  try:
    for note in fit_towers(config, schema):     # towers follow the schema's streams (in place)
      if jax.process_index() == 0:
        print(f"config: {note}", flush=True)
    return _build(config, schema, remat)
  except ValueError as e:
    fail(f"config does not fit the data schema: {e}")


RUN_INFO = "run_info.json"
RUN_INFO_FORMAT = "kunlun-run-info-v1"


def auto_capacity_sample(batch: int) -> int:
  """Examples whose kept lengths set ``data.jagged_capacity=auto`` for a process batch of
  ``batch``: 16 batches, 4,096 to 65,536. The rare long histories set the tail of a batch's total;
  on mid's lengths at batch 1024, 4,096 examples (4 batches) gave capacities that 0.1% to 2.9% of
  fresh batches overflowed (four samples; the three towers together), 16,384 gave 0.1% to 0.6%."""
  return min(max(4096, 16 * int(batch)), 65536)


def local_batch_shards(batch_sharding) -> int:
  """Batch shards held by this process's devices under ``batch_sharding`` (a NamedSharding of the
  leading axis): the packed (jagged) blocks this process packs."""
  n = batch_sharding.mesh.size                     # a multiple of the batch shard count
  starts = {idx[0].indices(n)[0]
            for idx in batch_sharding.addressable_devices_indices_map((n,)).values()}
  return len(starts)


def local_blocks(mesh, rules) -> int:
  """Packed (jagged) blocks this process packs: its devices' batch shards x the blocks each batch
  shard is cut into (its context shards under context parallelism,
  ``sharding.packed.blocks_per_batch_shard``), so that every device holds whole blocks."""
  try:
    per = blocks_per_batch_shard(mesh, rules)
  except ValueError as e:
    fail(f"config.sharding.rules: {e}")
  return local_batch_shards(partition.batch_sharding(mesh, rules)) * per


def jagged_capacity(data_cfg, data_dir: str, split: str, seq_lens: dict[str, int],
                    shard_count: int, blocks: int = 1) -> dict[str, int] | None:
  """``data_cfg.jagged_capacity`` resolved for ``pipeline.make_dataset``: None (padded) or
  {stream: N} per process batch, packed in ``blocks`` blocks (``local_blocks``) of N / blocks
  tokens. "auto": every stream, N / blocks = ``data.jagged.capacity_for`` (P(overflow) <= 0.001)
  of a block's batch over the kept lengths of up to ``auto_capacity_sample`` examples of ``split``,
  rounded up to a multiple of 64. A block holds whole examples, so a history longer than a
  block's capacity keeps only its most recent events (counted drops, ``data.jagged``): the limit
  of packing per block, tighter with more blocks per batch. Problems are FatalErrors."""
  try:
    value = parse_capacity(data_cfg.get("jagged_capacity", ""))
  except ValueError as e:
    fail(str(e))
  B = int(data_cfg.batch_size) // shard_count
  buckets = int(data_cfg.get("jagged_buckets", 1))
  if value:
    try:
      jagged.check_shards(blocks, B)
    except ValueError as e:
      fail(f"data.jagged_capacity with {blocks} packed blocks per process (its batch x context "
           f"shards): {e}")
  if buckets != 1:
    if value != "auto":
      fail(f"data.jagged_buckets = {buckets} needs data.jagged_capacity=auto (it sets the "
           f"buckets' capacities; data.jagged_capacity = {value or ''!r})")
    if shard_count > 1:
      fail(f"data.jagged_buckets = {buckets} runs on one process only: every process would pick "
           "its own bucket, and all must run the same program")
  if value != "auto":
    _check_fixed_capacity(value or {}, seq_lens, B, blocks)
    return value
  ds = pipeline.make_dataset(data_cfg, data_dir, split, seq_lens, train=False, shard_index=0,
                             shard_count=1)
  lens = {s: [] for s in seq_lens}
  n = 0
  for batch in itertools.islice(iter(ds), -(-auto_capacity_sample(B) // int(data_cfg.batch_size))):
    real = np.asarray(batch["example_mask"]) > 0
    for s in lens:
      lens[s].append(np.asarray(batch["events"][s]["length"])[real])
    n += int(real.sum())
  if not n:
    fail(f"data.jagged_capacity=auto: split {split!r} in {data_dir} has no examples")
  return capacity_from_lengths({s: np.concatenate(v) for s, v in lens.items()}, B, blocks,
                               buckets)


def _check_fixed_capacity(value: dict, seq_lens: dict[str, int], B: int, blocks: int) -> None:
  """A fixed ``data.jagged_capacity`` {stream: N}: streams of the data, N a multiple of 64 x
  ``blocks`` and no more than a process batch of ``B`` examples can hold (each block's
  ``B / blocks`` examples x the stream's kept length, rounded up to 64); FatalErrors."""
  unknown = sorted(set(value) - set(seq_lens))
  if unknown:
    fail(f"data.jagged_capacity: unknown stream(s) {unknown}; the data's streams are "
         f"{sorted(seq_lens)}")
  bad = {s: n for s, n in value.items() if n % (64 * blocks)}
  if bad:
    fail(f"data.jagged_capacity {bad}: N must be a multiple of 64 x the {blocks} blocks of a "
         "process (its batch x context shards; 64 tokens a block)")
  for s, n in value.items():
    T = int(seq_lens[s])
    most = blocks * -(-(B // blocks) * T // 64) * 64
    if n > most:
      fail(f"data.jagged_capacity {s}={n}: more tokens than a process batch holds ({B} examples "
           f"x kept_len {T} = {B * T}); at most {most}"
           + (f" ({blocks} blocks of {B // blocks} examples, each rounded up to 64)"
              if blocks > 1 else ""))


def aligned_capacity(n: int, most: int) -> int:
  """A block's ``auto`` capacity for ``n`` tokens: at least 64, rounded up to 64 x a power of two
  (up to 2048) that adds less than 1/32 of ``n``, and no more than ``most`` (the block's examples
  x their longest history) rounded up to 64. Why: the backward's weight gradients contract over
  the tokens, and XLA:GPU splits that dimension (split-K) into tiles whose multiple a capacity of
  a plain multiple of 64 rarely is: it then pads (copies) every operand, 10.3 of mid's 149 GB at
  batch 1024 on the H200 program."""
  m = 64
  while m < 2048 and 64 * m <= n:
    m *= 2
  up = lambda k, m: -(-k // m) * m
  return max(64, min(up(n, m), up(most, 64)))


def capacity_from_lengths(lens: dict, batch_size: int, shards: int = 1, buckets: int = 1
                          ) -> dict:
  """``data.jagged_capacity=auto`` from a sample of kept lengths ``{stream: i[n]}``: per stream
  ``shards`` x ``data.jagged.capacity_for`` (P(overflow) <= 0.001) of a block's batch
  ``batch_size / shards``, aligned (``aligned_capacity``: at least 64); printed. ``buckets`` K >
  1 (``data.jagged_buckets``): per stream a tuple of K such capacities
  (``data.jagged.capacity_buckets``), the last the one above."""
  Bs = batch_size // shards
  out = {s: tuple(shards * aligned_capacity(n, Bs * int(np.max(v, initial=0)))
                  for n in jagged.capacity_buckets(v, Bs, buckets)) for s, v in lens.items()}
  n = len(next(iter(lens.values()), ()))
  per = "" if shards == 1 else f" ({shards} blocks of {Bs} examples)"
  what = "" if buckets == 1 else f" in {buckets} buckets (a batch takes the smallest that fits)"
  caps = ",".join(f"{s}=" + "/".join(map(str, c)) for s, c in out.items())
  print(f"data.jagged_capacity=auto: {caps} tokens per process batch of {batch_size}{per}{what} "
        f"(from {n} examples)", flush=True)
  return {s: c[0] for s, c in out.items()} if buckets == 1 else out


def config_to_plain(x, path: str = "config"):
  """A ConfigDict as JSON-able plain types; tuples become ``{"__tuple__": [...]}`` so they come
  back as tuples. Anything else (objects, callables) raises ``TypeError`` naming the field."""
  import ml_collections
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
  import ml_collections

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
  from kunlun.configs.types import with_defaults
  config = config.copy_and_resolve_references()
  if "model" in config:
    config.model = with_defaults(config.model)
  try:
    plain = config_to_plain(config)
  except TypeError as e:
    fail(str(e))
  from kunlun.utils import atomic
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
  import dataclasses
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
  from kunlun.configs.types import with_defaults
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
  import pickle
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
    from kunlun.configs.types import upgrade_stored
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
