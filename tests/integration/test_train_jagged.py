"""train.py / eval.py with ``--config.data.jagged_capacity=auto``: packed towers end to end."""

import json
import os
import sys

import pytest

from tests import subproc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(script, args, base):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
             KUNLUN_COMPILATION_CACHE=str(base / "xla_cache"))
  return subproc.run([sys.executable, os.path.join(ROOT, script), *args], cwd=ROOT, env=env,
                     check=True)


@pytest.mark.slow
def test_train_and_eval_packed_tiny(tmp_path):
  from data import synthetic
  data = str(tmp_path / "data")
  synthetic.generate(data, "tiny", num_examples=2000, seed=0)
  wd = str(tmp_path / "w")
  p = _run("train.py", [f"--workdir={wd}", f"--data_dir={data}", "--steps=4",
                        "--config.data.jagged_capacity=auto", "--config.train.log_every=2",
                        "--config.train.checkpoint_every=4", "--config.train.validate_every=-1"],
           tmp_path)
  assert "data.jagged_capacity=auto: click=" in p.stdout, p.stdout[-2000:]
  assert "step 4/4" in p.stdout
  with open(os.path.join(wd, "metrics.jsonl")) as f:
    recs = [json.loads(line) for line in f]
  logged = [r for r in recs if "dropped_events" in r]
  assert logged and all(isinstance(r["dropped_events"], dict) for r in logged)
  assert all(r["loss"] is not None and r["loss"] > 0 for r in logged)
  out = str(tmp_path / "eval.json")
  _run("eval.py", [f"--workdir={wd}", f"--out={out}"], tmp_path)
  with open(out) as f:
    assert json.load(f)
