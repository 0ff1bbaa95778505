"""Table-batched embeddings: groups, one gather + one sorted segment-sum per group, the sharded
group exchange and the group sparse Adagrad, against numpy."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sharding import embedding as E
from sharding import mesh as M
from sharding import partition
from sharding import rules as R
from tests.sharding.test_embedding import ALL, np_adagrad

RNG = np.random.default_rng(7)
# three tables of width 4 (3 and 64 rows share a group unsharded; sharded over 8 devices only
# the 64- and 1024-row tables do), one of width 8
SHAPES = [(3, 4), (64, 4), (1024, 4), (40, 8)]
TABLES = [RNG.normal(size=s).astype(np.float32) for s in SHAPES]
IDS = [RNG.integers(-1, s[0], (8, 5)).astype(np.int32) for s in SHAPES]
W = [RNG.normal(size=i.shape + (s[1],)).astype(np.float32) for i, s in zip(IDS, SHAPES, strict=True)]


def np_rows(table, ids):
  return np.where((ids >= 0)[..., None], table[np.maximum(ids, 0)], 0)


def np_grad(table, ids, w):
  g = np.zeros(table.shape, np.float64)
  np.add.at(g, ids[ids >= 0], w[ids >= 0])
  return g


def loss(tables, ids):
  return sum(jnp.sum(r * w) for r, w in zip(E.lookup_tables(tables, ids), W, strict=True))


def test_plan_groups_and_ids():
  assert E.plan_groups([jax.ShapeDtypeStruct(s, jnp.float32) for s in SHAPES]) == [(0, 1, 2), (3,)]
  big = [jax.ShapeDtypeStruct((E.SMALL_TABLE_ROWS + 1, 4), jnp.float32)] + [
      jax.ShapeDtypeStruct(s, jnp.float32) for s in SHAPES[:2]]
  assert E.plan_groups(big) == [(0,), (1, 2)]            # a large table is never concatenated
  gids = np.asarray(E.group_ids([np.array([[0, -1], [1, 2]]), np.array([2, 1])], [3, 64]))
  np.testing.assert_array_equal(gids, [[0, -1, 5], [1, 2, 4]])    # the leading (batch) dim stays


def test_one_gather_and_one_segment_sum_per_group():
  """Values and table gradients equal numpy; the compiled forward + backward has one gather and
  one (sorted) scatter per group, not one per table."""
  tables = [jnp.asarray(t) for t in TABLES]
  fn = jax.jit(jax.value_and_grad(loss))
  val, grads = fn(tables, IDS)
  want = sum(float(np.sum(np_rows(t, i) * w)) for t, i, w in zip(TABLES, IDS, W, strict=True))
  np.testing.assert_allclose(float(val), want, rtol=1e-5)
  for t, i, w, g in zip(TABLES, IDS, W, grads, strict=True):
    # the sorted segment-sum adds each row's terms in their original order (a stable sort):
    # float32 round-off of the sums only
    np.testing.assert_allclose(np.asarray(g), np_grad(t, i, w), rtol=1e-6, atol=1e-6)
  hlo = jax.jit(jax.grad(loss)).lower(tables, IDS).as_text()
  assert hlo.count('"stablehlo.scatter"(') == 2           # not 3: one per group
  assert hlo.count('"stablehlo.sort"(') == 2
  assert hlo.count("indices_are_sorted = true") == 2


@functools.cache
def _mesh():
  return M.make_mesh({"fsdp": 2, "tensor": 2, "expert": 2}), R.get_rules("5d")


@pytest.mark.parametrize("force", [False, True], ids=["exchange", "fallback"])
def test_sharded_group_lookup_and_gradient(force):
  mesh, rules = _mesh()
  with partition.activate(mesh, rules):
    assert [E.row_axes(s[0]) for s in SHAPES] == [()] + [("fsdp", "tensor", "expert")] * 3
    put = lambda t: jax.device_put(t, NamedSharding(mesh, P(E.row_axes(t.shape[0]) or None)))
    tables = [put(t) for t in TABLES]
    groups = E.plan_groups(tables)
    assert groups == [(0,), (1, 2), (3,)]                   # 3 rows: not sharded, alone
    ids = [jax.device_put(i, partition.batch_sharding(mesh, rules)) for i in IDS]
    f = lambda ts, ids: sum(
        jnp.sum(r * w) for r, w in zip(
            [E.lookup_flat([ts[j] for j in g], E.group_ids([ids[j] for j in g],
                                                           [SHAPES[j][0] for j in g]),
                           force_fallback=force) for g in groups], _group_w(groups), strict=True))
    val, grads = jax.jit(jax.value_and_grad(f))(tables, ids)
  want = sum(float(np.sum(np_rows(t, i) * w)) for t, i, w in zip(TABLES, IDS, W, strict=True))
  np.testing.assert_allclose(float(val), want, rtol=1e-5)
  for t, i, w, g, s in zip(TABLES, IDS, W, grads, tables, strict=True):
    np.testing.assert_allclose(np.asarray(g), np_grad(t, i, w), rtol=1e-6, atol=1e-6)
    assert g.sharding.is_equivalent_to(s.sharding, 2)


def _group_w(groups):
  return [jnp.concatenate([jnp.asarray(W[j]).reshape(8, -1, SHAPES[j][1]) for j in g], axis=1)
          for g in groups]


@pytest.mark.parametrize("sharded", [False, True], ids=["no-mesh", "exchange"])
def test_group_sparse_adagrad(sharded):
  """One group update equals numpy's per-table row-wise Adagrad; untouched rows bitwise equal."""
  grp = (1, 2)
  accs = [RNG.uniform(0.1, 1.0, SHAPES[j][0]).astype(np.float32) for j in grp]
  gids = E.group_ids([IDS[j] for j in grp], [SHAPES[j][0] for j in grp])
  g = _group_w([grp])[0]
  upd = jax.jit(functools.partial(E.sparse_adagrad_update_group, lr=0.1, with_sq_norm=True))
  if sharded:
    mesh, rules = _mesh()
    with partition.activate(mesh, rules):
      ts = [jax.device_put(TABLES[j], NamedSharding(mesh, P(ALL, None))) for j in grp]
      acs = [jax.device_put(a, NamedSharding(mesh, P(ALL))) for a in accs]
      tabs, acc_out, sq = upd(ts, acs, gids, g)
  else:
    tabs, acc_out, sq = upd([jnp.asarray(TABLES[j]) for j in grp], [jnp.asarray(a) for a in accs],
                            gids, g)
  want_sq = 0.0
  for j, a0, t, a in zip(grp, accs, tabs, acc_out, strict=True):
    want_t, want_a, touched, s = np_adagrad(TABLES[j], a0, IDS[j], W[j], lr=0.1)
    want_sq += s
    np.testing.assert_allclose(np.asarray(t), want_t, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(a), want_a, rtol=1e-5, atol=1e-6)
    untouched = np.setdiff1d(np.arange(SHAPES[j][0]), touched)
    np.testing.assert_array_equal(np.asarray(t)[untouched], TABLES[j][untouched])
  np.testing.assert_allclose(float(sq), want_sq, rtol=1e-5)
