import json
import os

import numpy as np
import pytest

from data import records, verify
from data.fake import tiny_schema


def _rand_arrays(rng):
  return {
      "f32": rng.normal(size=(3, 2)).astype(np.float32),
      "f64": rng.normal(size=5),
      "i32": rng.integers(-5, 5, (0, 4)).astype(np.int32),
      "i64": np.array(2**40 + 3, np.int64),
      "u8": rng.integers(0, 255, 7).astype(np.uint8),
      "b": np.array([True, False]),
      "nan": np.array([np.nan, np.inf], np.float32),
      "t": np.arange(12, dtype=np.int32).reshape(3, 4).T,   # non-contiguous input
  }


def test_encode_decode_roundtrip():
  rng = np.random.default_rng(0)
  a = _rand_arrays(rng)
  d = records.decode(records.encode(a))
  assert list(d) == list(a)
  for k in a:
    assert d[k].dtype == a[k].dtype and d[k].shape == a[k].shape, k
    np.testing.assert_array_equal(d[k], a[k])


def test_encode_columns_matches_rowwise_encode():
  rng = np.random.default_rng(1)
  n = 5
  fixed = {"x": rng.normal(size=(n, 3)).astype(np.float32), "s": np.arange(n, dtype=np.int32)}
  lens = np.array([0, 2, 1, 0, 3])
  offs = np.concatenate([[0], np.cumsum(lens)])
  ev = rng.integers(0, 100, (offs[-1], 4)).astype(np.int32)
  ids = rng.integers(0, 9, offs[-1]).astype(np.int64)
  recs = records.encode_columns(fixed, {"ev": (ev, offs), "ids": (ids, offs)})
  for i in range(n):
    row = {"x": fixed["x"][i], "s": fixed["s"][i], "ev": ev[offs[i]:offs[i + 1]],
           "ids": ids[offs[i]:offs[i + 1]]}
    assert recs[i] == records.encode(row)


@pytest.mark.parametrize("mutate", [lambda b: b[:-3], lambda b: b"XX" + b[2:],
                                    lambda b: b + b"\0", lambda b: b[:5], lambda b: b""])
def test_decode_rejects_malformed_bytes(mutate):
  b = records.encode({"a": np.arange(4, dtype=np.int32)})
  with pytest.raises(records.RecordFormatError):
    records.decode(mutate(b))


def _example(schema, rng, surface):
  rec = {"dense": rng.normal(size=len(schema.dense)).astype(np.float32),
         "surface": np.int32(surface), "labels": np.array([1, 0], np.float32),
         "label_mask": np.array([1, 1], np.float32),
         "true_prob": np.array([.5, np.nan], np.float32), "user_id": np.int32(rng.integers(1000)),
         "ad_id": np.int32(7), "request_ts": np.int32(10**6)}
  for f in schema.sparse:
    rec[f"sparse/{f.name}"] = rng.integers(0, f.vocab_size, rng.integers(0, f.max_len + 1))
  for s in schema.streams:
    L = int(rng.integers(0, 5))
    ev = np.zeros((L, len(records.event_columns(s))), np.int32)
    ev[:, 0] = rng.integers(0, s.item_vocab, L)
    ev[:, 3] = np.sort(rng.integers(0, 10**6, L))
    rec[f"events/{s.name}"] = ev
  return rec


def test_writer_reader_roundtrip(tmp_path):
  schema = tiny_schema()
  rng = np.random.default_rng(2)
  w = records.DatasetWriter(str(tmp_path), schema, records_per_shard=3)
  written = {}
  for surface, n in (("feed", 7), ("reels", 2)):     # stories: no records at all
    recs = [_example(schema, rng, schema.surfaces.index(surface)) for _ in range(n)]
    written[surface] = recs
    w.write("train", surface, [records.encode(r) for r in recs])
  manifest = w.close(("train",))
  assert json.load(open(tmp_path / "manifest.json")) == manifest
  feed = manifest["splits"]["train"]["feed"]
  assert [e["count"] for e in feed] == [3, 3, 1]
  assert [e["file"] for e in feed] == [f"train/feed-0000{i}-of-00003.arrayrecord" for i in range(3)]
  stories = manifest["splits"]["train"]["stories"]
  assert [(e["file"], e["count"]) for e in stories] == [
      ("train/stories-00000-of-00001.arrayrecord", 0)]
  assert stories[0]["bytes"] == os.path.getsize(tmp_path / stories[0]["file"])
  for e in feed:                                      # small shards (< 64 KB of data) are fine
    assert os.path.exists(tmp_path / e["file"])
  got = {}
  for path, _, rec in verify.read_split(str(tmp_path), "train"):
    got.setdefault(os.path.basename(path).split("-")[0], []).append(rec)
  assert sorted(got) == ["feed", "reels"]
  for surface, recs in written.items():
    assert len(got[surface]) == len(recs)
    for a, b in zip(recs, got[surface], strict=True):
      assert a.keys() == b.keys()
      for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_split_files_errors(tmp_path):
  schema = tiny_schema()
  with pytest.raises(FileNotFoundError, match="manifest.json"):
    records.split_files(str(tmp_path), "train", schema)
  records.DatasetWriter(str(tmp_path), schema).close(("train",))
  with pytest.raises(ValueError, match="unknown split 'test'"):
    records.split_files(str(tmp_path), "test", schema)


