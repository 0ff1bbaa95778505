"""End-to-end train.py / eval.py on CPU (subprocesses, real signals, 1 and 8 fake devices).

One 300-step tiny run (module fixture) feeds several tests: NE below the base rate on every
surface, bitwise resume after SIGTERM, a loss curve on an 8-device mesh, evaluation under another
mesh, and a corrupt checkpoint. Compilations are shared through a persistent cache.
"""

import glob
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests import subproc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 300
# KUNLUN_E2E_EXTRA: extra train.py flags, e.g. "--config.model.arch=dlrm" to run a baseline
TRAIN_ARGS = ["--config.train.log_every=1", "--config.train.checkpoint_every=100",
              *os.environ.get("KUNLUN_E2E_EXTRA", "").split()]
NE_MARGIN = 0.05     # eval click NE must be below 1 - NE_MARGIN on every surface


def _env(devices, cache):
  env = dict(os.environ)
  env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices),
             XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} "        # the suite's (tests/conftest.py)
                       f"--xla_force_host_platform_device_count={devices}",
             KUNLUN_COMPILATION_CACHE=cache, PYTHONPATH=ROOT)
  return env


def _run(script, args, env, devices=1, check=True):
  """``python script args`` on ``devices`` CPU devices, forked from the module's interpreter for
  that count (tests/subproc.Programs: jax & co. imported once). The child's last output is shown
  on failure or if it runs past the (generous) limit: XLA compiles slowly on a loaded machine,
  which must not fail a test."""
  return env["programs"](devices).run1([os.path.join(ROOT, script), *args], check=check)


def _losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return {r["step"]: r["loss"] for r in map(json.loads, f)}


def _params(workdir, step):
  import orbax.checkpoint as ocp
  path = os.path.join(workdir, "checkpoints", str(step), "params")
  meta = ocp.PyTreeCheckpointer().metadata(path)
  tree = meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta.tree
  args = jax_tree_map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
  return ocp.PyTreeCheckpointer().restore(path, restore_args=args)


def jax_tree_map(f, tree):
  import jax
  return jax.tree.map(f, tree, is_leaf=lambda x: not isinstance(x, dict))


@pytest.fixture(scope="module")
def env(tmp_path_factory):
  from data import synthetic
  base = tmp_path_factory.mktemp("e2e")
  data_dir = str(base / "data")
  synthetic.generate(data_dir, "tiny", seed=0)
  cache, servers = subproc.compile_cache(base / "xla_cache"), {}

  def programs(devices):            # started on first use, one per device count
    if devices not in servers:
      servers[devices] = subproc.Programs(_env(devices, cache), subproc.TRAIN_MODULES)
    return servers[devices]
  yield {"base": base, "data": data_dir, "cache": cache, "programs": programs}
  for s in servers.values():
    s.close()


@pytest.fixture(scope="module")
def trained(env):
  """300 tiny steps on one CPU device; returns the workdir."""
  wd = str(env["base"] / "w1")
  p = _run("train.py", [f"--workdir={wd}", f"--data_dir={env['data']}", f"--steps={STEPS}",
                        *TRAIN_ARGS], env)
  assert "step 300/300" in p.stdout
  return wd


@pytest.fixture(scope="module")
def eval_1dev(env, trained):
  out = str(env["base"] / "eval_1dev.json")
  p = _run("eval.py", [f"--workdir={trained}", f"--out={out}",
                       f"--plots_dir={env['base'] / 'plots'}"], env)
  return p, json.load(open(out))


@pytest.mark.slow
def test_tiny_beats_base_rate_on_every_surface(eval_1dev, env):
  p, res = eval_1dev
  assert res["step"] == STEPS and res["examples"] > 0
  assert set(res["metrics"]) == {"feed", "stories", "reels"}
  for surface, tasks in res["metrics"].items():
    m = tasks["click"]
    assert set(m) == {"ne", "auc", "calibration", "count", "positive_rate", "bayes_ne"}
    assert m["ne"] < 1.0 - NE_MARGIN, (surface, m)
    assert m["auc"] > 0.5 and m["bayes_ne"] < m["ne"]
  counts = sum(t["click"]["count"] for t in res["metrics"].values())
  assert counts == res["examples"] == res["overall"]["click"]["count"]
  assert "overall" in p.stdout and "click" in p.stdout       # the table
  assert os.path.getsize(env["base"] / "plots" / "calibration_click.png") > 1000


