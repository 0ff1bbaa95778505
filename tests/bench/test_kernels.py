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


def test_bench_small_sliding_window_case(tmp_path):
  """The sliding-window softmax case: pallas (interpret) and the cuDNN LSE merge (its XLA
  stand-in on CPU) agree with the banded reference; the table names only real backends."""
  kernels.main(["--small", "--iters", "1", "--out_dir", str(tmp_path), "--cases", "swa",
                "--write_tables", str(tmp_path / "tables")])
  (path,) = tmp_path.glob("kernels_*_small_*.json")
  case = json.loads(path.read_text())["cases"]["swa"]
  s = case["shape"]
  assert case["fwd_flops"] == 4 * s["B"] * kernels.band_pairs(53, 5) * s["H"] * s["D"]
  assert kernels.band_pairs(53, 5) == sum(min(i + 5, 52) - max(i - 5, 0) + 1 for i in range(53))
  for impl in ("pallas", "cudnn_xla_standin"):
    err = case["check"][impl]
    assert max(err.values()) < 1e-5, (impl, err)
  table = json.loads((tmp_path / "tables" / "backend_table.json").read_text())
  (dev,) = table["devices"].values()
  assert set(dev["softmax_attention"]["swa"].values()) <= {"xla", "pallas"}


def test_attention_bytes_counts_entry_ops_and_kernel_bytes():
  import jax
  import jax.numpy as jnp
  f = jax.jit(lambda x, y: jnp.tanh(x @ y).sum(0))
  text = f.lower(jnp.ones((4, 8)), jnp.ones((8, 3))).compile().as_text()
  nbytes, launches = kernels.hlo_entry_bytes(text)
  assert launches >= 1 and nbytes >= 4 * (4 * 8 + 8 * 3 + 3)  # inputs read, output written
  r = kernels.attention_bytes(B=2, T=80, H=2, D=16, window=8, dtype="float32")
  assert r["xla_path"] == "banded"
  q = 2 * 80 * 2 * 16 * 4
  assert r["kernel_fwd"]["hbm_bytes"] == 4 * q + 2 * 80 * 2 * 4          # q, k, v, o + lse
  assert r["xla_fwd_bwd"]["entry_op_bytes"] > r["kernel_fwd_bwd"]["hbm_bytes"] > 0
