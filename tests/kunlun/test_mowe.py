"""MoWE equals the mean of its experts applied independently; experts carry the `exp` axis."""

import flax.linen as nn
import jax
import numpy as np
import pytest

from kunlun.mowe import MoWE
from kunlun.wukong import WukongStack


def test_mowe_is_mean_of_independent_experts():
  x = np.random.default_rng(0).normal(size=(3, 6, 8)).astype(np.float32)
  m = MoWE(num_experts=3, layers_per_expert=2, n_out=4, rank=2, mlp_hidden=16)
  v = jax.jit(m.init)(jax.random.key(0), x)
  y = np.asarray(jax.jit(m.apply)(v, x))
  assert y.shape == (3, 4, 8)
  p = jax.tree.map(np.asarray, nn.meta.unbox(v)["params"]["experts"])
  stack = jax.jit(WukongStack(2, 4, 2, 16).apply)
  expert = lambda e: jax.tree.map(lambda a: a[e], p)
  outs = [np.asarray(stack({"params": expert(e)}, x)) for e in range(3)]
  np.testing.assert_allclose(y, np.mean(outs, 0), rtol=1e-5, atol=1e-5)
  assert np.abs(outs[0] - outs[1]).max() > 1e-3            # experts are initialised differently
  names = jax.tree.leaves(v["params"], is_leaf=lambda a: isinstance(a, nn.LogicallyPartitioned))
  assert all(isinstance(a, nn.LogicallyPartitioned) and a.names[0] == "exp" for a in names)


def test_mowe_errors():
  with pytest.raises(ValueError, match="num_experts"):
    MoWE(0, 1, 4, 2, 8).init(jax.random.key(0), np.ones((2, 3, 4), np.float32))


def test_mowe_experts_shard_on_expert_axis():
  mesh = jax.make_mesh((2, 4), ("expert", "data"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  rules = (("exp", "expert"), ("batch", "data"), ("tokens", None), ("embed", None),
           ("mlp", None))
  x = np.ones((4, 6, 8), np.float32)
  m = MoWE(num_experts=2, layers_per_expert=1, n_out=4, rank=2, mlp_hidden=8)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    boxed = jax.eval_shape(m.init, jax.random.key(0), x)
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
    init = jax.jit(lambda k, x: nn.meta.unbox(m.init(k, x)),
                   out_shardings=nn.meta.unbox(shardings))
    params = init(jax.random.key(0), x)
    y = jax.jit(m.apply)(params, x)
  w = params["params"]["experts"]["layer_0"]["fm_mlp_in"]["kernel"]
  assert w.sharding.spec[0] == "expert" and w.addressable_shards[0].data.shape[0] == 1
  assert y.shape == (4, 4, 8)
