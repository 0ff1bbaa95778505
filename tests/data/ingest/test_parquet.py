import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data import records, verify
from data.ingest.parquet import convert_parquet
from data.schema import Schema


def _table(recs, schema):
  """Builds the documented Parquet column layout from records (independent of the converter)."""
  cols = {"surface": pa.array([schema.surfaces[int(r["surface"])] for r in recs]),
          "request_ts": pa.array([int(r["request_ts"]) for r in recs], pa.int64()),
          "user_id": pa.array([int(r["user_id"]) for r in recs], pa.int64()),
          "ad_id": pa.array([int(r["ad_id"]) for r in recs], pa.int32())}
  for j, d in enumerate(schema.dense):
    cols[f"dense.{d}"] = pa.array([float(r["dense"][j]) for r in recs], pa.float64())
  for f in schema.sparse:
    cols[f"sparse.{f.name}"] = pa.array([r[f"sparse/{f.name}"].tolist() for r in recs],
                                        pa.list_(pa.int64()))
  for s in schema.streams:
    for c, name in enumerate(records.event_columns(s)):
      cols[f"events.{s.name}.{name}"] = pa.array(
          [r[f"events/{s.name}"][:, c].tolist() for r in recs], pa.list_(pa.int32()))
  for k, t in enumerate(schema.tasks):
    cols[f"label.{t.name}"] = pa.array(
        [int(r["labels"][k]) if r["label_mask"][k] else None for r in recs], pa.int8())
    cols[f"true_prob.{t.name}"] = pa.array([float(r["true_prob"][k]) for r in recs], pa.float32())
  return pa.table(cols)


@pytest.fixture(scope="module")
def source(tiny_dir):
  schema = Schema.load(tiny_dir)
  recs = [r for _, _, r in verify.read_split(tiny_dir, "eval", schema)][:120]
  return schema, recs


def test_parquet_roundtrip(source, tmp_path):
  schema, recs = source
  path = str(tmp_path / "a.parquet")
  pq.write_table(_table(recs, schema), path, row_group_size=50)
  manifest = convert_parquet({"train": [path]}, str(tmp_path / "out"), schema)
  got = [r for _, _, r in verify.read_split(str(tmp_path / "out"), "train")]
  assert sum(e["count"] for es in manifest["splits"]["train"].values() for e in es) == len(recs)
  # converter groups rows per surface (schema order), keeping row order within a surface
  want = sorted(recs, key=lambda r: int(r["surface"]))
  for a, b in zip(want, got, strict=True):
    assert a.keys() == b.keys()
    for k in a:
      np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize("column,change,msg", [
    ("dense.ad_bid", "drop", "missing column 'dense.ad_bid'"),
    ("events.click.category", "drop", "missing column 'events.click.category'"),
    ("label.click", "drop", "missing column 'label.click'"),
    ("request_ts", "string", "column 'request_ts' has type string, expected integer"),
    ("sparse.user_segment", "string", "column 'sparse.user_segment' has type string"),
    ("surface", "ads", r"unknown surface\(s\) \['ads'\]"),
    ("label.click", "null", "'label.click' has nulls but task 'click' is always valid"),
    ("events.click.action", "short", "row 0: column .events.click.action. has a different number"),
    ("dense.ad_bid", "nan", "row 3: invalid value .*dense/ad_bid"),
])
def test_parquet_column_errors(source, tmp_path, column, change, msg):
  schema, recs = source
  recs = [r for r in recs if len(r["events/click"])][:10]
  t = _table(recs, schema)
  i = t.column_names.index(column)
  n = t.num_rows
  if change == "drop":
    t = t.remove_column(i)
  elif change == "string":
    t = t.set_column(i, column, pa.array(["x"] * n))
  elif change == "ads":
    t = t.set_column(i, column, pa.array(["ads"] * n))
  elif change == "null":
    t = t.set_column(i, column, pa.array([None] * n, pa.int8()))
  elif change == "short":
    t = t.set_column(i, column, pa.array([v[:-1] for v in t.column(i).to_pylist()],
                                         pa.list_(pa.int32())))
  elif change == "nan":
    v = t.column(i).to_pylist()
    v[3] = float("nan")
    t = t.set_column(i, column, pa.array(v, pa.float64()))
  path = str(tmp_path / "bad.parquet")
  pq.write_table(t, path)
  with pytest.raises(ValueError, match=msg) as e:
    convert_parquet({"train": [path]}, str(tmp_path / "out"), schema)
  assert "bad.parquet" in str(e.value)


@pytest.mark.parametrize("change", ["nan", "sparse_range", "sparse_long", "item_range",
                                    "ts_late", "ts_order", "events_long", "neg_action",
                                    "true_prob", "ok"])
def test_column_checks_agree_with_record_checks(source, change):
  """``check_columns`` (before encoding) flags the same row and field as the decoded-record
  validator (``validate="records"``), for each kind of bad value."""
  from data.ingest.parquet import table_to_records
  schema, recs = source
  recs = [r for r in recs if len(r["events/click"]) > 1][:12]
  t = _table(recs, schema)
  col = lambda name: t.column(name).to_pylist()
  put = lambda name, v, typ: t.set_column(t.column_names.index(name), name, pa.array(v, typ))
  L = pa.list_(pa.int32())
  f = schema.sparse[0]
  s = schema.stream("click")
  if change == "nan":
    v = col("dense.ad_bid"); v[4] = float("inf"); t = put("dense.ad_bid", v, pa.float64())
  elif change == "sparse_range" and not f.hashed:
    v = col(f"sparse.{f.name}"); v[5] = [f.vocab_size]; t = put(f"sparse.{f.name}", v,
                                                                pa.list_(pa.int64()))
  elif change == "sparse_long":
    v = col(f"sparse.{f.name}"); v[2] = [0] * (f.max_len + 1)
    t = put(f"sparse.{f.name}", v, pa.list_(pa.int64()))
  elif change == "item_range":
    v = col("events.click.item"); v[6][0] = s.item_vocab; t = put("events.click.item", v, L)
  elif change == "ts_late":
    v = col("events.click.ts"); v[3][-1] = col("request_ts")[3] + 1
    t = put("events.click.ts", v, L)
  elif change == "ts_order":
    v = col("events.click.ts"); v[7][0], v[7][1] = v[7][1] + 1, v[7][0]
    t = put("events.click.ts", v, L)
  elif change == "events_long":
    for c in records.event_columns(s):
      v = col(f"events.click.{c}"); v[1] = v[1] * (s.max_len // len(v[1]) + 1)
      t = put(f"events.click.{c}", v, L)
  elif change == "neg_action":
    v = col("events.click.action"); v[8][0] = -1; t = put("events.click.action", v, L)
  elif change == "true_prob":
    name = f"true_prob.{schema.tasks[0].name}"
    v = col(name); v[9] = 1.5; t = put(name, v, pa.float32())
  errs = []
  for mode in ("columns", "records"):
    try:
      table_to_records(t, schema, "x.parquet", validate=mode)
      errs.append(None)
    except ValueError as e:
      msg = str(e)
      errs.append((msg.split(": invalid")[0], msg.split("field ")[1].split(":")[0]))
  assert errs[0] == errs[1], errs
  assert (errs[0] is None) == (change == "ok" or (change == "sparse_range" and f.hashed))
