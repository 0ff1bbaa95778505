"""python -m data.ingest: own column names, inferred / file schema, coercions, truncation,
unknown columns, time split, progress and one-line errors (issue #14 friction points 1-4).

Expected records are computed here from the source rows, independently of the converter."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data import ingest, verify
from data.schema import Schema

N = 40
RENAME = ("request_ts=time,user_id=uid,ad_id=item,label.click=clicked,label.like=liked,"
          "dense.price=price,sparse.genre=genre,events.click.item=hist_items,"
          "events.click.ts=hist_ts,events.click.surface=hist_tab,surface=tab")


def _log_table(n=N, seed=0, long_hist=6):
  """A log in its owner's conventions: float times, bool / nullable labels, int price, scalar
  genre ids, list histories (float times), an unknown column."""
  rng = np.random.default_rng(seed)
  time_s = 1_700_000_000 + np.arange(n) * 1000 + 0.75          # unique, with a fraction
  lens = rng.integers(0, long_hist + 1, n)
  lens[3] = long_hist
  items = [rng.integers(0, 30, k).tolist() for k in lens]
  hts = [sorted((time_s[i] - rng.uniform(1, 5000, k)).tolist()) for i, k in enumerate(lens)]
  tabs = [rng.integers(0, 2, k).tolist() for k in lens]
  liked = [None if i % 3 else float(rng.integers(0, 2)) for i in range(n)]
  return pa.table({
      "time": time_s, "uid": rng.integers(0, 9, n), "item": rng.integers(100, 140, n),
      "tab": rng.choice(["feed", "reels"], n), "clicked": rng.random(n) < 0.4,
      "liked": pa.array(liked, pa.float64()), "price": rng.integers(1, 50, n),
      "genre": rng.integers(0, 7, n), "hist_items": pa.array(items, pa.list_(pa.int64())),
      "hist_ts": pa.array(hts, pa.list_(pa.float64())),
      "hist_tab": pa.array(tabs, pa.list_(pa.int64())), "junk": rng.random(n)})


def _records(d):
  out = {}
  for split in ("train", "valid", "eval"):
    out[split] = [r for _, _, r in verify.read_split(d, split)]
  return out


def _coercions(out: str) -> dict:
  """{column: message} from the printed ``coercion: col1, col2: message`` lines."""
  got = {}
  for line in out.splitlines():
    if line.startswith("coercion: "):
      cols, _, msg = line[len("coercion: "):].partition(": ")
      got.update({c: msg for c in cols.split(", ")})
  return got


def _run(argv, capsys):
  code = ingest.main(argv)
  cap = capsys.readouterr()
  return code, cap.out, cap.err


@pytest.fixture(scope="module")
def log_file(tmp_path_factory):
  p = str(tmp_path_factory.mktemp("log") / "log.parquet")
  pq.write_table(_log_table(), p, row_group_size=16)
  return p


def test_inferred_schema_needs_confirmation_then_converts(log_file, tmp_path, capsys):
  out = str(tmp_path / "ds")
  code, o, e = _run(["--input", log_file, "--out", out, "--rename", RENAME], capsys)
  assert code == 2 and e.strip().splitlines()[-1].startswith("data.ingest: error: the schema "
                                                              "above was inferred: pass --yes")
  assert '"columns"' in o and '"tasks"' in o                        # the printed proposal
  code, o, e = _run(["--input", log_file, "--out", out, "--rename", RENAME, "--yes"], capsys)
  assert code == 0, e
  # coercions are explicit and logged, unknown columns listed, the ids note printed
  assert _coercions(o) == {
      "time (as request_ts)": "double -> integer seconds (floor)",
      "hist_ts (as events.click.ts)": "double -> integer seconds (floor)",
      "clicked (as label.click)": "bool -> 0/1", "price (as dense.price)": "int64 -> float",
      "genre (as sparse.genre)": "int64 scalars -> one-id lists (null -> empty)",
      "events.click.action": "missing -> 0 for every event"}
  assert "warning: columns with no role, not converted: ['junk']" in e
  assert "user_id / ad_id are join keys only: the model never sees them" in o
  assert "rows / 40 (100%" in e                                     # progress
  schema = Schema.load(out)
  assert schema.surfaces == ("feed", "reels") and schema.dense == ("price",)
  assert [(t.name, t.always_valid) for t in schema.tasks] == [("click", True), ("like", False)]
  assert schema.stream("click").max_len == 6 and schema.sparse[0].name == "genre"
  assert "user_id" not in [f.name for f in schema.sparse]
  # every row once, in its time window, with the values of the source row
  t = _log_table().to_pydict()
  got = _records(out)
  assert [len(got[s]) for s in ("train", "valid", "eval")] == [32, 4, 4]
  bounds = [max(int(r["request_ts"]) for r in got["train"]),
            min(int(r["request_ts"]) for r in got["valid"]),
            max(int(r["request_ts"]) for r in got["valid"]),
            min(int(r["request_ts"]) for r in got["eval"])]
  assert bounds == sorted(bounds) and bounds[0] < bounds[1] and bounds[2] < bounds[3]
  by_ts = {int(np.floor(x)): i for i, x in enumerate(t["time"])}
  for r in got["train"] + got["valid"] + got["eval"]:
    i = by_ts[int(r["request_ts"])]
    assert int(r["user_id"]) == t["uid"][i] and int(r["ad_id"]) == t["item"][i]
    assert schema.surfaces[int(r["surface"])] == t["tab"][i]
    assert r["labels"][0] == float(t["clicked"][i])
    assert r["label_mask"][1] == (t["liked"][i] is not None)
    assert r["dense"].tolist() == [float(t["price"][i])]
    assert r["sparse/genre"].tolist() == [t["genre"][i]]
    ev = r["events/click"]
    assert ev[:, 0].tolist() == t["hist_items"][i] and ev[:, 2].tolist() == t["hist_tab"][i]
    assert ev[:, 1].tolist() == [0] * len(ev)
    assert ev[:, 3].tolist() == [int(np.floor(x)) for x in t["hist_ts"][i]]
  rep = json.load(open(f"{out}/ingest.json"))
  assert rep["unknown_columns"] == ["junk"] and rep["examples"]["train"] == 32


def test_spec_file_truncation_and_ids_as_features(log_file, tmp_path, capsys):
  spec = tmp_path / "spec.yaml"
  cols = dict(kv.split("=") for kv in RENAME.split(","))
  import yaml
  spec.write_text(yaml.safe_dump({"columns": cols, "schema": {"streams": [
      {"name": "click", "max_len": 4, "item_vocab": 30, "action_vocab": 1}]}}))
  out = str(tmp_path / "ds")
  args = ["--input", log_file, "--out", out, "--schema", str(spec), "--yes", "--split", "none"]
  code, _, e = _run(args, capsys)
  assert code == 2
  last = e.strip().splitlines()[-1]
  lens = [len(x) for x in _log_table().column("hist_items").to_pylist()]
  row = next(i for i, k in enumerate(lens) if k > 4)
  assert last == (f"data.ingest: error: {log_file}: row {row}: column 'hist_items (as "
                  f"events.click.item)' has {lens[row]} events > max_len 4 of stream 'click'; "
                  "pass --truncate_history to keep the most recent 4")
  code, o, e = _run(args + ["--truncate_history", "--ids_as_features"], capsys)
  assert code == 0, e
  assert _coercions(o)["events.click"] == ("histories longer than 4 truncated to the most recent "
                                           "(--truncate_history)")
  schema = Schema.load(out)
  assert {"user_id", "ad_id"} <= {f.name for f in schema.sparse}
  t = _log_table().to_pydict()
  by_ts = {int(np.floor(x)): i for i, x in enumerate(t["time"])}
  got = [r for _, _, r in verify.read_split(out, "train")]
  assert len(got) == N
  for r in got:
    i = by_ts[int(r["request_ts"])]
    assert r["events/click"][:, 0].tolist() == t["hist_items"][i][-4:]        # most recent 4
    assert r["sparse/user_id"].tolist() == [t["uid"][i]]
    assert r["sparse/ad_id"].tolist() == [t["item"][i]]


def test_write_schema_then_reuse_without_confirmation(tmp_path, capsys):
  rng = np.random.default_rng(1)
  n = 30
  csv = tmp_path / "log.csv"
  rows = ["ts,user,movie,liked"] + [f"{1_600_000_000 + 60 * i},{rng.integers(0, 5)},"
                                    f"{rng.integers(0, 8)},{int(rng.random() < 0.5)}"
                                    for i in range(n)]
  csv.write_text("\n".join(rows) + "\n")
  spec = str(tmp_path / "spec.json")
  base = ["--input", str(csv), "--rename", "request_ts=ts,user_id=user,ad_id=movie,"
          "label.click=liked", "--history", "clicks=label.click,all=all", "--history_len", "3",
          "--ids_as_features", "--split", "time:0.8,0,0.2"]
  code, o, _ = _run(base + ["--out", str(tmp_path / "x"), "--write_schema", spec], capsys)
  assert code == 0 and f"wrote {spec}" in o and not (tmp_path / "x").exists()
  saved = json.load(open(spec))
  assert saved["history"]["streams"] == {"clicks": "label.click", "all": "all"}
  assert [s["name"] for s in saved["schema"]["streams"]] == ["clicks", "all"]
  halves = [tmp_path / "log_a.csv", tmp_path / "log_b.csv"]   # as a shell glob passes them
  halves[0].write_text("\n".join(rows[:16]) + "\n")
  halves[1].write_text("\n".join(rows[:1] + rows[16:]) + "\n")
  code, o, e = _run(["--input", *map(str, halves), "--out", str(tmp_path / "ds"), "--schema",
                     spec, "--split", "time:0.8,0,0.2"], capsys)
  assert code == 0, e
  assert "proposed spec" not in o                     # nothing inferred: no confirmation
  m = json.load(open(tmp_path / "ds" / "manifest.json"))
  assert sorted(m["splits"]) == ["eval", "train"]     # no valid window asked for
  assert sum(x["count"] for sp in m["splits"].values() for xs in sp.values() for x in xs) == n


@pytest.mark.parametrize("change,msg", [
    ("label2", "row 5: column 'clicked (as label.click)' has value 2.0; labels must be 0 or 1"),
    ("null_dense", "row 7: column 'price (as dense.price)' is null"),
    ("no_ts", "missing column 'request_ts' (rename yours with --rename request_ts=<column>)"),
    ("ms", "are the times in ms or us? pass --ts_unit ms|us"),
    ("bad_key", "spec.json: unknown key(s) ['colums']"),
])
def test_bad_input_is_one_line(tmp_path, capsys, change, msg):
  t = _log_table(12)
  rename = RENAME
  spec = []
  if change == "label2":
    t = t.set_column(t.column_names.index("clicked"), "clicked",
                     pa.array([0, 1, 0, 0, 1, 2] + [0] * 6))
  elif change == "null_dense":
    t = t.set_column(t.column_names.index("price"), "price",
                     pa.array([1.0] * 7 + [None] + [2.0] * 4))
  elif change == "no_ts":
    rename = RENAME.replace("request_ts=time,", "")
  elif change == "ms":
    t = t.set_column(0, "time", pa.array(np.asarray(t.column("time")) * 1000))
  elif change == "bad_key":
    (tmp_path / "spec.json").write_text('{"colums": {}}')
    spec = ["--schema", str(tmp_path / "spec.json")]
  p = str(tmp_path / "log.parquet")
  pq.write_table(t, p)
  code, _, e = _run(["--input", p, "--out", str(tmp_path / "ds"), "--rename", rename, "--yes",
                     *spec], capsys)
  assert code == 2
  last = e.strip().splitlines()[-1]
  assert last.startswith("data.ingest: error: ") and msg in last, last
  assert "Traceback" not in e and not (tmp_path / "ds").exists()


def test_convert_parquet_warns_about_unknown_columns(tiny_dir, tmp_path, capsys):
  from data.ingest.parquet import convert_parquet, unknown_columns
  schema = Schema.load(tiny_dir)
  assert unknown_columns(["surface", "dense.ad_bid", "sparse.nope", "extra"], schema) == [
      "sparse.nope", "extra"]
  recs = [r for _, _, r in verify.read_split(tiny_dir, "eval", schema)][:5]
  from tests.data.ingest.test_parquet import _table
  t = _table(recs, schema).append_column("campaign", pa.array(["x"] * 5))
  p = str(tmp_path / "a.parquet")
  pq.write_table(t, p)
  convert_parquet({"train": [p]}, str(tmp_path / "out"), schema)
  assert f"warning: {p}: columns not in the schema, ignored: ['campaign']" in capsys.readouterr().err
