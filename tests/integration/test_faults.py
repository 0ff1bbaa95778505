"""Fault injection on train.py / eval.py (issue 15), kept short: 6 steps of the DLRM baseline on
tiny data (the checkpoint and data machinery is the same for every architecture, and DLRM
compiles in a third of Kunlun's time), checkpoints every 2, one shared uninterrupted baseline. Faults come from ``bench/faults/hooks.py`` (patched library
calls, nothing in the programs); ``bench/faults/run.py`` runs the long version (20+ random kills).

* a damaged latest checkpoint: eval.py (default step and --step) fails in one line; train.py
  warns, moves it aside, resumes from the step before and ends bitwise equal to the baseline;
* SIGKILL while the async save of step 4 is being written: the step is never used, the resumed
  run ends bitwise equal to the baseline;
* a train shard with damaged chunks under skip_invalid: the run finishes, skips are counted as
  ``bytes`` in metrics.jsonl and the checkpoint's iterator state, and a resume from step 2 ends
  bitwise equal, with the same counts.
* a data error mid-run: the step reached is saved first; the resumed run ends bitwise equal;
* SIGKILL while eval.py writes --predictions: the previous file is intact and no metrics.json
  claims a finished evaluation;
* a full disk (a 2 MB tmpfs workdir; an injected ENOSPC where mounting is not allowed): one
  error line, no traceback, no partial checkpoint left, the newest good checkpoint restores.
"""

import json
import os
import shutil

import numpy as np
import pytest

from bench.faults.run import committed, flip_shard_bytes, iter_state, params
from tests import fs_faults, subproc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 6
ARGS = [f"--steps={STEPS}", "--config.train.checkpoint_every=2", "--config.train.log_every=1",
        "--config.data.num_threads=1", "--config.model.arch=dlrm"]


def run(script, args, progs, faults=None, check=True):
  """``python bench/faults/hooks.py script args`` with ``faults``, forked from the module's one
  interpreter (tests/subproc.Programs: jax & co. imported once); generous limit, the child's
  last output shown on failure."""
  extra = {"KUNLUN_FAULTS": json.dumps(faults)} if faults else {}
  return progs.run1([os.path.join(ROOT, "bench", "faults", "hooks.py"), script, *args],
                    env=extra, check=check)


def no_noise(p):
  out = p.stdout + p.stderr
  assert "Traceback" not in out and "Event loop is closed" not in out, out[-3000:]
  assert "tensorstore_spec" not in out


def one_line_error(p, prog):
  no_noise(p)
  assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
  lines = [x for x in p.stderr.splitlines() if x.strip()]
  errors = [x for x in lines if x.startswith(f"{prog}: error: ")]
  assert len(errors) == 1 and errors[0] == lines[-1], lines
  return errors[0]


def assert_same_params(a, b):
  la, lb = params(a, STEPS), params(b, STEPS)     # read with orbax, as numpy
  assert [k for k, _ in la] == [k for k, _ in lb] and len(la) > 10
  for (k, x), (_, y) in zip(la, lb, strict=True):
    np.testing.assert_array_equal(x, y, err_msg=k)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  from data import synthetic
  base = tmp_path_factory.mktemp("faults")
  data = str(base / "data")
  synthetic.generate(data, "tiny", num_examples=2000, seed=0)
  e = dict(os.environ)
  e.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1", PYTHONPATH=ROOT,
           XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} "        # the suite's (tests/conftest.py)
                     "--xla_force_host_platform_device_count=1",
           KUNLUN_COMPILATION_CACHE=subproc.compile_cache(base / "xla_cache"))
  with subproc.Programs(e, subproc.TRAIN_MODULES) as progs:
    yield {"base": base, "data": data, "progs": progs}


@pytest.fixture(scope="module")
def baseline(env):
  wd = str(env["base"] / "baseline")
  run("train.py", [f"--workdir={wd}", f"--data_dir={env['data']}", *ARGS], env["progs"])
  return wd


def test_damaged_checkpoint_eval_errors_and_train_falls_back(env, baseline):
  wd = str(env["base"] / "damaged")
  shutil.copytree(baseline, wd, ignore=shutil.ignore_patterns("tb"))
  for root, _, files in os.walk(os.path.join(wd, "checkpoints", str(STEPS), "params")):
    for f in files:
      if "ocdbt" in root or os.path.basename(root) == "d":
        with open(os.path.join(root, f), "r+b") as fh:
          fh.truncate(10)
  for extra in ([], [f"--step={STEPS}"]):
    err = one_line_error(run("eval.py", [f"--workdir={wd}", *extra], env["progs"], check=False),
                         "eval.py")
    assert f"checkpoints/{STEPS} could not be restored" in err and "older steps: [2, 4]" in err
  p = run("train.py", [f"--workdir={wd}", f"--data_dir={env['data']}", *ARGS], env["progs"])
  no_noise(p)
  assert "resumed from step 4" in p.stdout
  assert f"checkpoints/{STEPS} could not be restored" in p.stderr and "moved it to" in p.stderr
  moved = [d for d in os.listdir(os.path.join(wd, "checkpoints")) if d.startswith("6.corrupt-")]
  assert len(moved) == 1
  assert_same_params(baseline, wd)


def test_sigkill_during_async_save_resumes_bitwise(env, baseline):
  wd = str(env["base"] / "killed")
  args = [f"--workdir={wd}", f"--data_dir={env['data']}", *ARGS]
  p = run("train.py", args, env["progs"], faults={"kill_after_save": 4}, check=False)
  assert p.returncode == -9
  assert 4 not in [int(d) for d in os.listdir(os.path.join(wd, "checkpoints")) if d.isdigit()
                   and os.path.exists(os.path.join(wd, "checkpoints", d, "commit_success.txt"))]
  p = run("train.py", args, env["progs"])
  no_noise(p)
  assert "resumed from step 2" in p.stdout
  assert_same_params(baseline, wd)
  assert iter_state(wd, STEPS)["plan"] == iter_state(baseline, STEPS)["plan"]


