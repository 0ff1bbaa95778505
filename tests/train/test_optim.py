"""Optimizer against numpy re-implementations of AdamW and row-wise Adagrad."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from kunlun.train import optim
from sharding.embedding import group_ids


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


def _sparse_params():
  rng = np.random.default_rng(1)
  return {"SparseEmbed_0": {"ad_embedding": jnp.asarray(rng.normal(size=(16, 3)), jnp.float32),
                            "small_embedding": jnp.asarray(rng.normal(size=(3, 3)), jnp.float32)},
          "Pos_0": {"pos_embedding": jnp.ones((4, 3))},          # "emb" but not looked up
          "Dense_0": {"kernel": jnp.full((2, 3), 0.5), "bias": jnp.zeros((3,))}}


def _np_rowwise(table, acc, g_table, touched, lr=0.05):
  acc[touched] += (g_table[touched].astype(np.float64) ** 2).mean(1)
  table[touched] -= lr * g_table[touched] / (np.sqrt(acc[touched])[:, None] + 1e-8)


def _scatter(ids, g_rows, rows):
  g = np.zeros((rows, g_rows.shape[-1]), np.float32)
  for i, gi in zip(ids.ravel(), g_rows.reshape(-1, g_rows.shape[-1]), strict=False):
    if i >= 0:
      g[i] += gi
  return g


@pytest.mark.parametrize("jit, grouped", [(True, False), (False, False), (True, True)])
def test_sparse_update_matches_dense_optimizer_and_numpy(jit, grouped):
  """Row gradients + ids drive the same update as the dense table gradient (numpy scatter-add):
  a 16-row table (> ids: the sparse path) and a 3-row one (<= ids: the scatter path), or both in
  one table group (group ids into their concatenation); the optimizer-state layout is
  make_optimizer's; rows never looked up stay bitwise unchanged."""
  cfg = _cfg()
  tx, sparse = optim.make_optimizer(cfg, 100), optim.make_sparse_update(cfg, 100)
  sparse = jax.jit(sparse) if jit else sparse
  params = _sparse_params()
  p_dense, s_dense = params, tx.init(params)
  p_sparse, s_sparse = params, tx.init(params)
  ref = {n: [np.asarray(params["SparseEmbed_0"][n], np.float64), np.zeros(len(params["SparseEmbed_0"][n]))]
         for n in ("ad_embedding", "small_embedding")}
  rng = np.random.default_rng(0)
  key = lambda n: f"['SparseEmbed_0']['{n}']"
  pkey = "['Pos_0']['pos_embedding']"
  for _ in range(3):
    ids = {"ad_embedding": rng.integers(-1, 12, (5, 2)).astype(np.int32),   # rows 12.. never read
           "small_embedding": rng.integers(-1, 2, (5, 2)).astype(np.int32)}  # row 2 never read
    ids["ad_embedding"][0] = [2, 2]                                      # a repeated id
    g_rows = {n: rng.normal(size=(5, 2, 3)).astype(np.float32) for n in ids}
    g_table = {n: _scatter(ids[n], g_rows[n], len(ref[n][0])) for n in ids}
    g_other = {"['Dense_0']['kernel']": rng.normal(size=(2, 3)), "['Dense_0']['bias']": rng.normal(size=3),
               pkey: rng.normal(size=(4, 3))}
    g_other = {k: jnp.asarray(v, jnp.float32) for k, v in g_other.items()}
    grads = {"SparseEmbed_0": {n: jnp.asarray(g) for n, g in g_table.items()},
             "Pos_0": {"pos_embedding": g_other[pkey]},
             "Dense_0": {"kernel": g_other["['Dense_0']['kernel']"], "bias": g_other["['Dense_0']['bias']"]}}
    upd, s_dense = tx.update(grads, s_dense, p_dense)
    p_dense = jax.tree.map(lambda p, u: p + u, p_dense, upd)
    if grouped:
      names = ("ad_embedding", "small_embedding")
      gids = group_ids([ids[n] for n in names], [16, 3])
      g = jnp.concatenate([jnp.asarray(g_rows[n]) for n in names], axis=1)
      rows = {"+".join(key(n) for n in names): (gids, g)}
    else:
      rows = {key(n): (ids[n], g_rows[n]) for n in ids}
    p_sparse, s_sparse, sq = sparse(p_sparse, s_sparse, g_other, rows, jnp.asarray(True))
    want_sq = sum(float(np.sum(g.astype(np.float64) ** 2)) for g in g_table.values())
    np.testing.assert_allclose(float(sq), want_sq, rtol=1e-5)
    for n in ids:
      _np_rowwise(*ref[n], g_table[n], np.unique(ids[n][ids[n] >= 0]))
  assert jax.tree.structure(s_sparse) == jax.tree.structure(s_dense)
  for a, b in zip(jax.tree.leaves(p_sparse) + jax.tree.leaves(s_sparse),
                  jax.tree.leaves(p_dense) + jax.tree.leaves(s_dense), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
  acc_tree = s_sparse.inner_states["emb"].inner_state.acc
  for n, untouched in (("ad_embedding", slice(12, None)), ("small_embedding", slice(2, None))):
    table = np.asarray(p_sparse["SparseEmbed_0"][n])
    np.testing.assert_allclose(table, ref[n][0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(acc_tree["SparseEmbed_0"][n]), ref[n][1], rtol=1e-5)
    np.testing.assert_array_equal(table[untouched], np.asarray(params["SparseEmbed_0"][n])[untouched])

  # ok = False: every parameter and state leaf bitwise unchanged
  p2, s2, _ = sparse(p_sparse, s_sparse, g_other, rows, jnp.asarray(False))
  for a, b in zip(jax.tree.leaves((p2, s2)), jax.tree.leaves((p_sparse, s_sparse)), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(ValueError, match="no gradient"):
    optim.make_sparse_update(cfg, 100)(p_sparse, s_sparse, {}, rows, jnp.asarray(True))
