"""Train step: finite updates apply, non-finite loss/grad skips the update bitwise."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from kunlun.configs import fields
from kunlun.nn import remat as remat_lib
from kunlun.train import optim, sparse_update, step
from kunlun.train.sparse_update import make_sparse_update


class _Toy(nn.Module):
  """A two-task logistic model over dense features and one embedding table (test only)."""

  @nn.compact
  def __call__(self, batch, train: bool = False):
    table = self.param("user_embedding", nn.initializers.normal(0.1), (10, 4))
    h = jnp.concatenate([batch["dense"], table[batch["sparse"]["u"][:, 0]]], -1)
    return nn.Dense(2)(h)


def _batch(seed=0, B=16):
  rng = np.random.default_rng(seed)
  return {"dense": rng.normal(size=(B, 3)).astype(np.float32),
          "sparse": {"u": rng.integers(0, 10, (B, 1)).astype(np.int32)},
          "labels": (rng.uniform(size=(B, 2)) < 0.4).astype(np.float32),
          "label_mask": np.ones((B, 2), np.float32),
          "example_mask": np.r_[np.ones(B - 3), np.zeros(3)].astype(np.float32)}


@functools.cache
def _toy_state():
  """The toy model, its optimizer and one compiled init of its params and optimizer state
  (numpy), shared by the tests."""
  cfg = ml_collections.ConfigDict(dict(lr=1e-2, warmup_steps=0, schedule="constant", weight_decay=0.0,
                                       b1=0.9, b2=0.999, clip_norm=1.0, emb_lr=0.05))
  model, tx = _Toy(), optim.make_optimizer(cfg, 10)

  def init(k):
    p = model.init(k, _batch())["params"]
    return p, tx.init(p)
  return model, tx, jax.tree.map(np.asarray, jax.jit(init)(jax.random.key(0)))


def _setup():
  """``(model, tx, params, opt_state)``: fresh device copies (the train step donates them)."""
  model, tx, state = _toy_state()
  return model, tx, *jax.device_put(state)


def test_finite_step_updates_and_sums_match_numpy():
  model, tx, params, opt = _setup()
  train_step = step.make_train_step(model, tx)
  b = _batch()
  logits = np.asarray(model.apply({"params": params}, b), np.float64)
  before = jax.tree.map(np.asarray, params)
  new_params, _, s = train_step(params, opt, b, jax.random.key(1), 0)
  assert bool(s["ok"])
  m = b["label_mask"] * b["example_mask"][:, None]
  p = 1 / (1 + np.exp(-logits))
  bce = -(b["labels"] * np.log(p) + (1 - b["labels"]) * np.log(1 - p))
  np.testing.assert_allclose(s["loss_sum"], (bce * m).sum(0), rtol=1e-5)
  np.testing.assert_allclose(s["count"], m.sum(0))
  np.testing.assert_allclose(s["loss"], ((bce * m).sum(0) / m.sum(0)).sum(), rtol=1e-5)
  assert not np.allclose(new_params["Dense_0"]["kernel"], before["Dense_0"]["kernel"])


def test_nonfinite_step_is_skipped_bitwise():
  model, tx, params, opt = _setup()
  train_step = step.make_train_step(model, tx)
  p_before = jax.tree.map(np.asarray, params)
  o_before = jax.tree.map(np.asarray, opt)
  b = _batch()
  b["dense"][0, 0] = np.nan
  new_params, new_opt, s = train_step(params, opt, b, jax.random.key(1), 0)
  assert not bool(s["ok"])
  for a, c in zip(jax.tree.leaves(new_params) + jax.tree.leaves(new_opt),
                  jax.tree.leaves(p_before) + jax.tree.leaves(o_before), strict=False):
    np.testing.assert_array_equal(np.asarray(a), c)


def test_microbatches_match_the_whole_batch():
  """Gradient accumulation over 4 strided microbatches: the loss, statistics and the update of
  the whole batch (f32; the per-task sums are reassociated: tolerance 1e-5 relative)."""
  model, tx, params, opt = _setup()
  p0 = jax.tree.map(np.asarray, params)
  b = _batch(B=16)
  b["label_mask"][::3, 1] = 0.0           # uneven valid counts across microbatches
  one = step.make_train_step(model, tx)(params, opt, b, jax.random.key(1), 0)
  p2 = jax.tree.map(jnp.asarray, p0)
  four = step.make_train_step(model, tx, microbatches=4)(p2, tx.init(p2), b, jax.random.key(1), 0)
  for a, c in zip(jax.tree.leaves(one), jax.tree.leaves(four), strict=True):
    np.testing.assert_allclose(np.asarray(c), np.asarray(a), rtol=1e-5, atol=1e-7)
  assert not np.allclose(four[0]["Dense_0"]["kernel"], p0["Dense_0"]["kernel"])
  parts = step.split_microbatches({"x": np.arange(8)}, 4)["x"]
  np.testing.assert_array_equal(parts, [[0, 4], [1, 5], [2, 6], [3, 7]])


# ---- sparse embedding update (config.train.sparse_embedding_update) ------------------------

import contextlib  # noqa: E402

import grain  # noqa: E402

from data.fake import random_batch, tiny_schema  # noqa: E402
from kunlun.nn import inputs  # noqa: E402
from kunlun.nn.inputs import ContextEncoder, EventEmbed  # noqa: E402
from kunlun.train import checkpoint  # noqa: E402
from sharding import mesh as M  # noqa: E402
from sharding import partition  # noqa: E402
from sharding import rules as R  # noqa: E402

SEQ = {"click": 8, "impression": 6}
TABLE = "embedding_ad_id_hash"         # 1000 rows: sharded 8 ways (others: partly or not at all)


class _Inputs(nn.Module):
  """The real context input stage (a multi-hot and a one-hot sparse table, the surface table, read
  through ``kunlun.nn.inputs.lookup``; optionally an event stream's four tables) and a linear head
  (in ``dtype``, over float32 params): compiles in seconds (test only). ``event_dtype``: the
  event stream's compute dtype (bfloat16: its row gradients are bfloat16, ``tap_dtype``)."""
  events: bool = False
  dtype: str = "float32"
  event_dtype: str = "float32"

  @nn.compact
  def __call__(self, batch, train: bool = False):
    s = tiny_schema()
    feats = tuple(f for f in s.sparse if f.name in ("ad_id_hash", "user_interests"))
    x = ContextEncoder(feats, 1, 2, 8, len(s.surfaces), name="context")(
        batch["sparse"], jnp.asarray(batch["dense"]), jnp.asarray(batch["surface"]))
    h = [x.reshape(x.shape[0], -1)]
    if self.events:
      st = s.stream("impression")
      h.append(EventEmbed(st, len(s.surfaces), 8, 16, dtype=jnp.dtype(self.event_dtype),
                          name="embed_impression")(batch["events"][st.name])
               .astype(jnp.float32).mean(1))
    h = nn.Dropout(0.1, deterministic=not train)(jnp.concatenate(h, -1))
    return nn.Dense(len(s.tasks), dtype=self.dtype)(h.astype(self.dtype)).astype(jnp.float32)


def _cfg():
  return ml_collections.ConfigDict(dict(lr=1e-2, warmup_steps=0, schedule="constant",
                                        weight_decay=1e-3, b1=0.9, b2=0.999, clip_norm=1.0,
                                        emb_lr=0.05))


@functools.cache
def _sparse_batches(n=2, B=16):
  return tuple(random_batch(tiny_schema(), B, SEQ, seed=10 + i, min_len=1) for i in range(n))


@functools.cache
def _host_params(events):
  """One compiled 1-device init of the test model's params (numpy), shared by every variant:
  each mesh gets them through ``jax.device_put`` (sharded init == unsharded init is
  tests/sharding/test_presets.py's claim)."""
  init = jax.jit(lambda k: _Inputs(events).init(k, _sparse_batches()[0])["params"])
  return jax.tree.map(np.asarray, nn.meta.unbox(init(jax.random.key(0))))


@functools.cache
def _step_setup(sparse, mesh_shape=None, rules_name=None, events=False, microbatches=1,
                event_dtype="float32"):
  """``(step_fn, init_state_fn, put, (mesh, rules) or None)`` for the test model; cached so that
  tests share one compiled step per variant."""
  model, batch = _Inputs(events, event_dtype=event_dtype), _sparse_batches()[0]
  tx = optim.make_optimizer(_cfg(), 10)
  su = make_sparse_update(_cfg(), 10) if sparse else None
  ctx, kw = None, {}
  if mesh_shape is None:
    p = jax.device_put(_host_params(events))
    o, put = jax.jit(tx.init)(p), lambda b: b
  else:
    ctx = mesh, rules = M.make_mesh(dict(mesh_shape)), R.get_rules(rules_name)
    p_sh = partition.param_shardings(model, jax.random.key(0), batch, mesh, rules)
    p = jax.device_put(_host_params(events), p_sh)
    o_sh = optim.opt_state_shardings(tx, checkpoint.abstract_like(p), p_sh, mesh)
    o, b_sh = jax.jit(tx.init, out_shardings=o_sh)(p), partition.batch_sharding(mesh, rules)
    kw = dict(param_shardings=p_sh, opt_shardings=o_sh, batch_sharding=b_sh)
    put = lambda b: jax.device_put(b, b_sh)
  arrays, shardings = jax.tree.map(np.asarray, (p, o)), jax.tree.map(lambda x: x.sharding, (p, o))
  init = lambda: jax.tree.map(jax.device_put, arrays, shardings)   # fresh: the step donates
  return (step.make_train_step(model, tx, sparse_update=su, microbatches=microbatches, **kw),
          init, put, ctx)


def _run(sparse, mesh_shape=None, rules_name=None, events=False, microbatches=1,
         event_dtype="float32", setup=_step_setup):
  """Steps over every test batch from the same init: (initial params, params, opt_state, stats).
  ``setup``: ``_step_setup`` (cached) or its uncached function."""
  f, init, put, ctx = setup(sparse, mesh_shape, rules_name, events, microbatches, event_dtype)
  p, o = init()
  p0 = jax.tree.map(np.asarray, p)
  stats = []
  with partition.activate(*ctx) if ctx else contextlib.nullcontext():
    for i, b in enumerate(_sparse_batches()):
      p, o, s = f(p, o, put(b), jax.random.key(1), i)
      stats.append(jax.device_get(s))
  return p0, p, o, stats


def _touched(batches, vocab):
  """Rows of the ad_id_hash table any batch reads (SparseEmbed maps empty slots to row 0)."""
  ids = np.concatenate([b["sparse"]["ad_id_hash"].ravel() for b in batches])
  return np.union1d(ids[ids >= 0] % vocab, [0])


def _leaves(tree):
  return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tree)}