def test_damaged_shard_skipped_counted_and_resumed_exactly(env):
  data = str(env["base"] / "data_damaged")
  shutil.copytree(env["data"], data)
  path = os.path.join(data, "train", "feed-00000-of-00001.arrayrecord")
  flip_shard_bytes(path)
  # the manifest's size still matches (flipped bytes): start-up passes, the damage is met later
  wd = str(env["base"] / "skip")
  args = [f"--data_dir={data}", *ARGS, "--config.data.skip_invalid=True"]
  p = run("train.py", [f"--workdir={wd}", *args], env["progs"])
  no_noise(p)
  assert "warning: skipping invalid record (1 so far" in p.stderr and "damaged chunk" in p.stderr
  logged = [json.loads(x) for x in open(os.path.join(wd, "metrics.jsonl"))]
  skipped = logged[-1]["skipped_records"]
  assert set(skipped) == {"bytes"} and skipped["bytes"] > 0
  assert iter_state(wd, STEPS)["invalid"] == skipped
  # resume from step 2 (later steps removed): the same final params and counts
  wd2 = str(env["base"] / "skip_resumed")
  shutil.copytree(wd, wd2, ignore=shutil.ignore_patterns("tb", "metrics.jsonl"))
  for s in (4, 6):
    shutil.rmtree(os.path.join(wd2, "checkpoints", str(s)))
  p = run("train.py", [f"--workdir={wd2}", *args], env["progs"])
  assert "resumed from step 2" in p.stdout
  assert_same_params(wd, wd2)
  assert iter_state(wd2, STEPS)["invalid"] == skipped
  # without skip_invalid: a one-line error naming the file and the damaged record range
  err = one_line_error(run("train.py", [f"--workdir={env['base'] / 'noskip'}",
                                        f"--data_dir={data}", *ARGS], env["progs"], check=False),
                       "train.py")
  assert f"{path}: record" in err and "damaged chunk" in err and "skip_invalid" in err


def test_data_error_mid_run_saves_first_and_resumes_exactly(env, baseline):
  """A damaged chunk met after 3 steps (checkpoints every 2): step 3 is saved before the one-line
  error, and the rerun resumes from it and ends bitwise equal to the uninterrupted run."""
  wd = str(env["base"] / "data_error")
  args = [f"--workdir={wd}", f"--data_dir={env['data']}", *ARGS]
  p = run("train.py", args, env["progs"], faults={"data_error_at_step": 3}, check=False)
  err = one_line_error(p, "train.py")
  assert "damaged chunk" in err and "skip_invalid" in err
  assert "saved checkpoint 3 before stopping" in p.stdout
  assert committed(wd) == [2, 3]
  p = run("train.py", args, env["progs"])
  assert "resumed from step 3" in p.stdout
  assert_same_params(baseline, wd)


def test_sigkill_while_writing_predictions_leaves_no_partial_output(env, baseline):
  """eval.py killed halfway through writing --predictions: the file at that path is still the
  previous complete one (written beside it, renamed when whole) and no metrics.json says the
  evaluation finished (it is written last)."""
  import pyarrow as pa
  import pyarrow.parquet as pq
  out, preds = str(env["base"] / "kill_eval.json"), str(env["base"] / "kill_preds.parquet")
  pq.write_table(pa.table({"previous": [1, 2, 3]}), preds)
  before = open(preds, "rb").read()
  p = run("eval.py", [f"--workdir={baseline}", f"--out={out}", f"--predictions={preds}"],
          env["progs"], faults={"kill_in_write": "parquet"}, check=False)
  assert p.returncode == -9, p.stderr[-2000:]
  assert open(preds, "rb").read() == before
  assert pq.read_table(preds).column("previous").to_pylist() == [1, 2, 3]
  assert not os.path.exists(out)


def test_full_disk_stops_in_one_line_keeping_the_newest_checkpoint(env, tmp_path):
  """The workdir on a 2 MB filesystem (data elsewhere), a checkpoint every step: the disk fills
  within a few steps. train.py stops with one error line (no TensorBoard / metrics.jsonl /
  orbax traceback), removes the partial steps failed saves left and keeps a committed step that
  restores."""
  disk = str(tmp_path / "disk")
  cleanup = fs_faults.small_fs(disk, "2m")
  faults = None if cleanup else {"disk_full_at_step": 4}     # no mount: an injected ENOSPC
  wd = os.path.join(disk, "wd")
  try:
    p = run("train.py", [f"--workdir={wd}", f"--data_dir={env['data']}", "--steps=30",
                         "--config.train.checkpoint_every=1", "--config.train.keep_checkpoints=50",
                         "--config.train.log_every=1", "--config.data.num_threads=1",
                         "--config.model.arch=dlrm"], env["progs"], faults=faults, check=False)
    err = one_line_error(p, "train.py")
    assert "disk full" in err and "No space left on device" in err, err
    left = os.listdir(os.path.join(wd, "checkpoints"))
    assert not [x for x in left if "orbax-checkpoint-tmp" in x], left
    good = committed(wd)
    assert good and f"newest good checkpoint is step {good[-1]}" in err
    assert len(params(wd, good[-1])) > 10                       # it restores
    assert f"stopped at step {good[-1]}" in err or good[-1] < 30
  finally:
    if cleanup:
      cleanup()
