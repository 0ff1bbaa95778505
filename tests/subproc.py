"""Helpers for tests that start JAX worker processes (gloo on CPU)."""

import os
import socket

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def worker_env() -> dict:
  """The current environment without JAX/XLA settings (the workers set their own), on CPU, with
  the repository importable."""
  env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  return env
