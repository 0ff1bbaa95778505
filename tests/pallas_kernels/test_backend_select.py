"""backend="auto": per device and shape class from the measured table, with safe defaults."""

import json

import jax.numpy as jnp
import numpy as np

import pallas_kernels
from pallas_kernels import api, tuning

H200 = "NVIDIA H200"
TABLE = {"devices": {H200: {
    "gdpa": {"self": {"fwd": "triton", "fwd_bwd": "triton"},
             "cross": {"fwd": "pallas", "fwd_bwd": "xla"}},
    "block_attention": {"block": {"fwd_bwd": "xla"}},
}}}


def _sel(kind, tq, tk, **kw):
  kw.setdefault("platform", "gpu")
  kw.setdefault("device_kind", H200)
  kw.setdefault("table", TABLE)
  kw.setdefault("has_jax_triton", True)
  return api.select_backend(kind, tq, tk, **kw)


def test_shape_classes():
  assert api.shape_class("gdpa", 2048, 2048) == "self"
  assert api.shape_class("gdpa", 1024, 128) == "cross"
  assert api.shape_class("gdpa", 32, 1024) == "pool"
  assert api.shape_class("block_attention", 4096, 4096) == "block"


def test_table_entries_win_per_shape_class_and_mode():
  assert _sel("gdpa", 2048, 2048) == "triton"
  assert _sel("gdpa", 1024, 128) == "xla"                     # training default: fwd_bwd
  assert _sel("gdpa", 1024, 128, mode="fwd") == "pallas"
  assert _sel("block_attention", 4096, 4096) == "xla"


def test_defaults_without_an_entry_never_pick_pallas_for_gdpa():
  other = "NVIDIA A100"
  assert _sel("gdpa", 2048, 2048, device_kind=other) == "triton"
  assert _sel("gdpa", 2048, 2048, device_kind=other, has_jax_triton=False) == "xla"
  assert _sel("gdpa", 32, 1024) == "triton"                   # class "pool" not in the table
  assert _sel("gdpa", 32, 1024, has_jax_triton=False) == "xla"
  assert _sel("block_attention", 64, 64, device_kind=other) == "pallas"
  # a triton entry without jax-triton installed falls back to the default
  assert _sel("gdpa", 2048, 2048, has_jax_triton=False) == "xla"
  for kind in ("gdpa", "block_attention"):                    # CPU: always the reference
    assert _sel(kind, 2048, 2048, platform="cpu") == "xla"


def test_table_file_round_trip_and_cpu_dispatch(tmp_path):
  path = tmp_path / "table.json"
  path.write_text(json.dumps(TABLE))
  assert api.load_table(str(path)) == TABLE
  assert api.load_table(str(tmp_path / "missing.json")) == {}
  q = k = v = jnp.ones((1, 4, 1, 16))
  np.testing.assert_array_equal(pallas_kernels.gdpa(q, k, v, backend="auto"),
                                pallas_kernels.reference.gdpa_reference(q, k, v))


def test_tuning_lookup(tmp_path):
  path = tmp_path / "tuning.json"
  key = tuning.key("self", 128, jnp.bfloat16)
  path.write_text(json.dumps({H200: {"triton": {key: {"fwd": [64, 128, 4, 2]}}}}))
  assert tuning.lookup("triton", "fwd", key, jnp.bfloat16, device_kind=H200,
                       path=str(path)) == (64, 128, 4, 2)
  assert tuning.lookup("triton", "dq", key, jnp.bfloat16, device_kind=H200,
                       path=str(path)) == tuning.DEFAULTS["dq"]
  assert tuning.lookup("triton", "fwd", key, jnp.float32, device_kind=None,
                       path=str(path)) == tuning.DEFAULTS_F32["fwd"]
  assert tuning.clamp_tile(128, 37) == 64 and tuning.clamp_tile(128, 3) == 16


def test_softmax_attention_defaults_and_table():
  """Softmax attention: banded -> pallas, full -> cudnn (16-bit, head_dim <= 128) without an
  entry; a table entry wins, except cudnn for operands cuDNN cannot take; CPU -> xla."""
  bf16, f32 = jnp.bfloat16, jnp.float32
  sel = lambda **kw: _sel("softmax_attention", 512, 512, **{"dtype": bf16, "head_dim": 64, **kw})
  assert sel(window=64) == "pallas"
  assert sel() == "cudnn"
  assert sel(dtype=f32) == "pallas" and sel(head_dim=256) == "pallas"
  table = {"devices": {H200: {"softmax_attention": {
      "swa": {"fwd": "cudnn", "fwd_bwd": "xla"}, "full": {"fwd_bwd": "cudnn"}}}}}
  assert sel(window=64, table=table) == "xla"
  assert sel(window=64, table=table, mode="fwd") == "cudnn"
  assert sel(table=table, dtype=f32) == "pallas"              # cudnn entry, fp32 operands
  assert sel(window=64, platform="cpu") == "xla"
