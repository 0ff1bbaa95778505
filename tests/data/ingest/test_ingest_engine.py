"""data.ingest on DuckDB (data/ingest/engine.py) = the in-memory reference, example by example, on small
logs with the edge cases: same-second rows, a heavy user, null labels, unicode ids, several
inputs, explicit splits, many buckets and workers; plus the output-safety rules (atomic output,
--out around an input)."""

import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest

from data import ingest
from data.ingest import engine as duckdb_runner
from data.ingest.infer import Spec
from tests.data.ingest.logs import SPEC, assert_same_examples, flat_log


def _ingest(tmp_path, name, tables, engine, spec=SPEC, split="time:0.7,0.15,0.15", **kw):
  srcs = []
  for i, t in enumerate(tables):
    p = str(tmp_path / f"log{i}.parquet")
    if not os.path.exists(p):
      pq.write_table(t, p, row_group_size=97)
    srcs.append(ingest.Source(p, batch_rows=131))
  out = str(tmp_path / name)
  sources = kw.pop("sources", None) or {None: srcs}
  rep = ingest.run(sources, out, Spec.from_dict(spec), split=split, yes=True, engine=engine,
                   out=open(os.devnull, "w"), err=open(os.devnull, "w"), **kw)
  return out, rep


@pytest.mark.parametrize("kw", [dict(workers=1), dict(workers=2, rows_per_bucket=150)])
def test_engine_equals_reference_with_histories(tmp_path, kw):
  tables = [flat_log(500, 0), flat_log(300, 1)]
  ref, rref = _ingest(tmp_path, "ref", tables, "memory")
  eng, reng = _ingest(tmp_path, "eng", tables, "duckdb", records_per_shard=64, **kw)
  assert_same_examples(ref, eng)
  for k in ("counts", "examples", "split", "coercions", "encodings"):
    assert rref[k] == reng[k], k
  for s, rates in rref["positive_rate"].items():
    assert rates == pytest.approx(reng["positive_rate"][s])
  m = json.load(open(f"{eng}/manifest.json"))
  assert max(len(v) for s in m["splits"].values() for v in s.values()) > 1   # rotated shards
  assert not [f for f in os.listdir(tmp_path) if f.startswith(".")]          # no staging left


def test_engine_equals_reference_without_histories_and_explicit_splits(tmp_path):
  spec = {k: v for k, v in SPEC.items() if k != "history"}
  t = flat_log(400, 2)
  a, b = t.slice(0, 250), t.slice(250)
  for i, x in enumerate((a, b)):
    pq.write_table(x, str(tmp_path / f"s{i}.parquet"), row_group_size=50)
  mk = lambda: {"train": [ingest.Source(str(tmp_path / "s0.parquet"), batch_rows=60)],
                "eval": [ingest.Source(str(tmp_path / "s1.parquet"), batch_rows=60)]}
  # the halves of a shuffled log overlap in time: accepted with allow_overlap
  ref, _ = _ingest(tmp_path, "ref", [], "memory", spec=spec, sources=mk(), allow_overlap=True)
  eng, _ = _ingest(tmp_path, "eng", [], "duckdb", spec=spec, sources=mk(), workers=2,
                   allow_overlap=True)
  assert_same_examples(ref, eng)
  hist = dict(spec, history=SPEC["history"])      # histories across explicit splits too
  ref, _ = _ingest(tmp_path, "ref2", [], "memory", spec=hist, sources=mk(), allow_overlap=True)
  eng, _ = _ingest(tmp_path, "eng2", [], "duckdb", spec=hist, sources=mk(), workers=2,
                   rows_per_bucket=100, allow_overlap=True)
  assert_same_examples(ref, eng)


