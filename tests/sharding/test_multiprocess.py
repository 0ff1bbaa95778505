"""Two ``jax.distributed`` processes on 127.0.0.1 (gloo CPU collectives, 4 devices each) train a
few steps on one global mesh and save an orbax checkpoint that a single process restores onto a
different mesh; the single-process run from scratch reproduces the two-process losses."""

import json
import os
import subprocess
import sys

import pytest

from tests.subproc import free_port, worker_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_two_process_train_checkpoint_single_process_restore(tmp_path):
  port = free_port()
  cmd = lambda *a: [sys.executable, "-m", "tests.sharding.multiprocess_worker", *map(str, a)]
  procs = [subprocess.Popen(cmd("train", i, 2, port, tmp_path), cwd=ROOT, env=worker_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  outs = []
  for p in procs:
    try:
      outs.append(p.communicate(timeout=300)[0])
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
  for p, out in zip(procs, outs, strict=True):
    assert p.returncode == 0, out[-3000:]
  r = subprocess.run(cmd("restore", 0, 1, 0, tmp_path), cwd=ROOT, env=worker_env(), timeout=300,
                     capture_output=True, text=True)
  assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
  train = json.load(open(tmp_path / "train.json"))
  restore = json.load(open(tmp_path / "restore.json"))
  assert train["devices"] == 8 and train["mesh"]["data"] == 2 and train["mesh"]["fsdp"] == 4
  assert restore["restored_step"] == 3
  import numpy as np
  np.testing.assert_allclose(train["losses"], restore["losses"], rtol=1e-5)
  assert train["losses"][-1] != train["losses"][0]
