"""MoWE equals the mean of its experts applied independently; experts carry the `exp` axis;
the cross-layer connections (h-19) against a numpy loop and in one training step of the model."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from data.fake import random_batch, tiny_schema
from kunlun.configs import tiny
from kunlun.configs.types import seq_lens
from kunlun.models.build import build_model
from kunlun.nn import wukong
from kunlun.nn.losses import masked_bce
from kunlun.nn.mowe import MoWE
from kunlun.nn.wukong import WukongStack
from tests.kunlun.nn.backends import pallas_matches_xla
from tests.kunlun.nn.test_wukong import np_cross_stack


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


def _expert_mesh():
  """A 2 (expert) x 4 (data) mesh and the logical rules that put ``exp`` on ``expert``."""
  mesh = jax.make_mesh((2, 4), ("expert", "data"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  rules = (("exp", "expert"), ("batch", "data"), ("tokens", None), ("embed", None),
           ("mlp", None))
  return mesh, rules


def test_mowe_experts_shard_on_expert_axis():
  mesh, rules = _expert_mesh()
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


def test_mowe_cross_layer_matches_per_expert_loop():
  E, L, n_out = 3, 3, 4
  x = np.random.default_rng(0).normal(size=(2, 6, 8)).astype(np.float32)
  m = MoWE(num_experts=E, layers_per_expert=L, n_out=n_out, rank=2, mlp_hidden=16,
           cross_layer=True)
  v = jax.jit(m.init)(jax.random.key(0), x)
  boxed = v["params"]["experts"]
  assert boxed["cross_logits_2"].names == ("exp", None)          # per-expert logits on `exp`
  assert boxed["cross_proj"].names == ("exp", "tokens", None)
  rng = np.random.default_rng(1)
  p = jax.tree.map(np.asarray, nn.meta.unbox(v)["params"]["experts"])
  p = {k: (rng.normal(size=a.shape).astype(np.float32) if k.startswith("cross_logits") else a)
       for k, a in p.items()}
  y = np.asarray(jax.jit(m.apply)({"params": {"experts": p}}, x))
  expert = lambda e: jax.tree.map(lambda a: a[e], p)
  ref = np.mean([np_cross_stack(expert(e), x, L, 2) for e in range(E)], 0)
  np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)


def test_full_model_with_cross_layer_trains_one_step():
  """Tiny preset cut to one Kunlun layer, 2-layer experts with connections; one SGD step.

  Parameters come from the model's abstract init (shapes, names) filled with random values, so
  only the training step is compiled (compiling the real init as well doubles the test time).
  """
  cfg, schema = tiny.get_config(), tiny_schema()
  cfg.model.num_layers = 1
  cfg.model.towers.click.depth = 1
  cfg.model.mowe.update(layers_per_expert=2, cross_layer=True)
  model = build_model(cfg, schema)
  batch = random_batch(schema, 8, seq_lens(cfg), seed=0)
  shapes = nn.meta.unbox(jax.eval_shape(model.init, jax.random.key(0), batch, False))["params"]
  rng = np.random.default_rng(0)
  params = jax.tree_util.tree_map_with_path(
      lambda k, s: (float(jax.tree_util.keystr(k).endswith("'scale']"))
                    + 0.1 * rng.normal(size=s.shape)).astype(s.dtype), shapes)
  tx = optax.sgd(1e-1)

  @jax.jit
  def step(p):
    loss_fn = lambda p: masked_bce(model.apply({"params": p}, batch, True), batch["labels"],
                                   batch["label_mask"])[0]
    loss, g = jax.value_and_grad(loss_fn)(p)
    upd, _ = tx.update(g, tx.init(p), p)
    return optax.apply_updates(p, upd), loss, g

  new, loss, g = step(params)
  flat = {jax.tree_util.keystr(k): np.asarray(a)
          for k, a in jax.tree_util.tree_flatten_with_path(g)[0]}
  cross = [k for k in flat if "cross_logits_1" in k or "cross_proj" in k]
  assert len(cross) == 2 and all(flat[k].shape[0] == 2 for k in cross), cross   # 2 experts
  assert np.isfinite(float(loss)) and all(np.all(np.isfinite(a)) for a in flat.values())
  assert all(np.abs(flat[k]).max() > 0 for k in cross)
  moved = jax.tree.leaves(jax.tree.map(lambda a, b: np.abs(np.asarray(a) - b).max(), new, params))
  assert all(m > 0 for m, gk in zip(moved, flat.values(), strict=False) if np.abs(gk).max() > 0)


def test_mowe_cross_layer_params_shard_on_expert_axis():
  """The connection parameters map to the ``expert`` mesh axis like the layers' (abstract init)."""
  mesh, rules = _expert_mesh()
  x = np.ones((4, 6, 8), np.float32)
  m = MoWE(num_experts=2, layers_per_expert=2, n_out=4, rank=2, mlp_hidden=8, cross_layer=True)
  boxed = jax.eval_shape(m.init, jax.random.key(0), x)
  specs = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
  e = specs["params"]["experts"]
  assert e["cross_logits_1"].spec == jax.sharding.PartitionSpec("expert", None)
  assert e["cross_proj"].spec == jax.sharding.PartitionSpec("expert", None, None)
  assert boxed["params"]["experts"]["cross_proj"].value.shape == (2, 6, 4)


# float32 (1e-5): N_in == n_out with 3 layers at d 32 (one column chunk), a residual map with 2
# layers at 72 x 256 (two chunks); bfloat16: a residual map with 2 layers at d 32
@pytest.mark.parametrize("dtype,n_in,layers,d", [
    (jnp.float32, 6, 3, 32), (jnp.bfloat16, 20, 2, 32), (jnp.float32, 72, 2, 256)])
def test_pallas_token_side_matches_xla(dtype, n_in, layers, d):
  """backend="pallas" (``pallas_kernels.wukong_fm`` in interpret mode: the FM, its norm and the
  token maps of every layer, the first cross-layer map riding along layer 0's pass; at 72
  tokens of 256, layer 0's examples in the kernels' column chunks, as prod's; the last
  layer's cross-layer input written by the second-to-last layer's output norm, layer 0's with 2
  layers, layer 1's with 3) against the XLA backend: output and gradients of parameters and
  tokens, with N_in != n_out (layer 0 has a residual map) and N_in == n_out (the 3-layer case),
  and an all-zero example. float32: 1e-5; bfloat16: 4e-2 (about
  6 bfloat16 ulps: XLA:CPU sums the weight gradients' 16-bit products in 16 bits, the kernels in
  float32)."""
  rng = np.random.default_rng(n_in)
  x = rng.normal(size=(5, n_in, d)).astype(np.float32)
  x[2] = 0.0
  x = jnp.asarray(x, dtype)
  mods = {b: MoWE(2, layers, 6, 16, 32, dtype=dtype, cross_layer=True, backend=b)
          for b in ("xla", "pallas")}
  assert wukong.fm_kernel("pallas", n_in, d, 16, [3, 6])
  params = jax.jit(mods["xla"].init)(jax.random.key(1), x)
  g = jnp.asarray(rng.normal(size=(5, 6, d)), jnp.float32)
  pallas_matches_xla(mods, params, x, lambda m, v, x: m.apply(v, x), g, dtype, bf16_tol=4e-2)
