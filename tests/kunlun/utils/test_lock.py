"""One writer per workdir (kunlun/utils/lock.py): a held lock stops a second taker with a line
naming the holder; the lock dies with its process (kill -9) and is then taken over with a
warning; a normal release leaves nothing stale."""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from kunlun.utils import lock
from tests.subproc import ROOT, worker_env

HOLD = ("import sys, time\n"
        "from kunlun.utils.lock import WorkdirLock\n"
        "WorkdirLock(sys.argv[1]).acquire()\n"
        "print('held', flush=True)\n"
        "time.sleep(600)\n")


@pytest.fixture()
def holder(tmp_path):
  """A separate process holding the lock of ``tmp_path/wd``; yields (workdir, process)."""
  wd = tmp_path / "wd"
  wd.mkdir()
  p = subprocess.Popen([sys.executable, "-c", HOLD, str(wd)], cwd=ROOT, env=worker_env(),
                       stdout=subprocess.PIPE, text=True)
  try:
    assert p.stdout.readline().strip() == "held"
    yield str(wd), p
  finally:
    if p.poll() is None:
      p.kill()
    p.wait(timeout=30)


def test_second_taker_is_refused_naming_the_holder(holder):
  wd, p = holder
  with pytest.raises(lock.LockError) as e:
    lock.WorkdirLock(wd).acquire(warn=pytest.fail)
  msg = str(e.value)
  assert f"--workdir={wd} is in use" in msg and f"pid {p.pid}" in msg
  assert socket.gethostname() in msg and "\n" not in msg
  info = json.load(open(os.path.join(wd, lock.LOCK_NAME)))     # the holder's record is intact
  assert info["pid"] == p.pid and info["host"] == socket.gethostname()


def test_lock_dies_with_its_process_and_is_taken_over_with_a_warning(holder):
  wd, p = holder
  p.send_signal(signal.SIGKILL)
  p.wait(timeout=30)
  warnings = []
  lk = lock.WorkdirLock(wd)
  lk.acquire(warn=warnings.append)
  assert len(warnings) == 1 and f"pid {p.pid}" in warnings[0] and "no longer runs" in warnings[0]
  assert json.load(open(lk.path))["pid"] == os.getpid()
  lk.release()
  assert open(lk.path).read() == ""                       # a normal end leaves nothing stale
  again = lock.WorkdirLock(wd)
  again.acquire(warn=pytest.fail)
  again.release()


def test_lock_file_that_cannot_be_created_is_one_line(tmp_path):
  missing = tmp_path / "file"
  missing.write_text("x")
  with pytest.raises(lock.LockError, match="cannot create train.lock"):
    lock.WorkdirLock(str(missing / "sub")).acquire()
