"""Where a benchmark's JSON goes: ``bench/results/<name>[_quick].json`` unless ``--out`` says;
written atomically (a killed bench leaves the previous table, never a partial one). And the
benchmarks' flag checks: ``at_least`` / ``int_list`` (argparse types), ``make_folder``."""

from __future__ import annotations

import argparse
import os

from kunlun.utils import atomic

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def result_path(name: str, quick: bool, out: str | None = None) -> str:
  """``out`` or the default result file of ``name``; its directory exists on return."""
  path = out or os.path.join(RESULTS, f"{name}_quick.json" if quick else f"{name}.json")
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  return path


def write_json(path: str, obj) -> None:
  atomic.write_json(path, obj)


def at_least(low: int):
  """An argparse ``type``: an integer >= ``low``; anything else is argparse's usage error
  naming the flag, before any work."""
  def parse(text: str) -> int:
    try:
      v = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < low:
      raise argparse.ArgumentTypeError(f"{v} is below {low}")
    return v
  return parse


def int_list(low: int = 1):
  """An argparse ``type``: comma-separated integers, each >= ``low``."""
  one = at_least(low)
  return lambda text: [one(t) for t in text.split(",")]


def make_folder(flag: str, path: str | None) -> None:
  """Makes ``path`` (a ``--workdir``) at once, so a path that cannot be made stops the run in one
  line before its work; None: nothing."""
  if path:
    try:
      os.makedirs(path, exist_ok=True)
    except OSError as e:
      raise SystemExit(f"{flag} {path}: cannot make the folder ({e.strerror})") from None
