"""Wukong layer against the explicit pairwise factorization-machine form in numpy."""

import flax.linen as nn
import jax
import numpy as np
import pytest

from kunlun.wukong import WukongLayer, WukongStack, split_tokens


def ln(x, scale, bias):
  mu = x.mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-6) * scale + bias


def gelu_tanh(x):
  return 0.5 * x * (1.0 + np.tanh(0.7978845608 * (x + 0.044715 * x ** 3)))


def np_wukong_layer(p, x, n_fm):
  """FM block from the explicit pairwise inner products <x_i, x_j> (an [N, N] matrix)."""
  B, N, d = x.shape
  out = []
  for b in range(B):
    inter = np.array([[x[b, i] @ x[b, j] for j in range(N)] for i in range(N)])   # X X^T
    fm = (inter @ p["fm_y"]).reshape(-1)                                             # [N * r]
    h = ln(fm, p["fm_norm"]["scale"], p["fm_norm"]["bias"])
    h = gelu_tanh(h @ p["fm_mlp_in"]["kernel"] + p["fm_mlp_in"]["bias"])
    fmb = (h @ p["fm_mlp_out"]["kernel"] + p["fm_mlp_out"]["bias"]).reshape(n_fm, d)
    parts = [fmb]
    if "lcb" in p:
      parts.append(p["lcb"].T @ x[b])
    res = x[b] if "res_proj" not in p else p["res_proj"].T @ x[b]
    out.append(ln(np.concatenate(parts, 0) + res, p["out_norm"]["scale"], p["out_norm"]["bias"]))
  return np.stack(out)


def _perturb(v, seed):
  """Random norm affines / biases so the test exercises them."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda a: np.asarray(a) + 0.1 * rng.normal(size=a.shape).astype(np.float32),
                      nn.meta.unbox(v)["params"])


@pytest.mark.parametrize("n_fm,n_lcb", [(3, 2), (2, 4), (6, 0)])
def test_wukong_layer_matches_pairwise(n_fm, n_lcb):
  B, N, d = 2, 5, 6            # N == n_fm + n_lcb for (3, 2): identity residual
  x = np.random.default_rng(0).normal(size=(B, N, d)).astype(np.float32)
  m = WukongLayer(n_fm, n_lcb, rank=3, mlp_hidden=7)
  p = _perturb(jax.jit(m.init)(jax.random.key(0), x), 1)
  y = np.asarray(jax.jit(m.apply)({"params": p}, x))
  assert y.shape == (B, n_fm + n_lcb, d)
  assert ("res_proj" in p) == (N != n_fm + n_lcb)
  np.testing.assert_allclose(y, np_wukong_layer(p, x, n_fm), rtol=1e-4, atol=1e-4)


def test_wukong_stack_and_errors():
  x = np.random.default_rng(0).normal(size=(2, 5, 4)).astype(np.float32)
  m = WukongStack(num_layers=2, n_out=3, rank=2, mlp_hidden=8)
  v = jax.jit(m.init)(jax.random.key(0), x)
  p = nn.meta.unbox(v)["params"]
  assert sorted(p) == ["layer_0", "layer_1"]
  h = x
  for i in range(2):
    h = np_wukong_layer(jax.tree.map(np.asarray, p[f"layer_{i}"]), h, 2)
  np.testing.assert_allclose(np.asarray(jax.jit(m.apply)(v, x)), h, rtol=1e-4, atol=1e-4)
  assert split_tokens(1) == (1, 0) and split_tokens(5) == (2, 3)
  with pytest.raises(ValueError, match="n_out"):
    split_tokens(0)
  with pytest.raises(ValueError, match="num_layers"):
    WukongStack(0, 3, 2, 8).init(jax.random.key(0), x)