def _assert_close(a, b, rtol=2e-5, atol=2e-6):
  a, b = _leaves(a), _leaves(b)
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_allclose(a[k], b[k], rtol=rtol, atol=atol, err_msg=k)


def _assert_same_run(sparse, dense, keys=("loss", "grad_norm", "loss_sum", "per_task")):
  """Two ``_run``s: the same params, optimizer state (and its structure) and statistics, every
  step taken."""
  (_, p_s, o_s, s_s), (_, p_d, o_d, s_d) = sparse, dense
  assert jax.tree.structure(o_s) == jax.tree.structure(o_d)
  _assert_close(p_s, p_d)
  _assert_close(o_s, o_d)
  for a, b in zip(s_s, s_d, strict=True):
    assert a["ok"] and b["ok"]
    for k in keys:
      np.testing.assert_allclose(a[k], b[k], rtol=2e-5, err_msg=k)


MESHES = [pytest.param(None, None, False, id="1-device"),
          pytest.param((("data", 2), ("fsdp", 4)), "fsdp", False, id="data2-fsdp4"),
          pytest.param((("fsdp", 2), ("tensor", 2), ("expert", 2)), "5d", True, id="5d-events",
                       marks=pytest.mark.slow)]


# data=2 x fsdp=4: the whole tiny model's case (tests/sharding/test_kunlun_lookup.py) covers it
@pytest.mark.parametrize("mesh_shape, rules_name, events", [MESHES[0], MESHES[2]])
def test_sparse_update_equals_dense(mesh_shape, rules_name, events):
  """Sparse and dense embedding updates give the same params, optimizer state and statistics
  after 2 steps; table rows no batch reads stay bitwise equal to their initial values."""
  sparse = _run(True, mesh_shape, rules_name, events)
  _assert_same_run(sparse, _run(False, mesh_shape, rules_name, events))
  p0, p_s = sparse[:2]
  table = np.asarray(p_s["context"]["sparse"][TABLE])
  init = p0["context"]["sparse"][TABLE]
  untouched = np.setdiff1d(np.arange(table.shape[0]), _touched(_sparse_batches(), table.shape[0]))
  assert len(untouched) > 500
  np.testing.assert_array_equal(table[untouched], init[untouched])
  assert not np.array_equal(table, init)
  if mesh_shape is not None:
    assert p_s["context"]["sparse"][TABLE].sharding.spec[0] is not None


