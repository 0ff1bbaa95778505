"""The row-scaled weight gradient (``pallas_kernels.wgrad``): the kernel (interpret mode,
NaN-poisoned outputs) and its twin against a float64 numpy ``(r x)^T g``, row counts over
several splits and no multiple of a step's rows, zero rows (a packed block's tail), column
widths whose tile is under 128, and the one-line errors on mismatched shapes."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _poison, wgrad
from tests.pallas_kernels.deviceless import close
from tests.pallas_kernels.np_ref import _bf16


def _inputs(N, d, C, P, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(N, d)).astype(np.float32) * rng.uniform(0.2, 3.0, size=(N, 1))
  x[N - 5:] = 0.0
  r = (1.0 / np.sqrt(np.mean(x * x, 1) + 1e-6)).astype(np.float32)
  return x, r, [rng.normal(size=(N, C)).astype(np.float32) for _ in range(P)]


@pytest.mark.parametrize("N,d,C,P,S", [(700, 16, 16, 2, 4), (150, 32, 96, 2, 1), (70, 64, 32, 1, 1)])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-5)])
def test_kernel_and_twin_match_numpy(N, d, C, P, S, dtype, tol):
  """float32 operands, or bfloat16 ones with ``h`` rounded to bfloat16 (the products are exact
  in the float32 accumulator either way, so both match numpy to summation order); ``S`` splits
  (700 rows: 4 of 192, the last one ragged), column tiles of 16 and 32."""
  x, r, gs = _inputs(N, d, C, P)
  assert wgrad._split(N, d, P * C, (d // wgrad._tile(d)) * P * (C // wgrad._tile(C)))[0] == S
  rnd = (lambda a: a) if dtype == jnp.float32 else _bf16
  xd, gd = jnp.asarray(x, dtype), [jnp.asarray(g, dtype) for g in gs]
  h = rnd(np.asarray(xd, np.float64) * r[:, None].astype(np.float64))
  refs = [h.T @ np.asarray(g, np.float64) for g in gd]
  with _poison.poison_outputs():
    outs = wgrad.row_scaled_wgrad_pallas(xd, jnp.asarray(r), gd, dtype=dtype, interpret=True)
  twin = wgrad.row_scaled_wgrad_xla(xd, jnp.asarray(r), gd, dtype=dtype)
  for o, t, ref in zip(outs, twin, refs, strict=True):
    assert o.shape == (d, C) and o.dtype == jnp.float32
    close(o, ref, tol)
    close(t, ref, tol)


def test_splits_bound_the_partials():
  """At most ``PROGRAMS`` programs; the float32 partials at most an eighth of the bytes read; a
  split at least a step of rows; every row in exactly one split."""
  for N, d, PC, tiles in ((583680, 512, 1024, 32), (37888, 256, 512, 8), (4992, 256, 512, 8),
                          (126976, 128, 256, 2), (150, 32, 192, 6), (70, 64, 32, 1)):
    S, rows = wgrad._split(N, d, PC, tiles)
    assert rows % wgrad.BK == 0 and (S - 1) * rows < N <= S * rows, (N, S, rows)
    assert S == 1 or (S * tiles <= wgrad.PROGRAMS + tiles and 8 * 4 * S * d * PC <= 2 * N * (d + PC))
  assert wgrad._split(583680, 512, 1024, 32)[0] == 9          # prod's HSP: 288 programs
  assert wgrad._split(4992, 256, 512, 8)[0] == 1              # a short stream: one split


def test_mismatched_shapes_are_refused():
  x, r, gs = _inputs(40, 32, 32, 2)
  with pytest.raises(ValueError, match="r .* must be \\[N\\]"):
    wgrad.row_scaled_wgrad_pallas(x, r[:-1], gs, interpret=True)
  with pytest.raises(ValueError, match="every cotangent"):
    wgrad.row_scaled_wgrad_pallas(x, r, [gs[0], gs[1][:, :16]], interpret=True)
  with pytest.raises(ValueError, match="power-of-two factor"):
    wgrad.row_scaled_wgrad_pallas(x[:, :24], r, gs, interpret=True)
