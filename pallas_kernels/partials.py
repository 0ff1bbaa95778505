"""Per-program partial sums summed and split in one launch (issue 38).

A backward kernel whose programs each write partial sums of several small gradients side by
side (``part f32[P, R, W]``: ``P`` programs, the gradients' rows and columns) needs them summed
over ``P`` and cut into the gradients. XLA does it as one reduction and then one slice per
gradient, each a launch of its own: the optimizer and the gradient norm read every leaf as a
buffer of its own, so no slice fuses into them. ``sum_split_pallas`` does both in one launch.

``pieces``: per output, ``Piece(rows=(r0, r1), cols=(c0, c1), dtype, round)``, the block
``sum_p part[p, r0:r1, c0:c1]`` in ``dtype`` (rounded through ``round`` first where it is not
None, as a gradient of a weight read in a 16-bit compute dtype is). ``sum_split_xla`` is the
twin (XLA's sum and slices). Triton on GPU, ``interpret=True`` on CPU.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _poison
from pallas_kernels._common import pow2

F32 = jnp.float32
ROWS = 8        # a program's rows of one piece (at most: a shorter piece takes its power of two)
COLS = 64       # and its columns (likewise)
BLOCK = 8192    # float32 values per load, [step, rows, cols] (64 per thread): a piece of few
                # rows or columns sums more partials per load, so a long sum takes few steps


class Piece(NamedTuple):
  """An output: ``rows`` and ``cols`` (``(start, stop)``) of the summed partials, its dtype, and
  the dtype its value is rounded through first (None: none)."""
  rows: tuple[int, int]
  cols: tuple[int, int]
  dtype: Any = F32
  round: Any = None

  @property
  def shape(self) -> tuple[int, int]:
    return self.rows[1] - self.rows[0], self.cols[1] - self.cols[0]


def _finish(v, piece: Piece):
  if piece.round is not None:
    v = v.astype(piece.round)
  return v.astype(piece.dtype)


def sum_split_xla(part, pieces):
  """The twin: ``part.sum(0)`` cut into ``pieces`` (module docstring)."""
  total = jnp.sum(part.astype(F32), 0)
  return tuple(_finish(total[p.rows[0]:p.rows[1], p.cols[0]:p.cols[1]], p) for p in pieces)


def _check(part, pieces):
  if part.ndim != 3:
    raise ValueError(f"sum_split: part must be [programs, rows, cols], got shape {part.shape}")
  _, R, W = part.shape
  for p in pieces:
    (r0, r1), (c0, c1) = p.rows, p.cols
    if not (0 <= r0 < r1 <= R and 0 <= c0 < c1 <= W):
      raise ValueError(f"sum_split: piece rows {p.rows}, cols {p.cols} is not inside "
                       f"[{R}, {W}]")


class _Block(NamedTuple):
  start: int      # the piece's first program
  nr: int         # its row blocks
  nc: int         # and column blocks
  rows: int       # a block's rows, columns and partials per load
  cols: int
  step: int


def _grid(pieces):
  """Per piece, its programs' blocks (``_Block``); the programs in all."""
  out, start = [], 0
  for p in pieces:
    rows, cols = p.shape
    rb, cw = min(ROWS, pow2(rows)), min(COLS, pow2(cols))
    b = _Block(start, pl.cdiv(rows, rb), pl.cdiv(cols, cw), rb, cw, BLOCK // (rb * cw))
    out.append(b)
    start += b.nr * b.nc
  return out, start


def _kernel(part_ref, *out_refs, pieces, grid):
  P = part_ref.shape[0]
  i = pl.program_id(0)
  for p, o_ref, b in zip(pieces, out_refs, grid, strict=True):
    @pl.when((i >= b.start) & (i < b.start + b.nr * b.nc))
    def _(p=p, o_ref=o_ref, b=b):
      k = i - b.start
      rb, cb = k // b.nc, k % b.nc
      (r0, r1), (c0, c1) = p.rows, p.cols
      rows = rb * b.rows + jnp.arange(b.rows)               # within the piece
      cols = cb * b.cols + jnp.arange(b.cols)
      ok = (rows < r1 - r0)[:, None] & (cols < c1 - c0)[None, :]

      def step(s, acc):
        ps = s * b.step + jnp.arange(b.step)
        m = (ps < P)[:, None, None] & ok[None]
        v = plgpu.load(part_ref.at[pl.ds(s * b.step, b.step), pl.ds(r0 + rb * b.rows, b.rows),
                                   pl.ds(c0 + cb * b.cols, b.cols)], mask=m, other=0.0)
        return acc + jnp.sum(v, axis=0)

      acc = jax.lax.fori_loop(0, pl.cdiv(P, b.step), step, jnp.zeros((b.rows, b.cols), F32))
      plgpu.store(o_ref.at[pl.ds(rb * b.rows, b.rows), pl.ds(cb * b.cols, b.cols)],
                  _finish(acc, p), mask=ok)


def sum_split_pallas(part, pieces, *, interpret: bool = False, name: str = "sum_split"):
  """``sum_split_xla``'s outputs from one kernel (``name``: its name in profiles): a program
  sums one block of at most ``[ROWS, COLS]`` of one piece over the partials, ``BLOCK`` values
  per load."""
  pieces = tuple(Piece(*p) for p in pieces)
  _check(part, pieces)
  grid, n = _grid(pieces)
  outs = tuple(jax.ShapeDtypeStruct(p.shape, p.dtype) for p in pieces)
  whole = pl.no_block_spec
  return tuple(_poison.pallas_call(
      functools.partial(_kernel, pieces=pieces, grid=tuple(grid)), (part.astype(F32),),
      out_shape=outs, grid=(n,), in_specs=[whole], out_specs=(whole,) * len(outs),
      interpret=interpret, name=name,
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1)))