@pytest.mark.slow
def test_checkpoint_evaluates_identically_on_another_mesh(env, trained, eval_1dev):
  out = str(env["base"] / "eval_8dev.json")
  _run("eval.py", [f"--workdir={trained}", f"--out={out}", "--mesh=data=2,fsdp=4"],
       env, devices=8)
  a, b = eval_1dev[1], json.load(open(out))
  assert a["examples"] == b["examples"]
  for s in a["metrics"]:
    for t in a["metrics"][s]:
      for k, v in a["metrics"][s][t].items():
        if v is None:
          assert b["metrics"][s][t][k] is None
        else:
          assert b["metrics"][s][t][k] == pytest.approx(v, rel=1e-4, abs=1e-6), (s, t, k)


@pytest.mark.slow
def test_sigterm_and_resume_reproduce_params_bitwise(env, trained):
  # starts from a copy of the uninterrupted run's step-200 checkpoint (its first 200 steps are
  # not trained a second time): resumes there, is stopped by SIGTERM past step 230, resumes again
  wd = str(env["base"] / "w2")
  shutil.copytree(trained, wd, ignore=shutil.ignore_patterns("tb", "train.lock"))
  for step in (100, 300):
    shutil.rmtree(os.path.join(wd, "checkpoints", str(step)))
  with open(os.path.join(wd, "metrics.jsonl")) as f:
    rows = [r for r in f if json.loads(r).get("step", 0) <= 200]
  with open(os.path.join(wd, "metrics.jsonl"), "w") as f:
    f.writelines(rows)
  assert sorted(os.listdir(os.path.join(wd, "checkpoints"))) == ["200"]
  cmd = [sys.executable, os.path.join(ROOT, "train.py"), f"--workdir={wd}",
         f"--data_dir={env['data']}", f"--steps={STEPS}", *TRAIN_ARGS]
  proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(1, env["cache"]), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  jsonl = os.path.join(wd, "metrics.jsonl")
  deadline = time.time() + subproc.LONG_TIMEOUT
  while time.time() < deadline and proc.poll() is None:
    if os.path.exists(jsonl) and len(open(jsonl).read().splitlines()) >= 230:
      break
    time.sleep(0.05)
  assert proc.poll() is None, "training finished before it could be interrupted"
  proc.send_signal(signal.SIGTERM)
  try:
    out, err = proc.communicate(timeout=subproc.LONG_TIMEOUT)
  except subprocess.TimeoutExpired:
    proc.kill()
    out, err = proc.communicate()
    raise AssertionError(f"train.py did not stop after SIGTERM:\n{out[-3000:]}\n"
                         f"{err[-3000:]}") from None
  assert proc.returncode == 0, err[-3000:]
  assert "resumed from step 200" in out and "received signal" in out
  steps = sorted(int(d) for d in os.listdir(os.path.join(wd, "checkpoints")) if d.isdigit())
  interrupted_at = steps[-1]
  assert 230 <= interrupted_at < STEPS and interrupted_at % 100, steps
  p = _run("train.py", cmd[2:], env)
  assert f"resumed from step {interrupted_at}" in p.stdout
  a, b = _params(trained, STEPS), _params(wd, STEPS)
  leaves_a, leaves_b = jax_leaves(a), jax_leaves(b)
  assert len(leaves_a) == len(leaves_b) > 10
  for (ka, x), (kb, y) in zip(leaves_a, leaves_b, strict=False):
    assert ka == kb
    np.testing.assert_array_equal(x, y, err_msg=ka)
  # the logged losses after the resume continue the uninterrupted curve exactly
  la, lb = _losses(trained), _losses(wd)
  assert all(la[s] == lb[s] for s in range(interrupted_at + 1, STEPS + 1))


def jax_leaves(tree):
  import jax
  return [(jax.tree_util.keystr(k), np.asarray(v)) for k, v in jax.tree_util.tree_leaves_with_path(tree)]


@pytest.fixture(scope="module")
def mesh8(env):
  """20 steps on a data=2 x fsdp=4 mesh of 8 CPU devices, profiling steps 3..5."""
  wd = str(env["base"] / "w8")
  p = _run("train.py", [f"--workdir={wd}", f"--data_dir={env['data']}", "--steps=20",
                        f"--config.train.schedule_steps={STEPS}", "--mesh=data=2,fsdp=4",
                        "--profile_steps=3:5", *TRAIN_ARGS], env, devices=8)
  assert "data=2 fsdp=4" in p.stdout
  return wd


