"""The split of a log into train / valid / eval: ``--split`` parsed (``time:`` fractions, ``ts:``
unix times, ``none``) and the time cuts of a log held in memory (``cut_times``)."""

from __future__ import annotations

import datetime

import numpy as np

SPLITS = ("train", "valid", "eval")


def parse_split(text: str) -> tuple[str, tuple[float, ...]]:
  """``time:a,b,c`` (fractions), ``ts:T1,T2`` (unix seconds) or ``none``."""
  kind, _, rest = text.partition(":")
  try:
    if kind == "none" and not rest:
      return "none", ()
    vals = tuple(float(x) for x in rest.split(","))
    if kind == "time" and len(vals) == 3 and min(vals) >= 0 and abs(sum(vals) - 1) < 1e-6 \
        and vals[0] > 0:
      return kind, vals
    if kind == "ts" and len(vals) == 2 and vals[0] <= vals[1]:
      return kind, vals
  except ValueError:
    pass
  raise ValueError(f"--split={text}: expected time:TRAIN,VALID,EVAL (fractions summing to 1, "
                   "train > 0), ts:T1,T2 (unix seconds) or none")


def cut_times(ts: np.ndarray, kind: str, vals) -> tuple[float, float]:
  """Split boundaries (t1, t2): train ts < t1 <= valid < t2 <= eval."""
  if kind == "ts":
    return vals
  s = np.sort(ts)
  n = len(s)
  at = lambda f: float(s[int(np.ceil(f * n))]) if int(np.ceil(f * n)) < n else float("inf")
  t1, t2 = at(vals[0]), at(vals[0] + vals[1])
  if vals[1] == 0:
    t2 = t1
  if not n or t1 <= s[0]:
    raise ValueError(f"--split=time:...: no train rows (the earliest {vals[0]:.0%} of the rows all "
                     "have the first request_ts); use --split ts:T1,T2 or none")
  return t1, t2


def utc(t: float) -> str:
  if not np.isfinite(t):
    return "end"
  return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
