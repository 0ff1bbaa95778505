"""bench/kernels.py --small runs on CPU (interpret mode) and writes a complete JSON."""

import json

from bench import kernels


def test_bench_small_runs_and_writes_json(tmp_path, capsys):
  kernels.main(["--small", "--iters", "1", "--out_dir", str(tmp_path),
                "--cases", "cross_attention", "--write_tables", str(tmp_path / "tables")])
  (path,) = tmp_path.glob("kernels_*_small_*.json")
  res = json.loads(path.read_text())
  assert res["backend"] == "cpu" and res["versions"]["jax"]
  assert set(res["cases"]) == {"cross_attention"}
  for case in res["cases"].values():
    err = case["check"]["pallas"]
    assert max(err.values()) < 1e-5, err  # kernel agrees with the reference (fwd, dq, dk, dv)
    for key in ("fwd_ms", "fwd_bwd_ms"):
      assert set(case[key]) == {"xla", "pallas"} and all(ms > 0 for ms in case[key].values())
  assert res["targets"]["cross_attention/fwd"]["best"] == "pallas"
  assert "TFLOP/s" in capsys.readouterr().out
  table = json.loads((tmp_path / "tables" / "backend_table.json").read_text())
  entry = table["devices"][res["device"]]["gdpa"]["cross"]
  assert set(entry) == {"fwd", "fwd_bwd"} and set(entry.values()) <= {"xla", "pallas"}
  assert (tmp_path / "tables" / "tuning.json").exists()
