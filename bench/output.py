"""Where a benchmark's JSON goes: ``bench/results/<name>[_quick].json`` unless ``--out`` says;
written atomically (a killed bench leaves the previous table, never a partial one)."""

from __future__ import annotations

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
