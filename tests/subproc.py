"""Helpers for tests that start JAX worker processes (gloo on CPU)."""

import os
import socket

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def worker_env() -> dict:
  """The current environment without JAX settings (the workers set their own), on CPU, with the
  repository importable. ``XLA_FLAGS`` is kept: the suite's XLA:CPU -O0 (tests/conftest.py)
  halves the workers' compile time too."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  return env


LONG_TIMEOUT = 3600      # seconds; a guard against a hang, not a speed test (CI has its own limit)


def run(cmd, *, timeout: float = LONG_TIMEOUT, check: bool = False, **kw):
  """``subprocess.run(cmd, capture_output=True, text=True)``; a timeout (or, with ``check``, a
  non-zero exit) is an AssertionError carrying the child's last output, so a slow or stuck
  child shows what it was doing instead of a bare ``TimeoutExpired``."""
  import subprocess
  try:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
  except subprocess.TimeoutExpired as e:
    out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (
        e.stdout or "")
    err = (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (
        e.stderr or "")
    raise AssertionError(f"{' '.join(map(str, cmd))} did not finish in {timeout:.0f}s; its last "
                         f"output:\n{out[-3000:]}\n{err[-5000:]}") from None
  if check and p.returncode != 0:
    raise AssertionError(f"{' '.join(map(str, cmd))} failed ({p.returncode}):\n"
                         f"{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
  return p
