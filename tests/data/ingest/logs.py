"""Small flat logs with the edge cases of history building, and a comparison of two datasets
example by example (shared by the engine and Beam equality tests)."""

import json
import os

import numpy as np
import pyarrow as pa


def flat_log(n=600, seed=0, users=25):
  """Same-second rows (times on a coarse grid), a heavy user (~40% of the rows), null labels,
  unicode string user ids, string categories (exact vocabulary) and two surfaces."""
  rng = np.random.default_rng(seed)
  u = rng.integers(0, users, n)
  u[rng.random(n) < 0.4] = 0                                    # the heavy user
  names = [f"usér-{k}-名" for k in range(users)]
  conv = [None if rng.random() < 0.5 else float(rng.random() < 0.3) for _ in range(n)]
  cat = [None if rng.random() < 0.1 else f"c{int(x)}" for x in rng.integers(0, 9, n)]
  return pa.table({
      "time": 1_700_000_000 + rng.integers(0, 40, n) * 30,     # ~15 rows per second
      "uid": pa.array([names[k] for k in u]), "ad": rng.integers(0, 30, n),
      "tab": rng.choice(["feed", "reels"], n), "click": (rng.random(n) < 0.3).astype(np.int64),
      "conv": pa.array(conv, pa.float64()), "bid": rng.random(n), "cat": pa.array(cat)})


SPEC = {"columns": {"request_ts": "time", "user_id": "uid", "ad_id": "ad", "surface": "tab",
                    "label.click": "click", "label.conv": "conv", "dense.bid": "bid",
                    "sparse.cat": "cat"},
        "ids_as_features": True,
        "history": {"streams": {"click": "label.click", "impression": "all"}, "max_len": 8,
                    "stats": True, "label_delay": {"click": "0s", "conv": "5m"}}}


def decoded(d):
  """{split: [decoded example, ...]} sorted by (surface, request_ts, user_id, ad_id, bytes)."""
  from data import records
  m = json.load(open(os.path.join(d, "manifest.json")))
  out = {}
  for split, surfaces in m["splits"].items():
    rows = []
    for surface, entries in surfaces.items():
      from array_record.python import array_record_module
      for e in entries:
        r = array_record_module.ArrayRecordReader(os.path.join(d, e["file"]))
        raws = r.read_all() if r.num_records() else []
        r.close()
        assert len(raws) == e["count"], e
        rows += [(surface, raw) for raw in raws]
    rows.sort(key=lambda x: (x[0], int(records.decode(x[1])["request_ts"]),
                             int(records.decode(x[1])["user_id"]),
                             int(records.decode(x[1])["ad_id"]), x[1]))
    out[split] = [(s, records.decode(raw)) for s, raw in rows]
  return out


def assert_same_examples(a, b):
  """Two datasets hold the same examples (decoded, example by example) and the same schema."""
  from data.schema import Schema
  assert Schema.load(a) == Schema.load(b)
  da, db = decoded(a), decoded(b)
  assert sorted(da) == sorted(db)
  for split in da:
    assert len(da[split]) == len(db[split]), split
    for i, ((sa, ra), (sb, rb)) in enumerate(zip(da[split], db[split], strict=True)):
      assert sa == sb and sorted(ra) == sorted(rb), (split, i)
      for k in ra:
        assert ra[k].dtype == rb[k].dtype and ra[k].shape == rb[k].shape, (split, i, k)
        assert np.array_equal(ra[k], rb[k], equal_nan=True), (split, i, k, ra[k], rb[k])
