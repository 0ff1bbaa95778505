"""Trains a Kunlun model; resumes automatically from the latest checkpoint in --workdir.

  python train.py --config=kunlun/configs/tiny.py --workdir=/tmp/kunlun_tiny
  python train.py --config=kunlun/configs/dev.py --config.train.lr=1e-3 \
      --workdir=runs/dev --mesh=data=1,fsdp=-1 --data_dir=/data/dev --profile_steps=20:25

  python train.py --show_config [--config=...] [--config.a.b=value]   # every field, described

SIGTERM / SIGINT finish the current step, save a checkpoint and exit 0. Settings are checked
before any data is read (kunlun/train/settings.py); the workdir is locked against a second
train.py (kunlun/train/lock.py); a full disk stops the run with the newest good checkpoint kept.
"""

from __future__ import annotations

import os
import signal
import sys

from absl import app, flags

from kunlun.train import flags as runtime_flags

_HERE = os.path.dirname(os.path.abspath(__file__))
runtime_flags.define_config("train.py", os.path.join(_HERE, "kunlun/configs/tiny.py"),
                            "Config file; override fields with --config.a.b=value.")
flags.DEFINE_string("workdir", None, "Checkpoints, metrics.jsonl, tb/ and (generated) data/ "
                    "(required; one train.py at a time: train.lock).")
flags.DEFINE_bool("show_config", False, "Print every config field (overrides applied) with its "
                  "value and a one-line description, then exit.")
flags.DEFINE_string("mesh", "data=1,fsdp=-1,tensor=1,context=1,expert=1",
                    "Mesh axis sizes within a host (one -1 absorbs the remaining devices).")
flags.DEFINE_string("dcn_mesh", None, "Mesh axis sizes across hosts / slices (e.g. data=2).")
flags.DEFINE_integer("steps", None, "Total training steps (overrides config.train.steps).")
flags.DEFINE_string("data_dir", None, "Dataset directory; absent: generate config.data.preset "
                    "into <workdir>/data once and reuse it.")
flags.DEFINE_string("profile_steps", None,
                    "START:END: capture a jax.profiler trace of these steps.")
flags.DEFINE_string("profile_dir", None, "Trace output directory (default <workdir>/profile).")
runtime_flags.define(train=True)
FLAGS = flags.FLAGS


def parse_profile_steps(spec: str | None):
  from kunlun.train.runtime import fail
  if not spec:
    return None
  try:
    a, b = (int(x) for x in spec.split(":"))
  except ValueError:
    fail(f"--profile_steps={spec}: expected START:END (integers)")
  if not 0 <= a < b:
    fail(f"--profile_steps={spec}: need 0 <= START < END")
  return a, b


class _StopFlag:
  """Set by SIGTERM / SIGINT; the loop saves and exits after the current step."""

  def __init__(self):
    self.signum = None
    for s in (signal.SIGTERM, signal.SIGINT):
      signal.signal(s, self._handle)

  def _handle(self, signum, _):
    if self.signum is not None:       # second signal: give up immediately
      signal.signal(signum, signal.SIG_DFL)
      os.kill(os.getpid(), signum)
    self.signum = signum


def show_config(config) -> None:
  """``--show_config``: every field of the config (overrides applied), its value and what it is."""
  from kunlun.train import settings
  try:
    settings.check(config)
    status = "all settings within their allowed ranges"
  except settings.SettingsError as e:
    status = f"NOT VALID: {e}"
  print(f"# config {_config_file()}, overrides applied: {status}")
  print("\n".join(settings.describe(config)))


def _config_file() -> str:
  given = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--config=")]
  return given[-1] if given else "kunlun/configs/tiny.py (default)"


def train(argv):
  del argv
  from kunlun.train import runtime
  config = FLAGS.config
  if FLAGS.show_config:
    show_config(config)
    return
  if not FLAGS.workdir:
    runtime.fail("--workdir is required (checkpoints, metrics and generated data go there)")
  runtime.check_settings(config, steps_flag=FLAGS.steps)   # before any data, jax or compile
  if FLAGS.steps is not None:
    config.train.steps = FLAGS.steps
  profile = parse_profile_steps(FLAGS.profile_steps)
  workdir = os.path.abspath(FLAGS.workdir)
  runtime.maybe_initialize_distributed(FLAGS.coordinator_address, FLAGS.num_processes,
                                       FLAGS.process_id)
  lock = runtime.prepare_workdir(workdir)       # one writer: a second train.py stops here
  try:
    _train(config, workdir, profile)
  finally:
    lock.release()


