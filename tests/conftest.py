"""Test configuration: 8 fake CPU devices, one persistent XLA compilation cache per test run and
XLA:CPU at -O0, all set before JAX initialises any backend.

The cache is a fresh temp dir made by the process that starts the run and inherited (through the
environment) by the xdist workers and the train.py / eval.py / bench subprocesses they start, so a
program compiled by one test is loaded, not recompiled, by the next. ``JAX_COMPILATION_CACHE_DIR``
or ``KUNLUN_COMPILATION_CACHE`` set by the caller are kept; a test that sets its own keeps it.
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "PYTEST_XDIST_WORKER" not in os.environ and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache = tempfile.mkdtemp(prefix="kunlun-test-xla-")
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
  # Most of the suite's compiles take well under a second each; cache them all.
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("KUNLUN_COMPILATION_CACHE", _cache)     # train.py / eval.py's --flag

# XLA:CPU codegen at LLVM -O0 for the tests only (users' runs keep XLA's default): the suite is
# compile-bound (tiny models, a few steps); compiles take about half the CPU time, steps run
# ~1.6x slower. A level set by the caller is kept.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_backend_optimization_level=0").strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402

from tests import compile_log  # noqa: E402

# KUNLUN_TEST_COMPILE_LOG=DIR: every compile of this process, with its test (tests/compile_log.py)
_compiles = compile_log.install(os.environ[compile_log.ENV]) if os.environ.get(compile_log.ENV) \
    else None


def pytest_runtest_setup(item):
  if _compiles is not None:
    _compiles.current = item.nodeid


def pytest_collection_modifyitems(config, items):
  has_gpu = any(d.platform == "gpu" for d in jax.devices()) if os.environ.get("JAX_PLATFORMS") != "cpu" else False
  skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none present)")
  for item in items:
    if "gpu" in item.keywords and not has_gpu:
      item.add_marker(skip_gpu)
