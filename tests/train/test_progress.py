"""Progress: MFU formula, CPU peak is unknown, JSONL + TensorBoard files written."""

import glob
import io
import json

import jax

from kunlun.train import progress


def test_mfu_and_peak():
  assert progress.device_peak_flops(jax.devices("cpu")[0]) is None
  assert progress.mfu(1e12, 0.5, 4, None) is None
  assert abs(progress.mfu(989e12, 2.0, 2, 989e12) - 0.25) < 1e-12


def test_log_writes_jsonl_tb_and_line(tmp_path):
  out = io.StringIO()
  p = progress.Progress(str(tmp_path), total_steps=10, stream=out)
  p.log(5, {"loss": 0.5, "ne": {"click": 0.9, "conversion": float("nan")}, "mfu": None,
            "examples_per_s": 100.0, "step_time_ms": 3.0})
  p.close()
  rec = json.loads(open(tmp_path / "metrics.jsonl").read().splitlines()[0])
  assert rec["step"] == 5 and rec["ne"]["click"] == 0.9 and rec["ne"]["conversion"] is None
  assert glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
  line = out.getvalue()
  assert "step 5/10" in line and "click=0.9000" in line and "MFU n/a" in line
