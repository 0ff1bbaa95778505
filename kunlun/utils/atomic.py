"""Atomic file outputs: written to a temporary file beside the target, flushed to disk, then
renamed over it (``os.replace``), so a writer killed at any point leaves the previous file or no
file at the target path, never a partial one. Only a regular file is ever replaced: a FIFO, a
device, a symbolic link or a directory at the target is an OSError naming it (issue 39). No jax:
benches and exports use it too.

  with atomic.target("out/predictions.parquet") as tmp:   # any writer that takes a path
    pq.write_table(table, tmp)
  atomic.write_json("out/metrics.json", result)
"""

from __future__ import annotations

import contextlib
import errno
import json
import os

from kunlun.utils.outputs import file_kind_problem, not_regular


def _fsync_dir(directory: str) -> None:
  try:
    fd = os.open(directory, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:
    pass                      # some filesystems cannot fsync a directory; the rename still holds
  finally:
    os.close(fd)


def tmp_name(path: str) -> str:
  """The temporary name used for ``path`` (same directory, hidden)."""
  d, base = os.path.split(os.path.abspath(path))
  return os.path.join(d, f".{base}.tmp-{os.getpid()}")


def _refuse_not_regular(path: str) -> None:
  why = not_regular(path)
  if why:
    raise OSError(errno.EEXIST, f"is {why}, not a regular file: not replaced", path)


@contextlib.contextmanager
def target(path: str):
  """Yields a temporary path in ``path``'s directory; when the block ends without an exception
  the file there is fsync'ed and renamed to ``path``, otherwise removed. Something other than a
  regular file at ``path`` is an OSError, before the block and again before the rename."""
  path = os.path.abspath(path)
  _refuse_not_regular(path)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tmp = tmp_name(path)
  try:
    yield tmp
    fd = os.open(tmp, os.O_RDONLY)
    try:
      os.fsync(fd)
    finally:
      os.close(fd)
    _refuse_not_regular(path)
    os.replace(tmp, path)
  except BaseException:
    with contextlib.suppress(OSError):
      os.remove(tmp)
    raise
  _fsync_dir(os.path.dirname(path))


def write_bytes(path: str, data: bytes) -> None:
  with target(path) as tmp, open(tmp, "wb") as f:
    f.write(data)


def write_text(path: str, text: str) -> None:
  write_bytes(path, text.encode())


def write_json(path: str, obj, indent: int | None = 1, **kw) -> None:
  write_text(path, json.dumps(obj, indent=indent, **kw))


def check_writable(path: str, what: str) -> str | None:
  """Why an output file ``path`` could not be written (None: it can): something other than a
  regular file at the path (``outputs.not_regular``), a parent that is not a directory, or a
  directory that refuses a new file (read-only, full, no permission). Probes by creating and
  removing a temporary file; creates missing parents."""
  path = os.path.abspath(path)
  why = file_kind_problem(what, path)
  if why:
    return why
  d = os.path.dirname(path)
  try:
    os.makedirs(d, exist_ok=True)
  except OSError as e:
    return f"{what}={path}: cannot create its directory {d} ({e.strerror or e})"
  probe = tmp_name(path) + "-probe"
  try:
    with open(probe, "wb") as f:
      f.write(b"x")
      f.flush()
      os.fsync(f.fileno())
  except OSError as e:
    return f"{what}={path}: cannot write in {d} ({e.strerror or e})"
  finally:
    with contextlib.suppress(OSError):
      os.remove(probe)
  return None