def test_histories_against_a_loop(tmp_path):
  """The engine's streams and statistics of every example, from the source rows directly."""
  t = flat_log(300, 3)
  out, _ = _ingest(tmp_path, "eng", [t], "duckdb", split="none", workers=2, rows_per_bucket=60)
  from tests.data.ingest.logs import decoded
  rows = t.to_pydict()
  n = t.num_rows
  ts, uid, ad = rows["time"], rows["uid"], rows["ad"]
  click, conv = rows["click"], rows["conv"]
  got = decoded(out)["train"]
  assert len(got) == n
  seen = {}
  for _, r in got:
    key = (int(r["request_ts"]), int(r["ad_id"]))
    cands = [i for i in range(n) if (ts[i], ad[i]) == key and i not in seen.get(key, set())]
    match = None
    for i in cands:
      earlier = sorted((j for j in range(n) if uid[j] == uid[i] and ts[j] < ts[i]),
                       key=lambda j: (ts[j], j))
      want_imp = [ad[j] for j in earlier][-8:]
      want_clk = [ad[j] for j in earlier if click[j] == 1][-8:]
      if (r["events/impression"][:, 0].tolist() == want_imp
          and r["events/click"][:, 0].tolist() == want_clk):
        match = i
        assert r["events/impression"][:, 3].tolist() == [ts[j] for j in earlier][-8:]
        assert all(x < ts[i] for x in r["events/impression"][:, 3])
        d = r["dense"]      # bid, user_count, user_click_rate, user_conv_rate, ad_count, ...
        assert d[1] == len(earlier)
        pos = sum(click[j] for j in earlier)
        assert np.isclose(d[2], (pos + 1) / (len(earlier) + 2))
        vis = [j for j in earlier if conv[j] is not None and ts[j] + 300 < ts[i]]   # 5m delay
        assert np.isclose(d[3], (sum(conv[j] > 0.5 for j in vis) + 1) / (len(vis) + 2))
        want_act = [click[j] + 2 * (conv[j] is not None and conv[j] > 0.5
                                    and ts[j] + 300 < ts[i]) for j in earlier][-8:]
        assert r["events/impression"][:, 1].tolist() == want_act
        same_ad = [j for j in range(n) if ad[j] == ad[i] and ts[j] < ts[i]]
        assert d[4] == len(same_ad)
        vis = [j for j in same_ad if conv[j] is not None and ts[j] + 300 < ts[i]]
        assert np.isclose(d[6], (sum(conv[j] > 0.5 for j in vis) + 1) / (len(vis) + 2))
        break
    assert match is not None, key
    seen.setdefault(key, set()).add(match)


def test_failed_run_leaves_the_old_dataset(tmp_path, monkeypatch):
  t = flat_log(200, 4)
  out, _ = _ingest(tmp_path, "ds", [t], "duckdb")
  before = json.load(open(f"{out}/manifest.json"))
  def boom(*a, **k):
    raise ValueError("disk full (simulated)")
  monkeypatch.setattr(duckdb_runner, "write_manifest", boom)
  with pytest.raises(ValueError, match="simulated"):
    _ingest(tmp_path, "ds", [t], "duckdb", overwrite=True)
  assert json.load(open(f"{out}/manifest.json")) == before     # untouched, still complete
  assert os.path.exists(f"{out}/ingest.json")
  assert not [f for f in os.listdir(tmp_path) if f.startswith(".")]   # staging removed
  monkeypatch.undo()
  _ingest(tmp_path, "ds", [t], "duckdb", overwrite=True)          # and a good run replaces it
  assert json.load(open(f"{out}/manifest.json")) == before


def test_overwrite_refuses_an_out_that_holds_an_input(tmp_path, capsys):
  d = tmp_path / "ds"
  d.mkdir()
  log = d / "log.csv"
  log.write_text("ts,user,item,clicked\n100,1,5,1\n200,2,6,0\n300,1,7,1\n")
  (d / "manifest.json").write_text("{}")              # looks like a dataset
  args = ["--input", str(log), "--out", str(d), "--rename",
          "request_ts=ts,user_id=user,ad_id=item,label.click=clicked", "--yes", "--overwrite",
          "--split", "none"]
  assert ingest.main(args) == 2
  e = capsys.readouterr().err
  assert f"--out={d} contains the input {log}" in e and "Traceback" not in e
  assert log.exists()
  assert ingest.main(args[:2] + ["--out", str(log / "sub")] + args[4:]) == 2
  assert "lies inside the input" in capsys.readouterr().err and log.exists()


@pytest.mark.parametrize("text,msg", [
    ("ts,user,item,clicked,user\n100,1,5,1,3\n200,2,6,0,4\n",
     "column name(s) ['user'] appear more than once in the input"),
    ("ts,user,item,clicked\n100,9223372036854775808,5,1\n200,2,6,0\n",
     "row 0: column 'user (as user_id)' has integer ids outside the int64 range"),
])
def test_bad_columns_are_one_line(tmp_path, capsys, text, msg):
  p = tmp_path / "log.csv"
  p.write_text(text)
  code = ingest.main(["--input", str(p), "--out", str(tmp_path / "o"), "--yes", "--rename",
                      "request_ts=ts,user_id=user,ad_id=item,label.click=clicked"])
  e = capsys.readouterr().err
  assert code == 2 and msg in e.strip().splitlines()[-1] and "Traceback" not in e, e
  assert "double" not in e


