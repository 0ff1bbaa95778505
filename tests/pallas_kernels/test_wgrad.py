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


@pytest.mark.parametrize("N,d,C,P", [(150, 32, 96, 2), (70, 64, 32, 1)])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-5)])
def test_kernel_and_twin_match_numpy(N, d, C, P, dtype, tol):
  """float32 operands, or bfloat16 ones with ``h`` rounded to bfloat16 (the products are exact
  in the float32 accumulator either way, so both match numpy to summation order)."""
  x, r, gs = _inputs(N, d, C, P)
  rnd = (lambda a: a) if dtype == jnp.float32 else _bf16
  xd, gd = jnp.asarray(x, dtype), [jnp.asarray(g, dtype) for g in gs]
  h = rnd(np.asarray(xd, np.float64) * r[:, None].astype(np.float64))
  refs = [h.T @ np.asarray(g, np.float64) for g in gd]
  with _poison.poison_outputs():
    outs = wgrad.row_scaled_wgrad_pallas(xd, jnp.asarray(r), gd, dtype=dtype, interpret=True)
  twin = wgrad.row_scaled_wgrad_xla(xd, jnp.asarray(r), gd, dtype=dtype)
  assert wgrad._split(N, (d // wgrad._tile(d)) * P * (C // wgrad._tile(C)))[0] == 3 - (N < 100)
  for o, t, ref in zip(outs, twin, refs, strict=True):
    assert o.shape == (d, C) and o.dtype == jnp.float32
    close(o, ref, tol)
    close(t, ref, tol)


def test_mismatched_shapes_are_refused():
  x, r, gs = _inputs(40, 32, 32, 2)
  with pytest.raises(ValueError, match="r .* must be \\[N\\]"):
    wgrad.row_scaled_wgrad_pallas(x, r[:-1], gs, interpret=True)
  with pytest.raises(ValueError, match="every cotangent"):
    wgrad.row_scaled_wgrad_pallas(x, r, [gs[0], gs[1][:, :16]], interpret=True)
  with pytest.raises(ValueError, match="power-of-two factor"):
    wgrad.row_scaled_wgrad_pallas(x[:, :24], r, gs, interpret=True)
