"""Shard files on disk: integrity (byte size, SHA-256), opening, and reads that survive damage.

The manifest (``data.records``) lists every shard with its record ``count``, its ``bytes`` and
its ``sha256`` (manifests written before these two fields existed carry only the count).

* ``check_entry`` (start-up, cheap): the file exists and has the recorded size.
* ``sha256_file``: the whole-file checksum (``python -m data.verify`` compares it).
* ``open_reader``: an ArrayRecord reader, or a ``DataFileError`` naming the file when it cannot
  be opened (truncated, not an ArrayRecord file).
* ``read_records``: a batched read that, when a chunk is damaged (Riegeli checks a hash per
  chunk), finds the records that cannot be read and reports each as a ``DamagedChunkError``
  naming the file and the record range of its chunk (the neighbouring records that fail too).

Every error here is a ``DataError``: a one-line ``ValueError`` that names the file.
"""

from __future__ import annotations

import hashlib
import os
import re

READER_OPTIONS = "readahead_buffer_size:0,max_parallelism:0"   # random reads, no reader threads
_PROBE = 4096          # max records probed on each side of a damaged record for its chunk's range


class DataError(ValueError):
  """A problem with the data on disk; the message names the file (one line)."""


class DataFileError(DataError):
  """A shard that is missing, has the wrong size or checksum, or cannot be opened."""


class DamagedChunkError(DataError):
  """Records of a shard that cannot be read (a chunk whose hash does not match, a cut file).

  ``file``, ``first``..``last`` (the damaged chunk's record range, inclusive), ``index`` (the
  record that was asked for). ``kind`` is ``"bytes"``, as for undecodable records
  (``data.verify.KINDS``), so ``skip_invalid`` counts it with them.
  """
  kind = "bytes"

  def __init__(self, file: str, first: int, last: int, index: int, reason: str):
    self.file, self.first, self.last, self.index, self.reason = file, first, last, index, reason
    what = f"record {first}" if first == last else f"records {first}-{last}"
    super().__init__(f"{file}: {what}: damaged chunk, cannot be read ({reason}) [bytes]")


def short_reason(e: BaseException) -> str:
  """The first clause of a Riegeli / ArrayRecord error, without hash values."""
  msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
  msg = msg.split(";")[0].replace("Corrupted Riegeli/records file: ", "")
  return re.sub(r" \(computed 0x[0-9a-f]+, stored 0x[0-9a-f]+\)", "", msg)[:200]


def sha256_file(path: str, progress=None, block: int = 1 << 22) -> str:
  """Hex SHA-256 of a file; ``progress(nbytes)`` is called after every block read."""
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(block):
      h.update(chunk)
      if progress:
        progress(len(chunk))
  return h.hexdigest()


def file_entry(data_dir: str, rel: str, count: int) -> dict:
  """A manifest entry for a written shard: ``{"file", "count", "bytes", "sha256"}``."""
  path = os.path.join(data_dir, rel)
  return {"file": rel, "count": int(count), "bytes": os.path.getsize(path),
          "sha256": sha256_file(path)}


def check_entry(path: str, entry: dict) -> None:
  """Raises ``DataFileError`` if ``path`` is missing or its size differs from ``entry["bytes"]``
  (when the manifest records one)."""
  try:
    size = os.path.getsize(path)
  except OSError as e:
    raise DataFileError(f"{path}: missing or unreadable ({e.strerror or e}), listed in the "
                        "manifest") from None
  want = entry.get("bytes")
  if want is not None and size != int(want):
    how = "truncated" if size < int(want) else "longer than written"
    raise DataFileError(f"{path}: {size} bytes, the manifest says {int(want)} ({how}: damaged "
                        "or partly copied; restore the file, or check all files with "
                        "`python -m data.verify DIR`)")


def open_reader(path: str, count: int | None = None):
  """An ArrayRecord reader for random single-record reads; ``DataFileError`` naming the file
  when it cannot be opened or holds fewer records than ``count``."""
  from array_record.python import array_record_module
  try:
    r = array_record_module.ArrayRecordReader(path, options=READER_OPTIONS,
                                              file_reader_buffer_size=4096)
  except (RuntimeError, OSError, ValueError) as e:
    raise DataFileError(f"{path}: cannot open ({short_reason(e)})") from None
  if not r.ok():
    why = "not an ArrayRecord file or truncated"
    try:
      r.read([0])
    except (RuntimeError, OSError, ValueError) as e:
      why = short_reason(e)
    raise DataFileError(f"{path}: cannot open ArrayRecord file ({why})")
  if count is not None and r.num_records() != count:
    raise DataFileError(f"{path}: {r.num_records()} records, the manifest says {count}")
  return r


def _readable(reader, i: int) -> bool:
  try:
    reader.read([i])
    return True
  except (RuntimeError, OSError, ValueError):
    return False


def chunk_range(reader, i: int, n: int) -> tuple[int, int]:
  """``(first, last)``: the run of unreadable records around record ``i`` of ``n`` (its
  damaged chunk; a single record with one record per chunk)."""
  lo = i
  while lo > 0 and i - lo < _PROBE and not _readable(reader, lo - 1):
    lo -= 1
  hi = i
  while hi + 1 < n and hi - i < _PROBE and not _readable(reader, hi + 1):
    hi += 1
  return lo, hi


def read_records(reader, path: str, indices: list[int], n: int, damaged=None) -> list[bytes]:
  """``reader.read(indices)``; if that fails, record by record. A record that cannot be read
  raises a ``DamagedChunkError``, or, with a list ``damaged``, appends ``(position in
  indices, DamagedChunkError)`` to it and returns ``b""`` in its place."""
  try:
    return list(reader.read(indices))
  except (RuntimeError, OSError, ValueError):
    pass
  out, ranges = [], []
  for pos, i in enumerate(indices):
    try:
      out.append(reader.read([i])[0])
      continue
    except (RuntimeError, OSError, ValueError) as e:
      reason = short_reason(e)
    rng = next((r for r in ranges if r[0] <= i <= r[1]), None) or chunk_range(reader, i, n)
    ranges.append(rng)
    err = DamagedChunkError(path, rng[0], rng[1], i, reason)
    if damaged is None:
      raise err
    damaged.append((pos, err))
    out.append(b"")
  return out
