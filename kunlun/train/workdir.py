"""Before any work: a program's output paths (``kunlun.utils.outputs``'s rules, then writable)
and train.py's workdir (created, writable, locked for the run). Problems are one-line
FatalErrors."""

from __future__ import annotations

import os

import jax

from kunlun.train.run_info import saved_run_info
from kunlun.train.startup import fail
from kunlun.utils import lock, outputs
from kunlun.utils.atomic import check_writable


def check_output(path: str, what: str) -> None:
  """An output file can be written at ``path`` (a one-line FatalError naming the flag otherwise:
  a directory there, read-only, full, no permission); run before the work that fills it."""
  why = check_writable(path, what) if jax.process_index() == 0 else None
  if why:
    fail(why)


def check_outputs(files=(), *, dirs=(), inputs=(), workdir: str | None = None) -> None:
  """Before any work: the run's outputs by the rules every program follows
  (``kunlun.utils.outputs.problem``: ``files`` ``[(flag, path)]``, ``dirs`` ``[(flag, path,
  names)]``, ``inputs`` ``[(flag, path)]``; ``workdir``: a train.py workdir, whose own entries
  no output is and whose recorded data directory is an input), then each file output writable
  (``check_output``, process 0); one-line FatalErrors."""
  owned = []
  if workdir:
    owned = [("the train.py workdir", workdir, outputs.TRAIN_WORKDIR)]
    recorded = (saved_run_info(workdir) or {}).get("data_dir")
    inputs = [*inputs, ("the data directory recorded in the workdir", recorded)]
  why = outputs.problem(files, dirs=dirs, inputs=inputs, owned=owned)
  if why:
    fail(why)
  for flag, path in files:
    if path:
      check_output(path, flag)


def prepare_workdir(workdir: str):
  """train.py's workdir: a directory (created), writable, and locked for this run (process 0;
  ``kunlun.utils.lock``). Returns the held lock; problems are one-line FatalErrors."""
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    fail(f"--workdir={workdir}: exists and is not a directory")
  if jax.process_index() == 0:
    try:
      os.makedirs(workdir, exist_ok=True)
    except OSError as e:
      fail(f"--workdir={workdir}: cannot create it ({e.strerror or e})")
  try:
    return lock.acquire_all(workdir)
  except lock.LockError as e:
    fail(str(e))
