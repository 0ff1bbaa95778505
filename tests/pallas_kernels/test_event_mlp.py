"""An event stream's per-event MLP (``pallas_kernels.event_mlp``): the twin against float64
numpy, the kernels (interpret mode, NaN-poisoned outputs) against the twin in values and all
five gradients (float32: 1e-5 of the largest magnitude; bfloat16: 3e-2), with a row count no
multiple of the tiles, masked rows that hold values and input widths no power of two (read in
power-of-two column chunks, ``_common.tile_spans``), and an input given as a pair, whose gradient
comes back as a pair."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _poison, event_mlp
from pallas_kernels._common import tile_spans
from tests.pallas_kernels.deviceless import close, twin_jit


def _inputs(N, K, F, D, seed):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(N, K)).astype(np.float32)
  w1 = (rng.normal(size=(K, F)) / np.sqrt(K)).astype(np.float32)
  w2 = (rng.normal(size=(F, D)) / np.sqrt(F)).astype(np.float32)
  b1, b2 = (rng.normal(size=(n,)).astype(np.float32) * 0.5 for n in (F, D))
  valid = (np.arange(N) < N - 7).astype(np.float32)
  return x, w1, b1, w2, b2, valid


def test_twin_matches_numpy():
  args = _inputs(40, 32, 64, 16, 0)
  x, w1, b1, w2, b2, valid = (a.astype(np.float64) for a in args)
  z = x @ w1 + b1
  h = 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z ** 3)))
  ref = valid[:, None] * (h @ w2 + b2)
  twin = twin_jit(lambda *a: event_mlp.event_mlp_xla(*a, dtype=jnp.float32), jnp.float32)
  close(twin(*map(jnp.asarray, args)), ref, 1e-5)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
# K: 112 in chunks of 64, 32 and 16; mid's click streams (448: three chunks of 128 and one of
# 64); prod's click / conversion streams (896 = 7 x 128 as a loop, hidden and output 512, the
# hidden layer in two chunks); a loop over K's whole chunks and one of 16 after it
@pytest.mark.parametrize("N,K,F,D", [(77, 112, 32, 32), (45, 448, 256, 256), (21, 896, 512, 512),
                                     (13, 272, 512, 16)])
def test_kernels_match_the_twin(dtype, tol, N, K, F, D):
  x, w1, b1, w2, b2, valid = map(jnp.asarray, _inputs(N, K, F, D, N + K))
  x = x.astype(dtype)
  dy = jnp.asarray(np.random.default_rng(1).normal(size=(N, D)), jnp.float32)

  def run(fn, jit):
    f = lambda *a: fn(*a, valid, dtype=dtype)
    g = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) * dy), (0, 1, 2, 3, 4))
    return jit(lambda *a: (f(*a), g(*a)))(x, w1, b1, w2, b2)

  with _poison.poison_outputs():
    y, grads = run(lambda *a, **k: event_mlp.event_mlp_pallas(*a, interpret=True, **k), jax.jit)
  ref, rgrads = run(event_mlp.event_mlp_xla, lambda f: twin_jit(f, dtype))
  assert y.dtype == dtype and y.shape == ref.shape
  close(y, ref, tol)
  assert not np.any(np.asarray(y, np.float32)[N - 7:])
  for name, g, r in zip(("x", "w1", "b1", "w2", "b2"), grads, rgrads, strict=True):
    assert g.dtype == r.dtype and g.shape == r.shape, name
    close(g, r, tol)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
# an item table's columns apart from the side tables': mid-like (64 + 48: dx's second range in
# chunks of 32 and 16) and prod's click stream (512 + 384, the hidden layer's loop)
@pytest.mark.parametrize("N,Ka,Kb,F,D", [(77, 64, 48, 32, 32), (21, 512, 384, 512, 512)])
def test_a_pair_gives_its_gradient_as_a_pair(dtype, tol, N, Ka, Kb, F, D):
  """x as a pair: the kernels' dx comes back as two arrays, each equal to its columns of the
  twin's gradient w.r.t. the concatenated input (and y to the twin's)."""
  x, w1, b1, w2, b2, valid = map(jnp.asarray, _inputs(N, Ka + Kb, F, D, N + Ka))
  x = x.astype(dtype)
  dy = jnp.asarray(np.random.default_rng(2).normal(size=(N, D)), jnp.float32)

  def run(fn, jit, pair):
    f = lambda x, w1: fn((x[:, :Ka], x[:, Ka:]) if pair else x, w1, b1, w2, b2, valid,
                         dtype=dtype)
    if pair:          # the gradient w.r.t. the pair itself, as the kernels write it
      g = jax.grad(lambda xs, w1: jnp.sum(fn(xs, w1, b1, w2, b2, valid, dtype=dtype)
                                          .astype(jnp.float32) * dy), (0, 1))
      return jit(lambda x, w1: (f(x, w1), g((x[:, :Ka], x[:, Ka:]), w1)))(x, w1)
    g = jax.grad(lambda x, w1: jnp.sum(f(x, w1).astype(jnp.float32) * dy), (0, 1))
    return jit(lambda x, w1: (f(x, w1), g(x, w1)))(x, w1)

  with _poison.poison_outputs():
    y, ((dxa, dxb), dw1) = run(lambda *a, **k: event_mlp.event_mlp_pallas(*a, interpret=True, **k),
                               jax.jit, True)
  ref, (rdx, rdw1) = run(event_mlp.event_mlp_xla, lambda f: twin_jit(f, dtype), False)
  close(y, ref, tol)
  assert dxa.shape == (N, Ka) and dxb.shape == (N, Kb) and dxa.dtype == dxb.dtype == dtype
  close(dxa, rdx[:, :Ka], tol)
  close(dxb, rdx[:, Ka:], tol)
  close(dw1, rdw1, tol)


def test_bad_shapes_and_widths_are_refused():
  x, w1, b1, w2, b2, valid = map(jnp.asarray, _inputs(8, 32, 32, 16, 2))
  with pytest.raises(ValueError, match="must be"):
    event_mlp.event_mlp_pallas(x, w1[:16], b1, w2, b2, valid, interpret=True)
  with pytest.raises(ValueError, match="multiple of 16"):
    event_mlp.event_mlp_pallas(x[:, :24], w1[:24], b1, w2, b2, valid, interpret=True)
  with pytest.raises(ValueError, match="a pair x"):
    event_mlp.event_mlp_pallas((x[:, :8], x[:, 8:]), w1, b1, w2, b2, valid, interpret=True)
  assert event_mlp.supported(512, 256, 256) and event_mlp.supported(224, 128, 128)
  assert not event_mlp.supported(200, 128, 128) and not event_mlp.supported(224, 96, 128)
  assert event_mlp.supported(1024, 512, 512) and not event_mlp.supported(1024, 1024, 512)
  assert not event_mlp.supported(2048, 512, 512) and not event_mlp.supported(8, 16, 16)
  assert [event_mlp.width(k) for k in (224, 200, 896, 5)] == [224, 208, 896, 16]


@pytest.mark.parametrize("n", [16, 48, 96, 112, 224, 256, 448, 896, 912, 1024])
def test_tile_spans_cover_the_columns_in_power_of_two_chunks(n):
  chunks = tile_spans(n, 128)
  starts = np.cumsum([0] + [w for _, w in chunks])
  assert [c for c, _ in chunks] == list(starts[:-1]) and starts[-1] == n
  widths = [w for _, w in chunks]
  assert all(16 <= w <= 128 and w & (w - 1) == 0 for w in widths)
  assert widths == sorted(widths, reverse=True)
  assert len(chunks) == n // 128 + bin(n % 128).count("1")   # the fewest such chunks
  with pytest.raises(ValueError, match="multiple of 16"):
    tile_spans(n + 8, 128)
