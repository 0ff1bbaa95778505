"""Storage damage (issue 15): manifest sizes / checksums, truncated and bit-flipped shards named
by file and record range, skip_invalid counting damaged chunks as ``bytes`` with exact resume."""

import hashlib
import json
import os
import shutil

import ml_collections
import numpy as np
import pytest

from data import records, shards, verify
from data.pipeline import invalid_counts, make_dataset

SEQ = {"click": 8, "impression": 16}
FEED = "train/feed-00000-of-00001.arrayrecord"


def _cfg(**kw):
  d = dict(batch_size=32, surface_weights={"feed": 0.5, "stories": 0.3, "reels": 0.2},
           shuffle_seed=0, num_threads=2, prefetch=2, skip_invalid=False, length_balance=False)
  return ml_collections.ConfigDict({**d, **kw})


def flip(path, offset, n=256):
  with open(path, "r+b") as f:
    f.seek(offset)
    b = f.read(n)
    f.seek(offset)
    f.write(bytes(x ^ 0xFF for x in b))


@pytest.fixture()
def copy_dir(tiny_dir, tmp_path):
  d = str(tmp_path / "d")
  shutil.copytree(tiny_dir, d)
  return d


def test_manifest_records_size_and_sha256(tiny_dir):
  m = json.load(open(os.path.join(tiny_dir, "manifest.json")))
  n = 0
  for split in m["splits"].values():
    for entries in split.values():
      for e in entries:
        path = os.path.join(tiny_dir, e["file"])
        assert e["bytes"] == os.stat(path).st_size
        assert e["sha256"] == hashlib.sha256(open(path, "rb").read()).hexdigest()
        n += 1
  assert n == 6


def test_truncated_shard_is_named_at_startup(copy_dir):
  path = os.path.join(copy_dir, FEED)
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)
  with pytest.raises(shards.DataFileError, match=f"{path}: .* bytes, the manifest says .*truncated"):
    make_dataset(_cfg(), copy_dir, "train", SEQ, train=True, shard_index=0, shard_count=1)
  os.remove(path)
  with pytest.raises(shards.DataFileError, match=f"{path}: missing"):
    make_dataset(_cfg(), copy_dir, "train", SEQ, train=True, shard_index=0, shard_count=1)


def _strip_sizes(d):
  """The manifest as written before sizes / checksums existed."""
  p = os.path.join(d, "manifest.json")
  m = json.load(open(p))
  for split in m["splits"].values():
    for entries in split.values():
      for e in entries:
        del e["bytes"], e["sha256"]
  json.dump(m, open(p, "w"))


def test_old_manifest_loads_and_a_truncated_file_is_named_when_opened(copy_dir):
  _strip_sizes(copy_dir)
  assert records.unsized_files(copy_dir, "train") == 3
  ds = make_dataset(_cfg(), copy_dir, "eval", SEQ, train=False, shard_index=0, shard_count=1)
  assert next(iter(ds))["example_mask"].sum() == 32        # old manifests still work
  path = os.path.join(copy_dir, "eval/feed-00000-of-00001.arrayrecord")
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) - 5000)                 # the footer / postscript is gone
  it = iter(make_dataset(_cfg(), copy_dir, "eval", SEQ, train=False, shard_index=0,
                         shard_count=1))
  with pytest.raises(shards.DataFileError, match=f"{path}: cannot open"):
    next(it)


