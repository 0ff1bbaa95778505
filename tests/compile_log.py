"""Where the suite's compile time goes: each XLA compile of a test process, with its test.

``KUNLUN_TEST_COMPILE_LOG=DIR bash scripts/test.sh`` makes every pytest process (the xdist
workers too) append one row per compile to ``DIR/<worker>.<pid>.tsv``: the test's node id, the seconds
and the program's name, from jax's own compile log (``jax_log_compiles``). Subprocesses a test
starts (train.py, the bench scripts, the GPU venv) are not in it; their tests' durations are.
``python -m tests.compile_log DIR [--top N]`` prints the totals per test file, per program and for
the small compiles (under 0.2 s: mostly eager operations, one compile per new shape)."""

from __future__ import annotations

import argparse
import collections
import glob
import logging
import os
import re
import sys

import jax

ENV = "KUNLUN_TEST_COMPILE_LOG"
SMALL_S = 0.2
_DONE = re.compile(r"Finished XLA compilation of (.*) in ([0-9.]+) sec")


class Recorder(logging.Handler):
  """A handler for the ``jax._src.dispatch`` logger: one ``test\\tseconds\\tprogram`` row per
  finished compile, attributed to ``current`` (set by the conftest before each test)."""

  def __init__(self, path: str):
    super().__init__(logging.WARNING)
    self.current = "<collection>"
    self.before = None                # jax's log settings before install (uninstall)
    self._file = open(path, "a", buffering=1)    # noqa: SIM115 - open while the run lasts

  def close(self):
    self._file.close()
    super().close()

  def emit(self, record):
    m = _DONE.search(record.getMessage())
    if m:
      self._file.write(f"{self.current}\t{m.group(2)}\t{m.group(1)}\n")


_LOGGER = logging.getLogger("jax._src.dispatch")


def install(log_dir: str) -> Recorder:
  """Turns jax's compile log on and records it under ``log_dir`` (one file per process)."""
  os.makedirs(log_dir, exist_ok=True)
  name = os.environ.get("PYTEST_XDIST_WORKER", "main")
  rec = Recorder(os.path.join(log_dir, f"{name}.{os.getpid()}.tsv"))
  rec.before = (jax.config.jax_log_compiles, _LOGGER.level, _LOGGER.propagate)
  jax.config.update("jax_log_compiles", True)
  _LOGGER.addHandler(rec)
  _LOGGER.setLevel(logging.WARNING)
  _LOGGER.propagate = False          # recorded here, not repeated in every failing test's report
  return rec


def uninstall(rec: Recorder) -> None:
  """Undoes ``install``: the handler removed and closed, jax's log settings as they were."""
  _LOGGER.removeHandler(rec)
  rec.close()
  log_compiles, level, propagate = rec.before
  jax.config.update("jax_log_compiles", log_compiles)
  _LOGGER.setLevel(level)
  _LOGGER.propagate = propagate


def read(log_dir: str) -> list[tuple[str, float, str]]:
  """Every ``(test, seconds, program)`` row under ``log_dir``."""
  rows = []
  for path in sorted(glob.glob(os.path.join(log_dir, "*.tsv"))):
    with open(path) as f:
      for line in f:
        parts = line.rstrip("\n").split("\t")
        if len(parts) == 3:
          rows.append((parts[0], float(parts[1]), parts[2]))
  return rows


def summarize(rows) -> dict:
  """``{"total": (s, n), "small": (s, n), "files": {file: (s, n)}, "programs": {name: (s, n)}}``,
  files and programs by seconds, largest first."""
  files, progs = collections.defaultdict(lambda: [0.0, 0]), collections.defaultdict(lambda: [0.0, 0])
  total, small = [0.0, 0], [0.0, 0]
  for test, s, prog in rows:
    for acc in (files[test.split("::")[0]], progs[prog], total, *([small] if s < SMALL_S else [])):
      acc[0] += s
      acc[1] += 1
  order = lambda d: {k: tuple(v) for k, v in sorted(d.items(), key=lambda kv: -kv[1][0])}
  return {"total": tuple(total), "small": tuple(small), "files": order(files),
          "programs": order(progs)}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("log_dir")
  ap.add_argument("--top", type=int, default=25, help="files and programs listed")
  args = ap.parse_args(argv)
  rows = read(args.log_dir)
  if not rows:
    sys.exit(f"compile_log: no compile rows under {args.log_dir} (run the suite with "
             f"{ENV}={args.log_dir})")
  s = summarize(rows)
  print(f"{s['total'][0]:.0f} s in {s['total'][1]} compiles; under {SMALL_S} s each: "
        f"{s['small'][0]:.0f} s in {s['small'][1]}")
  for title, table in (("test file", s["files"]), ("program", s["programs"])):
    print(f"\n{'seconds':>8} {'compiles':>8}  {title}")
    for k, (sec, n) in list(table.items())[:args.top]:
      print(f"{sec:8.1f} {n:8d}  {k}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
