import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data import records, validate
from data.parquet import convert_parquet
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
  recs = [r for _, _, r in validate.read_split(tiny_dir, "eval", schema)][:120]
  return schema, recs


def test_parquet_roundtrip(source, tmp_path):
  schema, recs = source
  path = str(tmp_path / "a.parquet")
  pq.write_table(_table(recs, schema), path, row_group_size=50)
  manifest = convert_parquet({"train": [path]}, str(tmp_path / "out"), schema)
  got = [r for _, _, r in validate.read_split(str(tmp_path / "out"), "train")]
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