def test_sparse_update_sums_every_small_group_inside_the_cond(monkeypatch):
  """With no group small enough to sum its table-shaped gradient before the optimizer's cond
  (``SMALL_TABLE_ROWS`` 0) every small group sums it inside: the same run as the dense update.
  The other tests take the other path (the test model's tables are all small)."""
  monkeypatch.setattr(sparse_update, "SMALL_TABLE_ROWS", 0)
  _assert_same_run(_run(True, events=True, setup=_step_setup.__wrapped__), _run(False, events=True))


@pytest.mark.parametrize("mesh_shape, rules_name, events, k", [
    pytest.param(*MESHES[0].values, 4, id="1-device-mb4"),
    pytest.param(*MESHES[1].values, 2, id="data2-fsdp4-mb2")])
def test_sparse_update_under_microbatches_equals_dense(mesh_shape, rules_name, events, k):
  """Microbatches (4; 2 on a mesh) with the sparse update: the looked-up rows' gradients of every
  microbatch are applied in one update, repeated ids summed across microbatches (the batches
  repeat ids across microbatches, checked): the same params, optimizer state and statistics as
  the dense update with the same microbatches (f32, the dense path's own accumulation), after 2
  steps; rows no batch reads stay bitwise equal to their initial values."""
  batches = _sparse_batches()
  for name in ("ad_id_hash", "user_interests"):     # the sparse path's table, a small one
    mbs = [step.split_microbatches(b["sparse"][name], 2) for b in batches]
    assert any((np.intersect1d(np.ravel(m[0]), np.ravel(m[1])) >= 0).any() for m in mbs), name
  sparse = _run(True, mesh_shape, rules_name, events, microbatches=k)
  _assert_same_run(sparse, _run(False, mesh_shape, rules_name, events, microbatches=k),
                   ("loss", "grad_norm", "loss_sum", "per_task", "count"))
  p0, p_s = sparse[:2]
  table, init = np.asarray(p_s["context"]["sparse"][TABLE]), p0["context"]["sparse"][TABLE]
  untouched = np.setdiff1d(np.arange(table.shape[0]), _touched(batches, table.shape[0]))
  np.testing.assert_array_equal(table[untouched], init[untouched])
  assert not np.array_equal(table, init)


