"""train.py's set-up and loop: ``setup`` builds one ``Run`` (mesh, plan, model, data pipeline,
train step, restored state, checkpointer), ``train`` runs it; ``StepAccounting`` does the per-step
bookkeeping (lagged statistics, skipped steps, progress lines with MFU, log / save / validation
cadence). ``eval_setup`` is eval.py's set-up (the mesh, data checks and model are shared)."""

from __future__ import annotations

import dataclasses
import itertools
import os
import signal
import sys

import jax

from data import pipeline
from data.shards import DataError
from kunlun.configs import types as model_config
from kunlun.models.flops import FlopMeter
from kunlun.train import checkpoint, devices, evaluation, progress, run_info, startup
from kunlun.train import step as step_lib
from kunlun.train.capacity import jagged_capacity, local_blocks
from kunlun.train.metrics import RunningNE
from kunlun.train.model import fit_and_build_model
from kunlun.train.plan import Plan, check_data_files, load_schema, train_plan
from sharding import mesh as mesh_lib
from sharding import partition


class StopFlag:
  """Set by SIGTERM / SIGINT; the loop saves and exits after the current step. A second signal
  exits at once and says, in one line on stderr, that it does not save (``describe()``: the
  step left unsaved and the latest checkpoint)."""

  def __init__(self, describe=None):
    startup.raise_if_interrupted()    # a set-up Ctrl-C that was swallowed on its way: stop now
    self.signum = None
    self.describe = describe
    for s in (signal.SIGTERM, signal.SIGINT):
      signal.signal(s, self._handle)

  def _handle(self, signum, _):
    if self.signum is not None:       # second signal: give up immediately, and say so
      try:
        what = self.describe() if self.describe else "the current step"
      except Exception:  # noqa: BLE001  (a listing that fails must not stop the exit)
        what = "the current step"
      sys.stderr.write(f"received signal {signum} again: exiting now without saving {what}\n")
      sys.stderr.flush()
      signal.signal(signum, signal.SIG_DFL)
      os.kill(os.getpid(), signum)
    self.signum = signum


@dataclasses.dataclass(eq=False)
class Run:
  """What the train loop works on; ``params``, ``opt_state`` and ``step`` advance as it runs."""
  config: object
  workdir: str
  data_dir: str
  schema: object
  plan: Plan
  mesh: object
  rules: object
  model: object
  data_iter: object
  train_step: step_lib.TrainStep
  ckpt: checkpoint.Checkpointer
  params: object
  opt_state: object
  rng: object
  start: int
  step: int

  def save(self, **kw) -> None:
    """Checkpoints the current step (async; ``ckpt.settle`` waits)."""
    self.ckpt.save(self.step, self.params, self.opt_state, self.rng, self.data_iter, **kw)