def _train(config, workdir: str, profile):
  import jax
  import numpy as np

  from kunlun.train import runtime

  runtime.enable_compilation_cache(FLAGS.compilation_cache)
  mesh = runtime.build_mesh(FLAGS.mesh, FLAGS.dcn_mesh)
  rules = runtime.get_rules(config.sharding.rules)
  runtime.check_batch_size(config.data.batch_size, mesh, rules, "config.data.batch_size")
  microbatches = int(config.train.get("microbatches", 1))
  runtime.check_batch_size(config.data.batch_size // microbatches, mesh, rules,
                           "config.data.batch_size / config.train.microbatches")

  data_dir = FLAGS.data_dir or runtime.synthetic_data_dir(workdir, config)
  schema = runtime.load_schema(data_dir)
  task_w = tuple(config.train.get("task_weights", ()) or ())
  if task_w and len(task_w) != len(schema.tasks):
    runtime.fail(f"config.train.task_weights={task_w} needs one weight per task "
                 f"{schema.task_names}")
  runtime.check_data_files(data_dir, config.data.train_split)
  from kunlun.train import validation
  run_plan = validation.plan(config, schema, data_dir, FLAGS.steps)   # surfaces, epochs, valid
  total = run_plan.total
  model = runtime.build_model(config, schema)
  runtime.save_run_info(workdir, config, data_dir)

  from data import pipeline
  from kunlun import config as model_config
  from kunlun.flops import FlopMeter
  from kunlun.train import checkpoint, optim, progress
  from kunlun.train import step as step_lib
  from kunlun.train.metrics import RunningNE
  from sharding import mesh as mesh_lib
  from sharding import partition

  seq_lens = model_config.seq_lens(config)
  ds = pipeline.make_dataset(config.data, data_dir, config.data.train_split, seq_lens,
                             train=True, shard_index=jax.process_index(),
                             shard_count=jax.process_count())
  example = next(iter(ds))           # shapes only; the training iterator starts fresh below
  data_iter = iter(ds)

  rng = jax.random.key(config.seed)
  init_rng, train_rng = jax.random.split(rng)
  params, p_shard = partition.init_sharded(model, init_rng, example, mesh, rules)
  schedule_steps = int(config.train.get("schedule_steps", 0)) or total
  tx = optim.make_optimizer(config.train, schedule_steps)
  sparse_update = (optim.make_sparse_update(config.train, schedule_steps)
                   if config.train.get("sparse_embedding_update", False) else None)
  o_shard = optim.opt_state_shardings(tx, checkpoint.abstract_like(params), p_shard, mesh)
  opt_state = jax.jit(tx.init, out_shardings=o_shard)(params)
  b_shard = partition.batch_sharding(mesh, rules)

  ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"),
                                 keep=config.train.keep_checkpoints)
  start = 0
  restored = ckpt.restore_latest(checkpoint.abstract_like(params),   # falls back past bad steps
                                 checkpoint.abstract_like(opt_state), data_iter,
                                 strict=FLAGS.strict_restore)
  if restored is not None:
    start, params, opt_state, train_rng = restored
    print(f"resumed from step {start} ({ckpt.directory})", flush=True)

  train_step = step_lib.make_train_step(
      model, tx, np.asarray(task_w, np.float32) if task_w else None, sparse_update=sparse_update,
      param_shardings=p_shard, opt_shardings=o_shard, batch_sharding=b_shard,
      microbatches=microbatches)

  is_main = jax.process_index() == 0
  prog = progress.Progress(workdir, total, enabled=is_main)
  flop_meter = FlopMeter(config, schema, scale=jax.process_count())   # at the actual lengths
  peak = progress.device_peak_flops()
  n_dev = mesh.devices.size
  if is_main:
    print(f"mesh {mesh_lib.describe(mesh)}, rules {config.sharding.rules!r}, "
          f"{sum(x.size for x in jax.tree.leaves(params)):,} params, "
          f"batch {config.data.batch_size}, "
          f"steps {start}->{total}, data {data_dir}", flush=True)

  validate = validation.Validator(config, data_dir, schema, model, run_plan, b_shard, workdir,
                                  prog if is_main else None)
  stop = _StopFlag()
  running = RunningNE(schema.task_names)
  bad_in_row = bad_total = 0
  window_loss, window_n, window_t0, times = 0.0, 0, None, []
  # statistics stay on the device and are fetched metrics_lag steps later (never blocking the
  # device queue); every pending step is drained before a log line, checkpoint, stop or the end
  lagged = progress.LaggedStats(int(config.train.get("metrics_lag", 1)))
  valid_due = lambda s: validate.on and (s % validate.plan.every == 0 or s == validate.plan.total)

  def consume(at, stats, now) -> bool:
    """Bad-step accounting, running NE and the log line for the (fetched) stats of step ``at``;
    returns whether the step's update was applied."""
    nonlocal bad_in_row, bad_total, window_loss, window_n, window_t0, times
    if window_t0 is None:            # the first step includes compilation: not timed
      window_t0 = now
    else:
      times.append(now)
    if not stats["ok"]:
      bad_in_row += 1
      bad_total += 1
      print(f"step {at}: non-finite loss or gradient (loss={stats['loss']}, "
            f"grad_norm={stats['grad_norm']}); update skipped ({bad_in_row} in a row)",
            flush=True)
      if bad_in_row > config.train.max_bad_steps:
        ckpt.close()
        runtime.fail(f"{bad_in_row} consecutive non-finite steps (> config.train.max_bad_steps="
                     f"{config.train.max_bad_steps}) at step {at}; stopping without a "
                     "checkpoint")
      return False
    bad_in_row = 0
    running.update(stats["loss_sum"], stats["pos_sum"], stats["count"])
    window_loss += float(stats["loss"])
    window_n += 1
    if at % config.train.log_every == 0 or at == total:
      dt = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else float("nan")
      prog.log(at, {
          "loss": window_loss / max(window_n, 1), "ne": running.value(),
          "grad_norm": float(stats["grad_norm"]), "step_time_ms": 1e3 * dt,
          "examples_per_s": config.data.batch_size / dt, "bad_steps": bad_total,
          "skipped_records": pipeline.invalid_counts(data_iter),
          "mfu": progress.mfu(flop_meter.per_step(), dt, n_dev, peak)})
      running.reset()
      window_loss, window_n, times = 0.0, 0, times[-1:]
    return True

  profiling = False
  ok = True
  step = start

  def drain_all() -> None:
    nonlocal ok
    for rec in lagged.pop(True):
      ok = consume(*rec)

  def stop_disk_full():
    """A write failed for lack of space: keep the newest good checkpoint (remove what failed saves
    left, then try once more to save this step) and stop with one line."""
    err = ckpt.disk_full or prog.disk_full or validate.disk_full
    drain_all()
    ckpt.settle()                                  # the async save in flight, if any
    ckpt.remove_tmp_dirs()                         # partial steps: frees their space
    validate.remove_tmp_dirs()
    good = ckpt.latest_step()
    if ok and (good is None or good < step):       # the last attempt to keep this step
      ckpt.save(step, params, opt_state, train_rng, data_iter, last_try=True)
      ckpt.settle()
      ckpt.remove_tmp_dirs()
      good = ckpt.latest_step()
    validate.close()
    prog.close()
    ckpt.close()
    runtime.fail(f"disk full ({err}): stopped at step {step}; the newest good checkpoint is "
                 f"{'step ' + str(good) if good is not None else 'none'} in {ckpt.directory}; "
                 "free some space and run the same command again to resume")

  def stop_data_error(e):
    """A data error mid-run (damaged shard, invalid record): save this step first, then stop
    (single process: under several, the others are not at this point to save with it)."""
    drain_all()
    if ok and step > start and jax.process_count() == 1:
      ckpt.save(step, params, opt_state, train_rng, data_iter)   # position: the batches used
      ckpt.settle()
      if step in ckpt.all_steps():
        print(f"data error after step {step}: saved checkpoint {step} before stopping",
              flush=True)
    validate.close()
    prog.close()
    ckpt.close()
    raise e

  from data.shards import DataError
  with partition.activate(mesh, rules):
    while step < total:
      if profile and step == profile[0]:
        jax.profiler.start_trace(FLAGS.profile_dir or os.path.join(workdir, "profile"))
        profiling = True
      with jax.profiler.StepTraceAnnotation("train", step_num=step):
        try:
          host_batch = next(data_iter)
        except DataError as e:
          stop_data_error(e)
        flop_meter.add(host_batch)
        batch = pipeline.device_put_batch(host_batch, b_shard)
        params, opt_state, stats = train_step(params, opt_state, batch, train_rng, step)
      step += 1
      lagged.push(step, stats)
      if profiling and step == profile[1]:
        jax.block_until_ready(params)
        jax.profiler.stop_trace()
        profiling = False
      save = step % config.train.checkpoint_every == 0 and step < total
      drain = (save or step == total or stop.signum is not None
               or step % config.train.log_every == 0 or valid_due(step))
      for rec in lagged.pop(drain):
        ok = consume(*rec)
      if prog.disk_full:
        stop_disk_full()
      if not ok:                     # a skipped step: no checkpoint or stop before a good one
        continue
      if save:
        ckpt.save(step, params, opt_state, train_rng, data_iter)
      if validate(step, params):
        times.clear()                # the validation pause is not a step time
      if ckpt.disk_full or prog.disk_full or validate.disk_full:
        stop_disk_full()
      if stop.signum is not None:
        print(f"received signal {stop.signum}: saving step {step} and exiting", flush=True)
        break
  if profiling:
    jax.profiler.stop_trace()
  if step >= total:
    validate(step, params)           # no-op unless the last step was skipped
  ckpt.save(step, params, opt_state, train_rng, data_iter)
  ckpt.settle()
  if ckpt.disk_full or prog.disk_full or validate.disk_full:
    stop_disk_full()
  validate.close()
  ckpt.wait()
  steps = ckpt.all_steps()
  ckpt.close()
  prog.close()
  if is_main:
    print(f"done: step {step}, checkpoints {steps} in {ckpt.directory}", flush=True)


def main(argv):
  from kunlun.train.runtime import run_main
  run_main("train.py", train, argv)


if __name__ == "__main__":
  app.run(main, flags_parser=runtime_flags.parser("train.py"))
