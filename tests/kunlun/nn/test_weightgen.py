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


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pallas_matches_xla(dtype):
  """backend="pallas" (``pallas_kernels.weightgen`` in interpret mode) against the XLA backend:
  the same parameter tree, outputs and gradients of parameters and tokens (float32: 1e-5;
  bfloat16: 3e-2, the kernels compute the GELU in float32), with an all-zero example."""
  from kunlun.nn import weightgen
  from tests.kunlun.nn.backends import pallas_matches_xla
  rng = np.random.default_rng(3)
  x = rng.normal(size=(3, 16, 32)).astype(np.float32)
  x[1] = 0.0
  x = jnp.asarray(x, dtype)
  mods = {b: WeightGen(32, 2, 64, dtype=dtype, backend=b) for b in ("xla", "pallas")}
  assert weightgen.kernel("pallas", False, 16, 32, 32, 64)
  assert not weightgen.kernel("pallas", True, 16, 32, 32, 64)      # the key norm: XLA
  params = jax.jit(mods["xla"].init)(jax.random.key(1), x)
  p_pal = jax.jit(mods["pallas"].init)(jax.random.key(1), x)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(nn.meta.unbox(params)),
                          jax.tree.leaves(nn.meta.unbox(p_pal)), strict=True):
    np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
  assert jax.tree.structure(params) == jax.tree.structure(p_pal)
  g = jnp.asarray(rng.normal(size=(2, 3, 32, 2, 32)), jnp.float32)      # k's and v's
  pallas_matches_xla(mods, params, x, lambda m, v, x: jnp.stack(m.apply(v, x)), g, dtype,
                     bf16_tol=3e-2)
