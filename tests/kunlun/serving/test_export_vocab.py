"""Exact vocabularies reach serving: raw values -> ingest (vocabularies in schema.json) -> export
(signature.json) -> the loader's ``vocab_ids`` give the ids ingestion wrote into the records
(decoded) and ``data.ingest.vocab.ids_for`` gives, for strings and integers, nulls and unseen values."""

import os

import flax.linen as nn
import jax
import numpy as np
import orbax.checkpoint as ocp
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data import ingest
from data.fake import random_batch
from data.ingest import vocab
from data.ingest.infer import Spec
from data.schema import Schema
from kunlun.configs import tiny
from kunlun.configs.types import seq_lens
from kunlun.models.build import build_model
from kunlun.serving import export, loader
from kunlun.train import checkpoint, run_info
from tests.data.ingest.logs import decoded

AGES = ["18-24", "25-34", "<18", "ünï-名", "56+"]
REGIONS = [-7, 3, 40_000_000_000, -1]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
  root = tmp_path_factory.mktemp("vocab_export")
  rng = np.random.default_rng(0)
  n = 200
  t = pa.table({"ts": 1_600_000_000 + np.arange(n) * 10, "user": rng.integers(0, 20, n),
                "item": rng.integers(0, 40, n), "clicked": rng.integers(0, 2, n),
                "age": pa.array([None if rng.random() < 0.1 else AGES[k]
                                 for k in rng.integers(0, len(AGES), n)], pa.string()),
                "region": pa.array([REGIONS[k] for k in rng.integers(0, len(REGIONS), n)])})
  p = str(root / "log.parquet")
  pq.write_table(t, p)
  data_dir = str(root / "data")
  spec = {"columns": {"request_ts": "ts", "user_id": "user", "ad_id": "item",
                      "label.click": "clicked", "sparse.age": "age", "sparse.region": "region"},
          "vocab": {"region": "exact"},       # the tiny config's two streams, from the log
          "history": {"streams": {"click": "label.click", "impression": "all"}, "max_len": 64}}
  ingest.run({None: [ingest.Source(p)]}, data_dir, Spec.from_dict(spec), split="none", yes=True,
             out=open(os.devnull, "w"), err=open(os.devnull, "w"))
  schema = Schema.load(data_dir)
  config = tiny.get_config()
  workdir = str(root / "work")
  run_info.save_run_info(workdir, config, data_dir)
  model = build_model(config, schema)
  shapes = nn.unbox(jax.eval_shape(model.init, jax.random.key(0),
                                   random_batch(schema, 2, seq_lens(config)))["params"])
  params = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)
  ck = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"))
  ck.mngr.save(1, args=ocp.args.Composite(params=ocp.args.StandardSave(params)))
  ck.close()
  out = str(root / "artifact")
  export.export(workdir, out, verify=False, log=lambda *_: None)
  return t, schema, data_dir, loader.load(out)


def test_loader_maps_raw_values_as_ingest_did(artifact):
  t, schema, data_dir, art = artifact
  f = {x.name: x for x in schema.sparse}
  assert f["age"].vocab == tuple(sorted(AGES)) and f["region"].vocab == tuple(sorted(REGIONS))
  assert set(art.signature["vocab"]) == {"age", "region"}
  rows = t.to_pydict()
  written = {int(r["request_ts"]): r for _, r in decoded(data_dir)["train"]}
  for name, extra in (("age", ["90+", "", "18-24 "]), ("region", [5, 0, -7])):
    got = art.vocab_ids(name, rows[name] + extra)
    # the ids ingestion wrote into the records (decoded), and data.ingest.vocab's mapping
    want = [written[ts][f"sparse/{name}"].tolist()[0] for ts in rows["ts"]]
    assert got[:len(want)].tolist() == want
    np.testing.assert_array_equal(got, vocab.ids_for(f[name], rows[name] + extra))
  assert art.vocab_ids("age", [None, "90+", "<18"]).tolist() == [0, 1,
                                                                 2 + sorted(AGES).index("<18")]
  assert art.vocab_ids("region", []).tolist() == []


def test_string_keys_are_ingests():
  """The loader's own copy of the 63-bit string key (a collision maps as ingestion mapped it)."""
  from data.ingest.coerce import hash_strings
  words = AGES + ["", "90+", "x" * 300]
  assert [loader._string_key(w) for w in words] == hash_strings(pa.array(words)).tolist()


def test_feature_without_vocabulary_is_one_line(artifact):
  _, _, _, art = artifact
  with pytest.raises(ValueError, match="'bid' has no exact vocabulary in this artifact"):
    art.vocab_ids("bid", ["x"])