def test_record_source_read_many_matches_getitem(tmp_path):
  schema = tiny_schema()
  rng = np.random.default_rng(4)
  w = records.DatasetWriter(str(tmp_path), schema, records_per_shard=4)
  w.write("train", "feed", [records.encode(_example(schema, rng, 0)) for _ in range(11)])
  w.close(("train",))
  files = records.split_files(str(tmp_path), "train", schema)["feed"]
  src = records.RecordSource(files)
  idx = rng.integers(0, 11, 20)
  f, local, raws = src.read_many(idx)
  for i, fi, li, raw in zip(idx.tolist(), f.tolist(), local.tolist(), raws, strict=True):
    assert src[i] == (fi, li, raw)
    assert sum(c for _, c in files[:fi]) + li == i
  with pytest.raises(IndexError):
    src.read_many([11])


def test_parse_header_dims_offsets():
  a = {"x": np.zeros((3, 2), np.float32), "y": np.int32(1), "z": np.zeros(5, np.int64)}
  raw = records.encode(a)
  fields, H = records.parse_header(raw)
  assert [(n, d, s) for n, d, s, _ in fields] == [("x", np.float32, (3, 2)), ("y", np.int32, ()),
                                                  ("z", np.int64, (5,))]
  assert H == len(raw) - (24 + 4 + 40)
  for _, _, shape, off in fields:
    assert list(np.frombuffer(raw, "<u4", len(shape), off)) == list(shape)


def _ranged_records(rng, n):
  fixed = {"x": rng.normal(size=(n, 3)).astype(np.float32), "s": np.arange(n, dtype=np.int32),
           "none": np.zeros((n, 0), np.float32), "flag": rng.random(n) < 0.5,
           "big": np.arange(n, dtype=">i8")}                         # converted to little-endian
  ragged = {}
  for name, shape, dt in (("ev", (4,), np.int32), ("ids", (), np.int64), ("u8", (), np.uint8),
                          ("pair", (2,), ">i2"), ("nothing", (3,), np.float32)):
    e = 0 if name == "nothing" else int(rng.integers(1, 40))
    vals = rng.integers(-1000, 1000, (e,) + shape).astype(dt)
    start = rng.integers(0, e + 1, n)                # any order, overlapping, some empty
    stop = np.minimum(start + rng.integers(0, 6, n), e)
    ragged[name] = (vals, start, stop)
  return fixed, ragged


@pytest.mark.parametrize("batch,view_max", [(1 << 16, (1 << 31) - 1), (3, (1 << 31) - 1),
                                            (1 << 16, 300)])
def test_encode_ranges_matches_rowwise_encode(monkeypatch, batch, view_max):
  """Records whose ragged fields are windows into shared arrays (overlapping, unordered, empty,
  inline-short and long pieces, several dtypes), batched and split for the view offsets: each
  equals ``encode`` of its row dict, the independent per-record encoder."""
  monkeypatch.setattr(records, "_BATCH", batch)
  monkeypatch.setattr(records, "_VIEW_MAX", view_max)
  rng = np.random.default_rng(3)
  n = 57
  fixed, ragged = _ranged_records(rng, n)
  got = records.encode_ranges(fixed, ragged)
  assert len(got) == n and (batch > n or got.num_chunks > 1)
  got = got.to_pylist()
  for i in range(n):
    row = {k: v[i] for k, v in fixed.items()}
    row.update({k: v[s[i]:e[i]] for k, (v, s, e) in ragged.items()})
    assert got[i] == records.encode(row), i
    assert records.decode(got[i])["ev"].shape == (ragged["ev"][2][i] - ragged["ev"][1][i], 4)


def test_encode_ranges_rejects_ranges_outside_the_values():
  fixed = {"s": np.arange(2, dtype=np.int32)}
  vals = np.zeros((3, 4), np.int32)
  with pytest.raises(ValueError, match="'ev': ranges outside its 3 values"):
    records.encode_ranges(fixed, {"ev": (vals, np.array([0, 2]), np.array([1, 4]))})
  with pytest.raises(ValueError, match="'ev': 1 ranges for 2 records"):
    records.encode_ranges(fixed, {"ev": (vals, np.array([0]), np.array([1]))})
  assert records.encode_ranges({"s": np.zeros(0, np.int32)}, {}).to_pylist() == []
