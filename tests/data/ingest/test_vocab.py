"""Exact vocabularies (value -> id, null and out-of-vocabulary buckets, stored in schema.json and
reused by a later ingest) and the collision report of hashed columns (data/ingest/vocab.py)."""

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data import ingest
from data.ingest import vocab
from data.ingest.infer import Spec
from data.schema import Schema
from tests.data.ingest.logs import decoded

AGES = ["18-24", "25-34", "35-44", "45-49", "50-55", "56+", "<18"]


def _log(n=300, seed=0, ages=AGES, occupations=60):
  rng = np.random.default_rng(seed)
  age = [None if rng.random() < 0.1 else ages[k] for k in rng.integers(0, len(ages), n)]
  return pa.table({"ts": 1_600_000_000 + np.arange(n) * 10, "user": rng.integers(0, 20, n),
                   "item": rng.integers(0, 40, n), "clicked": rng.integers(0, 2, n),
                   "age": pa.array(age, pa.string()),
                   "occ": pa.array([f"job-{k}" for k in rng.integers(0, occupations, n)])})


SPEC = {"columns": {"request_ts": "ts", "user_id": "user", "ad_id": "item",
                    "label.click": "clicked", "sparse.age": "age", "sparse.occ": "occ"}}


def _run(tmp_path, name, t, spec, **kw):
  p = str(tmp_path / f"{name}.parquet")
  pq.write_table(t, p)
  out = str(tmp_path / name)
  o, e = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
  with open(o, "w") as fo, open(e, "w") as fe:
    rep = ingest.run({None: [ingest.Source(p)]}, out, Spec.from_dict(spec), split="none",
                     yes=True, out=fo, err=fe, **kw)
  return out, rep, o.read_text(), e.read_text()


def _ids(out, feature):
  """{source row's request_ts: ids} of one sparse feature."""
  return {int(r["request_ts"]): r[f"sparse/{feature}"].tolist() for _, r in decoded(out)["train"]}


@pytest.mark.parametrize("engine", ["duckdb", "memory"])
def test_exact_vocabulary_maps_every_value_to_its_own_id(tmp_path, engine):
  t = _log()
  out, rep, o, e = _run(tmp_path, "ds", t, {**SPEC, "vocab_max": 100}, engine=engine)
  f = {x.name: x for x in Schema.load(out).sparse}
  assert f["age"].vocab == tuple(sorted(AGES)) and f["age"].vocab_size == len(AGES) + 2
  assert not f["age"].hashed and f["occ"].vocab is not None
  ids = _ids(out, "age")
  rows = t.to_pydict()
  for ts, age in zip(rows["ts"], rows["age"], strict=True):
    want = 0 if age is None else 2 + sorted(AGES).index(age)       # 0 = null, 1 = OOV
    assert ids[ts] == [want]
  assert len({v[0] for v in ids.values()} - {0}) == len(AGES)       # 7 values stay 7
  assert rep["encodings"]["sparse.age"] == {"kind": "vocab", "values": 7, "vocab_size": 9}
  # serving / eval map raw values the same way (schema.json alone)
  got = vocab.ids_for(f["age"], rows["age"] + ["90+"]).tolist()
  assert got == [ids[ts][0] for ts in rows["ts"]] + [1]
  assert "exact vocabularies" in o and "age 7" in o


def test_vocabulary_is_reused_by_a_later_ingest(tmp_path):
  spec_file = str(tmp_path / "spec.json")
  p = str(tmp_path / "a.parquet")
  pq.write_table(_log(200, 1), p)
  ingest.run({None: [ingest.Source(p)]}, str(tmp_path / "x"), Spec.from_dict(SPEC), split="none",
             yes=False, write_schema=spec_file, out=open(os.devnull, "w"),
             err=open(os.devnull, "w"))
  saved = json.load(open(spec_file))
  assert {f["name"]: f["vocab"] for f in saved["schema"]["sparse"]}["age"] == sorted(AGES)
  later = _log(150, 2, ages=AGES[:3] + ["90+"])                     # an unseen value
  out, _, _, _ = _run(tmp_path, "later", later, saved)
  ids = _ids(out, "age")
  for ts, age in zip(later.column("ts").to_pylist(), later.column("age").to_pylist(),
                     strict=True):
    want = 0 if age is None else (1 if age == "90+" else 2 + sorted(AGES).index(age))
    assert ids[ts] == [want]