def test_table_source_equals_reference(tmp_path):
  """A table source (the public recipes) goes through the engine path too."""
  t = flat_log(120, 5)
  src = ingest.Source(table=t, name="tbl", batch_rows=50)
  out = str(tmp_path / "ds")
  ingest.run({None: [src]}, out, Spec.from_dict(SPEC), yes=True, out=open(os.devnull, "w"),
             err=open(os.devnull, "w"))
  ref = str(tmp_path / "ref")
  ingest.run({None: [ingest.Source(table=t, name="tbl", batch_rows=50)]}, ref,
             Spec.from_dict(SPEC), yes=True, engine="memory", out=open(os.devnull, "w"),
             err=open(os.devnull, "w"))
  assert_same_examples(ref, out)


def test_kill_leaves_no_partial_dataset(tmp_path):
  """SIGKILL in the middle of the conversion: nothing at --out (the old dataset stays), the
  staging folder beside it is removed by the next run, which then completes."""
  import signal
  import subprocess
  import sys
  import time
  t = flat_log(4000, 6)
  p = str(tmp_path / "log.parquet")
  pq.write_table(t, p)
  out = tmp_path / "ds"
  cols = ",".join(f"{r}={c}" for r, c in SPEC["columns"].items())
  args = [sys.executable, "-m", "data.ingest", "--input", p, "--out", str(out), "--rename", cols,
          "--ids_as_features", "--history", "click=label.click,impression=all", "--yes",
          "--history_stats", "--label_delay", "conv=5m", "--workers", "1"]
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__)))))
  env = dict(os.environ, PYTHONPATH=root)
  proc = subprocess.Popen(args, cwd=root, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  deadline = time.time() + 120
  staging = tmp_path / f".ds.ingest-{proc.pid}"
  while time.time() < deadline and not list(staging.glob("*/.*.tmp")):   # shards being written
    time.sleep(0.01)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert staging.exists() and not out.exists()
  r = subprocess.run(args, cwd=root, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  assert "left by an ingest that was killed" in r.stderr
  assert not staging.exists() and (out / "manifest.json").exists()


def test_bad_history_events_are_one_line_errors(tmp_path):
  """A forced schema whose item vocabulary the ad ids exceed: both paths stop with the field
  and the value; the engine (which checks each event once, at its source row) names a row
  whose ad id is that value."""
  t = flat_log(300, 7)
  streams = [{"name": s, "max_len": 8, "item_vocab": 10, "action_vocab": 4}
             for s in ("click", "impression")]
  spec = dict(SPEC, schema={"streams": streams})
  msgs = {}
  for eng in ("memory", "duckdb"):
    with pytest.raises(ValueError) as e:
      _ingest(tmp_path, eng, [t], eng, spec=spec)
    msgs[eng] = str(e.value)
    assert "invalid value in the column(s) of field 'events/impression/item'" in msgs[eng]
    assert "outside [0, 10)" in msgs[eng] and "\n" not in msgs[eng]
  row = int(msgs["duckdb"].split(": row ")[1].split(":")[0])
  value = int(msgs["duckdb"].split(": value ")[1].split(" ")[0])
  assert t.column("ad")[row].as_py() == value >= 10


def test_records_per_chunk_changes_files_not_examples(tmp_path):
  t = flat_log(400, 8)
  one, _ = _ingest(tmp_path, "one", [t], "duckdb", records_per_chunk=1)
  eight, _ = _ingest(tmp_path, "eight", [t], "duckdb", records_per_chunk=8)
  assert_same_examples(one, eight)
  size = lambda d: sum(e["bytes"] for s in json.load(open(f"{d}/manifest.json"))["splits"].values()
                       for es in s.values() for e in es)
  assert size(eight) < size(one)              # fewer chunk headers
  from data import records
  from data.schema import Schema
  files = records.split_files(eight, "train", Schema.load(eight))
  src = records.RecordSource([f for fs in files.values() for f in fs])
  idx = np.random.default_rng(0).permutation(len(src))[:50]
  _, _, got = src.read_many(idx)                # random access into 8-record chunks
  assert all(records.decode(g)["labels"].shape == (2,) for g in got)
