"""Export: records equal a direct representations() pass (up to int8 rounding); resumable."""

import os

import flax.linen as nn
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from data import pipeline, synthetic
from kunlun.configs import vm_tiny
from kunlun.configs.types import seq_lens
from kunlun.models.build import build_model
from kunlun.train import checkpoint, devices, run_info
from kunlun.transfer import export


def test_quantize_roundtrip():
  x = np.random.default_rng(0).normal(size=(5, 7)).astype(np.float32)
  x[1] = 0
  c = export.quantize(x, "int8")
  y = export.dequantize(c["q"], "int8", c["scale"])
  assert np.all(np.abs(y - x) <= c["scale"][:, None] / 2 + 1e-7)
  np.testing.assert_array_equal(y[1], 0)
  b = export.dequantize(export.quantize(x, "bf16")["q"], "bf16")
  np.testing.assert_allclose(b, x, rtol=2 ** -8)
  with pytest.raises(ValueError, match="int4"):
    export.quantize(x, "int4")


@pytest.fixture(scope="module")
def fm_workdir(tmp_path_factory):
  """A train.py-style workdir: run_info.json, checkpoints/<step>/params."""
  root = tmp_path_factory.mktemp("fm")
  data_dir, workdir = str(root / "data"), str(root / "work")
  schema = synthetic.generate(data_dir, "tiny", num_examples=160, seed=0)
  config = vm_tiny.get_config()
  config.data.batch_size = 16
  run_info.save_run_info(workdir, config, data_dir)
  model = build_model(config, schema)
  ds = pipeline.make_dataset(config.data, data_dir, "eval", seq_lens(config), train=False,
                             shard_index=0, shard_count=1)
  batch = next(iter(ds))
  shapes = nn.unbox(jax.eval_shape(model.init, jax.random.key(0), batch)["params"])
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda s: (0.3 * rng.normal(size=s.shape)).astype(s.dtype), shapes)
  ck = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"))
  ck.mngr.save(7, args=ocp.args.Composite(params=ocp.args.StandardSave(params)))
  ck.close()
  return workdir, data_dir, config, model, params


def _direct(config, model, params, data_dir, split):
  ds = pipeline.make_dataset(config.data, data_dir, split, seq_lens(config), train=False,
                             shard_index=0, shard_count=1)
  f = jax.jit(lambda p, b: model.apply({"params": p}, b, method="representations"))
  out = {"pooled": [], "logits": [], "user_id": [], "request_ts": []}
  for b in ds:
    keep = b["example_mask"] > 0
    r = f(params, b)
    out["pooled"].append(np.asarray(r["pooled"])[keep])
    out["logits"].append(np.asarray(r["logits"])[keep])
    out["user_id"].append(b["user_id"][keep])
    out["request_ts"].append(b["request_ts"][keep])
  return {k: np.concatenate(v) for k, v in out.items()}


@pytest.fixture(scope="module")
def direct_eval(fm_workdir):
  """The padded FM's representations of the eval split, computed once."""
  _, data_dir, config, model, params = fm_workdir
  return _direct(config, model, params, data_dir, "eval")


