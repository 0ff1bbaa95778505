"""Optimizer against numpy re-implementations of AdamW and row-wise Adagrad."""

import grain
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from kunlun.train import opt_layout, optim
from kunlun.train.sparse_update import make_sparse_update
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
  s = jax.jit(optim.lr_schedule(_cfg(schedule="cosine", warmup_steps=10), 110))
  assert float(s(0)) == 0.0 and float(s(5)) == pytest.approx(5e-3)
  assert float(s(10)) == pytest.approx(1e-2) and float(s(110)) == pytest.approx(0.0, abs=1e-9)
  assert float(s(60)) == pytest.approx(1e-2 * 0.5 * (1 + np.cos(np.pi * 0.5)), rel=1e-5)
  with pytest.raises(ValueError, match="schedule"):
    optim.lr_schedule(_cfg(schedule="linear"), 10)


def _apply(tx):
  """``tx``'s update added to the params, jitted (one compile, not one per operation)."""
  def step(grads, state, params):
    upd, state = tx.update(grads, state, params)
    return jax.tree.map(lambda p, u: p + u, params, upd), state
  return jax.jit(step)


def test_updates_match_numpy():
  cfg = _cfg()
  tx = optim.make_optimizer(cfg, 100)
  params = _params()
  state = jax.jit(tx.init)(params)
  step = _apply(tx)
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
    params, state = step(grads, state, params)
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


@pytest.mark.parametrize("jit, grouped, backend", [(True, False, "xla"), (False, False, "xla"),
                                                    (True, True, "xla"), (True, False, "pallas"),
                                                    (True, True, "pallas")])
def test_sparse_update_matches_dense_optimizer_and_numpy(jit, grouped, backend):
  """Row gradients + ids drive the same update as the dense table gradient (numpy scatter-add):
  a 16-row table (> ids: the sparse path) and a 3-row one (<= ids: the scatter path), or both in
  one table group (group ids into their concatenation); the optimizer-state layout is
  make_optimizer's; rows never looked up stay bitwise unchanged. ``backend="pallas"``: both
  optimizers on their kernels (interpret mode), the tables updated inside the skip-cond (the
  scatter path's and the one that is not looked up) on ``pallas_kernels.adagrad``."""
  cfg = _cfg()
  tx, sparse = (optim.make_optimizer(cfg, 100, backend=backend),
                make_sparse_update(cfg, 100, backend=backend))
  sparse = jax.jit(sparse) if jit else sparse
  params = _sparse_params()
  init, dense_step = jax.jit(tx.init), _apply(tx)
  p_dense, s_dense = params, init(params)
  p_sparse, s_sparse = params, init(params)
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
    p_dense, s_dense = dense_step(grads, s_dense, p_dense)
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
    make_sparse_update(cfg, 100, backend=backend)(p_sparse, s_sparse, {}, rows, jnp.asarray(True))


# ---- the flat (multi-tensor) AdamW ------------------------------------------------------------

import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from kunlun.train import checkpoint, flat  # noqa: E402


def _mixed_params(seed=0):
  """Leaves of 0 to 3 dimensions (decayed: ndim >= 2) and two embedding tables."""
  rng = np.random.default_rng(seed)
  a = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  return {"blk": {"kernel": a(8, 4), "bias": a(4), "w3": a(2, 4, 8), "scale": a()},
          "out": {"kernel": a(4, 8), "bias": a(8)},
          "SparseEmbed_0": {"ad_embedding": a(16, 4), "u_embedding": a(8, 2)}}


def _optax_reference(cfg, total):
  """Plain optax, leaf by leaf: clip + AdamW (decay on ndim >= 2) on dense leaves; the row-wise
  Adagrad in numpy."""
  sched = optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps),
                                optax.constant_schedule(cfg.lr)], [cfg.warmup_steps])
  return optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                     optax.adamw(sched, b1=cfg.b1, b2=cfg.b2, eps=1e-8,
                                 weight_decay=cfg.weight_decay,
                                 mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)))


