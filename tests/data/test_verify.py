import zlib

import ml_collections
import numpy as np
import pytest

from data import records
from data.fake import tiny_schema
from data.pipeline import make_dataset
from data.verify import BatchValidator, InvalidRecordError, RecordChecker
from tests.data.test_records import _example

SCHEMA = tiny_schema()


def _bad(name):
  """(kind, field, record bytes) for one kind of invalid record (surface feed = 0)."""
  r = _example(SCHEMA, np.random.default_rng(zlib.crc32(name.encode())), 0)
  r["events/click"] = np.array([[1, 0, 0, 100, 2], [2, 1, 1, 200, 3]], np.int32)
  field = None
  if name == "bytes":
    return "bytes", "<record>", b"KR\x01\x05garbage"
  if name == "dtype":
    r["dense"], field = r["dense"].astype(np.float64), "dense"
  elif name == "shape":
    r["labels"], field = np.zeros(3, np.float32), "labels"
  elif name == "multi_hot_too_long":
    r["sparse/user_interests"], field = np.zeros(5, np.int64), "sparse/user_interests"
  elif name == "id_range":
    r["sparse/user_segment"], field = np.array([50]), "sparse/user_segment"
  elif name == "item_range":
    r["events/click"][0, 0], field = 500, "events/click/item"
  elif name == "nan":
    r["dense"][1], field = np.nan, "dense/ad_bid"
  elif name == "inf":
    r["dense"][0], field = -np.inf, "dense/user_age_days"
  elif name == "neg_ts":
    r["events/click"][0, 3], field = -5, "events/click/ts"
  elif name == "future_event":
    r["events/click"][1, 3], field = 10**6 + 1, "events/click/ts"
  elif name == "unordered":
    r["events/click"][:, 3], field = [300, 200], "events/click/ts"
  elif name == "surface":
    r["surface"], field = np.int32(3), "surface"
  elif name == "surface_wrong_file":
    r["surface"], field = np.int32(2), "surface"
  elif name == "missing":
    del r["labels"]
    field = "labels"
  elif name == "label":
    r["labels"], field = np.array([2, 0], np.float32), "labels"
  kind = {"multi_hot_too_long": "shape", "item_range": "id_range", "nan": "non_finite",
          "inf": "non_finite", "neg_ts": "timestamp", "future_event": "timestamp",
          "unordered": "timestamp", "surface_wrong_file": "surface"}.get(name, name)
  return kind, field, records.encode(r)


CASES = ["bytes", "dtype", "shape", "multi_hot_too_long", "id_range", "item_range", "nan", "inf",
         "neg_ts", "future_event", "unordered", "surface", "surface_wrong_file", "missing", "label"]


@pytest.mark.parametrize("name", CASES)
def test_each_bad_kind_is_named(name):
  kind, field, raw = _bad(name)
  with pytest.raises(InvalidRecordError) as e:
    RecordChecker(SCHEMA)(raw, file="f.arrayrecord", index=17, surface=0)
  assert e.value.kind == kind and e.value.field == field
  assert "f.arrayrecord: record 17: field" in str(e.value) and field in str(e.value)


def test_valid_record_passes_and_hashed_ids_unbounded():
  r = _example(SCHEMA, np.random.default_rng(0), 1)
  r["sparse/ad_id_hash"] = np.array([2**40], np.int64)        # hashed: any id >= 0
  out = RecordChecker(SCHEMA)(records.encode(r), file="x", index=0, surface=1)
  np.testing.assert_array_equal(out["sparse/ad_id_hash"], [2**40])


def _cfg(**kw):
  d = dict(batch_size=4, surface_weights={"feed": 1.0}, shuffle_seed=0, num_threads=1,
           prefetch=2, skip_invalid=False, length_balance=False)
  return ml_collections.ConfigDict({**d, **kw})


def _write_mixed(tmp_path, n_good=5):
  w = records.DatasetWriter(str(tmp_path), SCHEMA)
  rng = np.random.default_rng(3)
  good = [records.encode(_example(SCHEMA, rng, 0)) for _ in range(n_good)]
  bad = [_bad(name) for name in CASES]
  recs = good[:2] + [b for _, _, b in bad] + good[2:]
  w.write("eval", "feed", recs)
  w.close(("eval",))
  return bad


def test_pipeline_raises_with_file_index_field(tmp_path):
  _write_mixed(tmp_path)
  ds = make_dataset(_cfg(), str(tmp_path), "eval", {}, train=False, shard_index=0, shard_count=1)
  with pytest.raises(InvalidRecordError, match=r"eval/feed-00000-of-00001.arrayrecord: record 2: "
                     r"field '<record>'"):
    list(ds)


