"""train.py / eval.py with ``--config.data.jagged_capacity=auto``: packed towers end to end
(training with 2 microbatches: a block per microbatch)."""

import json
import os

import pytest

from tests import subproc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_train_and_eval_packed_tiny(tmp_path):
  from data import synthetic
  data = str(tmp_path / "data")
  synthetic.generate(data, "tiny", num_examples=2000, seed=0)
  wd = str(tmp_path / "w")
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
             KUNLUN_COMPILATION_CACHE=subproc.compile_cache(tmp_path / "xla_cache"))
  # both programs forked from one interpreter that imported jax & co. once (tests/subproc)
  with subproc.Programs(env, subproc.TRAIN_MODULES) as progs:
    p = progs.run1([os.path.join(ROOT, "train.py"), f"--workdir={wd}", f"--data_dir={data}",
                    "--steps=4", "--config.data.jagged_capacity=auto", "--config.train.microbatches=2",
                    "--config.train.log_every=2", "--config.train.checkpoint_every=4",
                    "--config.train.validate_every=-1"], check=True)
    assert "data.jagged_capacity=auto: click=" in p.stdout, p.stdout[-2000:]
    assert "step 4/4" in p.stdout
    with open(os.path.join(wd, "metrics.jsonl")) as f:
      recs = [json.loads(line) for line in f]
    logged = [r for r in recs if "dropped_events" in r]
    assert logged and all(isinstance(r["dropped_events"], dict) for r in logged)
    assert all(r["loss"] is not None and r["loss"] > 0 for r in logged)
    out = str(tmp_path / "eval.json")
    progs.run1([os.path.join(ROOT, "eval.py"), f"--workdir={wd}", f"--out={out}"], check=True)
  with open(out) as f:
    assert json.load(f)
