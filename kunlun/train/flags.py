"""Start-up flags shared by train.py and eval.py (multi-host launch, compilation cache)."""

from __future__ import annotations

import os

from absl import flags


def define() -> None:
  """Defines ``--coordinator_address``, ``--num_processes``, ``--process_id`` and
  ``--compilation_cache`` (env ``KUNLUN_COMPILATION_CACHE``)."""
  flags.DEFINE_string("coordinator_address", None, "Multi-host: coordinator host:port.")
  flags.DEFINE_integer("num_processes", None, "Multi-host: number of processes.")
  flags.DEFINE_integer("process_id", None, "Multi-host: this process's index.")
  flags.DEFINE_string("compilation_cache",
                      os.environ.get("KUNLUN_COMPILATION_CACHE", "~/.cache/kunlun-jax/xla"),
                      "Persistent XLA compilation cache directory ('' disables).")
