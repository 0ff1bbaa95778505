"""Per-shape tile configurations of the GPU kernels, cached in ``tuning.json``.

``bench/kernels.py --autotune`` times a small candidate set (``CANDIDATES``) per kernel and
shape class on the GPU and writes the fastest correct one here, keyed by device kind, backend
and ``key(...)``. Kernels look their tiles up at trace time; without an entry they use
``DEFAULTS`` (chosen from the sm_90 compile-only register and spill report,
docs/results/kernels.md).
The packed (jagged) kernels fit their tiles and pipeline stages to the GPU's shared memory
(``fit_smem``).
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


# ----------------------------------------------------------------------------- shared memory
# Shared memory one thread block may use (the opt-in maximum, CUDA C++ Programming Guide,
# "Technical Specifications per Compute Capability"), bytes, by compute capability.
SMEM_PER_BLOCK = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376}
TARGET_CC = 90     # without a GPU attached (deviceless compiles, interpret mode): H100 / H200
# The target's streaming multiprocessors and its ridge point (bf16 dense peak over memory
# bandwidth, FLOP per byte): H100 / H200 SXM, 132 SMs, 989 TFLOP/s, 4.8 TB/s (H200); for the
# kernels that choose a split of their work by a roofline of their own (pallas_kernels.wgrad).
SM_COUNT, RIDGE = 132, 989e12 / 4.8e12
# The jagged kernels' Triton settings (jax's defaults, which mid's figures were measured with).
JAGGED_WARPS, JAGGED_STAGES = 4, 3


def smem_limit() -> int:
  """Shared memory per block of the attached GPU, else of ``TARGET_CC`` (an unknown GPU: the
  smallest in ``SMEM_PER_BLOCK``)."""
  try:
    d = jax.devices()[0]
  except RuntimeError:
    d = None
  cc = getattr(d, "compute_capability", None) if d is not None and d.platform == "gpu" else None
  cc = TARGET_CC if cc is None else int(float(cc) * 10)
  return SMEM_PER_BLOCK.get(cc, min(SMEM_PER_BLOCK.values()))


def smem_estimate(resident: int, streamed: int, num_stages: int, copies: int = 1) -> int:
  """Shared-memory bytes of a Triton kernel: the tiles it loads once (``resident``) plus
  ``num_stages`` buffers of those its loop loads every step (``streamed``: the pipeliner keeps up
  to num_stages in flight), each pipelined loop ``copies`` times (XLA's Triton unswitches a loop
  over a per-head activation switch: one loop and its own buffers per distinct activation). An
  upper bound of what XLA's Triton allocated for every jagged kernel at mid and prod shapes, 1 to
  4 stages."""
  return resident + num_stages * streamed * (copies if num_stages > 1 else 1)


def fit_smem(need, whole: int | None = None, *, copies: int = 1, stages: int = JAGGED_STAGES,
             floor: int = 64, limit: int | None = None,
             what: str = "kernel") -> tuple[int | None, int]:
  """``(chunk, num_stages)`` of a kernel needing ``need(chunk) = (resident, streamed)`` bytes
  (``smem_estimate``) within ``limit`` (``smem_limit()``): the most stages (at most ``stages``)
  at which a chunk of ``whole`` rows (a power of two: a dimension the kernel would load at once;
  None: nothing to split) halved down to ``floor`` rows fits, and the largest such chunk; else
  one stage and chunks down to 16 rows (the dot minimum). ValueError when none fits."""
  limit = smem_limit() if limit is None else limit
  halves = lambda lo: [whole >> i for i in range(whole.bit_length()) if whole >> i >= lo]
  chunks = [None] if whole is None else halves(min(floor, whole))
  tries = [(s, c) for s in range(stages, 0, -1) for c in chunks]
  tries += [] if whole is None else [(1, c) for c in halves(16) if c not in chunks]
  for s, c in tries:
    if smem_estimate(*need(c), s, copies) <= limit:
      return c, s
  s, c = tries[-1]
  raise ValueError(f"{what}: needs {smem_estimate(*need(c), s, copies)} bytes of shared memory "
                   f"at its smallest tiles, more than the GPU's {limit} per block: use smaller "
                   "tiles or 16-bit operands")


def clamp_tile(block: int, n: int) -> int:
  """A power-of-two tile <= block covering small n (>= 16, the minimum dot size)."""
  return min(block, max(16, 1 << (max(n, 1) - 1).bit_length()))
