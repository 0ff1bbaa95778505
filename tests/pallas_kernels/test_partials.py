"""Partial sums summed and cut in one launch (``pallas_kernels.partials``): the kernel
(interpret mode, NaN-poisoned outputs) and its twin against a float64 numpy sum, with partial
counts, rows and columns that are no multiple of a program's block, pieces of one row or one
column block, rounding through bfloat16, batching under ``vmap``, and the one-line error for a
piece outside the partials."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _poison, partials
from pallas_kernels.partials import Piece
from tests.pallas_kernels.deviceless import close
from tests.pallas_kernels.np_ref import _bf16

PIECES = (Piece((0, 1), (0, 128)),                                  # one row (a scale's)
          Piece((1, 2), (0, 128), jnp.float32, jnp.bfloat16),       # rounded, kept float32
          Piece((2, 19), (0, 130), jnp.bfloat16),                   # 17 rows, 130 columns
          Piece((3, 20), (100, 130)))                               # 30 columns at an offset


def _ref(part, p):
  v = part.astype(np.float64).sum(0)[p.rows[0]:p.rows[1], p.cols[0]:p.cols[1]]
  return v if p.round is None else _bf16(v)


@pytest.mark.parametrize("P", [1, 16, 37, 300])
def test_kernel_and_twin_match_numpy(P):
  """1 to 300 partials: one load or several (a one-row piece takes 128 partials per load, a
  17-row one 16; norm_qkv's scales sum thousands)."""
  part = np.random.default_rng(P).normal(size=(P, 20, 130)).astype(np.float32)
  with _poison.poison_outputs():
    outs = jax.jit(lambda a: partials.sum_split_pallas(a, PIECES, interpret=True))(part)
  twin = partials.sum_split_xla(jnp.asarray(part), PIECES)
  for o, t, p in zip(outs, twin, PIECES, strict=True):
    shape = (p.rows[1] - p.rows[0], p.cols[1] - p.cols[0])
    assert o.shape == t.shape == shape and o.dtype == t.dtype == p.dtype
    tol = 1e-6 if p.round is None and p.dtype == jnp.float32 else 8e-3   # bfloat16: 2^-8
    close(o, _ref(part, p), tol)
    close(t, _ref(part, p), tol)


def test_batched_under_vmap():
  """Two experts' partials (the Wukong kernels run under the experts' ``vmap``)."""
  part = np.random.default_rng(5).normal(size=(2, 9, 72, 48)).astype(np.float32)
  pieces = (Piece((0, 72), (0, 16)), Piece((0, 72), (16, 48), jnp.float32, jnp.bfloat16))
  with _poison.poison_outputs():
    outs = jax.jit(jax.vmap(lambda a: partials.sum_split_pallas(a, pieces, interpret=True)))(part)
  for o, p in zip(outs, pieces, strict=True):
    for e in range(2):
      close(o[e], _ref(part[e], p), 1e-6 if p.round is None else 8e-3)


@pytest.mark.parametrize("piece", [Piece((0, 21), (0, 8)), Piece((3, 3), (0, 8)),
                                   Piece((0, 1), (120, 131))])
def test_piece_outside_the_partials_is_a_one_line_error(piece):
  with pytest.raises(ValueError, match=r"^sum_split: piece rows .* is not inside \[20, 130\]$"):
    partials.sum_split_pallas(jnp.zeros((4, 20, 130)), (piece,), interpret=True)
