"""The tiny Kunlun model with its tables row-sharded: ``kunlun.nn.inputs.lookup`` takes the sharded
all-to-all exchange (forward unchanged), and the sparse embedding update
(``config.train.sparse_embedding_update``) trains exactly like the dense row-wise Adagrad."""

import functools

import jax
import numpy as np
import pytest

from data.fake import random_batch
from sharding import checks, partition
from sharding import mesh as M
from sharding import rules as R
from tests.sharding import tiny_kunlun


@functools.cache
def _tiny():
  """The small tiny model (one layer, one event stream: every table is in the input stage; more
  layers or streams only lengthen the compile), two batches and host params, shared by both
  tests."""
  from kunlun.configs.types import seq_lens
  cfg, schema, model = tiny_kunlun.small()
  cfg.train.warmup_steps = 0
  batches = [random_batch(schema, 16, seq_lens(cfg), seed=1 + i, min_len=1) for i in range(2)]
  return cfg, model, batches, tiny_kunlun.host_params(model, batches[0])


@pytest.mark.slow
def test_kunlun_forward_with_sharded_lookup():
  _, model, (batch, _), params = _tiny()
  fwd = lambda p, b: model.apply({"params": p}, b, train=False)
  want = np.asarray(jax.jit(fwd)(params, batch))

  mesh, rules = M.make_mesh({"fsdp": 8}), R.get_rules("fsdp")
  p = jax.device_put(params, partition.param_shardings(model, jax.random.key(0), batch, mesh, rules))
  with partition.activate(mesh, rules):
    b = jax.device_put(batch, partition.batch_sharding(mesh, rules))
    compiled = jax.jit(fwd).lower(p, b).compile()
    got = np.asarray(compiled(p, b))
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
  # the 1000-row ad_id_hash table (125 rows per device) goes through the bucket exchange
  assert any(c["op"] == "all-to-all" and c["group"] == 8
             for c in checks.collectives(compiled.as_text()))


@pytest.mark.slow
def test_kunlun_sparse_embedding_update_equals_dense():
  """2 train steps of the tiny model: sparse and dense embedding updates agree on every parameter
  and optimizer-state leaf (so every table is read only through the look-ups); rows no batch
  reads stay bitwise unchanged. On a data=2 x fsdp=4 mesh (the 1-device case is covered on the
  input stage in tests/kunlun/train/test_step.py)."""
  from kunlun.train import checkpoint, optim, step
  from kunlun.train.sparse_update import make_sparse_update
  cfg, model, batches, p0 = _tiny()
  tx = optim.make_optimizer(cfg.train, 10)
  mesh, rules = M.make_mesh({"data": 2, "fsdp": 4}), R.get_rules("fsdp")
  # the shared init's params and one sharded init of the optimizer state, copied into both
  # runs: the train step donates its inputs
  p_sh = partition.param_shardings(model, jax.random.key(0), batches[0], mesh, rules)
  p = jax.device_put(p0, p_sh)
  o_sh = optim.opt_state_shardings(tx, checkpoint.abstract_like(p), p_sh, mesh)
  o, b_sh = jax.jit(tx.init, out_shardings=o_sh)(p), partition.batch_sharding(mesh, rules)
  o0 = jax.tree.map(np.asarray, o)
  out = {}
  for sparse in (False, True):
    p, o = jax.device_put(p0, p_sh), jax.device_put(o0, o_sh)
    f = step.make_train_step(model, tx, sparse_update=make_sparse_update(cfg.train, 10)
                             if sparse else None, param_shardings=p_sh, opt_shardings=o_sh,
                             batch_sharding=b_sh)
    with partition.activate(mesh, rules):
      for i, b in enumerate(batches):
        p, o, s = f(p, o, jax.device_put(b, b_sh), jax.random.key(1), i)
        assert bool(s["ok"])
    out[sparse] = p0, p, o, float(s["grad_norm"])
  (_, p_d, o_d, n_d), (p0, p_s, o_s, n_s) = out[False], out[True]
  assert jax.tree.structure(o_s) == jax.tree.structure(o_d)
  np.testing.assert_allclose(n_s, n_d, rtol=2e-5)
  for (k, a), b in zip(jax.tree_util.tree_leaves_with_path((p_s, o_s)), jax.tree.leaves((p_d, o_d)),
                       strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6,
                               err_msg=jax.tree_util.keystr(k))
  table = np.asarray(p_s["context"]["sparse"]["embedding_ad_id_hash"])
  ids = np.concatenate([b["sparse"]["ad_id_hash"].ravel() for b in batches])
  untouched = np.setdiff1d(np.arange(table.shape[0]), np.r_[ids[ids >= 0] % table.shape[0], 0])
  assert len(untouched) > 500 and not np.array_equal(table, p0["context"]["sparse"]["embedding_ad_id_hash"])
  np.testing.assert_array_equal(table[untouched], p0["context"]["sparse"]["embedding_ad_id_hash"][untouched])