def test_flat_adamw_matches_optax_leafwise():
  """Five steps (clipping on in some, off in others): params, moments and accumulators equal
  plain optax / numpy leaf by leaf. Only the global norm is a reassociated sum: rtol 2e-6."""
  cfg = _cfg(clip_norm=3.0)
  tx = optim.make_optimizer(cfg, 100)
  ref_tx = _optax_reference(cfg, 100)
  params = _mixed_params()
  dense = lambda t: {k: v for k, v in t.items() if k != "SparseEmbed_0"}
  state, ref_p = jax.jit(tx.init)(params), dense(params)
  ref_s = jax.jit(ref_tx.init)(ref_p)
  emb = {n: [np.asarray(v, np.float64), np.zeros(v.shape[0])]
         for n, v in params["SparseEmbed_0"].items()}
  rng = np.random.default_rng(1)
  update, ref_update = jax.jit(tx.update), jax.jit(ref_tx.update)
  apply = jax.jit(optax.apply_updates)
  for t in range(5):
    scale = 5.0 if t % 2 else 0.01                       # clipped / not clipped
    grads = jax.tree.map(lambda x, s=scale: jnp.asarray(rng.normal(size=x.shape) * s, jnp.float32),
                         params)
    upd, state = update(grads, state, params)
    params = apply(params, upd)
    u, ref_s = ref_update(dense(grads), ref_s, ref_p)
    ref_p = apply(ref_p, u)
    for n, (tab, acc) in emb.items():
      g = np.asarray(grads["SparseEmbed_0"][n], np.float64)
      acc += (g ** 2).mean(1)
      tab -= 0.05 * g / (np.sqrt(acc)[:, None] + 1e-8)
  for a, b in zip(jax.tree.leaves(dense(params)), jax.tree.leaves(ref_p), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=1e-7)
  per_leaf = opt_layout.to_per_leaf(state, params)
  adam = per_leaf.inner_states["dense"].inner_state[1][0]
  assert int(adam.count) == int(ref_s[1][0].count) == 5
  for a, b in zip(jax.tree.leaves(adam.mu) + jax.tree.leaves(adam.nu),
                  jax.tree.leaves(ref_s[1][0].mu) + jax.tree.leaves(ref_s[1][0].nu), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=1e-9)
  acc = state.inner_states["emb"].inner_state.acc["SparseEmbed_0"]
  for n, (tab, a) in emb.items():
    np.testing.assert_allclose(np.asarray(params["SparseEmbed_0"][n]), tab, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(acc[n]), a, rtol=1e-5)
  # the step's norms: squared sums of the dense and the "emb" gradients, once
  prep = jax.jit(tx.prepare)(grads, params)
  want = lambda ks: sum(float(np.sum(np.asarray(v, np.float64) ** 2)) for k, v in
                        jax.tree_util.tree_leaves_with_path(grads)
                        if ("embedding" in jax.tree_util.keystr(k)) == ks)
  np.testing.assert_allclose([float(prep.dense_sq), float(prep.emb_sq)], [want(False), want(True)],
                             rtol=1e-5)


def _mesh(shape, names):
  return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


SPECS = {"blk": {"kernel": P("fsdp", "tensor"), "bias": P("tensor"), "w3": P(None, "fsdp"),
                 "scale": P()},
         "out": {"kernel": P(None, ("fsdp", "tensor")), "bias": P()},
         "SparseEmbed_0": {"ad_embedding": P(("fsdp", "tensor"), None), "u_embedding": P()}}


def test_flat_layout_keeps_shards_local_and_matches_one_device():
  """fsdp=4 x tensor=2: the flat buffers hold each device's own shards (grouped by the mesh axes
  that shard a leaf), the update moves no parameter data between devices (only scalar norm
  all-reduces) and equals the single-device update (norm sums reassociated: rtol 2e-6)."""
  mesh = _mesh((4, 2), ("fsdp", "tensor"))
  params0 = _mixed_params(3)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), SPECS,
                           is_leaf=lambda x: isinstance(x, P))
  params = jax.device_put(params0, shardings)
  cfg = _cfg()
  tx = optim.make_optimizer(cfg, 100)
  o_sh = optim.opt_state_shardings(tx, checkpoint.abstract_like(params), shardings, mesh)
  state = jax.jit(tx.init, out_shardings=o_sh)(params)
  layout, _ = tx.layout(params)
  groups = {g.axes: g for g in layout.groups}
  # fsdp x tensor (kernel [8, 4] on both dims; out kernel [4, 8] on dim 1), tensor (bias),
  # fsdp (w3 dim 1), unsharded (scale, bias)
  assert set(groups) == {(("fsdp",), ("tensor",)), (("fsdp", "tensor"),), (("tensor",),),
                         (("fsdp",),), ()}
  both = groups[(("fsdp",), ("tensor",))]
  assert both.shape == (4, 2, 4) and [m.shape for m in both.members] == [(8, 4)]
  mu = state.inner_states["dense"].inner_state.mu[layout.groups.index(both)]
  assert mu.sharding.shard_shape(mu.shape) == (1, 1, 4)
  grad_of = jax.jit(lambda p: jax.tree.map(lambda x: x * 0.7 + 0.1, p))
  grads = grad_of(params)
  update = jax.jit(lambda g, s, p: tx.update(g, s, p), out_shardings=(shardings, o_sh))
  hlo = update.lower(grads, state, params).compile().as_text()
  assert not any(op in hlo for op in ("all-gather", "all-to-all", "collective-permute")), hlo
  for line in hlo.splitlines():
    if "all-reduce(" in line:
      assert " f32[] all-reduce(" in line or "(f32[], f32[]" in line, line
  upd, state = update(grads, state, params)
  # single device, no shardings
  tx1 = optim.make_optimizer(cfg, 100)
  p1 = jax.tree.map(jnp.asarray, params0)
  u1, _ = jax.jit(tx1.update)(grad_of(p1), jax.jit(tx1.init)(p1), p1)
  for a, b, s in zip(jax.tree.leaves(upd), jax.tree.leaves(u1), jax.tree.leaves(shardings),
                     strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=1e-9)
    assert a.sharding.is_equivalent_to(s, a.ndim)
  with pytest.raises(ValueError, match="bind"):
    tx.bind(jax.tree.map(lambda x: NamedSharding(mesh, P()), shardings))


