"""Atomic outputs (kunlun/utils/atomic.py): a writer killed or failing mid-write leaves the
previous file (or none) at the target path, never a partial one, and never replaces what is
not a regular file (issue 39: a FIFO, a device, a symbolic link, a directory); ``check_writable``
names why a path cannot take an output."""

import json
import os
import signal
import stat
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
  assert atomic.check_writable(str(tmp_path / "d"), "--out") == (
      f"--out={tmp_path / 'd'}: is a directory; give the path of a regular file or a new one")
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


def _specials(tmp_path):
  """[(name, what is there)]: a FIFO, a symbolic link to a file, a dangling link, a directory."""
  (tmp_path / "target.json").write_text("kept")
  os.mkfifo(tmp_path / "fifo")
  (tmp_path / "link").symlink_to(tmp_path / "target.json")
  (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
  (tmp_path / "dir").mkdir()
  return [("fifo", "a FIFO (named pipe)"), ("link", "a symbolic link"),
          ("dangling", "a symbolic link"), ("dir", "a directory")]


def test_atomic_writes_never_replace_what_is_not_a_regular_file(tmp_path):
  """A FIFO, a link (to a file or to nothing) and a directory at the target stay what they were
  and the link's target is not written; the error names the path and what is there; no
  temporary file is left."""
  specials = _specials(tmp_path)
  before = sorted(os.listdir(tmp_path))
  for name, what in specials:
    path = str(tmp_path / name)
    with pytest.raises(OSError) as e:
      atomic.write_json(path, {"step": 1})
    assert e.value.filename == path and f"is {what}" in e.value.strerror, e.value
  assert sorted(os.listdir(tmp_path)) == before
  assert (tmp_path / "target.json").read_text() == "kept"
  assert os.path.islink(tmp_path / "link") and os.path.islink(tmp_path / "dangling")
  assert stat.S_ISFIFO(os.lstat(tmp_path / "fifo").st_mode)


def test_check_writable_refuses_what_is_not_a_regular_file(tmp_path):
  """Before any work: the same kinds, and a device node (``/dev/null``: only looked at), are
  one-line reasons naming the flag, the path and what is there; a regular file is writable."""
  for name, what in _specials(tmp_path):
    why = atomic.check_writable(str(tmp_path / name), "--out")
    assert why.startswith(f"--out={tmp_path / name}: is {what}"), why
    assert "\n" not in why
  assert atomic.check_writable("/dev/null", "--out").startswith(
      "--out=/dev/null: is a character device")
  assert atomic.check_writable(str(tmp_path / "target.json"), "--out") is None
