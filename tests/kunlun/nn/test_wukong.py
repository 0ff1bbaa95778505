"""Wukong layer against the explicit pairwise factorization-machine form in numpy."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kunlun.nn.wukong import WukongLayer, WukongStack, split_tokens


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


def np_softmax(c):
  e = np.exp(c - c.max())
  return e / e.sum()


def np_cross_stack(p, x, num_layers, n_fm):
  """Explicit loop (spec h-19): layer l >= 1 reads ``X_l + sum_j softmax(c_l)_j X~_j``, j <= l."""
  x0 = x if "cross_proj" not in p else np.stack([p["cross_proj"].T @ xb for xb in x])
  outs, h = [x0], x
  for l in range(num_layers):
    if l > 0:
      a = np_softmax(p[f"cross_logits_{l}"])
      mix = np.zeros_like(outs[-1])
      for j in range(l + 1):
        mix = mix + a[j] * outs[j]
      h = h + mix
    h = np_wukong_layer(p[f"layer_{l}"], h, n_fm)
    outs.append(h)
  return h


def _random_logits(p, seed):
  """Non-uniform connection weights (init is all-zero logits = plain average)."""
  rng = np.random.default_rng(seed)
  return {k: (rng.normal(size=a.shape).astype(np.float32) if k.startswith("cross_logits") else a)
          for k, a in p.items()}


@pytest.mark.parametrize("num_layers,N", [(2, 5), (3, 4)])
def test_cross_layer_stack_matches_loop(num_layers, N):
  B, d, n_out = 2, 6, 4
  x = np.random.default_rng(0).normal(size=(B, N, d)).astype(np.float32)
  m = WukongStack(num_layers, n_out, rank=2, mlp_hidden=8, cross_layer=True)
  v = jax.jit(m.init)(jax.random.key(0), x)
  p0 = nn.meta.unbox(v)["params"]
  assert ("cross_proj" in p0) == (N != n_out)
  assert "cross_logits_0" not in p0
  for l in range(1, num_layers):                      # zero logits: a plain average at init
    np.testing.assert_array_equal(p0[f"cross_logits_{l}"], np.zeros(l + 1, np.float32))
  p = _random_logits(_perturb(v, 1), 2)

  @jax.jit
  def fwd_and_grads(p, x):
    y, vjp = jax.vjp(lambda p, x: m.apply({"params": p}, x), p, x)
    return y, vjp(y ** 2)                                   # grads of sum(y^3) / 3

  y, (g, gx) = fwd_and_grads(p, x)
  y = np.asarray(y)
  np.testing.assert_allclose(y, np_cross_stack(p, x, num_layers, 2), rtol=1e-4, atol=1e-4)
  cross = [k for k in g if k.startswith("cross")]
  assert len(cross) == num_layers - 1 + (N != n_out)
  assert all(np.abs(g[k]).max() > 0 for k in cross), cross
  assert all(np.all(np.isfinite(a)) for a in jax.tree.leaves(g)) and np.all(np.isfinite(gx))
  y_plain = x
  for l in range(num_layers):
    y_plain = np_wukong_layer(p[f"layer_{l}"], y_plain, 2)
  assert np.abs(y - y_plain).max() > 1e-2                     # the connections do something


def test_cross_layer_off_or_single_layer_is_plain():
  x = np.random.default_rng(0).normal(size=(2, 5, 4)).astype(np.float32)
  pairs = [(WukongStack(n, 3, 2, 8, cross_layer=c), WukongStack(n, 3, 2, 8))
           for n, c in ((2, False), (1, True))]
  run = jax.jit(lambda k, x: [(m.init_with_output(k, x), r.init_with_output(k, x))
                              for m, r in pairs])
  for (y, v), (y_ref, v_ref) in run(jax.random.key(0), x):
    assert jax.tree.structure(v) == jax.tree.structure(v_ref)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_ref))



def test_cross_layer_stack_gradient_against_numpy_differences():
  """The stack's gradient (hand-written norm VJPs, one token-mixing matmul) against central
  differences of the numpy float64 loop along a random parameter direction and a random input
  direction: d/de sum(w * f(p + e v, x + e u)) at e = 0."""
  B, N, d, n_out = 2, 5, 6, 4
  rng = np.random.default_rng(4)
  x = rng.normal(size=(B, N, d)).astype(np.float32)
  m = WukongStack(2, n_out, rank=2, mlp_hidden=8, cross_layer=True)
  p = _random_logits(_perturb(jax.jit(m.init)(jax.random.key(0), x), 1), 2)
  w = rng.normal(size=(B, n_out, d))
  v = jax.tree.map(lambda a: rng.normal(size=a.shape), p)
  u = rng.normal(size=x.shape)
  gp, gx = jax.jit(jax.grad(lambda p, x: jnp.sum(m.apply({"params": p}, x) * w),
                            argnums=(0, 1)))(p, x)
  slope = (sum(float(np.sum(np.asarray(a) * b)) for a, b in
               zip(jax.tree.leaves(gp), jax.tree.leaves(v), strict=True))
           + float(np.sum(np.asarray(gx) * u)))
  f64 = lambda e: np.sum(w * np_cross_stack(
      jax.tree.map(lambda a, b: np.asarray(a, np.float64) + e * b, p, v),
      x.astype(np.float64) + e * u, 2, 2))
  eps = 1e-4
  np.testing.assert_allclose(slope, (f64(eps) - f64(-eps)) / (2 * eps), rtol=1e-4)