def test_pack_unpack_round_trip_of_local_blocks():
  """``flat.Layout``: pack then unpack gives every leaf back bitwise, for any sharded dims."""
  mesh = _mesh((4, 2), ("fsdp", "tensor"))
  params = _mixed_params(5)
  sh = jax.tree.leaves(jax.tree.map(lambda s: NamedSharding(mesh, s), SPECS,
                                    is_leaf=lambda x: isinstance(x, P)))
  leaves = jax.tree.leaves(params)
  layout = flat.Layout.build([(x.shape, x.dtype) for x in leaves], sh)
  bufs = jax.jit(layout.pack)(leaves)
  got = jax.jit(lambda bufs: {m.index: layout.unpack(b, m) for g, b in
                              zip(layout.groups, bufs, strict=True) for m in g.members})(bufs)
  assert sorted(got) == list(range(len(leaves)))
  for i, x in enumerate(leaves):
    np.testing.assert_array_equal(np.asarray(got[i]), np.asarray(x))


def test_checkpoint_of_the_per_leaf_optimizer_restores_into_the_flat_one(tmp_path):
  """A checkpoint written by the old code path (the per-leaf optax state, built here with plain
  optax) restores with the flat optimizer's abstract state; the next update then equals the old
  optimizer's next update."""
  mesh = _mesh((8,), ("fsdp",))
  specs = {"blk": {"kernel": P("fsdp", None), "bias": P(), "w3": P(None, None, "fsdp"),
                   "scale": P()},
           "out": {"kernel": P(None, "fsdp"), "bias": P("fsdp")},
           "SparseEmbed_0": {"ad_embedding": P("fsdp", None), "u_embedding": P("fsdp", None)}}
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                           is_leaf=lambda x: isinstance(x, P))
  params = jax.device_put(_mixed_params(7), shardings)
  cfg = _cfg()
  old = optax.partition({"dense": _optax_reference(cfg, 100),
                         "emb": optim.rowwise_adagrad(cfg.emb_lr)}, optim.param_labels)
  old_update = jax.jit(old.update)
  old_state = jax.jit(old.init)(params)
  g1 = jax.jit(lambda p: jax.tree.map(lambda x: x * 0.3 - 0.2, p))(params)
  u, old_state = old_update(g1, old_state, params)
  params = jax.jit(optax.apply_updates)(params, u)
  it = iter(grain.MapDataset.range(10).to_iter_dataset())
  ck = checkpoint.Checkpointer(str(tmp_path / "ck"))
  ck.save(1, params, old_state, jax.random.key(0), it)
  ck.close()

  tx = optim.make_optimizer(cfg, 100)
  o_sh = optim.opt_state_shardings(tx, checkpoint.abstract_like(params), shardings, mesh)
  new_abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                              jax.eval_shape(tx.init, params), o_sh)
  ck = checkpoint.Checkpointer(str(tmp_path / "ck"))
  step, p, state, _ = ck.restore(checkpoint.abstract_like(params), new_abstract,
                                 iter(grain.MapDataset.range(10).to_iter_dataset()))
  ck.close()
  assert step == 1 and opt_layout.is_flat(state)
  for a, s in zip(jax.tree.leaves(state), jax.tree.leaves(o_sh), strict=True):
    assert a.sharding.is_equivalent_to(s, a.ndim)
  g2 = jax.jit(lambda p: jax.tree.map(lambda x: x * -0.5 + 0.05, p))(params)
  u_new, _ = jax.jit(tx.update)(g2, state, p)
  u_old, _ = old_update(g2, old_state, params)
  for a, b in zip(jax.tree.leaves(u_new), jax.tree.leaves(u_old), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=1e-9)
