"""Per-shape tile configurations of the GPU kernels, cached in ``tuning.json``.

``bench/kernels.py --autotune`` times a small candidate set (``CANDIDATES``) per kernel and
shape class on the GPU and writes the fastest correct one here, keyed by device kind, backend
and ``key(...)``. Kernels look their tiles up at trace time; without an entry they use
``DEFAULTS`` (chosen from the sm_90 compile-only register and spill report, see README).
"""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp

TUNING_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuning.json")

# (block_q, block_k, num_warps, num_stages) per kernel. For "dkv" block_k is the kernel's own
# (outer) tile and block_q the inner loop's.
CANDIDATES = {
    "fwd": [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 4), (64, 128, 4, 2),
            (128, 64, 4, 3)],
    "dq": [(64, 64, 4, 3), (128, 64, 8, 2), (128, 32, 8, 3), (64, 32, 4, 3)],
    "dkv": [(32, 128, 8, 3), (64, 128, 8, 2), (32, 64, 4, 3), (64, 64, 8, 3)],
}
DEFAULTS = {  # no register spills at D = 128, bf16 (sm90_report)
    "fwd": (128, 64, 8, 3),
    "dq": (64, 64, 4, 3),
    "dkv": (32, 128, 8, 3),
}
DEFAULTS_F32 = {  # fp32 operands take twice the registers and shared memory
    "fwd": (64, 32, 4, 3),
    "dq": (64, 32, 4, 2),
    "dkv": (32, 64, 4, 2),
}

# Softmax attention (``pallas_softmax``), per shape class (not timed yet; sm_90 compile-only:
# ``sm90_report.pallas_softmax_stats``, bf16, D 128). Banded ("swa", w = 64): a 64-row q tile
# touches 3 key tiles of 64 (192 keys for a 129-key band, 67% useful), a 128-row one 4 (50%).
# Forward 64x64 / 8 warps: 174 registers, no spills (4 warps: 247). Backward ("dkv" tiles and
# warps, used by the dq kernel too) 64x64 / 8 warps / 2 stages: dq 153, dk/dv 249 registers, no
# spills, both on wgmma (32-row q tiles fall back to mma.sync in dq; 4 warps spill in dk/dv).
SOFTMAX_DEFAULTS = {
    "swa": {"fwd": (64, 64, 8, 3), "dkv": (64, 64, 8, 2)},
    "full": {"fwd": (128, 64, 8, 3), "dkv": (64, 64, 8, 2)},
}
SOFTMAX_DEFAULTS_F32 = {"fwd": (64, 32, 8, 2), "dkv": (32, 32, 8, 2)}


def softmax_defaults(shape_cls: str):
  """``(DEFAULTS for 16-bit, DEFAULTS for fp32)`` of the softmax-attention kernels."""
  return SOFTMAX_DEFAULTS[shape_cls], SOFTMAX_DEFAULTS_F32


def key(shape_cls: str, head_dim: int, dtype) -> str:
  return f"{shape_cls}/D{head_dim}/{jnp.dtype(dtype).name}"


@functools.cache
def _load(path: str) -> dict:
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return json.load(f)


def _device_kind() -> str | None:
  try:
    d = jax.devices()[0]
  except RuntimeError:
    return None
  return d.device_kind if d.platform == "gpu" else None


def lookup(backend: str, kernel: str, shape_key: str, dtype, *, device_kind=None,
           path: str = TUNING_PATH, defaults=None) -> tuple[int, int, int, int]:
  """``(block_q, block_k, num_warps, num_stages)`` for ``kernel`` ("fwd", "dq", "dkv").

  ``defaults``: ``(16-bit table, fp32 table)`` used without a tuned entry (GDPA's by default).
  """
  device_kind = device_kind or _device_kind()
  entry = _load(path).get(device_kind or "", {}).get(backend, {}).get(shape_key, {}).get(kernel)
  if entry:
    return tuple(entry)
  d16, d32 = defaults or (DEFAULTS, DEFAULTS_F32)
  return (d32 if jnp.dtype(dtype) == jnp.float32 else d16)[kernel]


def clamp_tile(block: int, n: int) -> int:
  """A power-of-two tile <= block covering small n (>= 16, the minimum dot size)."""
  return min(block, max(16, 1 << (max(n, 1) - 1).bit_length()))
