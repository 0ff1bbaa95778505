"""Sharded embedding lookup (bucket exchange + overflow fallback) and the sparse Adagrad update."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sharding import checks, partition
from sharding import embedding as E
from sharding import mesh as M
from sharding import rules as R

V, D = 1024, 4
ALL = ("data", "fsdp", "tensor", "context", "expert")
RNG = np.random.default_rng(0)
TABLE = RNG.normal(size=(V, D)).astype(np.float32)
IDS = RNG.integers(-1, V, (16, 5)).astype(np.int32)
HOT = (np.arange(80).reshape(16, 5) % 8).astype(np.int32)     # every id owned by shard 0


def np_lookup(table, ids):
  out = np.zeros(ids.shape + (table.shape[1],), table.dtype)
  for idx in np.ndindex(ids.shape):
    if ids[idx] >= 0:
      out[idx] = table[ids[idx]]
  return out


@functools.cache
def setup():
  mesh = M.make_mesh({"fsdp": 2, "tensor": 2, "expert": 2})
  rules = R.get_rules("5d")
  table = jax.device_put(TABLE, NamedSharding(mesh, P(ALL, None)))
  return mesh, rules, table


def test_lookup_without_mesh_is_take():
  np.testing.assert_array_equal(np.asarray(E.lookup(jnp.asarray(TABLE), IDS)), np_lookup(TABLE, IDS))
  assert E.row_axes(V) == ()


@pytest.mark.parametrize("ids, force", [(IDS, False), (IDS, True), (HOT, False)],
                         ids=["exchange", "forced-fallback", "overflow"])
def test_sharded_lookup_matches_take(ids, force):
  mesh, rules, table = setup()
  if ids is HOT:   # really overflows: one owner gets more distinct ids than the capacity
    m = ids.size // 8
    per_dev = ids.reshape(8, m)
    assert max(len(set(r)) for r in per_dev) > E.capacity(m, 8)
  with partition.activate(mesh, rules):
    assert E.row_axes(V) == ("fsdp", "tensor", "expert")
    i = jax.device_put(ids, partition.batch_sharding(mesh, rules))
    out = jax.jit(functools.partial(E.lookup, force_fallback=force))(table, i)
  np.testing.assert_array_equal(np.asarray(out), np_lookup(TABLE, ids))


def test_sharded_lookup_gradient_and_hlo():
  mesh, rules, table = setup()
  w = RNG.normal(size=IDS.shape + (D,)).astype(np.float32)
  want = np.zeros_like(TABLE)
  for idx in np.ndindex(IDS.shape):
    if IDS[idx] >= 0:
      want[IDS[idx]] += w[idx]
  with partition.activate(mesh, rules):
    i = jax.device_put(IDS, partition.batch_sharding(mesh, rules))
    grad_fn = jax.jit(jax.grad(lambda t: jnp.sum(E.lookup(t, i) * w)))
    g = grad_fn(table)
    hlo = grad_fn.lower(table).compile().as_text()
  np.testing.assert_allclose(np.asarray(g), want, rtol=1e-6, atol=1e-6)
  assert g.sharding.is_equivalent_to(table.sharding, 2)
  ops = checks.collectives(hlo)
  assert any(c["op"] == "all-to-all" and c["group"] == 8 for c in ops)
  # nothing as large as one table shard travels (only ids, looked-up rows and their gradients)
  assert all(np.prod(s) < V // 8 * D for c in ops for s in c["shapes"]), [c["line"] for c in ops]


def np_adagrad(table, acc, ids, g, lr, eps=1e-8):
  """Returns the updated table and accumulator, the touched rows and the squared norm of the
  per-row summed gradient."""
  t, a = table.astype(np.float64), acc.astype(np.float64)
  sums = {}
  for i, gi in zip(ids.ravel(), g.reshape(-1, table.shape[1]), strict=True):
    if i >= 0:
      sums[i] = sums.get(i, 0.0) + gi.astype(np.float64)
  for i, gi in sums.items():
    a[i] += np.mean(gi ** 2)
    t[i] -= lr * gi / (np.sqrt(a[i]) + eps)
  return t, a, np.array(sorted(sums)), sum(float(np.sum(gi ** 2)) for gi in sums.values())


@pytest.mark.parametrize("mode", ["no-mesh", "exchange", "fallback", "overflow"])
def test_sparse_adagrad_touches_only_looked_up_rows(mode):
  ids = HOT if mode == "overflow" else RNG.integers(-1, V, (16, 5)).astype(np.int32)
  g = RNG.normal(size=ids.shape + (D,)).astype(np.float32)
  acc = RNG.uniform(0.1, 1.0, V).astype(np.float32)
  want_t, want_a, touched, want_sq = np_adagrad(TABLE, acc, ids, g, lr=0.1)
  upd = jax.jit(functools.partial(E.sparse_adagrad_update, lr=0.1, with_sq_norm=True,
                                  force_fallback=mode == "fallback"))
  if mode == "no-mesh":
    t, a, sq = upd(jnp.asarray(TABLE), jnp.asarray(acc), ids, g)
  else:
    mesh, rules, table = setup()
    with partition.activate(mesh, rules):
      a0 = jax.device_put(acc, NamedSharding(mesh, P(ALL)))
      i = jax.device_put(ids, partition.batch_sharding(mesh, rules))
      t, a, sq = upd(table, a0, i, g)
      assert t.sharding.is_equivalent_to(table.sharding, 2)
  t, a = np.asarray(t), np.asarray(a)
  np.testing.assert_allclose(t, want_t, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(a, want_a, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(float(sq), want_sq, rtol=1e-5)
  untouched = np.setdiff1d(np.arange(V), touched)
  assert len(untouched) > 0
  np.testing.assert_array_equal(t[untouched], TABLE[untouched])     # bitwise
  np.testing.assert_array_equal(a[untouched], acc[untouched])


@pytest.mark.parametrize("sharded", [False, True], ids=["no-mesh", "exchange"])
def test_sparse_adagrad_disabled_changes_nothing(sharded):
  """``enabled=False`` (a skipped step) leaves every row and accumulator bitwise unchanged."""
  g = RNG.normal(size=IDS.shape + (D,)).astype(np.float32)
  acc = RNG.uniform(0.1, 1.0, V).astype(np.float32)
  upd = jax.jit(functools.partial(E.sparse_adagrad_update, lr=0.1, with_sq_norm=True))
  if not sharded:
    t, a, sq = upd(jnp.asarray(TABLE), jnp.asarray(acc), IDS, g, enabled=jnp.asarray(False))
  else:
    mesh, rules, table = setup()
    with partition.activate(mesh, rules):
      a0 = jax.device_put(acc, NamedSharding(mesh, P(ALL)))
      t, a, sq = upd(table, a0, IDS, g, enabled=jnp.asarray(False))
  np.testing.assert_array_equal(np.asarray(t), TABLE)
  np.testing.assert_array_equal(np.asarray(a), acc)
  assert float(sq) == 0.0
