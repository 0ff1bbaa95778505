"""One writer per workdir: an exclusive OS file lock (``flock``) on ``<workdir>/train.lock``.

The lock dies with its process (the kernel drops it when the file descriptor closes, kill -9
included), so there is nothing to clean up by hand. The file holds the holder's host, pid,
program and start time while it runs: a second ``train.py`` on the same workdir stops at start-up
with a one-line error naming the holder. A run that ends normally empties the file; finding the
lock free but the file still naming a holder means that holder died (kill -9, machine crash):
the lock is taken over with a warning naming it.

``flock`` is per host on some network filesystems (older NFS); jobs of one workdir that share a
host (the mistake this guards against: a job restarted while the old one still runs) are always
covered. Under several JAX processes only process 0 takes the lock and every process learns the
outcome before the first step (``acquire_all``).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time

LOCK_NAME = "train.lock"


class LockError(Exception):
  """The workdir is locked by another process, or the lock file cannot be written (one line)."""


def _describe(holder: dict | None) -> str:
  if not holder:
    return "an unknown process"
  return (f"{holder.get('program', 'train.py')} (pid {holder.get('pid', '?')} on host "
          f"{holder.get('host', '?')}, started {holder.get('started', '?')})")


def _read(fd) -> dict | None:
  try:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 65536).decode(errors="replace").strip()
    return json.loads(raw) if raw else None
  except (OSError, ValueError):
    return {"host": "?", "pid": "?", "started": "?", "program": "(unreadable lock file)"}


class WorkdirLock:
  """``acquire()`` takes the lock (or raises ``LockError``); ``release()`` empties the file and
  drops it. Holding the object keeps the descriptor, and so the lock, open."""

  def __init__(self, workdir: str, program: str = "train.py"):
    self.workdir = os.path.abspath(workdir)
    self.path = os.path.join(self.workdir, LOCK_NAME)
    self.program = program
    self._fd: int | None = None

  def acquire(self, warn=None) -> None:
    warn = warn or (lambda m: print(f"warning: {m}", file=sys.stderr, flush=True))
    try:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
      raise LockError(f"--workdir={self.workdir}: cannot create {LOCK_NAME} "
                      f"({e.strerror or e})") from None
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      holder = _read(fd)
      os.close(fd)
      if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
        raise LockError(f"--workdir={self.workdir} is in use: {_describe(holder)} holds "
                        f"{self.path}; wait for it to end, stop it, or use another "
                        "--workdir") from None
      raise LockError(f"--workdir={self.workdir}: cannot lock {LOCK_NAME} "
                      f"({e.strerror or e})") from None
    stale = _read(fd)
    me = {"host": socket.gethostname(), "pid": os.getpid(), "program": self.program,
          "started": time.strftime("%Y-%m-%d %H:%M:%S %z")}
    try:
      os.ftruncate(fd, 0)
      os.lseek(fd, 0, os.SEEK_SET)
      os.write(fd, (json.dumps(me) + "\n").encode())
      os.fsync(fd)
    except OSError as e:
      os.close(fd)
      raise LockError(f"--workdir={self.workdir}: cannot write {self.path} "
                      f"({e.strerror or e})") from None
    self._fd = fd
    if stale:
      warn(f"{self.path} named {_describe(stale)}, which no longer runs (killed or crashed); "
           "taking the workdir over")

  def release(self) -> None:
    if self._fd is None:
      return
    try:
      os.ftruncate(self._fd, 0)      # a normal end: the next run finds no stale holder
    except OSError:
      pass
    os.close(self._fd)               # closing drops the flock
    self._fd = None

  @property
  def held(self) -> bool:
    return self._fd is not None


def acquire_all(workdir: str, program: str = "train.py", warn=None) -> WorkdirLock:
  """Process 0 takes the workdir lock; with several JAX processes all of them agree on the
  outcome (a collective) before returning, so either every process goes on or every one raises
  ``LockError`` (process 0's message; the others name process 0)."""
  import jax
  lock = WorkdirLock(workdir, program)
  err = None
  if jax.process_index() == 0:
    try:
      lock.acquire(warn)
    except LockError as e:
      err = e
  if jax.process_count() > 1:
    import numpy as np
    from jax.experimental import multihost_utils
    ok = np.asarray(multihost_utils.process_allgather(np.int32(err is None)))
    if err is None and not ok[0]:
      err = LockError(f"--workdir={workdir}: process 0 could not take the workdir lock (see its "
                      "error)")
  if err is not None:
    raise err
  return lock
