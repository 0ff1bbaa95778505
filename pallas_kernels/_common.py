"""Small pieces the Pallas-Triton kernels share: a dot of compute-dtype operands into float32
and its precision, rounding to the compute dtype, the power-of-two tile sizes Triton needs (at
least 16, the GPU dot's minimum), the examples a program takes where it sums per-program
partials, and the masked loads and stores of the row-wise kernels' token tiles."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def precision(dtype):
  """A kernel dot's precision for operands of ``dtype``: HIGHEST for float32 (no TF32)."""
  return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def dot(a, b, cfg, **kw):
  """``a b`` (``trans_a`` / ``trans_b``) of operands rounded to ``cfg.dtype``, accumulated in
  float32 (``cfg.interpret``: float32 operands, as XLA:CPU has no 16-bit dot into float32; the
  products of 16-bit values are exact in float32)."""
  a, b = a.astype(cfg.dtype), b.astype(cfg.dtype)
  if cfg.interpret:
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  return plgpu.dot(a, b, precision=precision(cfg.dtype), **kw)


def round_to(x, dtype):
  """``x`` rounded to ``dtype`` and back to float32 (where the XLA path rounds)."""
  return x.astype(dtype).astype(jnp.float32)


def pow2(n: int) -> int:
  """The smallest power of two >= n (n >= 1)."""
  return 1 << (int(n) - 1).bit_length()


def pad_pow2(n: int) -> int:
  """The smallest power of two >= max(n, 16)."""
  return max(16, pow2(n))


# Programs a kernel that sums per-program partials should still have (the H200 has 132 SMs)
MIN_PROGRAMS = 128


def examples_per_program(examples: int, fewest: int, min_programs: int,
                         most: int | None = None) -> int:
  """Examples a program takes in turn: ``fewest``, doubled while the doubled count still leaves
  at least ``min_programs`` full programs (``examples // per``), up to ``most``. More examples
  per program means fewer per-program partial sums for XLA to add up."""
  per = fewest
  while (most is None or 2 * per <= most) and examples // (2 * per) >= max(min_programs, 1):
    per *= 2
  return per


def is_tile(n: int) -> bool:
  """Whether ``n`` is a power of two >= 16 (a width a kernel tiles without padding)."""
  return n >= 16 and n & (n - 1) == 0


def spans(n: int, size: int) -> list[tuple[int, int]]:
  """Static ``(start, width)`` chunks of ``n`` columns (or rows), ``size`` wide (one when
  ``n <= size``)."""
  w = min(n, size)
  return [(c, w) for c in range(0, n, w)]


def tile_spans(n: int, size: int) -> list[tuple[int, int]]:
  """Static ``(start, width)`` chunks of ``n`` columns (a multiple of 16), each a power of two
  from 16 to ``size``: ``size`` wide while that many are left, then the rest's powers of two,
  widest first (224 in 128s: 128, 64, 32), so no chunk reads padding."""
  if n % 16:
    raise ValueError(f"tile_spans: {n} columns are no multiple of 16")
  out, c = [], 0
  while c < n:
    w = min(size, 1 << ((n - c).bit_length() - 1))
    out.append((c, w))
    c += w
  return out


def loop_spans(n: int, size: int, body, carry):
  """``body((start, size), carry)`` over ``n``'s chunks of ``size`` (``n`` a multiple of it) as a
  loop, ``start`` traced (a multiple of ``size``): one copy of the body for ptxas, where unrolled
  chunks lengthen the build and the registers' live ranges."""
  return lax.fori_loop(0, n // size,
                       lambda j, c: body((pl.multiple_of(j * size, size), size), c), carry)


def _row_mask(ref, r0, rows, width):
  ok = (r0 + jnp.arange(rows)) < ref.shape[0]
  return jnp.broadcast_to(ok[:, None], (rows, width))


def load_rows(ref, r0, rows: int, cols=None):
  """``ref[r0:r0 + rows, cols]`` of a 2-D ref (``cols``: a static ``(start, width)``; None: all
  columns), zero past its rows."""
  c0, w = cols or (0, ref.shape[1])
  return plgpu.load(ref.at[pl.ds(r0, rows), pl.ds(c0, w)], mask=_row_mask(ref, r0, rows, w),
                    other=0.0)


def store_rows(ref, r0, x, c0: int = 0):
  """Stores ``x [rows, c]`` at rows ``r0 + [0, rows)``, columns ``c0 + [0, c)`` of a 2-D ref, in
  its dtype (rows past its end dropped)."""
  rows, c = x.shape
  plgpu.store(ref.at[pl.ds(r0, rows), pl.ds(c0, c)], x.astype(ref.dtype),
              mask=_row_mask(ref, r0, rows, c))


def load_vec(ref, r0, rows: int):
  """``ref[r0:r0 + rows]`` of a 1-D ref, zero past its end."""
  return plgpu.load(ref.at[pl.ds(r0, rows)], mask=(r0 + jnp.arange(rows)) < ref.shape[0],
                    other=0.0)


def store_vec(ref, r0, x):
  """Stores ``x [rows]`` at ``r0 + [0, rows)`` of a 1-D ref, in its dtype (past its end
  dropped)."""
  rows = x.shape[0]
  plgpu.store(ref.at[pl.ds(r0, rows)], x.astype(ref.dtype),
              mask=(r0 + jnp.arange(rows)) < ref.shape[0])
