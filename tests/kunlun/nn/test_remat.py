"""config.train.remat: same parameters, loss and gradients as no remat (float32); fewer saved
residuals; bad names fail with the allowed values."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals

from data.fake import random_batch, tiny_schema
from kunlun.configs import tiny
from kunlun.configs.types import parse, seq_lens
from kunlun.models.build import build_model
from kunlun.nn.layer import KunlunLayer
from kunlun.nn.losses import masked_bce

B = 4
KEY = jax.random.key(0, impl="unsafe_rbg")


def _model(remat="none", scope="layer"):
  cfg = tiny.get_config()
  cfg.train.remat, cfg.train.remat_scope = remat, scope
  return cfg, build_model(cfg, tiny_schema())


def _loss(model, batch):
  def f(p):
    logits = model.apply({"params": p}, batch, True)
    return masked_bce(logits, batch["labels"], batch["label_mask"])[0]
  return f


@pytest.fixture(scope="module")
def base():
  cfg, model = _model()
  batch = random_batch(tiny_schema(), B, seq_lens(cfg), seed=1, min_len=1)
  params = jax.eval_shape(model.init, KEY, batch, False)["params"]
  return batch, params


def _layer_case():
  """One Kunlun layer of the tiny config, click tower only, with CompSkip off (WeightGen, HSP,
  PFFN, attention, the final HSP and MoWE all run) and its inputs."""
  cfg, schema = tiny.get_config(), tiny_schema()
  cfg.model.comp_skip = False
  del cfg.model.towers["impression"]
  m = parse(cfg, dataclasses.replace(schema, streams=schema.streams[:1]))
  rng = np.random.default_rng(0)
  arr = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  x = arr(2, m.n_ns, m.d_ns)
  seqs = {t.name: arr(2, t.kept_len, t.width) for t in m.seq_towers}
  lengths = {t.name: jnp.asarray([t.kept_len, t.kept_len // 3], jnp.int32) for t in m.seq_towers}
  ages = {t.name: jnp.abs(arr(2, t.kept_len)) * 1e4 for t in m.seq_towers}
  return m, (x, seqs, lengths, ages, {})


def _layer_grads(layer_cls, m, args, remat="none", params=None):
  """(params, (loss, grads)); ``params`` given: those (remat keeps the tree), else the init's."""
  layer = layer_cls(m, 0, remat)
  if params is None:
    params = jax.jit(layer.init)(KEY, *args)    # op by op, the init took ~3x its compile

  def loss(p, x, seqs):
    x2, s2, summ = layer.apply(p, x, seqs, *args[2:])
    return (jnp.sum(x2 ** 2) + sum(jnp.sum(v ** 2) for v in s2.values())
            + sum(jnp.sum(jnp.sin(v)) for v in summ.values()))
  return params, jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(params, *args[:2])


def test_remat_keeps_loss_and_grads():
  """A layer under remat (each module wrapped, policy full: what remat_scope="tower" builds; the
  layer scope wraps the whole layer the same way) gives the loss and the gradients (parameters
  and inputs) of the plain layer, float32."""
  m, args = _layer_case()
  params, (loss, grads) = _layer_grads(KunlunLayer, m, args)
  for cls, remat in ((KunlunLayer, "full"),):
    _, (loss_r, grads_r) = _layer_grads(cls, m, args, remat, params)
    # recomputed forward values may be fused (reassociated) differently: f32 round-off only
    np.testing.assert_allclose(loss_r, loss, rtol=1e-6)
    flat = jax.tree_util.tree_leaves_with_path(grads)
    assert len(flat) == len(jax.tree.leaves(grads_r)) > 20
    for (path, g), g_r in zip(flat, jax.tree.leaves(grads_r), strict=True):
      np.testing.assert_allclose(g_r, g, rtol=1e-5, atol=1e-6 * float(np.abs(g).max()),
                                 err_msg=f"{remat} {jax.tree_util.keystr(path)}")


@pytest.mark.parametrize("remat, scope", [("full", "layer"), ("dots_no_batch", "tower")])
def test_remat_keeps_the_parameter_tree(base, remat, scope):
  batch, params = base
  shapes = jax.eval_shape(_model(remat, scope)[1].init, KEY, batch, False)["params"]
  assert jax.tree.structure(shapes) == jax.tree.structure(params)
  assert jax.tree.map(lambda s: s.shape, shapes) == jax.tree.map(lambda s: s.shape, params)


def _residual_bytes(model, batch, params):
  res = saved_residuals(_loss(model, batch), params)
  return sum(a.size * a.dtype.itemsize for a, src in res if "from the argument" not in src)


def test_remat_saves_fewer_residuals(base):
  """What the backward pass keeps (traced, not compiled): full remat per layer keeps under a
  quarter of the no-remat residuals; the tower scope sits in between."""
  batch, params = base
  params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), params)
  none = _residual_bytes(_model()[1], batch, params)
  full = _residual_bytes(_model("full")[1], batch, params)
  tower = _residual_bytes(_model("full", "tower")[1], batch, params)
  assert full < none / 4, (full, none)
  assert full <= tower < none, (full, tower, none)


def test_bad_remat_names_fail():
  with pytest.raises(ValueError, match="config.train.remat = 'some'.*allowed values"):
    _model("some")
  with pytest.raises(ValueError, match="config.train.remat_scope = 'net'.*allowed values"):
    _model("full", "net")