@pytest.mark.slow
def test_mesh_loss_curve_matches_one_device(trained, mesh8):
  """Same data, init and LR schedule: the first 20 losses on the 8-device mesh follow the
  1-device run's (only the reduction order differs)."""
  a, b = _losses(trained), _losses(mesh8)
  assert sorted(b) == list(range(1, 21))
  np.testing.assert_allclose([b[s] for s in range(1, 21)], [a[s] for s in range(1, 21)], rtol=2e-3)


@pytest.mark.slow
def test_profile_trace_has_named_scopes(mesh8):
  """Both trace files are written; the XLA ops in the xplane carry the components' named scopes
  (on CPU the Perfetto trace.json.gz holds host events only; on GPU it has the device ops too)."""
  prof = os.path.join(mesh8, "profile", "plugins", "profile")
  traces = glob.glob(os.path.join(prof, "*", "*.trace.json.gz"))
  xplanes = glob.glob(os.path.join(prof, "*", "*.xplane.pb"))
  assert len(traces) == len(xplanes) == 1, os.listdir(mesh8)
  assert gzip.open(traces[0]).read(100).startswith(b"{")
  data = open(xplanes[0], "rb").read()
  for scope in (b"PFFN", b"GDPA", b"HSP", b"MoWE", b"WeightGen"):
    assert scope in data, scope


@pytest.fixture(scope="module")
def fail_fast(env):
  """The bad-flag runs of train.py / eval.py, each in an empty workdir of its own, two at a time:
  {name: (workdir, run)}."""
  flags = {"mesh3": ("train.py", "--mesh=data=3,fsdp=1"),
           "pipeline": ("train.py", "--mesh=pipeline=2"),
           "profile": ("train.py", "--profile_steps=5"), "eval": ("eval.py",)}
  wds = {k: str(env["base"] / "fail_fast" / k) for k in flags}
  for wd in wds.values():
    os.makedirs(wd)
  runs = env["programs"](1).run([[f[0], f"--workdir={wds[k]}", *f[1:]]
                                 for k, f in flags.items()])
  return {k: (wds[k], p) for k, p in zip(flags, runs, strict=True)}


def test_bad_mesh_flags_fail_fast(fail_fast):
  p = fail_fast["mesh3"][1]
  assert p.returncode == 2 and "--mesh=data=3,fsdp=1" in p.stderr and "3" in p.stderr
  assert "devices" in p.stderr
  p = fail_fast["pipeline"][1]
  assert p.returncode == 2 and "unknown mesh axis 'pipeline'" in p.stderr
  p = fail_fast["profile"][1]
  assert p.returncode == 2 and "--profile_steps=5" in p.stderr


def test_eval_without_checkpoints_fails_fast(fail_fast):
  tmp_path, p = fail_fast["eval"]
  assert p.returncode == 2 and "no checkpoint" in p.stderr and str(tmp_path) in p.stderr


@pytest.mark.slow
def test_eval_on_corrupt_checkpoint_fails_with_a_clear_message(env, trained, tmp_path):
  wd = tmp_path / "w"
  shutil.copytree(trained, wd, ignore=shutil.ignore_patterns("tb", "data"))
  for root, _, files in os.walk(wd / "checkpoints" / str(STEPS) / "params"):
    for f in files:
      open(os.path.join(root, f), "wb").write(b"\x00corrupt")
  p = _run("eval.py", [f"--workdir={wd}"], env, check=False)
  assert p.returncode == 2 and "corrupt" in p.stderr and str(STEPS) in p.stderr


@pytest.mark.slow
def test_non_finite_steps_are_skipped_then_stop_without_checkpoint(env, tmp_path):
  """An absurd learning rate overflows the params after a step or two: those steps are skipped
  and counted, and after max_bad_steps + 1 in a row training stops with no checkpoint written.
  The DLRM baseline: the skipping is the loop's, the same for every architecture, and the step
  (its LR schedule is compiled in: no program to share with the runs above) compiles faster."""
  wd = tmp_path / "bad"
  p = _run("train.py", [f"--workdir={wd}", f"--data_dir={env['data']}", "--steps=40",
                        "--config.model.arch=dlrm",
                        "--config.train.lr=1e30", "--config.train.warmup_steps=1",
                        "--config.train.clip_norm=1e30", "--config.train.max_bad_steps=2"],
           env, check=False)
  assert p.returncode == 2, p.stderr[-2000:]
  assert "3 consecutive non-finite steps" in p.stderr and "max_bad_steps=2" in p.stderr
  assert p.stdout.count("update skipped") == 3
  ck = wd / "checkpoints"
  assert not ck.exists() or not [d for d in os.listdir(ck) if d.isdigit()]