def setup(config, workdir: str, *, mesh: str, dcn_mesh: str | None = None,
          data_dir: str | None = None, steps_flag: int | None = None,
          strict_restore: bool = False, compilation_cache: str | None = None,
          allow_config_change: bool = False) -> Run:
  """Everything before the first step, in this order: the mesh (``devices.open_mesh``), the plan
  (data generated into the workdir if no ``data_dir``, settings and data checked once:
  ``plan.train_plan``), the model, the resume compared with the recorded run
  (``run_info.check_resume``, before anything is written), the data iterator (packed capacities:
  ``capacity``), the train step and optimizer, the state restored from the latest good
  checkpoint (or freshly initialised), then the run info."""
  bs = config.data.batch_size
  mesh_, rules = devices.open_mesh(config, mesh, dcn_mesh, {
      "config.data.batch_size": bs, "config.data.batch_size / config.train.microbatches":
      bs // int(config.train.get("microbatches", 1))}, compilation_cache)
  plan = train_plan(config, workdir, data_dir, steps_flag)   # data, surfaces, epochs, validation
  data_dir, schema = plan.data_dir, plan.schema
  model = fit_and_build_model(config, schema)
  ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"),
                                 keep=config.train.keep_checkpoints)
  if ckpt.all_steps():
    run_info.check_resume(workdir, config, schema, plan.train_records, allow_config_change)

  # packed towers: a block per batch x context shard and microbatch (step.split_microbatches)
  blocks = local_blocks(mesh_, rules) * int(config.train.get("microbatches", 1))
  capacity = jagged_capacity(config.data, data_dir, config.data.train_split,
                             model_config.seq_lens(config), jax.process_count(), blocks)
  try:
    ds = pipeline.make_dataset(config.data, data_dir, config.data.train_split,
                               model_config.seq_lens(config), train=True,
                               shard_index=jax.process_index(), shard_count=jax.process_count(),
                               jagged_capacity=capacity, jagged_shards=blocks)
  except (ValueError, FileNotFoundError) as e:       # as eval_setup: one line, no traceback
    startup.fail(f"config.data.train_split={config.data.train_split!r} in {data_dir}: {e}")
  example = next(iter(ds))           # shapes only; the training iterator starts fresh below
  data_iter = iter(ds)
  init_rng, train_rng = jax.random.split(jax.random.key(config.seed))
  task_w = plan.task_weights
  if config.train.get("remat", "none") == "auto":   # the least recompute that fits a device
    model = pick_remat(config, schema, example, mesh_, rules, init_rng, task_w)
  ts, params, opt_state = step_lib.build(config, model, example, mesh_, rules, init_rng,
                                         task_weights=task_w)
  start = 0
  restored = ckpt.restore_latest(checkpoint.abstract_like(params),   # falls back past bad steps
                                 checkpoint.abstract_like(opt_state), data_iter,
                                 strict=strict_restore)
  if restored is not None:
    start, params, opt_state, train_rng = restored
    print(f"resumed from step {start} ({ckpt.directory})", flush=True)
  run_info.save_run_info(workdir, config, data_dir, schema, plan.train_records)  # after restore
  return Run(config, workdir, data_dir, schema, plan, mesh_, rules, model, data_iter, ts, ckpt,
             params, opt_state, train_rng, start, start)


def pick_remat(config, schema, example, mesh, rules, rng, task_weights):
  """``train.remat=auto``: the model under ``step.pick_remat``'s policy for this device's
  memory x ``train.remat_memory`` (printed; one line if none fits)."""
  memory = step_lib.device_memory()
  budget = None if memory is None else int(memory * float(config.train.remat_memory))
  try:
    name, _ = step_lib.pick_remat(lambda r: fit_and_build_model(config, schema, r),
                                  config, example, mesh, rules, rng, budget,
                                  task_weights=task_weights)
  except ValueError as e:
    startup.fail(str(e))
  why = "no device memory figure (CPU)" if budget is None else f"fits {budget / 2**30:.1f} GiB"
  print(f"train.remat=auto: {name} ({why})", flush=True)
  return fit_and_build_model(config, schema, name)


@dataclasses.dataclass(eq=False)
class EvalRun:
  """What eval.py's loop works on: the model and restored params on the mesh, and the split."""
  config: object
  data_dir: str
  schema: object
  mesh: object
  rules: object
  model: object
  step: int
  params: object
  batches: object            # iterator over the split's host batches
  batch_sharding: object


def eval_setup(workdir: str, ckpt: checkpoint.Checkpointer, *, config=None,
               trust_workdir: bool = False, data_dir: str | None = None, split: str,
               batch_size: int | None = None, step: int | None = None, mesh: str,
               dcn_mesh: str | None = None, compilation_cache: str | None = None) -> EvalRun:
  """eval.py's set-up after its flag and output checks: the config and data directory (given, or
  recorded in ``workdir``), mesh, model, the batches of ``split`` and the params of checkpoint
  ``step`` of ``ckpt`` (default the latest); problems are FatalErrors."""
  config, saved_data_dir = run_info.run_config(workdir, config, trust_workdir)
  data_dir = data_dir or saved_data_dir
  if not data_dir:
    startup.fail("no --data_dir given and none recorded in the workdir")
  bs = batch_size or config.data.get("eval_batch_size", 0) or config.data.batch_size
  mesh_, rules = devices.open_mesh(config, mesh, dcn_mesh, {"eval batch size": bs},
                                  compilation_cache)
  schema, remap = run_info.schema_as_trained(run_info.saved_run_info(workdir),
                                             load_schema(data_dir), f"--workdir={workdir}")
  check_data_files(data_dir, split)
  model = fit_and_build_model(config, schema)
  data_cfg = config.data.copy_and_resolve_references()
  data_cfg.batch_size = bs
  blocks = local_blocks(mesh_, rules)
  try:
    capacity = jagged_capacity(data_cfg, data_dir, split, model_config.seq_lens(config),
                               jax.process_count(), blocks)
    ds = pipeline.make_dataset(data_cfg, data_dir, split, model_config.seq_lens(config),
                               train=False, shard_index=jax.process_index(),
                               shard_count=jax.process_count(), jagged_capacity=capacity,
                               jagged_shards=blocks)
  except (ValueError, FileNotFoundError) as e:
    startup.fail(f"--split={split} in {data_dir}: {e}")
  it = iter(ds) if remap is None else map(remap, ds)      # surfaces / tasks matched by name
  first = next(it, None)
  if first is None:
    startup.fail(f"split {split!r} in {data_dir} is empty")
  abstract = partition.abstract_params(model, jax.random.key(0), first, mesh_, rules)
  try:
    step, params = ckpt.restore_params(abstract, step)
  except checkpoint.CheckpointError as e:
    startup.fail(str(e))
  return EvalRun(config, data_dir, schema, mesh_, rules, model, step, params,
                 itertools.chain([first], it), partition.batch_sharding(mesh_, rules))


class StepAccounting:
  """Per-step bookkeeping of the loop: statistics fetched ``metrics_lag`` steps late (drained
  before a log line, checkpoint, validation, stop or the end), non-finite steps (skipped; too many
  in a row stop the run), the loss / NE window and its progress line (step time, examples/s,
  MFU), and when a step is logged, saved or validated."""

  def __init__(self, run: Run, prog, evaluator):
    self.run, self.prog, self.evaluator = run, prog, evaluator
    self.train_cfg, self.total = run.config.train, run.plan.total
    self.running = RunningNE(run.schema.task_names)
    self.flops = FlopMeter(run.config, run.schema, scale=jax.process_count())   # actual lengths
    self.peak = progress.device_peak_flops()
    self.lagged = progress.LaggedStats(int(self.train_cfg.get("metrics_lag", 1)))
    self.ok = True                   # the newest fetched step's update was applied
    self.bad_in_row = self.bad_total = 0
    self.window_loss, self.window_n, self.window_t0, self.times = 0.0, 0, None, []

  def save_due(self, step: int) -> bool:
    return step % self.train_cfg.checkpoint_every == 0 and step < self.total

  def drain_due(self, step: int, stopping: bool) -> bool:
    ev = self.evaluator
    valid = ev.on and (step % ev.plan.every == 0 or step == ev.plan.total)
    return (self.save_due(step) or step == self.total or stopping
            or step % self.train_cfg.log_every == 0 or valid)

  def push(self, step: int, stats) -> None:
    self.lagged.push(step, stats)

  def drain(self, everything: bool = True) -> None:
    """Accounts for the fetched steps (every pending one with ``everything``)."""
    for rec in self.lagged.pop(everything):
      self.ok = self.consume(*rec)

  def pause(self) -> None:
    """The time since the last step (a validation) is not a step time."""
    self.times.clear()

  def disk_full(self) -> str | None:
    return self.run.ckpt.disk_full or self.prog.disk_full or self.evaluator.disk_full

  def consume(self, at: int, stats, now: float) -> bool:
    """Bad-step accounting, running NE and the log line for the (fetched) stats of step ``at``;
    returns whether the step's update was applied."""
    c = self.train_cfg
    if self.window_t0 is None:       # the first step includes compilation: not timed
      self.window_t0 = now
    else:
      self.times.append(now)
    if not stats["ok"]:
      self.bad_in_row += 1
      self.bad_total += 1
      print(f"step {at}: non-finite loss or gradient (loss={stats['loss']}, "
            f"grad_norm={stats['grad_norm']}); update skipped ({self.bad_in_row} in a row)",
            flush=True)
      if self.bad_in_row > c.max_bad_steps:
        self.run.ckpt.close()
        startup.fail(f"{self.bad_in_row} consecutive non-finite steps (> config.train."
                     f"max_bad_steps={c.max_bad_steps}) at step {at}; stopping without a "
                     "checkpoint")
      return False
    self.bad_in_row = 0
    self.running.update(stats["loss_sum"], stats["pos_sum"], stats["count"])
    self.window_loss += float(stats["loss"])
    self.window_n += 1
    if at % c.log_every == 0 or at == self.total:
      times = self.times
      dt = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else float("nan")
      self.prog.log(at, {
          "loss": self.window_loss / max(self.window_n, 1), "ne": self.running.value(),
          "grad_norm": float(stats["grad_norm"]), "step_time_ms": 1e3 * dt,
          "examples_per_s": self.run.config.data.batch_size / dt, "bad_steps": self.bad_total,
          "skipped_records": pipeline.invalid_counts(self.run.data_iter),
          "dropped_events": pipeline.dropped_events(self.run.data_iter),
          "mfu": progress.mfu(self.flops.per_step(), dt, self.run.mesh.devices.size,
                              self.peak)})
      self.running.reset()
      self.window_loss, self.window_n, self.times = 0.0, 0, times[-1:]
    return True


def packed_capacities(batch) -> tuple:
  """``((stream, N), ...)`` of a host batch's packed streams (one entry per capacity bucket)."""
  return tuple(sorted((s, len(ev["seg"])) for s, ev in batch["events"].items() if "seg" in ev))


def train(run: Run, profile: tuple[int, int] | None = None, profile_dir: str | None = None):
  """The train loop from ``run.step`` to the plan's total: saves every ``checkpoint_every``
  steps, validates when due, stops cleanly on SIGTERM / SIGINT, a full disk or a data error."""
  total = run.plan.total
  is_main = jax.process_index() == 0
  prog = progress.Progress(run.workdir, total, enabled=is_main)
  if is_main:
    print(f"mesh {mesh_lib.describe(run.mesh)}, rules {run.config.sharding.rules!r}, "
          f"{sum(x.size for x in jax.tree.leaves(run.params)):,} params, "
          f"batch {run.config.data.batch_size}, "
          f"steps {run.start}->{total}, data {run.data_dir}", flush=True)
  evaluator = evaluation.ValidSplitEvaluator(
      run.config, run.data_dir, run.schema, run.model, run.plan,
      run.train_step.batch_sharding, run.workdir, prog if is_main else None)
  acct = StepAccounting(run, prog, evaluator)
  stop = StopFlag(describe=lambda: f"step {run.step} (latest checkpoint: step "
                                   f"{run.ckpt.latest_step()})")
  profiling, capacities = False, set()
  with partition.activate(run.mesh, run.rules):
    while run.step < total:
      if profile and run.step == profile[0]:
        jax.profiler.start_trace(profile_dir or os.path.join(run.workdir, "profile"))
        profiling = True
      with jax.profiler.StepTraceAnnotation("train", step_num=run.step):
        try:
          host_batch = next(run.data_iter)
        except DataError as e:
          _stop_data_error(run, acct, e)
        acct.flops.add(host_batch)
        caps = packed_capacities(host_batch)
        if caps not in capacities:
          if capacities and is_main:
            print(f"packed towers: the first batch at capacities {dict(caps)} "
                  "(data.jagged_buckets): compiling its train step", flush=True)
          capacities.add(caps)
        batch = pipeline.device_put_batch(host_batch, run.train_step.batch_sharding)
        run.params, run.opt_state, stats = run.train_step.fn(run.params, run.opt_state, batch,
                                                             run.rng, run.step)
      run.step += 1
      acct.push(run.step, stats)
      if profiling and run.step == profile[1]:
        jax.block_until_ready(run.params)
        jax.profiler.stop_trace()
        profiling = False
      acct.drain(acct.drain_due(run.step, stop.signum is not None))
      if prog.disk_full:
        _stop_disk_full(run, acct)
      if not acct.ok:                # a skipped step: no checkpoint or stop before a good one
        continue
      if acct.save_due(run.step):
        run.save()
      if evaluator(run.step, run.params):
        acct.pause()
      if acct.disk_full():
        _stop_disk_full(run, acct)
      if stop.signum is not None:
        print(f"received signal {stop.signum}: saving step {run.step} and exiting (signal again "
              "to exit at once without saving)", flush=True)
        break
  if profiling:
    jax.profiler.stop_trace()
  if run.step >= total:
    evaluator(run.step, run.params)  # no-op unless the last step was skipped
  run.save()
  run.ckpt.settle()
  if acct.disk_full():
    _stop_disk_full(run, acct)
  evaluator.close()
  run.ckpt.wait()
  steps = run.ckpt.all_steps()
  run.ckpt.close()
  prog.close()
  if is_main:
    print(f"done: step {run.step}, checkpoints {steps} in {run.ckpt.directory}", flush=True)


def _close(run: Run, acct: StepAccounting) -> None:
  acct.evaluator.close()
  acct.prog.close()
  run.ckpt.close()


def _stop_disk_full(run: Run, acct: StepAccounting):
  """A write failed for lack of space: keep the newest good checkpoint (remove what failed saves
  left, then try once more to save this step) and stop with one line."""
  err = acct.disk_full()
  acct.drain()
  ckpt = run.ckpt
  ckpt.settle()                                  # the async save in flight, if any
  ckpt.remove_tmp_dirs()                         # partial steps: frees their space
  acct.evaluator.remove_tmp_dirs()
  good = ckpt.latest_step()
  if acct.ok and (good is None or good < run.step):   # the last attempt to keep this step
    run.save(last_try=True)
    ckpt.settle()
    ckpt.remove_tmp_dirs()
    good = ckpt.latest_step()
  _close(run, acct)
  startup.fail(f"disk full ({err}): stopped at step {run.step}; the newest good checkpoint is "
               f"{'step ' + str(good) if good is not None else 'none'} in {ckpt.directory}; "
               "free some space and run the same command again to resume")


def _stop_data_error(run: Run, acct: StepAccounting, e: Exception):
  """A data error mid-run (damaged shard, invalid record): save this step first, then stop
  (single process: under several, the others are not at this point to save with it)."""
  acct.drain()
  if acct.ok and run.step > run.start and jax.process_count() == 1:
    run.save()                                   # position: the batches used
    run.ckpt.settle()
    if run.step in run.ckpt.all_steps():
      print(f"data error after step {run.step}: saved checkpoint {run.step} before stopping",
            flush=True)
  _close(run, acct)
  raise e