def test_export_matches_direct_and_resumes(fm_workdir, direct_eval, tmp_path):
  workdir, data_dir, config, model, params = fm_workdir
  out = str(tmp_path / "emb")
  logs = []
  m = export.export(workdir, out, splits=("eval",), quantize_mode="int8", shard_batches=1,
                    mesh_flag="data=1,fsdp=-1", log=logs.append)
  want = direct_eval
  n = len(want["user_id"])
  assert m["splits"]["eval"]["count"] == n == 32 and m["step"] == 7
  got = export.read_records(out, ["eval"])
  np.testing.assert_array_equal(got["user_id"], want["user_id"])
  np.testing.assert_array_equal(got["request_ts"], want["request_ts"])
  np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-5, atol=1e-5)
  tol = np.abs(want["pooled"]).max(1, keepdims=True) / 127 / 2 + 1e-5
  assert np.all(np.abs(got["emb"] - want["pooled"]) <= tol)
  # interrupted after the first shard: drop the later ones from progress and disk, rerun
  shards = sorted(os.listdir(os.path.join(out, "eval")))
  assert len(shards) == 2
  import json
  prog = json.load(open(os.path.join(out, "progress.json")))
  prog["eval"] = prog["eval"][:1]
  json.dump(prog, open(os.path.join(out, "progress.json"), "w"))
  os.remove(os.path.join(out, "eval", shards[1]))
  logs2 = []
  export.export(workdir, out, splits=("eval",), quantize_mode="int8", shard_batches=1,
                mesh_flag="data=1,fsdp=-1", log=logs2.append)
  assert sum("shard" in l for l in logs2) == 1        # only the missing shard was recomputed
  got2 = export.read_records(out, ["eval"])
  for k in got:
    np.testing.assert_array_equal(got2[k], got[k])
  log = export.load_log(out)
  e, present, _ = log.join_current({"user_id": want["user_id"][:3], "ad_id": got["ad_id"][:3],
                                    "request_ts": want["request_ts"][:3]})
  assert present.all()
  with pytest.raises(ValueError, match="shard_batches"):   # resuming with another layout
    export.export(workdir, out, splits=("eval",), shard_batches=2, mesh_flag="data=1,fsdp=-1",
                  log=logs2.append)


def test_export_runs_packed_towers_when_the_fm_packs(fm_workdir, direct_eval, tmp_path,
                                                     monkeypatch):
  """An FM trained with data.jagged_capacity exports with packed towers, on a two-device data
  mesh one block per device, and writes the padded FM's representations."""
  import shutil

  from sharding import mesh as mesh_lib
  workdir, data_dir, config, _, _ = fm_workdir
  packed_cfg = config.copy_and_resolve_references()
  packed_cfg.data.jagged_capacity = "click=128,impression=128"     # 2 blocks of 8 x 8 events
  wd = str(tmp_path / "fm_packed")
  run_info.save_run_info(wd, packed_cfg, data_dir)
  shutil.copytree(os.path.join(workdir, "checkpoints"), os.path.join(wd, "checkpoints"))
  two = mesh_lib.make_mesh({"data": 2}, devices=jax.devices()[:2])
  monkeypatch.setattr(devices, "build_mesh", lambda *_: two)
  put, packed = pipeline.device_put_batch, []
  monkeypatch.setattr(pipeline, "device_put_batch", lambda b, sh: (
      packed.append(all(len(ev["offsets"]) == len(b["surface"]) + 2
                        for ev in b["events"].values())), put(b, sh))[1])
  logs = []
  out = str(tmp_path / "emb")
  export.export(wd, out, splits=("eval",), quantize_mode="none", log=logs.append)
  assert any("packed towers at {'click': 128, 'impression': 128} tokens per batch (2 blocks)"
             in line for line in logs), logs
  assert packed and all(packed)                  # every batch the FM ran was packed in 2 blocks
  got, want = export.read_records(out, ["eval"]), direct_eval
  np.testing.assert_array_equal(got["user_id"], want["user_id"])
  np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got["emb"], want["pooled"], rtol=1e-5, atol=1e-5)


def test_local_rows_dedups_replicas_in_row_order():
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P
  x = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
  mesh = Mesh(np.asarray(jax.devices()[:8])[::-1].reshape(4, 2), ("b", "r"))   # reversed order
  arr = jax.device_put(x, NamedSharding(mesh, P("b")))        # each row block on 2 devices
  rows, ranges = export.local_rows(arr)
  np.testing.assert_array_equal(rows, x)
  assert ranges == [(0, 4), (4, 8), (8, 12), (12, 16)]


def test_bad_workdir(tmp_path):
  assert export.main(["--workdir", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