def test_hashed_columns_report_collisions(tmp_path):
  t = _log(400, 3, occupations=300)
  out, rep, o, e = _run(tmp_path, "ds", t, {**SPEC, "vocab_max": 10})
  enc = rep["encodings"]["sparse.occ"]
  f = {x.name: x for x in Schema.load(out).sparse}["occ"]
  assert f.hashed and f.vocab is None and enc["kind"] == "hash"
  values = sorted(set(t.column("occ").to_pylist()))
  m = f.vocab_size
  assert enc["distinct"] == len(values) and enc["vocab_size"] == m
  # independently: each value's 63-bit string hash, then the pipeline's row hash
  import hashlib

  from data.pipeline import hash_ids
  h63 = np.array([int.from_bytes(hashlib.blake2b(v.encode(), digest_size=8).digest(), "little")
                  >> 1 for v in values], np.int64)
  rows = hash_ids(h63, m).tolist()
  shared = sum(rows.count(r) > 1 for r in rows)
  assert shared > 0 and enc["colliding_values"] == shared
  assert enc["rows_used"] == len(set(rows))
  assert enc["expected_collision_rate"] == pytest.approx(1 - (1 - 1 / m) ** (len(values) - 1))
  assert f"warning: sparse.occ: {shared} of its {len(values)} distinct values share" in e
  assert json.load(open(f"{out}/ingest.json"))["encodings"]["sparse.occ"] == enc
  assert "hashed columns (expected share of values colliding): sparse.occ" in o


def test_spec_forces_either_choice(tmp_path):
  t = _log(200, 4)
  out, rep, _, e = _run(tmp_path, "ds", t, {**SPEC, "vocab": {"age": "hash", "occ": "exact"},
                                            "vocab_max": 5})
  f = {x.name: x for x in Schema.load(out).sparse}
  assert f["age"].hashed and f["age"].vocab is None
  assert f["occ"].vocab == tuple(sorted(set(t.column("occ").to_pylist())))
  t = t.append_column("region", pa.array(np.random.default_rng(5).integers(0, 9, 200) * 1000))
  cols = dict(SPEC["columns"], **{"sparse.region": "region"})
  out2, _, _, _ = _run(tmp_path, "ds2", t, {"columns": cols, "vocab": {"region": "exact"}})
  g = {x.name: x for x in Schema.load(out2).sparse}["region"]      # integer ids, forced exact
  assert g.vocab == tuple(sorted(set(t.column("region").to_pylist())))
  ids = _ids(out2, "region")
  for ts, it in zip(t.column("ts").to_pylist(), t.column("region").to_pylist(), strict=True):
    assert ids[ts] == [2 + list(g.vocab).index(it)]
  with pytest.raises(ValueError, match="vocab must map sparse feature names"):
    Spec.from_dict({"vocab": {"age": "onehot"}})


def test_expected_collision_rate_matches_simulation():
  rng = np.random.default_rng(0)
  for n, m in ((2, 2), (50, 64), (300, 1024)):
    sims = []
    for _ in range(400):
      rows = rng.integers(0, m, n)
      _, inv, c = np.unique(rows, return_inverse=True, return_counts=True)
      sims.append(np.mean(c[inv] > 1))
    assert vocab.expected_collision_rate(n, m) == pytest.approx(np.mean(sims), abs=0.02)
  assert vocab.expected_collision_rate(1, 10) == 0.0
