"""Filesystem faults for tests: a read-only directory and a small full-able filesystem.

As root, permission bits do not stop writes, so a read-only directory is a read-only bind mount
and a small disk a size-limited tmpfs (``mount`` works for root in this container); otherwise a
read-only directory is ``chmod -R a-w`` and no small disk exists (``small_fs`` returns None and
callers use an injected ENOSPC instead, bench/faults/hooks.py). Every helper returns a cleanup.
"""

import os
import stat
import subprocess


def _writable(path: str) -> bool:
  probe = os.path.join(path, ".probe")
  try:
    with open(probe, "w") as f:
      f.write("x")
    os.remove(probe)
    return True
  except OSError:
    return False


def _mount(*args) -> bool:
  try:
    return subprocess.run(["mount", *args], capture_output=True, timeout=30).returncode == 0
  except (OSError, subprocess.TimeoutExpired):
    return False


def _umount(path: str) -> None:
  subprocess.run(["umount", "-l", path], capture_output=True, timeout=30)


def make_readonly(path: str):
  """Makes directory ``path`` read-only in place; returns ``cleanup()`` or None if it cannot."""
  if os.geteuid() == 0:
    if _mount("--bind", path, path) and _mount("-o", "remount,bind,ro", path, path):
      if not _writable(path):
        return lambda: _umount(path)
    _umount(path)
    return None
  modes = {}
  for root, dirs, files in os.walk(path):
    for n in [root] + [os.path.join(root, x) for x in dirs + files]:
      modes[n] = os.stat(n).st_mode
      os.chmod(n, modes[n] & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
  if _writable(path):
    return None

  def cleanup():
    for n, m in modes.items():
      os.chmod(n, m)
  return cleanup


def small_fs(path: str, size: str):
  """A tmpfs of ``size`` (e.g. "3m") mounted at ``path`` (created); cleanup or None."""
  os.makedirs(path, exist_ok=True)
  if os.geteuid() != 0 or not _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", path):
    return None
  return lambda: _umount(path)
