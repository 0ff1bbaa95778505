"""Two JAX processes agree (issue 20): on the workdir lock before the first step (process 0
holds it; a held workdir stops both), and on the step to resume when a restore fails on one
process only (both fall back together; the step is moved aside once)."""

import json
import os
import subprocess
import sys

import pytest

from kunlun.utils import lock
from tests.subproc import ROOT, free_port, worker_env


@pytest.mark.slow
def test_two_processes_agree_on_lock_and_restore_fallback(tmp_path):
  held = lock.WorkdirLock(str(tmp_path / "held"))
  os.makedirs(held.workdir)
  held.acquire()                                   # another program holds this workdir
  port = free_port()
  procs = [subprocess.Popen([sys.executable, "-m", "tests.kunlun.train.multihost_worker", str(i), "2",
                             str(port), str(tmp_path)], cwd=ROOT, env=worker_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  outs = []
  try:
    for p in procs:
      outs.append(p.communicate(timeout=600)[0])
  except subprocess.TimeoutExpired:
    for q in procs:
      q.kill()
    tails = [(q.communicate()[0] or "")[-3000:] for q in procs]
    pytest.fail("workers did not finish (disagreement deadlocks a collective):\n" +
                "\n----\n".join(tails))
  finally:
    held.release()
  for p, out in zip(procs, outs, strict=True):
    assert p.returncode == 0, out[-3000:]
  r = [json.load(open(tmp_path / f"result_{i}.json")) for i in range(2)]
  assert [x["free_held_here"] for x in r] == [True, False]      # process 0 holds it
  assert "is in use" in r[0]["held_error"] and f"pid {os.getpid()}" in r[0]["held_error"]
  assert "process 0 could not take the workdir lock" in r[1]["held_error"]
  assert [x["restored_step"] for x in r] == [1, 1]               # both fell back together
  assert [x["value_ok"] for x in r] == [True, True]             # step 1's params
  assert r[0]["moved"] == r[1]["moved"] and len(r[0]["moved"]) == 1
  assert r[0]["moved"][0].startswith("2.corrupt-")
  assert [x["steps_after"] for x in r] == [[1], [1]]
  assert "failed to restore on another process" in r[0]["warnings"][0]