@pytest.mark.parametrize("k", [1, 2], ids=["whole", "mb2"])
def test_sparse_update_with_16_bit_row_gradients_equals_dense(k):
  """An event stream computing in bfloat16 takes bfloat16 row taps (its rows' cotangents are
  bfloat16 values: ``kunlun.nn.inputs._embed_many``'s tap_dtype; the context's stay float32):
  the sparse update, which sums and applies them in float32, gives the dense update's params,
  optimizer state and statistics after 2 steps (autodiff's float32 table gradients), whole and
  in 2 microbatches."""
  model, b = _Inputs(True, event_dtype="bfloat16"), _sparse_batches()[0]
  _, state = jax.eval_shape(lambda p: model.apply(
      {"params": p}, b, mutable=[inputs.LOOKUP_IDS, inputs.ROW_TAPS]), _host_params(True))
  taps = {jax.tree_util.keystr(k): v.dtype for k, v in
          jax.tree_util.tree_leaves_with_path(state[inputs.ROW_TAPS])}
  assert {k for k, d in taps.items() if d == jnp.bfloat16} == {
      k for k in taps if "embed_impression" in k} != set()
  assert any(d == jnp.float32 for d in taps.values())
  _assert_same_run(_run(True, events=True, microbatches=k, event_dtype="bfloat16"),
                   _run(False, events=True, microbatches=k, event_dtype="bfloat16"))


