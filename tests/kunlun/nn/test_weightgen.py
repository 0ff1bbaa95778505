"""WeightGen against a numpy re-computation from its parameters."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kunlun.nn.weightgen import WeightGen


def rms(x):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6)


def gelu_tanh(x):
  return 0.5 * x * (1.0 + np.tanh(0.7978845608 * (x + 0.044715 * x ** 3)))


@pytest.mark.parametrize("key_norm", [False, True])
def test_weightgen_matches_numpy(key_norm):
  B, N, d_ns, n_kv, H, d = 2, 5, 12, 6, 2, 8
  x = np.random.default_rng(0).normal(size=(B, N, d_ns)).astype(np.float32)
  m = WeightGen(n_kv, H, d, key_norm=key_norm)
  v = jax.jit(m.init)(jax.random.key(0), jnp.array(x))
  p = jax.tree.map(np.asarray, nn.meta.unbox(v)["params"])
  k_out, v_out = jax.jit(m.apply)(v, jnp.array(x))
  z = np.einsum("bnd,nm->bmd", rms(x), p["tok"])
  h = gelu_tanh(z @ p["hidden"]["kernel"] + p["hidden"]["bias"])
  kk = np.einsum("bme,ehc->bmhc", h, p["key"])
  vv = np.einsum("bme,ehc->bmhc", h, p["value"])
  if key_norm:
    kk = rms(kk)
  assert k_out.shape == (B, n_kv, H, d // H) and v_out.shape == k_out.shape
  np.testing.assert_allclose(np.asarray(k_out), kk, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(np.asarray(v_out), vv, rtol=1e-4, atol=1e-5)


def test_weightgen_axes_and_errors():
  x = jnp.ones((2, 4, 8))
  v = jax.jit(WeightGen(3, 2, 8).init)(jax.random.key(0), x)
  assert v["params"]["tok"].names == ("tokens", "kv")
  assert v["params"]["key"].names == ("mlp", "heads", "head_dim")
  with pytest.raises(ValueError, match="does not divide"):
    WeightGen(3, 3, 8).init(jax.random.key(0), x)