def test_pipeline_skip_invalid_counts(tmp_path):
  bad = _write_mixed(tmp_path, n_good=5)
  ds = make_dataset(_cfg(skip_invalid=True), str(tmp_path), "eval", {}, train=False,
                    shard_index=0, shard_count=1)
  batches = list(ds)
  assert sum(b["example_mask"].sum() for b in batches) == 5
  want = {}
  for kind, _, _ in bad:
    want[kind] = want.get(kind, 0) + 1
  assert ds.invalid_counter.counts == want
  assert ds.invalid_counter.total == len(CASES)
  assert "skipped 15 invalid records" in ds.invalid_counter.report()


def test_batch_validator_matches_per_record_validator():
  """Good records (one with another field order) and every bad kind, shuffled into one batch:
  the same errors as ``RecordChecker`` row by row, good rows decoded, padded and truncated."""
  rng = np.random.default_rng(5)
  good = [_example(SCHEMA, rng, 0) for _ in range(12)]
  good[3] = dict(reversed(list(good[3].items())))                # another header layout
  for s in ("click", "impression"):
    good[5][f"events/{s}"] = good[5][f"events/{s}"][:0]          # no events
  raws = [(None, None, records.encode(r)) for r in good] + [_bad(n) for n in CASES]
  order = rng.permutation(len(raws))
  raws = [raws[i] for i in order]
  lens = {"click": 3, "impression": 2}
  cols, ok, errors = BatchValidator(SCHEMA, lens)(
      [r for _, _, r in raws], np.zeros(len(raws), np.int64), lambda i: ("f.ar", 100 + i))
  got_err = {i: (e.kind, e.field, e.index) for i, e in errors}
  for i, (kind, field, _) in enumerate(raws):
    if kind is None:
      assert ok[i] and i not in got_err
      r = good[order[i]]
      for k in ("dense", "labels", "label_mask", "true_prob", "surface", "user_id", "ad_id",
                "request_ts"):
        np.testing.assert_array_equal(cols[k][i], r[k])
      for f in SCHEMA.sparse:
        ids = r[f"sparse/{f.name}"].tolist()
        assert cols[f"sparse/{f.name}"][i].tolist() == ids + [-1] * (f.max_len - len(ids))
      for s, T in lens.items():
        ev = r[f"events/{s}"]
        kept = ev[max(0, len(ev) - T):]
        assert cols[f"length/{s}"][i] == len(kept)
        want = np.zeros((T, ev.shape[1]), np.int32)
        want[:len(kept)] = kept
        np.testing.assert_array_equal(cols[f"events/{s}"][i], want)
    else:
      assert not ok[i] and got_err[i] == (kind, field, 100 + i), (i, kind)


def test_batch_validator_empty_ragged_field_at_the_end_of_the_batch():
  rng = np.random.default_rng(6)
  recs = []
  for _ in range(3):
    r = _example(SCHEMA, rng, 0)
    last = r.pop("sparse/user_interests")
    r["sparse/user_interests"] = last[:0]                          # last field, no ids
    recs.append(r)
  cols, ok, errors = BatchValidator(SCHEMA, {})([records.encode(r) for r in recs],
                                                np.zeros(3, np.int64), lambda i: ("f", i))
  assert ok.all() and not errors
  assert (cols["sparse/user_interests"] == -1).all()


def test_batch_validator_agrees_with_validator_on_corrupted_bytes():
  """Random byte corruptions: a record is accepted by the batch path iff ``RecordChecker`` accepts
  it, with the same error kind and field otherwise (the batch path is never weaker)."""
  rng = np.random.default_rng(7)
  good = [records.encode(_example(SCHEMA, rng, 0)) for _ in range(8)]
  bv, v = BatchValidator(SCHEMA, {"click": 2, "impression": 3}), RecordChecker(SCHEMA)
  n_rejected = 0
  for trial in range(300):
    raw = bytearray(good[trial % 8])
    for _ in range(int(rng.integers(1, 3))):
      raw[int(rng.integers(len(raw)))] = int(rng.integers(256))
    batch = good[:3] + [bytes(raw)] + good[3:5]
    cols, ok, errors = bv(batch, np.zeros(len(batch), np.int64), lambda i: ("f", i))
    try:
      rec = v(bytes(raw), file="f", index=3, surface=0)
    except InvalidRecordError as e:
      n_rejected += 1
      assert [(i, x.kind, x.field) for i, x in errors] == [(3, e.kind, e.field)], trial
      assert ok.tolist() == [True] * 3 + [False] + [True] * 2
      continue
    assert ok.all() and not errors, trial
    np.testing.assert_array_equal(cols["dense"][3], rec["dense"])
    np.testing.assert_array_equal(cols["labels"][3], rec["labels"])
  assert 30 < n_rejected < 290                       # both outcomes exercised
