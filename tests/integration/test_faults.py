"""Fault injection on train.py / eval.py (issue 15), kept short: 6 steps of the DLRM baseline on
tiny data (the checkpoint and data machinery is the same for every architecture, and DLRM
compiles in a third of Kunlun's time), checkpoints every 2, one shared uninterrupted baseline. Faults come from ``bench/fault_hooks.py`` (patched library
calls, nothing in the programs); ``bench/faults.py`` runs the long version (20+ random kills).

* a damaged latest checkpoint: eval.py (default step and --step) fails in one line; train.py
  warns, moves it aside, resumes from the step before and ends bitwise equal to the baseline;
* SIGKILL while the async save of step 4 is being written: the step is never used, the resumed
  run ends bitwise equal to the baseline;
* a train shard with damaged chunks under skip_invalid: the run finishes, skips are counted as
  ``bytes`` in metrics.jsonl and the checkpoint's iterator state, and a resume from step 2 ends
  bitwise equal, with the same counts.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from bench.faults import flip_shard_bytes, iter_state, params

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 6
ARGS = [f"--steps={STEPS}", "--config.train.checkpoint_every=2", "--config.train.log_every=1",
        "--config.data.num_threads=1", "--config.model.arch=dlrm"]


def run(script, args, env, faults=None, check=True):
  e = dict(env)
  if faults:
    e["KUNLUN_FAULTS"] = json.dumps(faults)
  cmd = [sys.executable, os.path.join(ROOT, "bench", "fault_hooks.py"), script, *args]
  p = subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=600)
  if check and p.returncode != 0:
    raise AssertionError(f"{script} {args} failed ({p.returncode}):\n{p.stdout[-2000:]}\n"
                         f"{p.stderr[-3000:]}")
  return p


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
           XLA_FLAGS="--xla_force_host_platform_device_count=1",
           KUNLUN_COMPILATION_CACHE=str(base / "xla_cache"))
  return {"base": base, "data": data, "env": e}


@pytest.fixture(scope="module")
def baseline(env):
  wd = str(env["base"] / "baseline")
  run("train.py", [f"--workdir={wd}", f"--data_dir={env['data']}", *ARGS], env["env"])
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
    err = one_line_error(run("eval.py", [f"--workdir={wd}", *extra], env["env"], check=False),
                         "eval.py")
    assert f"checkpoints/{STEPS} could not be restored" in err and "older steps: [2, 4]" in err
  p = run("train.py", [f"--workdir={wd}", f"--data_dir={env['data']}", *ARGS], env["env"])
  no_noise(p)
  assert "resumed from step 4" in p.stdout
  assert f"checkpoints/{STEPS} could not be restored" in p.stderr and "moved it to" in p.stderr
  moved = [d for d in os.listdir(os.path.join(wd, "checkpoints")) if d.startswith("6.corrupt-")]
  assert len(moved) == 1
  assert_same_params(baseline, wd)


def test_sigkill_during_async_save_resumes_bitwise(env, baseline):
  wd = str(env["base"] / "killed")
  args = [f"--workdir={wd}", f"--data_dir={env['data']}", *ARGS]
  p = run("train.py", args, env["env"], faults={"kill_after_save": 4}, check=False)
  assert p.returncode == -9
  assert 4 not in [int(d) for d in os.listdir(os.path.join(wd, "checkpoints")) if d.isdigit()
                   and os.path.exists(os.path.join(wd, "checkpoints", d, "commit_success.txt"))]
  p = run("train.py", args, env["env"])
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
  p = run("train.py", [f"--workdir={wd}", *args], env["env"])
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
  p = run("train.py", [f"--workdir={wd2}", *args], env["env"])
  assert "resumed from step 2" in p.stdout
  assert_same_params(wd, wd2)
  assert iter_state(wd2, STEPS)["invalid"] == skipped
  # without skip_invalid: a one-line error naming the file and the damaged record range
  err = one_line_error(run("train.py", [f"--workdir={env['base'] / 'noskip'}",
                                        f"--data_dir={data}", *ARGS], env["env"], check=False),
                       "train.py")
  assert f"{path}: record" in err and "damaged chunk" in err and "skip_invalid" in err
