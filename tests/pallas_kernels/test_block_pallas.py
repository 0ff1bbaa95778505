"""Pallas block attention (interpret mode) against the XLA reference and a numpy loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import _poison, pallas_block, reference
from tests.pallas_kernels.deviceless import twin_jit
from tests.pallas_kernels.np_ref import block_loop

B, T, H, D, BS = 2, 32, 2, 8, 16


def _qkv(dtype=jnp.float32, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  return tuple(jax.random.normal(k, (B, T, H, D), dtype) for k in ks)


def _rotary(per_head, seed=5):
  shape = (B, T, H, D // 2) if per_head else (1, T, D // 2)
  ang = jax.random.uniform(jax.random.key(seed), shape, maxval=6.0)
  return jnp.cos(ang), jnp.sin(ang)


def _kernel(q, k, v, **kw):
  return pallas_block.block_attention_pallas(q, k, v, block_size=BS, interpret=True, **kw)


CASES = {
    "softmax": dict(),
    "softmax_lengths_rotary_heads": dict(lengths=np.array([21, 0]), rotary=_rotary(True)),
    "silu_rotary_shared": dict(activation="silu", lengths=np.array([32, 9]),
                               rotary=_rotary(False)),
    "per_head": dict(activation=("fast_gelu", "relu2"), lengths=np.array([17, 30])),
    # scores ~ N(0, 1): a 0.5 clip clamps most of them (spec h-13)
    "per_head_score_clip": dict(activation=("gelu", "relu2"), lengths=np.array([32, 23]),
                                rotary=_rotary(True), score_clip=0.5),
}


@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_gradients(name):
  kw = CASES[name]
  q, k, v = _qkv()
  out = jax.jit(lambda q, k, v: _kernel(q, k, v, **kw))(q, k, v)
  ref = jax.jit(lambda q, k, v: reference.block_attention_reference(q, k, v, block_size=BS, **kw))(
      q, k, v)
  loop = block_loop(q, k, v, BS, **kw)
  np.testing.assert_allclose(out, loop, atol=2e-5, rtol=1e-5)
  np.testing.assert_allclose(ref, loop, atol=2e-5, rtol=1e-5)
  w = jnp.cos(jnp.arange(T * D, dtype=jnp.float32).reshape(T, 1, D))
  grad = lambda fn: jax.jit(jax.grad(
      lambda q, k, v: jnp.sum(fn(q, k, v, block_size=BS, **kw) * w), argnums=(0, 1, 2)))(q, k, v)
  got = grad(lambda *a, **kw: pallas_block.block_attention_pallas(*a, interpret=True, **kw))
  want = grad(reference.block_attention_reference)
  for name_, g, r in zip("qkv", got, want, strict=True):
    np.testing.assert_allclose(g, r, atol=5e-5, rtol=1e-4, err_msg=f"d{name_}")


def test_poison_nan_padding_and_dispatch():
  q, k, v = _qkv(seed=1)
  lengths = np.array([5, 27])
  clean = (q, k, v)
  qn, kn, vn = (x.at[0, 5:].set(jnp.nan).at[1, 27:].set(jnp.inf) for x in (q, k, v))
  with _poison.poison_outputs():  # every output starts NaN-filled: all of it must be written
    f = lambda q, k, v: _kernel(q, k, v, lengths=lengths)
    out, (dq, dk, dv) = jax.jit(lambda *a: (f(*a), jax.grad(
        lambda *a: jnp.sum(f(*a) ** 2), (0, 1, 2))(*a)))(qn, kn, vn)
  assert np.isfinite(np.asarray(out)).all()
  np.testing.assert_allclose(out, block_loop(*clean, BS, lengths=lengths), atol=2e-5)
  out2 = jax.jit(lambda q, k, v: pallas_kernels.block_attention(
      q, k, v, block_size=BS, lengths=lengths, backend="pallas", interpret=True))(qn, kn, vn)
  np.testing.assert_array_equal(out, out2)
  ref_grads = twin_jit(jax.grad(lambda q, k, v: jnp.sum(reference.block_attention_reference(
      q, k, v, block_size=BS, lengths=lengths) ** 2), (0, 1, 2)), q.dtype)(*clean)
  for g, r in zip((dq, dk, dv), ref_grads, strict=True):
    assert np.isfinite(np.asarray(g)).all() and np.all(np.asarray(g[0, 5:]) == 0)
    np.testing.assert_allclose(g, r, atol=5e-5, rtol=1e-4)


def test_bf16_forward():
  q, k, v = _qkv(jnp.bfloat16, seed=2)
  kw = dict(lengths=np.array([32, 20]), rotary=_rotary(False))
  out = jax.jit(lambda q, k, v: _kernel(q, k, v, **kw))(q, k, v)
  assert out.dtype == jnp.bfloat16
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  np.testing.assert_allclose(np.asarray(out, np.float32), block_loop(*f32, BS, **kw),
                             atol=4e-2, rtol=3e-2)


def test_bad_arguments_raise():
  q, k, v = _qkv()
  with pytest.raises(ValueError, match="power of two"):
    pallas_block.block_attention_pallas(q, k, v, block_size=12)
  with pytest.raises(ValueError, match="rotary"):
    _kernel(q, k, v, rotary=(jnp.ones((B, T, D)), jnp.ones((B, T, D))))
  with pytest.raises(ValueError, match="activation"):
    _kernel(q, k, v, activation="tanh")


def test_score_clip_changes_gdpa_only():
  """The clip is active for GDPA activations (reference differs from unclipped; the kernel
  matches the reference in the cases above) and ignored by softmax (bitwise equal)."""
  q, k, v = _qkv(seed=3)
  jit = lambda backend: jax.jit if backend == "pallas" else (lambda g: twin_jit(g, q.dtype))
  f = lambda backend, **kw: np.asarray(jit(backend)(lambda q, k, v: pallas_kernels.block_attention(
      q, k, v, block_size=BS, backend=backend, interpret=True, **kw))(q, k, v))
  assert np.abs(f("xla", activation="silu", score_clip=0.5)
                - f("xla", activation="silu")).max() > 0.05
  for backend in ("xla", "pallas"):
    np.testing.assert_array_equal(f(backend, score_clip=0.5), f(backend))


@pytest.mark.parametrize("activation", ["softmax", ("silu", "fast_gelu")])
def test_partial_last_block(activation):
  """T = 37 with 16-token blocks (the last block holds 5 tokens), two blocks per program, rotary
  and lengths: forward against the dense numpy loop, gradients against jax.grad of the XLA
  reference (which pads internally); every output written (poisoned), the kernel pads nothing."""
  t = 37
  ks = jax.random.split(jax.random.key(9), 4)
  q, k, v = (jax.random.normal(kk, (B, t, H, D)) for kk in ks[:3])
  ang = jax.random.uniform(ks[3], (1, t, D // 2), maxval=6.0)
  kw = dict(activation=activation, lengths=np.array([37, 35]), rotary=(jnp.cos(ang), jnp.sin(ang)))
  kern = lambda q, k, v: pallas_block.block_attention_pallas(
      q, k, v, block_size=BS, interpret=True, blocks_per_program=2, **kw)
  with _poison.poison_outputs():
    out = jax.jit(kern)(q, k, v)
    w = jnp.cos(jnp.arange(t * D, dtype=jnp.float32).reshape(t, 1, D))
    got = jax.jit(jax.grad(lambda q, k, v: jnp.sum(kern(q, k, v) * w), (0, 1, 2)))(q, k, v)
  np.testing.assert_allclose(out, block_loop(q, k, v, BS, **kw), atol=2e-5, rtol=1e-5)
  assert np.all(np.asarray(out[1, 35:]) == 0)
  want = twin_jit(jax.grad(lambda q, k, v: jnp.sum(reference.block_attention_reference(
      q, k, v, block_size=BS, **kw) * w), (0, 1, 2)), q.dtype)(q, k, v)
  for name, g, r in zip("qkv", got, want, strict=True):
    np.testing.assert_allclose(g, r, atol=5e-5, rtol=1e-4, err_msg=f"d{name}")
