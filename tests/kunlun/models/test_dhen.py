"""DHEN (``kunlun/models/dhen.py``), InterFormer's interaction layer, against numpy."""

import flax.linen as nn
import jax
import numpy as np

from kunlun.models.dhen import DHENLayer

KEY = jax.random.key(0, impl="unsafe_rbg")
RNG = np.random.default_rng(0)
B = 3


def np_ln(x, scale, bias):
  mu = x.mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-6) * scale + bias


def np_gelu(x):
  return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def test_dhen_layer_matches_numpy():
  N, dd, n_out, r, hid = 5, 4, 3, 2, 6
  z = RNG.normal(size=(B, N, dd)).astype(np.float32)
  module = DHENLayer(n_out, r, hid)
  params = nn.meta.unbox(jax.jit(module.init)(KEY, z))
  params = jax.tree.map(lambda p: p + 0.1 * RNG.normal(size=p.shape).astype(np.float32), params)
  got = np.asarray(jax.jit(module.apply)(params, z))
  p = jax.tree.map(np.asarray, params["params"])
  i, j = np.triu_indices(N)
  gram = np.einsum("bnd,bmd->bnm", z, z) / np.sqrt(dd)
  dot = (gram[:, i, j] @ p["dot"]).reshape(B, n_out, dd)
  x0 = z.reshape(B, -1)
  cross = x0 * ((x0 @ p["dcn_u"]) @ p["dcn_v"] + p["dcn_b"]) + x0
  dcn = np.einsum("bnd,nm->bmd", cross.reshape(B, N, dd), p["dcn_tokens"])
  res = np.einsum("bnd,nm->bmd", z, p["res_proj"])
  y = np_ln(dot + dcn + res, p["norm"]["scale"], p["norm"]["bias"])
  hdn = np_gelu(y @ p["mlp_in"]["kernel"] + p["mlp_in"]["bias"])
  want = np_ln(y + hdn @ p["mlp_out"]["kernel"] + p["mlp_out"]["bias"], p["out_norm"]["scale"],
               p["out_norm"]["bias"])
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
