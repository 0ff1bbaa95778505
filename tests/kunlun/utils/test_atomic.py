"""Atomic outputs (kunlun/utils/atomic.py): a writer killed or failing mid-write leaves the
previous file (or none) at the target path, never a partial one; ``check_writable`` names why a
path cannot take an output."""

import json
import os
import signal
import subprocess
import sys

import pytest

from kunlun.utils import atomic
from tests import fs_faults
from tests.subproc import ROOT, worker_env

KILLED = ("import os, signal, sys\n"
          "from kunlun.utils import atomic\n"
          "with atomic.target(sys.argv[1]) as tmp:\n"
          "  with open(tmp, 'w') as f:\n"
          "    f.write('{\"half\": ')\n"
          "    f.flush()\n"
          "    os.kill(os.getpid(), signal.SIGKILL)\n")


def test_killed_writer_leaves_the_previous_file(tmp_path):
  path = str(tmp_path / "metrics.json")
  atomic.write_json(path, {"step": 1})
  p = subprocess.run([sys.executable, "-c", KILLED, path], cwd=ROOT, env=worker_env(),
                     timeout=120)
  assert p.returncode == -signal.SIGKILL
  assert json.load(open(path)) == {"step": 1}
  fresh = str(tmp_path / "new.json")                   # no previous file: none after the kill
  subprocess.run([sys.executable, "-c", KILLED, fresh], cwd=ROOT, env=worker_env(), timeout=120)
  assert not os.path.exists(fresh)


def test_failed_write_removes_its_temporary_file(tmp_path):
  path = str(tmp_path / "out.bin")
  atomic.write_bytes(path, b"old")
  with pytest.raises(RuntimeError, match="boom"):
    with atomic.target(path) as tmp:
      open(tmp, "wb").write(b"new, half")
      raise RuntimeError("boom")
  assert open(path, "rb").read() == b"old" and os.listdir(tmp_path) == ["out.bin"]
  atomic.write_text(path, "new")
  assert open(path).read() == "new" and os.listdir(tmp_path) == ["out.bin"]


def test_check_writable_names_the_reason(tmp_path):
  (tmp_path / "d").mkdir()
  (tmp_path / "f").write_text("x")
  assert atomic.check_writable(str(tmp_path / "new" / "m.json"), "--out") is None
  assert atomic.check_writable(str(tmp_path / "d"), "--out").endswith("is a directory (give a "
                                                                      "file path)")
  assert "cannot create its directory" in atomic.check_writable(str(tmp_path / "f" / "m.json"),
                                                                "--out")
  assert os.listdir(tmp_path / "new") == []                  # the probe leaves nothing behind
  ro = tmp_path / "ro"
  ro.mkdir()
  cleanup = fs_faults.make_readonly(str(ro))
  if cleanup is None:
    pytest.skip("cannot make a read-only directory on this machine")
  try:
    why = atomic.check_writable(str(ro / "m.json"), "--out")
    assert why.startswith(f"--out={ro}/m.json: cannot write in {ro} (")
  finally:
    cleanup()


def test_target_fsyncs_the_file_before_the_rename(tmp_path, monkeypatch):
  """The data must reach the disk before the rename publishes it (else a crash can leave an
  empty file at the target): the file's fsync comes before os.replace, the directory's after."""
  calls = []
  real_fsync, real_replace = os.fsync, os.replace
  monkeypatch.setattr(atomic.os, "fsync", lambda fd: (calls.append("fsync"), real_fsync(fd))[1])
  monkeypatch.setattr(atomic.os, "replace",
                      lambda a, b: (calls.append("replace"), real_replace(a, b))[1])
  atomic.write_json(str(tmp_path / "m.json"), {"step": 1})
  assert "replace" in calls and calls.index("fsync") < calls.index("replace"), calls
  assert json.load(open(tmp_path / "m.json")) == {"step": 1}
