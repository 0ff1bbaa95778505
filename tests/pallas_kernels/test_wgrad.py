"""The row-scaled weight gradient (``pallas_kernels.wgrad``): the kernel (interpret mode,
NaN-poisoned outputs) and its twin against a float64 numpy ``(r x)^T g``, row counts over
several splits and no multiple of a step's rows, zero rows (a packed block's tail), column
widths whose tile is under 128, and the one-line errors on mismatched shapes."""

import jax
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


@pytest.mark.parametrize("N,d,C,P,S", [(700, 16, 16, 2, 3), (150, 32, 96, 2, 2), (70, 64, 32, 1, 1)])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-5)])
def test_kernel_and_twin_match_numpy(N, d, C, P, S, dtype, tol):
  """float32 operands, or bfloat16 ones with ``h`` rounded to bfloat16 (the products are exact
  in the float32 accumulator either way, so both match numpy to summation order); ``S`` splits
  (700 rows: 3 of 256, the last one ragged), column tiles of 16 and 32."""
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


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-5)])
def test_without_r_a_plain_weight_gradient(dtype, tol):
  """``r`` None: ``sum_n x_n^T g_p[n]`` (WeightGen's weight gradients), 2 splits."""
  x, _, gs = _inputs(150, 32, 64, 2, seed=3)
  xd, gd = jnp.asarray(x, dtype), [jnp.asarray(g, dtype) for g in gs]
  with _poison.poison_outputs():
    outs = wgrad.row_scaled_wgrad_pallas(xd, None, gd, dtype=dtype, interpret=True)
  for o, t, g in zip(outs, wgrad.row_scaled_wgrad_xla(xd, None, gd, dtype=dtype), gd,
                     strict=True):
    ref = np.asarray(xd, np.float64).T @ np.asarray(g, np.float64)
    close(o, ref, tol)
    close(t, ref, tol)


def test_splits_keep_the_sms_busy_within_the_partials():
  """At most ``PROGRAMS`` programs and a split at least a step of rows, every row in one split;
  the float32 partials never more than the bytes read. prod's HSP (583,680 rows, 512 x 1,024,
  32 tiles, compute-bound: 2 d PC / (2 (d + PC)) = 341 FLOP per byte > the ridge) takes the
  fewest splits that fill 132 SMs: 5 (4 leave 4 idle); a short stream's (4,992 rows, 8 tiles)
  splits although it reads little, since one split would keep 8 SMs busy."""
  for N, d, PC, tiles in ((583680, 512, 1024, 32), (37888, 256, 512, 8), (4992, 256, 512, 8),
                          (126976, 128, 256, 2), (8192, 128, 128, 1), (70, 64, 32, 1)):
    S, rows = wgrad._split(N, d, PC, tiles)
    assert rows % wgrad.BK == 0 and (S - 1) * rows < N <= S * rows, (N, S, rows)
    assert S * tiles <= wgrad.PROGRAMS + tiles and 4 * S * d * PC <= 2 * N * (d + PC), (N, S)
  assert wgrad._split(583680, 512, 1024, 32)[0] == 5
  assert 1 < wgrad._split(4992, 256, 512, 8)[0] < 132 // 8


def test_mismatched_shapes_are_refused():
  x, r, gs = _inputs(40, 32, 32, 2)
  with pytest.raises(ValueError, match="r .* must be \\[N\\]"):
    wgrad.row_scaled_wgrad_pallas(x, r[:-1], gs, interpret=True)
  with pytest.raises(ValueError, match="every cotangent"):
    wgrad.row_scaled_wgrad_pallas(x, r, [gs[0], gs[1][:, :16]], interpret=True)
  with pytest.raises(ValueError, match="power-of-two factor"):
    wgrad.row_scaled_wgrad_pallas(x[:, :24], r, gs, interpret=True)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_dense_values_and_gradients_match_numpy(dtype, tol):
  """``dense_pallas`` (a summary projection's shape, ``x [B, n, K]``, 3 splits over its 300
  rows): the output and ``dx`` (XLA's GEMMs, bfloat16 outputs rounded once) and ``dw`` (the
  kernel, rounded to ``dtype`` once) against float64 numpy on the ``dtype``-rounded operands,
  and the same as the twin's autodiff."""
  rng = np.random.default_rng(5)
  x = rng.normal(size=(12, 25, 32)).astype(np.float32)
  w = (rng.normal(size=(32, 48)) / 6).astype(np.float32)
  gy = rng.normal(size=(12, 25, 48)).astype(np.float32)
  loss = lambda f: lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) * gy)
  kernel = lambda x, w: wgrad.dense_pallas(x, w, dtype=dtype, interpret=True)
  twin = lambda x, w: wgrad.dense_xla(x, w, dtype=dtype)
  assert wgrad._split(300, 32, 48, 3)[0] == 3
  rnd = (lambda a: np.asarray(a, np.float64)) if dtype == jnp.float32 else _bf16
  xr, wr, gr = rnd(x), rnd(w), rnd(gy)
  y_ref = np.einsum("bnk,kc->bnc", xr, wr)
  dx_ref, dw_ref = np.einsum("bnc,kc->bnk", gr, wr), np.einsum("bnk,bnc->kc", xr, gr)
  with _poison.poison_outputs():
    y = kernel(jnp.asarray(x), jnp.asarray(w))
    dx, dw = jax.grad(loss(kernel), (0, 1))(jnp.asarray(x), jnp.asarray(w))
  tdx, tdw = jax.grad(loss(twin), (0, 1))(jnp.asarray(x), jnp.asarray(w))
  assert y.dtype == dtype and dx.dtype == dw.dtype == jnp.float32
  close(y, y_ref, tol)
  for got, t, ref in ((dx, tdx, dx_ref), (dw, tdw, dw_ref)):
    close(got, ref, tol)
    close(got, t, tol)
  with pytest.raises(ValueError, match="must be \\[..., K\\] and \\[K, C\\]"):
    wgrad.dense_pallas(x, w[:16], interpret=True)


def test_the_kernel_takes_the_memory_bound_weight_gradients():
  """``memory_bound``: FLOPs per byte read, ``2 d C / ((d + C) 2)`` in bfloat16, against the
  H200's ridge (206): mid's HSP maps (256 x 256: 128; 1,024 x 256: 205) under it, prod's (512 x
  512: 256; 4,096 x 512: 455) over it; float32 operands halve the intensity."""
  assert wgrad.memory_bound(256, 256) and wgrad.memory_bound(1024, 256)
  assert not wgrad.memory_bound(512, 512) and not wgrad.memory_bound(4096, 512)
  assert wgrad.memory_bound(512, 512, itemsize=4)