def test_sparse_nonfinite_step_is_skipped_bitwise():
  f, init, _, _ = _step_setup(True, None, None, False)
  p, o = init()
  before = jax.tree.map(np.asarray, (p, o))
  b = dict(_sparse_batches()[0])
  b["dense"] = b["dense"].copy()
  b["dense"][0, 0] = np.nan
  new_p, new_o, s = f(p, o, b, jax.random.key(1), 0)
  assert not bool(s["ok"]) and not np.isfinite(s["grad_norm"])
  for a, c in zip(jax.tree.leaves((new_p, new_o)), jax.tree.leaves(before), strict=True):
    np.testing.assert_array_equal(np.asarray(a), c)


def test_sparse_checkpoint_resume(tmp_path):
  """A sparse-path state saves and restores into the dense path's abstract layout (what
  train.py builds from ``tx.init``); resuming continues bitwise."""
  f, init, put, ctx = _step_setup(True, (("data", 2), ("fsdp", 4)), "fsdp", False)
  p, o = init()
  abstract = checkpoint.abstract_like(p), checkpoint.abstract_like(o)
  b0, b1 = _sparse_batches()
  it = lambda: iter(grain.MapDataset.range(10).to_iter_dataset())
  ck = checkpoint.Checkpointer(str(tmp_path / "ck"))
  with partition.activate(*ctx):
    p, o, _ = f(p, o, put(b0), jax.random.key(1), 0)
    ck.save(1, p, o, jax.random.key(1), it())
    ck.wait()
    _, p2, o2, _ = ck.restore(*abstract, it())
    want = f(p, o, put(b1), jax.random.key(1), 1)[:2]
    got = f(p2, o2, put(b1), jax.random.key(1), 1)[:2]
  ck.close()
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_positive_count_uses_the_mask():
  """``pos_sum`` (the training-log NE's base rate) counts only labelled, real rows: masked rows
  and padding rows that carry label 1 are not positives (unmasked, the NE would be wrong or
  NaN). Checked against numpy, and through the running NE of the log."""
  from kunlun.train.metrics import RunningNE
  model, tx, params, opt = _setup()
  train_step = step.make_train_step(model, tx)
  b = _batch(seed=3)
  b["labels"][:] = 0.0
  b["labels"][:4] = 1.0                          # 4 positives per task ...
  b["label_mask"][1, 0] = 0.0                    # ... one unlabelled for task 0
  b["label_mask"][2:4, 1] = 0.0                  # ... two for task 1
  b["labels"][-3:] = 1.0                         # padding rows (example_mask 0) with label 1
  logits = np.asarray(model.apply({"params": params}, b), np.float64)
  _, _, s = train_step(params, opt, b, jax.random.key(1), 0)
  m = b["label_mask"] * b["example_mask"][:, None]
  want = (b["labels"] * m).sum(0)
  np.testing.assert_array_equal(want, [3.0, 2.0])
  np.testing.assert_allclose(s["pos_sum"], want)
  assert not np.allclose(s["pos_sum"], b["labels"].sum(0))
  ne = RunningNE(("a", "b"))
  ne.update(s["loss_sum"], s["pos_sum"], s["count"])
  p = 1 / (1 + np.exp(-logits))
  bce = -(b["labels"] * np.log(p) + (1 - b["labels"]) * np.log(1 - p))
  rate = want / m.sum(0)
  ent = -(rate * np.log(rate) + (1 - rate) * np.log(1 - rate))
  got = ne.value()
  np.testing.assert_allclose([got["a"], got["b"]], (bce * m).sum(0) / m.sum(0) / ent, rtol=1e-5)


