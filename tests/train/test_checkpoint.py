"""Checkpointer: composite round trip with the grain iterator, restore onto another mesh,
params-only restore, clear errors for missing / corrupt checkpoints."""

import os

import grain
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from kunlun.train import checkpoint, optim


def _mesh(shape, names):
  return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


def _state(mesh, spec):
  sh = NamedSharding(mesh, spec)
  params = {"tbl": {"item_embedding": jax.device_put(jnp.arange(128.0).reshape(16, 8), sh)},
            "Dense_0": {"kernel": jax.device_put(jnp.arange(64.0).reshape(8, 8) / 7, sh)}}
  cfg = ml_collections.ConfigDict(dict(lr=1e-2, warmup_steps=0, schedule="constant", weight_decay=0.0,
                                       b1=0.9, b2=0.999, clip_norm=1.0, emb_lr=0.05))
  tx = optim.make_optimizer(cfg, 10)
  shardings = jax.tree.map(lambda x: x.sharding, params)
  o_sh = optim.opt_state_shardings(tx, checkpoint.abstract_like(params), shardings, mesh)
  opt = jax.jit(tx.init, out_shardings=o_sh)(params)
  grads = jax.tree.map(jnp.ones_like, params)
  upd, opt = tx.update(grads, opt, params)
  return params, opt, o_sh


def _iter():
  return iter(grain.MapDataset.range(1000).seed(3).shuffle().to_iter_dataset().batch(8))


def test_roundtrip_other_mesh_and_iterator(tmp_path):
  mesh_a = _mesh((2, 4), ("data", "fsdp"))
  params, opt, _ = _state(mesh_a, P("fsdp", None))
  it = _iter()
  for _ in range(3):
    next(it)
  ck = checkpoint.Checkpointer(str(tmp_path / "ck"), keep=2)
  ck.save(3, params, opt, jax.random.key(7), it)
  expected_next = next(it)
  ck.close()

  mesh_b = _mesh((8,), ("fsdp",))
  params_b, opt_b, o_sh_b = _state(mesh_b, P(None, "fsdp"))  # different values' layout
  it_b = _iter()
  ck = checkpoint.Checkpointer(str(tmp_path / "ck"))
  step, p, o, rng = ck.restore(checkpoint.abstract_like(params_b), checkpoint.abstract_like(opt_b), it_b)
  assert step == 3
  np.testing.assert_array_equal(next(it_b), expected_next)
  np.testing.assert_array_equal(jax.random.key_data(rng), jax.random.key_data(jax.random.key(7)))
  for a, b in zip(jax.tree.leaves(p) + jax.tree.leaves(o),
                  jax.tree.leaves(params) + jax.tree.leaves(opt), strict=False):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert p["Dense_0"]["kernel"].sharding.spec == P(None, "fsdp")
  acc = o.inner_states["emb"].inner_state.acc["tbl"]["item_embedding"]
  assert acc.sharding == o_sh_b.inner_states["emb"].inner_state.acc["tbl"]["item_embedding"]
  s2, p2 = ck.restore_params(checkpoint.abstract_like(params_b))
  assert s2 == 3
  np.testing.assert_array_equal(np.asarray(p2["tbl"]["item_embedding"]), np.arange(128.0).reshape(16, 8))
  ck.close()


def test_errors_name_the_problem(tmp_path):
  mesh = _mesh((8,), ("fsdp",))
  params, opt, _ = _state(mesh, P("fsdp", None))
  with pytest.raises(checkpoint.CheckpointError, match="no checkpoint directory"):
    checkpoint.Checkpointer(str(tmp_path / "missing"), read_only=True)
  ck = checkpoint.Checkpointer(str(tmp_path / "ck"))
  with pytest.raises(checkpoint.CheckpointError, match="no checkpoint found"):
    ck.restore_params(checkpoint.abstract_like(params))
  ck.save(5, params, opt, jax.random.key(0), _iter())
  ck.wait()
  with pytest.raises(checkpoint.CheckpointError, match="step 4 .*available: \\[5\\]"):
    ck.restore_params(checkpoint.abstract_like(params), step=4)
  # corrupt: overwrite every file of the params item with garbage
  for root, _, files in os.walk(tmp_path / "ck" / "5" / "params"):
    for f in files:
      with open(os.path.join(root, f), "wb") as fh:
        fh.write(b"\x00garbage")
  with pytest.raises(checkpoint.CheckpointError, match="corrupt"):
    ck.restore_params(checkpoint.abstract_like(params))
  ck.close()
