"""Heads: the example's own surface is selected; per-(surface, task) towers and MMoE vs numpy."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kunlun.nn.heads import Heads


def gelu(x):
  return np.asarray(jax.nn.gelu(jnp.asarray(x)))


def np_heads(p, z, surface, kind):
  h = z
  top = p["top_mlp"]
  i = 0
  while f"dense_{i}" in top:
    h = gelu(h @ np.asarray(top[f"dense_{i}"]["kernel"]) + np.asarray(top[f"dense_{i}"]["bias"]))
    i += 1
  B = z.shape[0]
  S, K = p["tower_b2"].shape
  out = np.zeros((B, K))
  for b in range(B):
    s = surface[b]
    for k in range(K):
      if kind == "towers":
        x = h[b]
      else:
        ex = gelu(np.einsum("d,edh->eh", h[b], p["expert_w"]) + p["expert_b"])
        g = h[b] @ p["gate_w"][s, k]
        g = np.exp(g - g.max())
        g /= g.sum()
        x = g @ ex
      t = gelu(x @ p["tower_w1"][s, k] + p["tower_b1"][s, k])
      out[b, k] = t @ p["tower_w2"][s, k] + p["tower_b2"][s, k]
  return out, h


@pytest.mark.parametrize("kind", ["towers", "mmoe"])
def test_heads_select_surface(kind):
  rng = np.random.default_rng(0)
  B, D, S, K = 7, 12, 3, 2
  z = rng.normal(size=(B, D)).astype(np.float32)
  surface = np.array([0, 1, 2, 2, 1, 0, 2], np.int32)
  heads = Heads(S, K, kind, top_mlp=(16, 8), tower_hidden=6, num_experts=3, expert_hidden=5)
  # parameters perturbed inside the same compiled init (non-zero biases, so a wrong
  # (surface, task) index cannot pass by accident)
  def init(k, z, s):
    params = nn.meta.unbox(heads.init(k, z, s))["params"]
    leaves, tdef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.fold_in(k, 1), len(leaves))
    params = tdef.unflatten([x + 0.1 * jax.random.normal(kk, x.shape)
                             for x, kk in zip(leaves, keys, strict=True)])
    return params, heads.apply({"params": params}, z, s)
  params, (logits, shared) = jax.jit(init)(jax.random.key(1, impl="unsafe_rbg"), z, surface)
  p = jax.tree.map(np.asarray, params)
  ref, ref_h = np_heads(p, z.astype(np.float64), surface, kind)
  np.testing.assert_allclose(np.asarray(logits), ref, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(np.asarray(shared), ref_h, rtol=1e-4, atol=1e-4)
  # an example's gradient reaches only its own surface's towers
  g = jax.jit(jax.grad(lambda pp: heads.apply({"params": pp}, z[:1], surface[:1])[0].sum()))(params)
  w1 = np.asarray(g["tower_w1"])
  assert np.abs(w1[0]).sum() > 0 and np.abs(w1[1:]).sum() == 0
