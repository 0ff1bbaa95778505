"""Shared pieces of the kernel tests: a relative closeness check, the twins' jit rule
(``twin_jit``), and the deviceless H200 compile of a test module's ``main`` (run in the venv
``scripts/setup.sh --gpu-compile`` makes) with the shared memory each of its kernels launched
with."""

import glob
import json
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest


def close(a, b, tol):
  """Every element finite and ``max |a - b| <= tol * max |b|``."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  assert np.all(np.isfinite(a)) and np.all(np.isfinite(b))
  err = np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30)
  assert err <= tol, f"relative error {err:.3g} > {tol}"


def twin_jit(fn, dtype):
  """``fn`` (a twin's computation, the reference a kernel test holds the kernels to) jitted in
  float32; op by op in bfloat16, where XLA:CPU's jitted program rounds less faithfully (measured:
  ``wukong_fm``'s twin 3.4% off float32 in one gradient jitted, 0.5% op by op; the interpret-mode
  kernels give the same values either way). The kernels' side is always jitted, as the model
  runs them: one compile instead of one per operation."""
  return jax.jit(fn) if jnp.dtype(dtype) == jnp.float32 else fn


def compiled_smem(module: str, dump_dir, ptxas: bool = False):
  """``python -m module dump_dir`` in the GPU-compile venv (skips when it is missing): the
  ``{kernel: shared memory bytes}`` its ``main`` prints last; with ``ptxas``, also ptxas's report
  of each kernel compiled (``gpu_target.parse_ptxas``: registers, spills), in compile order."""
  from bench.profiling import gpu_target
  from tests.bench.profiling.test_gpu_target import GPU_PY, ROOT
  if not os.path.exists(GPU_PY):
    pytest.skip(f"no {GPU_PY}: {gpu_target.INSTALL} makes it")
  env = gpu_target.ptxas_env() if ptxas else {**os.environ, "JAX_PLATFORMS": "cpu"}
  p = subprocess.run([GPU_PY, "-m", module, str(dump_dir)], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=600)
  assert p.returncode == 0, p.stderr[-3000:]
  smem = json.loads(p.stdout.strip().splitlines()[-1])
  return (smem, gpu_target.parse_ptxas(p.stderr)) if ptxas else smem


def kernel_smem(dump_dir, prefix: str, seen: set | None = None) -> dict:
  """``{kernel: shared memory bytes}`` of the kernels named ``prefix...`` in an XLA dump; with
  ``seen`` (a set, updated) only in the modules dumped since the last call: the latest compile."""
  from bench.profiling import gpu_target
  paths = set(glob.glob(f"{dump_dir}/*thunk_sequence.txt"))
  if seen is not None:
    new = paths - seen
    seen |= paths
    paths = new
  return {k: v["smem"] for path in paths
          for k, v in gpu_target.thunk_launches(path).items() if k.startswith(prefix)}
