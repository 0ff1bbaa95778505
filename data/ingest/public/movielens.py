"""MovieLens ratings -> a kunlun dataset (one surface, one task), with no future leakage.

  python -m data.ingest.public.movielens --input ml-100k/u.data --out data/ml100k
  python -m data.ingest.public.movielens --input ml-latest-small/ratings.csv --out data/mll \\
      --positive 4.5

Formats (recognised by name, then by the first line)::

    u.data          ml-100k      user \\t item \\t rating \\t unix time, no header
    *.inter         RecBole      header user_id:token \\t item_id:token \\t rating:float \\t
                                 timestamp:float (other columns ignored)
    ratings.dat     ml-1m / 10m  UserID::MovieID::Rating::Timestamp
    ratings.csv     ml-latest*, ml-20m / 25m / 32m   header userId,movieId,rating,timestamp

One example per rating (user u, movie m, time t); label ``click`` = rating >= ``--positive``
(default 4). Built by ``data.ingest`` in flat-log mode (``--history``): stream ``liked`` = u's
earlier ratings >= positive, stream ``rated`` = all of u's earlier ratings, each event's action =
2 x its rating (half stars of ml-latest stay distinct), all **strictly earlier** than t (ratings of
the same second are not in each other's history); dense features = earlier rating count and
smoothed liked rate of the user and of the movie; the user and movie ids are also sparse features
(``ids_as_features``). Surface ``movielens``. Split by time (default 80 / 10 / 10: train, valid,
eval windows).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np
import pyarrow as pa

from data.ingest.cli import run_cli
from data.ingest.coerce import INT32_MAX
from data.ingest.driver import run
from data.ingest.infer import Spec
from data.ingest.sources import Source

SURFACE = "movielens"
FORMATS = ("u.data", "inter", "ratings.dat", "ratings.csv")
ID_BOUND = 1 << 63            # user and movie ids are read into int64


def detect(path: str) -> str:
  base = os.path.basename(path)
  if base.endswith(".inter"):
    return "inter"
  if base in FORMATS:
    return base
  with open(path) as f:
    first = f.readline()
  if "::" in first:
    return "ratings.dat"
  if first.startswith("userId,"):
    return "ratings.csv"
  if ":token" in first:
    return "inter"
  if first.count("\t") >= 3:
    return "u.data"
  raise ValueError(f"{path}: not a known MovieLens format {FORMATS}")


def read(path: str, fmt: str | None = None) -> dict[str, np.ndarray]:
  """``{"user", "item", "rating", "ts"}`` arrays of one ratings file."""
  fmt = fmt or detect(path)
  if fmt not in FORMATS:
    raise ValueError(f"format {fmt!r}; known: {FORMATS}")
  with open(path, encoding="latin-1") as f:
    lines = f.read().splitlines()
  sep = {"u.data": "\t", "inter": "\t", "ratings.dat": "::", "ratings.csv": ","}[fmt]
  cols = (0, 1, 2, 3)
  if fmt in ("inter", "ratings.csv"):
    head = [h.split(":")[0] for h in lines[0].split(sep)]
    want = (("user_id", "item_id", "rating", "timestamp") if fmt == "inter" else
            ("userId", "movieId", "rating", "timestamp"))
    missing = [w for w in want if w not in head]
    if missing:
      raise ValueError(f"{path}: header {lines[0]!r} lacks {missing}")
    cols = tuple(head.index(w) for w in want)
    lines = lines[1:]
  out = {k: [] for k in ("user", "item", "rating", "ts")}
  for i, line in enumerate(lines):
    if not line.strip():
      continue
    parts = line.split(sep)
    row = i + (2 if fmt in ("inter", "ratings.csv") else 1)
    try:
      vals = [parts[c] for c in cols]
      user, item, rating, ts = int(vals[0]), int(vals[1]), float(vals[2]), float(vals[3])
    except (IndexError, ValueError):
      raise ValueError(f"{path}: line {row}: expected {fmt} fields, got {line!r}") from None
    if not math.isfinite(rating):
      raise ValueError(f"{path}: line {row}: rating {vals[2]!r} is not a finite number")
    if not 0 <= ts <= INT32_MAX:
      raise ValueError(f"{path}: line {row}: timestamp {vals[3]!r} is not a unix time in seconds "
                       f"(0 to {INT32_MAX})")
    if not all(-ID_BOUND <= x < ID_BOUND for x in (user, item)):
      raise ValueError(f"{path}: line {row}: ids beyond 64 bits in {line!r}")
    for k, v in zip(out, (user, item, rating, int(ts)), strict=True):
      out[k].append(v)
  return {"user": np.asarray(out["user"], np.int64), "item": np.asarray(out["item"], np.int64),
          "rating": np.asarray(out["rating"], np.float64), "ts": np.asarray(out["ts"], np.int64)}


def table(r: dict[str, np.ndarray], positive: float = 4.0) -> pa.Table:
  """The flat log in ``data.ingest`` roles (one row per rating)."""
  return pa.table({"user_id": r["user"], "ad_id": r["item"], "request_ts": r["ts"],
                   "label.click": (r["rating"] >= positive).astype(np.int8),
                   "rating_x2": np.rint(2 * r["rating"]).astype(np.int64)})


def spec(max_len: int = 50) -> Spec:
  """The recipe's spec, checked (``max_len`` bounded); a rating is known when it is given
  (label delay ``immediate``)."""
  return Spec.from_dict({
      "surface": SURFACE, "ids_as_features": True,
      "history": {"streams": {"liked": "label.click", "rated": "all"}, "max_len": max_len,
                  "stats": True, "action": "rating_x2", "label_delay": {"click": "immediate"}}},
      "movielens")


def convert(path: str, out_dir: str, *, positive: float = 4.0, max_len: int = 50,
            split: str = "time:0.8,0.1,0.1", overwrite: bool = False, out=None, err=None) -> dict:
  """Reads one MovieLens ratings file and writes the dataset; returns the ingest report.
  ``positive`` must split the ratings: one that labels every rating alike is refused."""
  s = spec(max_len)
  if not math.isfinite(positive):
    raise ValueError(f"--positive={positive}: not a finite rating")
  r = read(path)
  n, liked = len(r["rating"]), int((r["rating"] >= positive).sum())
  if n and liked in (0, n):
    raise ValueError(f"--positive={positive} makes every label {int(liked > 0)}: the ratings of "
                     f"{path} run from {r['rating'].min():g} to {r['rating'].max():g}; give a "
                     "threshold above the lowest")
  src = Source(table=table(r, positive), name=path)
  return run({None: [src]}, out_dir, s, split=split, yes=True, overwrite=overwrite, out=out,
             err=err)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m data.ingest.public.movielens", description=__doc__)
  p.add_argument("--input", required=True, help="u.data, *.inter, ratings.dat or ratings.csv")
  p.add_argument("--out", required=True)
  p.add_argument("--positive", type=float, default=4.0, help="ratings >= this are clicks")
  p.add_argument("--max_len", type=int, default=50, help="events kept per history stream")
  p.add_argument("--split", default="time:0.8,0.1,0.1")
  p.add_argument("--overwrite", action="store_true")
  a = p.parse_args(argv)
  return run_cli("data.ingest.public.movielens", lambda: convert(
      a.input, a.out, positive=a.positive, max_len=a.max_len, split=a.split,
      overwrite=a.overwrite))


if __name__ == "__main__":
  sys.exit(main())
