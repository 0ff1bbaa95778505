"""Small pieces the Pallas-Triton kernels share: a dot's precision, rounding to the compute dtype,
and the power-of-two tile sizes Triton needs (at least 16, the GPU dot's minimum)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def precision(dtype):
  """A kernel dot's precision for operands of ``dtype``: HIGHEST for float32 (no TF32)."""
  return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def round_to(x, dtype):
  """``x`` rounded to ``dtype`` and back to float32 (where the XLA path rounds)."""
  return x.astype(dtype).astype(jnp.float32)


def pad_pow2(n: int) -> int:
  """The smallest power of two >= max(n, 16)."""
  return max(16, 1 << (int(n) - 1).bit_length())


def is_tile(n: int) -> bool:
  """Whether ``n`` is a power of two >= 16 (a width a kernel tiles without padding)."""
  return n >= 16 and n & (n - 1) == 0
