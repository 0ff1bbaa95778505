"""Optimizer against numpy re-implementations of AdamW and row-wise Adagrad."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from kunlun.train import optim


def _cfg(**kw):
  c = ml_collections.ConfigDict(dict(lr=1e-2, warmup_steps=2, schedule="constant", weight_decay=0.1,
                                     b1=0.9, b2=0.999, clip_norm=1.0, emb_lr=0.05))
  c.update(kw)
  return c


def _params():
  return {"SparseEmbed_0": {"ad_embedding": jnp.ones((5, 3))},
          "Dense_0": {"kernel": jnp.full((2, 3), 0.5), "bias": jnp.zeros((3,))}}


def test_labels():
  labels = optim.param_labels(_params())
  assert labels["SparseEmbed_0"]["ad_embedding"] == "emb"
  assert labels["Dense_0"]["kernel"] == "dense" and labels["Dense_0"]["bias"] == "dense"


def test_schedule_warmup_then_cosine():
  s = optim.lr_schedule(_cfg(schedule="cosine", warmup_steps=10), 110)
  assert float(s(0)) == 0.0 and float(s(5)) == pytest.approx(5e-3)
  assert float(s(10)) == pytest.approx(1e-2) and float(s(110)) == pytest.approx(0.0, abs=1e-9)
  assert float(s(60)) == pytest.approx(1e-2 * 0.5 * (1 + np.cos(np.pi * 0.5)), rel=1e-5)
  with pytest.raises(ValueError, match="schedule"):
    optim.lr_schedule(_cfg(schedule="linear"), 10)


def test_updates_match_numpy():
  cfg = _cfg()
  tx = optim.make_optimizer(cfg, 100)
  params = _params()
  state = tx.init(params)
  rng = np.random.default_rng(0)
  # numpy references
  emb = np.ones((5, 3)); acc = np.zeros(5)
  ker = np.full((2, 3), 0.5); bias = np.zeros(3)
  m = [np.zeros((2, 3)), np.zeros(3)]; v = [np.zeros((2, 3)), np.zeros(3)]
  sched = lambda t: min(t, 2) / 2 * 1e-2  # constant after a 2-step linear warm-up
  for t in range(4):
    g_emb = rng.normal(size=(5, 3)); g_emb[[1, 3]] = 0.0  # rows 1 and 3 untouched
    g_k, g_b = rng.normal(size=(2, 3)) * 3, rng.normal(size=3) * 3
    grads = {"SparseEmbed_0": {"ad_embedding": jnp.asarray(g_emb, jnp.float32)},
             "Dense_0": {"kernel": jnp.asarray(g_k, jnp.float32), "bias": jnp.asarray(g_b, jnp.float32)}}
    upd, state = tx.update(grads, state, params)
    params = jax.tree.map(lambda p, u: p + u, params, upd)
    # row-wise adagrad
    acc += (g_emb ** 2).mean(1)
    emb = emb - 0.05 * g_emb / (np.sqrt(acc)[:, None] + 1e-8)
    # global-norm clipping over dense leaves, then AdamW (decay only on the kernel)
    norm = np.sqrt((g_k ** 2).sum() + (g_b ** 2).sum())
    scale = min(1.0, 1.0 / norm)
    lr = sched(t)
    new = []
    for i, (p, g, wd) in enumerate([(ker, g_k * scale, 0.1), (bias, g_b * scale, 0.0)]):
      m[i] = 0.9 * m[i] + 0.1 * g
      v[i] = 0.999 * v[i] + 0.001 * g ** 2
      mh, vh = m[i] / (1 - 0.9 ** (t + 1)), v[i] / (1 - 0.999 ** (t + 1))
      new.append(p - lr * (mh / (np.sqrt(vh) + 1e-8) + wd * p))
    ker, bias = new
  np.testing.assert_allclose(params["SparseEmbed_0"]["ad_embedding"], emb, rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(params["SparseEmbed_0"]["ad_embedding"])[[1, 3]], 1.0)
  np.testing.assert_allclose(params["Dense_0"]["kernel"], ker, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(params["Dense_0"]["bias"], bias, rtol=1e-5, atol=1e-7)