def test_step_equals_plain_optax_and_numpy_with_a_few_optimizer_launches():
  """The step (f32) against an independent computation: the loss and gradients by
  ``jax.value_and_grad`` of an optax BCE, clip + AdamW by plain optax leaf by leaf, the row-wise
  Adagrad in numpy. The global norm is a reassociated sum (rtol 2e-6 on the updated params).
  The compiled optimizer is a few launches plus one per leaf (the per-leaf optax chain needs
  about seven per leaf)."""
  import optax

  from bench.profiling import hlo_stats
  cfg = ml_collections.ConfigDict(dict(lr=1e-2, warmup_steps=0, schedule="constant",
                                       weight_decay=0.1, b1=0.9, b2=0.999, clip_norm=0.5,
                                       emb_lr=0.05))
  model, b = _Toy(), _batch()
  p0 = _toy_state()[2][0]                  # the shared init of _Toy (key 0, _batch())
  params = jax.device_put(p0)
  tx = optim.make_optimizer(cfg, 10)
  train_step = step.make_train_step(model, tx)
  opt = jax.jit(tx.init)(params)
  compiled = train_step.lower(params, opt, b, jax.random.key(1), 0).compile()
  new_p, _, s = compiled(params, opt, b, jax.random.key(1), 0)

  m = jnp.asarray(b["label_mask"] * b["example_mask"][:, None])

  def loss_fn(p):
    bce = optax.sigmoid_binary_cross_entropy(model.apply({"params": p}, b), b["labels"])
    return jnp.sum(jnp.sum(bce * m, 0) / jnp.sum(m, 0))

  p_ref = jax.tree.map(jnp.asarray, p0)
  loss, g = jax.jit(jax.value_and_grad(loss_fn))(p_ref)
  np.testing.assert_allclose(float(s["loss"]), float(loss), rtol=1e-6)
  g_np = jax.tree.map(lambda x: np.asarray(x, np.float64), g)
  np.testing.assert_allclose(float(s["grad_norm"]),
                             np.sqrt(sum(np.sum(x ** 2) for x in jax.tree.leaves(g_np))), rtol=1e-5)
  dense_tx = optax.chain(optax.clip_by_global_norm(0.5),
                         optax.adamw(1e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1,
                                     mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)))
  dense = {"Dense_0": p_ref["Dense_0"]}
  want = jax.jit(lambda g, p: optax.apply_updates(p, dense_tx.update(g, dense_tx.init(p), p)[0]))(
      {"Dense_0": g["Dense_0"]}, dense)
  for a, c in zip(jax.tree.leaves(new_p["Dense_0"]), jax.tree.leaves(want["Dense_0"]),
                  strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=2e-6, atol=1e-8)
  ge = g_np["user_embedding"]
  acc = (ge ** 2).mean(1)
  tab = p0["user_embedding"] - 0.05 * ge / (np.sqrt(acc)[:, None] + 1e-8)
  np.testing.assert_allclose(np.asarray(new_p["user_embedding"]), tab, rtol=1e-6, atol=1e-7)
  # a deeper model (15 leaves): about 16 scalar / flat launches, then one per leaf (the per-leaf
  # optax chain: 84)
  deep = _Deep()
  pd = jax.eval_shape(lambda k: deep.init(k, b)["params"], jax.random.key(0))
  txd = optim.make_optimizer(cfg, 10)
  text = step.make_train_step(deep, txd).lower(pd, jax.eval_shape(txd.init, pd), b,
                                               jax.random.key(1), 0).compile().as_text()
  launches = hlo_stats.hlo_stats(text)["launches_by_group"]["optimizer"]
  assert launches <= len(jax.tree.leaves(pd)) + 20, launches


