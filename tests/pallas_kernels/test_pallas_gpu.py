"""Pallas kernels compiled for the GPU (Triton lowering, hardware tanh for bf16): numerics
against the XLA reference at moderate shapes. Marked gpu (skipped without a CUDA GPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import pallas_block, pallas_gdpa, reference


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 1e-2)])
def test_pallas_gdpa_sharing_gqa_on_gpu(dtype, tol):
  ks = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(ks[0], (2, 300, 4, 64), dtype)
  k = jax.random.normal(ks[1], (3, 200, 2, 64), dtype)
  v = jax.random.normal(ks[2], (3, 200, 2, 64), dtype)
  kw = dict(activation=("fast_gelu", "silu", "gelu", "hardswish"), q_index=np.array([1, 0, 1, 0]),
            kv_index=np.array([0, 2, 1, 2]), q_lengths=np.array([300, 123]),
            kv_lengths=np.array([200, 7, 150]), window=64, score_clip=8.0)
  out = pallas_gdpa.gdpa_pallas(q, k, v, **kw)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  assert _rel(out, reference.gdpa_reference(*f32, **kw)) < tol
  loss = lambda fn: (lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v, **kw).astype(jnp.float32))))
  got = jax.grad(loss(pallas_gdpa.gdpa_pallas), (0, 1, 2))(q, k, v)
  want = jax.grad(loss(reference.gdpa_reference), (0, 1, 2))(*f32)
  for g, r in zip(got, want, strict=True):
    assert _rel(g, r) < 3 * tol


@pytest.mark.gpu
def test_pallas_block_partial_block_on_gpu():
  ks = jax.random.split(jax.random.key(1), 3)
  q, k, v = (jax.random.normal(kk, (2, 1000, 4, 64), jnp.bfloat16) for kk in ks)
  for act in ("softmax", "silu"):
    kw = dict(block_size=64, activation=act, lengths=np.array([1000, 517]))
    out = pallas_block.block_attention_pallas(q, k, v, **kw)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    assert _rel(out, reference.block_attention_reference(*f32, **kw)) < 1e-2, act


def _softmax_case(seed, dtype, B=2, T=300, H=4, D=64):
  ks = jax.random.split(jax.random.key(seed), 3)
  return tuple(jax.random.normal(kk, (B, T, H, D), dtype) for kk in ks)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["pallas", "cudnn"])
@pytest.mark.parametrize("window", [64, None])
def test_softmax_attention_on_gpu(backend, window):
  """Pallas kernel and cuDNN (LSE merge of two left-window calls; full: padding lengths) in
  bf16 against the fp32 XLA reference, output and gradients, ragged lengths."""
  from pallas_kernels import api
  q, k, v = _softmax_case(2, jnp.bfloat16)
  kw = dict(window=window, q_lengths=np.array([300, 123], np.int32),
            kv_lengths=np.array([300, 123], np.int32))
  fn = lambda q, k, v: api.softmax_attention(q, k, v, backend=backend, **kw)
  ref = lambda q, k, v: reference.softmax_attention_reference(q, k, v, **kw)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  assert _rel(jax.jit(fn)(q, k, v), ref(*f32)) < 1e-2
  loss = lambda f: (lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v).astype(jnp.float32))))
  got = jax.jit(jax.grad(loss(fn), (0, 1, 2)))(q, k, v)
  want = jax.grad(loss(ref), (0, 1, 2))(*f32)
  for name, g, r in zip("qkv", got, want, strict=True):
    assert _rel(g, r) < 3e-2, name


@pytest.mark.gpu
def test_row_scaled_wgrad_on_gpu():
  """``pallas_kernels.wgrad`` compiled (Triton, several splits) at mid's HSP shape against float64
  numpy of the bfloat16-rounded ``h = r x``: only the float32 summation order differs."""
  from pallas_kernels import wgrad
  rng = np.random.default_rng(0)
  N, d, C = 37888, 256, 256
  x = jnp.asarray(rng.normal(size=(N, d)), jnp.bfloat16)
  r = jnp.asarray(rng.uniform(0.5, 2.0, size=(N,)), jnp.float32)
  gs = [jnp.asarray(rng.normal(size=(N, C)), jnp.bfloat16) for _ in range(2)]
  outs = jax.jit(lambda x, r, gs: wgrad.row_scaled_wgrad_pallas(x, r, gs))(x, r, gs)
  h = np.asarray((x.astype(jnp.float32) * r[:, None]).astype(jnp.bfloat16), np.float64)
  for o, g in zip(outs, gs, strict=True):
    assert _rel(o, h.T @ np.asarray(g, np.float64)) < 1e-5
