"""Export under two ``jax.distributed`` processes (127.0.0.1, gloo CPU collectives, 2 devices
each) through the CLI: every example of the split exactly once, with the logits and (dequantised)
embeddings of a one-process export of the same FM; per-process files and progress; the manifest
adds up; an interrupted process makes both recompute from the first shard not all finished."""

import json
import os

import numpy as np
import pytest

from kunlun.transfer import export
from tests import subproc
from tests.kunlun.transfer.test_export import fm_workdir  # noqa: F401  (module fixture)
from tests.subproc import free_port, worker_env

WORKER = """
import os, sys
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
from kunlun.transfer import export
sys.exit(export.main(sys.argv[1:]))
"""
SPLITS = "eval,train"
ARGS = ["--split", SPLITS, "--summaries", "--shard_batches", "1", "--mesh", "data=-1"]


def _run_two(progs, workdir, out):
  """The CLI in two processes, forked together from ``progs`` (jax imported once); returns
  their outputs."""
  port = free_port()
  runs = progs.run([["-c", WORKER, "--workdir", workdir, "--out", out, *ARGS,
                     "--coordinator_address", f"127.0.0.1:{port}", "--num_processes", "2",
                     "--process_id", str(i)] for i in range(2)], parallel=2, timeout=400)
  for p in runs:
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
  return [p.stdout + p.stderr for p in runs]


@pytest.fixture(scope="module")
def progs():
  """The interpreter the workers are forked from: jax and the export imported once. The workers
  share the run's persistent compilation cache (tests/conftest.py): the second two-process export
  loads the first one's programs instead of compiling them again."""
  cache = {k: os.environ[k] for k in ("JAX_COMPILATION_CACHE_DIR",
                                      "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")
           if k in os.environ}
  with subproc.Programs(dict(worker_env(), **cache), ("jax", "kunlun.transfer.export")) as p:
    yield p


def _by_key(r: dict) -> dict:
  keys = list(zip(r["user_id"].tolist(), r["ad_id"].tolist(), r["request_ts"].tolist(),
                  strict=True))
  assert len(set(keys)) == len(keys), "a (user, ad, request_ts) key was exported twice"
  return {k: i for i, k in enumerate(keys)}


@pytest.mark.slow
def test_two_process_export_equals_single_process(fm_workdir, progs, tmp_path):  # noqa: F811
  workdir = fm_workdir[0]
  ref_dir, out = str(tmp_path / "one"), str(tmp_path / "two")
  export.export(workdir, ref_dir, splits=tuple(SPLITS.split(",")), summaries=True,
                shard_batches=1, mesh_flag="data=-1", log=lambda *_: None)
  outs = _run_two(progs, workdir, out)
  m = export.load_manifest(out)
  ref_m = export.load_manifest(ref_dir)
  assert m["process_count"] == 2 and m["step"] == ref_m["step"] == 7

  # per-process files and progress; the manifest's counts add up to the files' records
  from array_record.python import array_record_module as arm
  for split in SPLITS.split(","):
    files = m["splits"][split]["files"]
    assert {e["process"] for e in files} == {0, 1}
    for e in files:
      assert os.path.basename(e["file"]).startswith(f"emb-p{e['process']:03d}-")
      rd = arm.ArrayRecordReader(os.path.join(out, e["file"]))
      assert rd.num_records() == e["count"]
      rd.close()
    assert m["splits"][split]["count"] == sum(e["count"] for e in files)
    assert m["splits"][split]["count"] == ref_m["splits"][split]["count"]
    on_disk = sorted(os.listdir(os.path.join(out, split)))
    assert on_disk == sorted(os.path.basename(e["file"]) for e in files)
    for pid in (0, 1):
      prog = json.load(open(os.path.join(out, f"progress-p{pid}.json")))
      assert [e["file"] for e in prog[split]] == [e["file"] for e in files if e["process"] == pid]
  assert not os.path.exists(os.path.join(out, "progress.json"))

  # every key exactly once, same logits / dequantised embeddings as the one-process export
  towers = [k[len("sum_"):] for k in m["record"] if k.startswith("sum_")]
  assert towers
  for split in SPLITS.split(","):
    for field in ["pooled"] + [f"sum_{t}" for t in towers]:
      got = export.read_records(out, [split], field)
      want = export.read_records(ref_dir, [split], field)
      gk, wk = _by_key(got), _by_key(want)
      assert set(gk) == set(wk) and len(gk) == ref_m["splits"][split]["count"]
      order = [gk[k] for k in wk]
      np.testing.assert_allclose(got["logits"][order], want["logits"], atol=1e-5, rtol=1e-5)
      # int8: equal up to a flipped rounding step where float sums differ in the last ulp
      step = np.abs(want["emb"]).max(1, keepdims=True) / 127
      diff = np.abs(got["emb"][order] - want["emb"])
      assert np.all(diff <= step + 1e-5), diff.max()
      assert np.mean(diff <= 1e-5) > 0.99

  # process 1 was interrupted after its first eval shard: both recompute eval shard 2
  before = export.read_records(out, None)
  p1 = os.path.join(out, "progress-p1.json")
  prog = json.load(open(p1))
  lost = prog["eval"][1:]
  assert lost, prog
  prog["eval"] = prog["eval"][:1]
  json.dump(prog, open(p1, "w"))
  for e in lost:
    os.remove(os.path.join(out, e["file"]))
  outs = _run_two(progs, workdir, out)
  recomputed = [line for o in outs for line in o.splitlines() if "[export] process" in line]
  assert len(recomputed) == 2 and all("eval: shard 2/" in line for line in recomputed), outs
  after = export.read_records(out, None)
  for k in before:
    np.testing.assert_array_equal(after[k], before[k])

  # a one-process run into the two-process directory is refused (clear error, no mixing)
  with pytest.raises(ValueError, match="process_count"):
    export.export(workdir, out, splits=("eval",), mesh_flag="data=-1", log=lambda *_: None)