def test_damaged_chunk_error_names_file_and_record_range(copy_dir):
  path = os.path.join(copy_dir, FEED)
  flip(path, os.path.getsize(path) // 2)
  it = iter(make_dataset(_cfg(), copy_dir, "train", SEQ, train=True, shard_index=0,
                         shard_count=1))
  with pytest.raises(shards.DamagedChunkError) as e:
    for _ in range(300):
      next(it)
  err = e.value
  assert err.file == path and err.first <= err.index <= err.last and err.kind == "bytes"
  assert str(err).startswith(f"{path}: record") and "damaged chunk" in str(err)
  assert "\n" not in str(err)
  # the range is exactly the records that cannot be read (one record per chunk here)
  src = records.RecordSource([(path, records.split_files(copy_dir, "train",
                                                         _schema(copy_dir))["feed"][0][1])])
  bad = [i for i in range(len(src)) if not _readable(src, i)]
  assert bad == list(range(err.first, err.last + 1))


def _schema(d):
  from data.schema import Schema
  return Schema.load(d)


def _readable(src, i):
  try:
    src[i]
    return True
  except shards.DamagedChunkError:
    return False


def test_skip_invalid_counts_damaged_chunk_as_bytes_and_resumes_exactly(copy_dir):
  path = os.path.join(copy_dir, FEED)
  flip(path, os.path.getsize(path) // 2)
  cfg = _cfg(skip_invalid=True)
  ds = make_dataset(cfg, copy_dir, "train", SEQ, train=True, shard_index=0, shard_count=1)
  it = iter(ds)
  batches, states = [], []
  for _ in range(160):                  # > one pass over the ~1500 feed records
    states.append(it.get_state())
    batches.append(next(it))
  counts = invalid_counts(it)
  assert set(counts) == {"bytes"} and counts["bytes"] >= 1
  assert ds.invalid_counter.counts == counts
  masked = sum(int((b["example_mask"] == 0).sum()) for b in batches)
  assert masked == counts["bytes"]      # each skipped record is one padding row, nothing else
  first_bad = next(k for k, b in enumerate(batches) if b["example_mask"].min() == 0)
  # restored just before and just after the damaged record: the same batches, the same counts
  for k in (first_bad, first_bad + 1):
    it2 = iter(make_dataset(cfg, copy_dir, "train", SEQ, train=True, shard_index=0,
                            shard_count=1))
    it2.set_state(states[k])
    for want in batches[k:k + 3]:
      got = next(it2)
      for name in ("user_id", "request_ts", "example_mask", "dense"):
        np.testing.assert_array_equal(got[name], want[name])
    assert invalid_counts(it2) == invalid_counts_at(batches, k + 3)


def invalid_counts_at(batches, n):
  return {"bytes": sum(int((b["example_mask"] == 0).sum()) for b in batches[:n])}


def test_read_split_lives_in_verify_and_imports_go_one_way():
  import ast
  import inspect
  src = inspect.getsource(records)
  imported = {a.name for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ImportFrom)
              for a in n.names} | {n.module for n in ast.walk(ast.parse(src))
                                   if isinstance(n, ast.ImportFrom)}
  assert "verify" not in imported and "data.verify" not in imported
  assert not hasattr(records, "read_split") and callable(verify.read_split)


def test_validate_cli_reports_per_file(tiny_dir, copy_dir, tmp_path, capsys):
  from data import verify
  feed = os.path.join(copy_dir, FEED)
  flip(feed, os.path.getsize(feed) // 2)
  reels = os.path.join(copy_dir, "eval/reels-00000-of-00001.arrayrecord")
  with open(reels, "r+b") as f:
    f.truncate(100_000)
  out = str(tmp_path / "report.json")
  assert verify.main([copy_dir, "--deep", "--json", out]) == 1
  text = capsys.readouterr()
  assert "records [" in text.err                          # the progress bar
  rep = {f["file"]: f for f in json.load(open(out))["files"]}
  assert len(rep) == 6 and [f for f, r in rep.items() if r["problems"]] == [
      FEED, "eval/reels-00000-of-00001.arrayrecord"]
  assert rep[FEED]["sha256"] == "mismatch" and rep[FEED]["size"] == "ok"
  src = records.RecordSource([(feed, rep[FEED]["count"])])
  bad = [i for i in range(len(src)) if not _readable(src, i)]
  assert bad and sum((list(range(a, b + 1)) for a, b in rep[FEED]["damaged"]), []) == bad
  assert rep[FEED]["invalid"] == {}
  assert rep["eval/reels-00000-of-00001.arrayrecord"]["size"] == "mismatch"
  line = next(x for x in text.out.splitlines() if x.startswith(FEED))
  assert line.endswith("DAMAGED") and f" {len(bad)} " in line
  assert "4/6 files intact" in text.out
  # an intact file holding a record that breaks the schema: counted per kind
  schema = _schema(copy_dir)
  recs = [r for _, _, r in verify.read_split(tiny_dir, "eval", schema)][:6]
  recs[4] = dict(recs[4], labels=np.array([2, 0], np.float32))
  w = records.DatasetWriter(str(tmp_path / "inv"), schema)
  w.write("eval", "feed", [records.encode(r) for r in recs])
  w.close(("eval",))
  assert verify.main([str(tmp_path / "inv"), "--deep", "--json", out]) == 1
  rep = {f["file"]: f for f in json.load(open(out))["files"]}
  assert rep["eval/feed-00000-of-00001.arrayrecord"]["invalid"] == {"label": 1}
  assert "record 4: field 'labels'" in capsys.readouterr().out


def test_validate_cli_old_manifest_and_update(copy_dir, capsys):
  from data import verify
  _strip_sizes(copy_dir)
  assert verify.main([copy_dir]) == 0
  assert "records no byte sizes / checksums" in capsys.readouterr().out
  assert verify.main([copy_dir, "--deep", "--update_manifest"]) == 0
  assert "recorded sizes and checksums of 6 files" in capsys.readouterr().out
  test_manifest_records_size_and_sha256(copy_dir)        # now equal to an independent hash
  assert verify.main([os.path.join(copy_dir, "nope")]) == 2
  assert "no such directory" in capsys.readouterr().err
