"""Atomic file outputs: written to a temporary file beside the target, flushed to disk, then
renamed over it (``os.replace``), so a writer killed at any point leaves the previous file or no
file at the target path, never a partial one. No jax: benches and exports use it too.

  with atomic.target("out/predictions.parquet") as tmp:   # any writer that takes a path
    pq.write_table(table, tmp)
  atomic.write_json("out/metrics.json", result)
"""

from __future__ import annotations

import contextlib
import json
import os


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


@contextlib.contextmanager
def target(path: str):
  """Yields a temporary path in ``path``'s directory; when the block ends without an exception
  the file there is fsync'ed and renamed to ``path``, otherwise removed."""
  path = os.path.abspath(path)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tmp = tmp_name(path)
  try:
    yield tmp
    fd = os.open(tmp, os.O_RDONLY)
    try:
      os.fsync(fd)
    finally:
      os.close(fd)
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
  """Why an output file ``path`` could not be written (None: it can): a directory at the path,
  a parent that is not a directory, or a directory that refuses a new file (read-only, full,
  no permission). Probes by creating and removing a temporary file; creates missing parents."""
  path = os.path.abspath(path)
  if os.path.isdir(path):
    return f"{what}={path}: is a directory (give a file path)"
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
