"""Reference models through build_model: the ablated Kunlun trunk and DLRM-style pooling."""

import flax.linen as nn
import jax
import numpy as np
import pytest
from jaxpr_scopes import name_stacks

from data.fake import random_batch, tiny_schema
from data.synthetic import PRESETS, preset_schema
from kunlun.config import parse, seq_lens
from kunlun.configs import mid, tiny
from kunlun.flops import model_flops
from kunlun.inputs import EventEmbed
from kunlun.losses import masked_bce
from kunlun.model import Kunlun, build_model

KEY = jax.random.key(0, impl="unsafe_rbg")


def _cfg(arch):
  c = tiny.get_config()
  c.model.arch = arch
  return c


def test_kunlun_ablated_structure():
  c, schema = _cfg("kunlun_ablated"), tiny_schema()
  model = build_model(c, schema)
  assert isinstance(model, Kunlun)
  m = model.cfg
  assert (not m.comp_skip and m.pooling == "pma" and m.attention.kind == "full"
          and m.pffn_activation == "identity" and m.mowe.num_experts == 1)
  assert all(t.depth == m.num_layers for t in m.towers)        # no event-level depth
  batch = random_batch(schema, 2, seq_lens(c), seed=0, min_len=1)
  params = jax.eval_shape(model.init, KEY, batch, False)["params"]
  for l in range(m.num_layers):                                 # every layer runs everything
    for t in ("click", "impression"):
      for part in ("weightgen", "hsp", "attention"):             # (PFFN has no parameters)
        assert f"{t}_{part}" in params[f"layer_{l}"], (l, t, part)
  names = name_stacks(jax.make_jaxpr(lambda p, b: model.apply(p, b, False))(
      jax.eval_shape(model.init, KEY, batch, False), batch))
  assert "PMA" in names and "HSP" not in names and "PFFN" in names
  # MoWE with one expert: the stacked expert axis has size 1
  assert all(x.shape[0] == 1 for x in jax.tree.leaves(params["layer_0"]["mowe"]))


def test_switched_off_and_interformer_cost_more_than_kunlun_at_mid():
  schema = preset_schema(PRESETS["mid"])
  c = mid.get_config()
  k = model_flops(c, schema)["forward"]
  for arch in ("kunlun_ablated", "interformer"):        # 3.7x and 4.5x at mid
    c.model.arch = arch
    assert model_flops(c, schema)["forward"] > 3 * k, arch


@pytest.fixture(scope="module")
def dlrm():
  c, schema = _cfg("dlrm"), tiny_schema()
  model = build_model(c, schema)
  batch = random_batch(schema, 6, seq_lens(c), seed=1, min_len=1)
  rep, v = jax.jit(lambda k, b: model.init_with_output(k, b, method="representations"))(KEY,
                                                                                         batch)
  return c, schema, model, batch, nn.meta.unbox(v)["params"], rep


def test_dlrm_pools_event_embeddings(dlrm):
  c, schema, model, batch, params, rep = dlrm
  m = parse(c, schema)
  for st in schema.streams:
    emb = EventEmbed(st, len(schema.surfaces), m.dlrm.seq_dim, m.num_time_buckets)
    e = np.asarray(jax.jit(emb.apply)({"params": params[f"embed_{st.name}"]},
                                      batch["events"][st.name]))
    L = batch["events"][st.name]["length"]
    ref = np.stack([e[b, :L[b]].mean(0) for b in range(len(L))])
    np.testing.assert_allclose(np.asarray(rep["summaries"][st.name][:, 0]), ref, rtol=1e-4,
                               atol=1e-5)
  assert rep["logits"].shape == (6, 2) and np.isfinite(np.asarray(rep["logits"])).all()


def test_dlrm_gradients(dlrm):
  _, _, model, batch, params, _ = dlrm

  def loss(p):
    return masked_bce(model.apply({"params": p}, batch, True), batch["labels"],
                      batch["label_mask"])[0]
  g = jax.jit(jax.grad(loss))(params)
  for path, x in jax.tree_util.tree_flatten_with_path(g)[0]:
    x = np.asarray(x)
    assert np.isfinite(x).all() and np.abs(x).sum() > 0, jax.tree_util.keystr(path)
