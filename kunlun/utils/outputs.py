"""Output paths, checked before any work (issue 39; per program: docs/outputs.md). ``problem``
names the first output that is an input or lies inside an input directory, is another output of
the same run, is an entry of a directory another program owns (a train.py workdir's
``run_info.json``, ``checkpoints``, ...) or, where something exists at its path, is not of the
kind written (``not_regular``: a FIFO, a device, a symbolic link or a directory where a file
goes; anything but a directory where a directory goes; a link to a directory is written
through). No jax, no project imports: every program uses it, data.ingest included."""

from __future__ import annotations

import fnmatch
import itertools
import os
import stat

# the entries train.py writes in its workdir (kunlun.train plan / run_info / loop / evaluation /
# progress, kunlun.utils.lock; config.pkl and data_dir.txt by older versions): another program's
# output is none of them and lies inside none of them
TRAIN_WORKDIR = ("run_info.json", "checkpoints", "best", "metrics.jsonl", "tb", "data", "profile",
                 "train.lock", "config.pkl", "data_dir.txt")

_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
          (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def not_regular(path: str) -> str | None:
  """What is at ``path`` when it is not a regular file ("a FIFO (named pipe)", "a symbolic
  link", ...; a link is never followed); None for a regular file, nothing, or a path that
  cannot be looked at (the write reports that)."""
  try:
    mode = os.lstat(path).st_mode
  except OSError:
    return None
  if stat.S_ISREG(mode):
    return None
  return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def file_kind_problem(flag: str, path: str) -> str | None:
  """The one-line refusal of a file output ``flag=path`` where something other than a regular
  file is (None: a regular file or a new path)."""
  why = not_regular(path)
  return f"{flag}={path}: is {why}; give the path of a regular file or a new one" if why else None


def _real(path: str, follow: bool = True) -> str:
  """Absolute, with every link resolved (``follow=False``: all but the last component)."""
  path = os.path.abspath(path)
  if follow:
    return os.path.realpath(path)
  d, base = os.path.split(path)
  return os.path.join(os.path.realpath(d), base)


def _within(p: str, d: str) -> bool:
  return os.path.commonpath([p, d]) == d


def _writes(d: str, names, p: str) -> bool:
  """Whether a directory output ``d`` writing ``names`` (fnmatch patterns of its entries) writes
  at or above ``p`` (a path inside ``d``)."""
  first = os.path.relpath(p, d).split(os.sep)[0]
  return first != "." and any(fnmatch.fnmatchcase(first, n) for n in names)


def _owned_entry(real: str, names, d: str, entries) -> str | None:
  """The entry of ``d`` (one of ``entries``) that an output at ``real`` (a directory writing
  ``names``; None: a file) is, lies inside, or writes."""
  if real != d and _within(real, d):
    first = os.path.relpath(real, d).split(os.sep)[0]
    return first if any(fnmatch.fnmatchcase(first, e) for e in entries) else None
  if names is not None and real == d:
    return next((e for e in entries if any(fnmatch.fnmatchcase(e, n) for n in names)), None)
  return None


def _same_file(a: str, b: str) -> bool:
  try:
    return os.path.samefile(a, b)
  except OSError:
    return False


def problem(files=(), *, dirs=(), inputs=(), owned=()) -> str | None:
  """The first reason the outputs of a run cannot be written as given (one line), or None.

  ``files``: ``[(flag, path)]`` file outputs: each a regular file or a new path (a path of
  None, here and in ``dirs`` and ``inputs``: not given, skipped; so is an input that is no
  string, e.g. from a damaged record).
  ``dirs``: ``[(flag, path, names)]`` directory outputs: a directory or a new path; ``names``
  are fnmatch patterns of the entries the program writes in it (``("*",)``: all of it).
  ``inputs``: ``[(flag, path)]`` files and directories the run reads: no output is one or lies
  inside one, and no directory output writes an entry that holds one.
  ``owned``: ``[(what, directory, names)]`` directories that another program owns the entries
  ``names`` of: no output is such an entry or lies inside one.
  """
  outs = [(flag, path, _real(path, follow=False), None) for flag, path in files if path]
  outs += [(flag, path, _real(path), tuple(names)) for flag, path, names in dirs if path]
  for flag, path, _, names in outs:
    if names is None:
      why = file_kind_problem(flag, path)
    elif os.path.lexists(path) and not os.path.isdir(path):
      why = f"{flag}={path}: exists and is not a directory"
    else:
      why = None
    if why:
      return why
  for flag, path, real, names in outs:
    for iflag, ipath in inputs:
      if not ipath or not isinstance(ipath, str):
        continue
      ireal = _real(ipath)
      if real == ireal or (names is None and _same_file(path, ipath)):
        return f"{flag}={path} is the input {ipath} ({iflag}): give another path"
      if _within(real, ireal):
        return f"{flag}={path} lies inside the input {ipath} ({iflag}): give another path"
      if names is not None and _within(ireal, real) and _writes(real, names, ireal):
        return f"{flag}={path} contains the input {ipath} ({iflag}): give another path"
    for what, d, entries in owned:
      entry = _owned_entry(real, names, _real(d), entries)
      if entry:
        return (f"{flag}={path}: {entry} belongs to {what} {d} (this program never writes it): "
                "give another path")
  for (fa, pa, ra, _), (fb, pb, rb, nb) in itertools.permutations(outs, 2):
    if ra == rb:
      return f"{fa}={pa} and {fb}={pb} are the same path: give each output its own"
    if nb is not None and _within(ra, rb) and _writes(rb, nb, ra):
      return f"{fa}={pa} lies inside {fb}={pb}, which this run writes: give another path"
  return None
