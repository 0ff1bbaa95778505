"""bench/experiments/transfer.py --quick runs end to end (FM via train.py on the pretrain window, export,
adapter, 4 VMs, serving through the speculative cache)."""

import json
import math
import os
import sys

import pytest

from tests import subproc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.mark.slow
def test_transfer_bench_quick(tmp_path):
  out = tmp_path / "transfer.json"
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  subproc.run([sys.executable, os.path.join(ROOT, "bench", "experiments", "transfer.py"), "--quick",
               "--workdir", str(tmp_path / "work"), "--out", str(out)],
              check=True, env=env, cwd=ROOT)
  r = json.loads(out.read_text())
  models = ("fm", "vm_alone", "vm_kd", "vm_loopfm", "vm_both")
  cells = [(s, t) for s in ("feed", "stories", "reels", "overall") for t in ("click", "conversion")]
  for m in models:
    for s, t in cells:
      assert math.isfinite(r["ne"][m][s][t]) and r["ne"][m][s][t] > 0, (m, s, t)
  for m in ("vm_kd", "vm_loopfm", "vm_both"):
    for s, t in cells:
      vm, var, fm = (r["ne"][k][s][t] for k in ("vm_alone", m, "fm"))
      want = (vm - var) / (vm - fm)
      assert r["transfer_ratio"][m][s][t] == pytest.approx(want, rel=1e-9, abs=1e-12)
  rates = r["loopfm_present_rate"]
  assert 0.95 < rates["ctx"] <= 1.0           # every real example has its own FM embedding
  assert 0.0 < rates["events"] < 1.0
  assert r["setup"]["vm_seq_lens"]["click"] < r["setup"]["fm_seq_lens"]["click"]
  assert r["setup"]["fm_window"].startswith("pretrain")
  serving = r["serving_through_cache"]
  assert serving["0.0"]["cache"]["hit_rate"] == 0.0
  assert serving["2.0"]["cache"]["hit_rate"] > 0.9
  hits = [serving[k]["cache"]["hit_rate"] for k in ("0.0", "0.5", "1.0", "2.0")]
  assert hits == sorted(hits)
  for row in serving.values():
    assert row["cache"]["total_evaluations"] <= row["cache"]["budget_per_refresh"] * \
        row["cache"]["refreshes"]
    for m in ("vm_loopfm", "vm_both"):
      assert all(math.isfinite(v) and v > 0 for v in row[m].values())