class _Deep(nn.Module):
  """_Toy with six hidden Dense layers (test only)."""

  @nn.compact
  def __call__(self, batch, train: bool = False):
    table = self.param("user_embedding", nn.initializers.normal(0.1), (10, 4))
    h = jnp.concatenate([batch["dense"], table[batch["sparse"]["u"][:, 0]]], -1)
    for _ in range(6):
      h = jax.nn.relu(nn.Dense(8)(h))
    return nn.Dense(2)(h)


class _Block(nn.Module):
  """A wide hidden layer between two narrow ones (test only)."""

  @nn.compact
  def __call__(self, h):
    return jnp.tanh(nn.Dense(64)(jnp.tanh(nn.Dense(2048)(h))))


class _Deep(nn.Module):
  """Four blocks under a remat policy (test only): the backward keeps each block's wide hidden
  activations unless they are recomputed."""
  remat: str = "none"

  @nn.compact
  def __call__(self, batch, train: bool = False):
    Block = remat_lib.wrap(_Block, self.remat)
    h = batch["dense"]
    for i in range(4):
      h = Block(name=f"b{i}")(h)
    return nn.Dense(2)(h)


def test_pick_remat_takes_the_least_recompute_that_fits():
  """``train.remat=auto``: the first of none, dots_saveable, dots_no_batch, full whose compiled
  step's peak per device fits the budget; none without a memory figure; an error naming the
  need when nothing fits. Peaks compiled here independently per policy."""
  from kunlun.configs import tiny
  from sharding import checks
  from sharding import mesh as M
  from sharding import rules as R
  config = tiny.get_config()
  mesh, rules = M.make_mesh({"fsdp": 1}, devices=jax.devices()[:1]), R.get_rules("fsdp")
  example = _batch(B=1024)
  rng = jax.random.key(0)

  def peak(name):
    ts, p, o = step.build(config, _Deep(name), example, mesh, rules, rng, abstract=True)
    b = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=ts.batch_sharding),
                     example)
    return checks.memory_per_device(ts.fn.lower(p, o, b, rng, jnp.int32(0)).compile())[
        "peak_estimate"]

  peaks = {n: peak(n) for n in ("none", "full")}
  assert peaks["full"] < peaks["none"], peaks             # the toy's recompute saves memory
  pick = lambda budget: step.pick_remat(_Deep, config, example, mesh, rules, rng, budget,
                                        log=lambda _: None)
  name, tried = pick(peaks["none"])
  assert name == "none" and tried == {"none": peaks["none"]}
  name, tried = pick(peaks["full"])
  assert list(tried) == list(fields.REMAT_ORDER)[:len(tried)] and tried[name] <= peaks["full"]
  assert all(tried[n] > peaks["full"] for n in list(tried)[:-1]) and name != "none"
  assert pick(None) == ("none", {})
  with pytest.raises(ValueError, match="no policy fits"):
    pick(peaks["full"] - 1)
