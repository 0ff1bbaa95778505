"""KuaiRand (Pure / 1K / 27K) -> a multi-surface, multi-task kunlun dataset in the GEM mould.

  python -m data.ingest.public.kuairand \\
      --input KuaiRand-Pure/data/log_standard_4_08_to_4_21_pure.csv \\
      --input KuaiRand-Pure/data/log_standard_4_22_to_5_08_pure.csv \\
      [--user_features KuaiRand-Pure/data/user_features_pure.csv] --out data/kuairand

Reads the interaction logs in their published CSV layout (header ``user_id,video_id,date,
hourmin,time_ms,is_click,is_like,is_follow,is_comment,is_forward,is_hate,long_view,play_time_ms,
duration_ms,profile_stay_time,comment_stay_time,is_profile_enter,is_rand,tab``; the random-
exposure logs have the same header). One example per impression:

* surfaces: the app tab of the impression (``tab<k>``); tabs with fewer than
  ``--min_surface_rows`` impressions are pooled into ``tab_other``; a log with an empty tab
  cell is refused (the row named);
* tasks: ``click``, ``like``, ``follow`` (is_click, is_like, is_follow; every impression labelled);
* streams (``--history``, from the same user's impressions **strictly earlier** in time, whole
  seconds): ``click`` = clicked videos, ``impression`` = all impressions; each event carries its
  tab as surface and click | like << 1 | follow << 2 as action; label delays ``immediate``
  (``spec``);
* features known at request time: user and video ids, hour of day, is_rand (random exposure),
  video duration, earlier count / smoothed rates per user and per video, and, with
  ``--user_features``, the user profile columns (categorical ones as sparse features; the
  ``*_num`` counts and register_days as dense). Outcome columns (play time, long_view, comments,
  ...) are never features.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv

from data.ingest.cli import run_cli
from data.ingest.driver import run
from data.ingest.infer import Spec
from data.ingest.sources import Source

LOG_COLUMNS = ("user_id", "video_id", "date", "hourmin", "time_ms", "is_click", "is_like",
               "is_follow", "is_comment", "is_forward", "is_hate", "long_view", "play_time_ms",
               "duration_ms", "profile_stay_time", "comment_stay_time", "is_profile_enter",
               "is_rand", "tab")
TASKS = {"click": "is_click", "like": "is_like", "follow": "is_follow"}
USER_DENSE = ("follow_user_num", "fans_user_num", "friend_user_num", "register_days")


def _read_csv(path: str) -> pa.Table:
  try:
    return pcsv.read_csv(path)
  except (pa.ArrowInvalid, OSError) as e:
    raise ValueError(f"{path}: unreadable CSV: {str(e).splitlines()[0]}") from None


def read_logs(paths) -> pa.Table:
  parts = []
  for p in paths:
    t = _read_csv(p)
    missing = [c for c in ("user_id", "video_id", "hourmin", "time_ms", "duration_ms", "is_rand",
                           "tab", *TASKS.values()) if c not in t.column_names]
    if missing:
      raise ValueError(f"{p}: not a KuaiRand log: columns {missing} missing (header "
                       f"{t.column_names})")
    tab = t.column("tab")
    if not pa.types.is_integer(tab.type) and tab.null_count < len(tab):
      raise ValueError(f"{p}: tab: expected integer tab ids, got {tab.type} values")
    if tab.null_count:
      first = int(np.argmax(pc.is_null(tab).to_numpy(zero_copy_only=False)))
      raise ValueError(f"{p}: {tab.null_count} row(s) with an empty tab cell (the first: data "
                       f"row {first + 1}); every impression needs its tab, the surface")
    parts.append(t.select([c for c in LOG_COLUMNS if c in t.column_names]))
  return pa.concat_tables(parts, promote_options="permissive")


def table(logs: pa.Table, users: pa.Table | None = None, min_surface_rows: int = 1000) -> pa.Table:
  """The flat log in ``data.ingest`` roles."""
  n = logs.num_rows
  tab = logs.column("tab").to_numpy(zero_copy_only=False).astype(np.int64)
  ids, counts = np.unique(tab, return_counts=True)
  big = set(ids[counts >= min_surface_rows].tolist())
  surface = [f"tab{k}" if k in big else "tab_other" for k in tab.tolist()]
  t_ms = logs.column("time_ms").to_numpy(zero_copy_only=False)
  cols = {"user_id": logs.column("user_id"), "ad_id": logs.column("video_id"),
          "request_ts": (np.floor(np.asarray(t_ms, np.float64) / 1000)).astype(np.int64),
          "surface": pa.array(surface, pa.string()),
          "dense.duration_s": pc.divide(logs.column("duration_ms").cast(pa.float64()), 1000.0),
          "sparse.hour": pc.divide(logs.column("hourmin").cast(pa.int64()), 100),
          "sparse.is_rand": logs.column("is_rand").cast(pa.int64())}
  for task, col in TASKS.items():
    cols[f"label.{task}"] = logs.column(col)
  if users is not None:
    uid = users.column("user_id").to_numpy(zero_copy_only=False).astype(np.int64)
    order = np.argsort(uid)
    q = logs.column("user_id").to_numpy(zero_copy_only=False).astype(np.int64)
    pos = np.clip(np.searchsorted(uid[order], q), 0, max(len(uid) - 1, 0))
    found = uid[order][pos] == q if len(uid) else np.zeros(n, bool)
    take = pa.array(np.where(found, order[pos], 0))
    for c in users.column_names:
      if c == "user_id":
        continue
      v = users.column(c).take(take)
      v = pc.if_else(pa.array(found), v, pa.nulls(n, v.type))
      if c in USER_DENSE:
        cols[f"dense.{c}"] = pc.fill_null(v.cast(pa.float64()), 0.0)
      else:
        cols[f"sparse.{c}"] = v
  return pa.table(cols)


def spec(max_len: int = 50) -> Spec:
  """The recipe's spec, checked (``max_len`` bounded). Label delays: ``immediate`` for all
  three tasks: a click, like or follow is part of the impression's own log line, and the user's
  next impression comes after it (the feed shows one video at a time)."""
  return Spec.from_dict({
      "ids_as_features": True,
      "history": {"streams": {"click": "label.click", "impression": "all"}, "max_len": max_len,
                  "stats": True, "action": None,
                  "label_delay": {t: "immediate" for t in TASKS}}}, "kuairand")


def convert(paths, out_dir: str, *, user_features: str | None = None, max_len: int = 50,
            min_surface_rows: int = 1000, split: str = "time:0.8,0.1,0.1",
            overwrite: bool = False, out=None, err=None) -> dict:
  s = spec(max_len)
  users = _read_csv(user_features) if user_features else None
  if users is not None and "user_id" not in users.column_names:
    raise ValueError(f"{user_features}: no user_id column")
  src = Source(table=table(read_logs(paths), users, min_surface_rows),
                      name=",".join(paths))
  return run({None: [src]}, out_dir, s, split=split, yes=True, overwrite=overwrite, out=out,
             err=err)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m data.ingest.public.kuairand",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--input", action="append", required=True, help="log_*.csv (repeatable)")
  p.add_argument("--user_features", help="user_features_*.csv (optional)")
  p.add_argument("--out", required=True)
  p.add_argument("--max_len", type=int, default=50)
  p.add_argument("--min_surface_rows", type=int, default=1000)
  p.add_argument("--split", default="time:0.8,0.1,0.1")
  p.add_argument("--overwrite", action="store_true")
  a = p.parse_args(argv)
  return run_cli("data.ingest.public.kuairand", lambda: convert(
      a.input, a.out, user_features=a.user_features, max_len=a.max_len,
      min_surface_rows=a.min_surface_rows, split=a.split, overwrite=a.overwrite))


if __name__ == "__main__":
  sys.exit(main())
