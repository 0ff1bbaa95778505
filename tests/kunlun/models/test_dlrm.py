"""DLRM (``kunlun/models/dlrm.py``) through build_model: pooling against numpy, gradients."""

import flax.linen as nn
import jax
import numpy as np
import pytest

from data.fake import random_batch, tiny_schema
from kunlun.configs import tiny
from kunlun.configs.types import parse, seq_lens
from kunlun.models.build import build_model
from kunlun.nn.inputs import EventEmbed
from kunlun.nn.losses import masked_bce

KEY = jax.random.key(0, impl="unsafe_rbg")


@pytest.fixture(scope="module")
def dlrm():
  c, schema = tiny.get_config(), tiny_schema()
  c.model.arch = "dlrm"
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
