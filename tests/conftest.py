"""Test configuration: 8 fake CPU devices, set before JAX initialises any backend."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402

# Test files that take minutes on 2 cores, longest first. They are collected first so that the
# two xdist workers (``--dist loadfile``: a file stays on one worker) start them early instead of
# one worker finishing them alone at the end. Order only: every test still runs.
_HEAVY_FIRST = (
    "tests/transfer/test_bench_transfer.py",
    "tests/integration/test_train_eval.py",
    "tests/sharding/test_kunlun_lookup.py",
    "tests/sharding/test_kunlun_presets.py",
    "tests/integration/test_faults.py",
    "tests/integration/test_bench_scaling.py",
    "tests/integration/test_cli_errors.py",
    "tests/integration/test_bench_real_data.py",
    "tests/kunlun/test_model.py",
    "tests/train/test_step.py",
)


def _heavy_rank(item) -> int:
  path = item.nodeid.split("::", 1)[0]
  return _HEAVY_FIRST.index(path) if path in _HEAVY_FIRST else len(_HEAVY_FIRST)


def pytest_collection_modifyitems(config, items):
  items.sort(key=_heavy_rank)     # stable: the order inside each file is kept
  has_gpu = any(d.platform == "gpu" for d in jax.devices()) if os.environ.get("JAX_PLATFORMS") != "cpu" else False
  skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none present)")
  for item in items:
    if "gpu" in item.keywords and not has_gpu:
      item.add_marker(skip_gpu)
