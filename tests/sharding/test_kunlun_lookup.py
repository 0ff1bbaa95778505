"""Routing ``kunlun.inputs.lookup`` to the sharded exchange (monkeypatched here; see the sharding
report for the one-line change in kunlun/inputs.py): the tiny model's forward is unchanged."""

import flax.linen as nn
import jax
import numpy as np
import pytest

from data.fake import random_batch, tiny_schema
from sharding import checks, embedding, partition
from sharding import mesh as M
from sharding import rules as R


@pytest.mark.slow
def test_kunlun_forward_with_sharded_lookup(monkeypatch):
  from kunlun import inputs
  from kunlun.config import seq_lens
  from kunlun.configs import tiny
  from kunlun.model import build_model
  cfg, schema = tiny.get_config(), tiny_schema()
  model = build_model(cfg, schema)
  batch = random_batch(schema, 16, seq_lens(cfg), seed=1, min_len=1)
  params = nn.meta.unbox(jax.jit(lambda k: model.init(k, batch, train=False))(jax.random.key(0))["params"])
  fwd = lambda p, b: model.apply({"params": p}, b, train=False)
  want = np.asarray(jax.jit(fwd)(params, batch))

  monkeypatch.setattr(inputs, "lookup", embedding.lookup)
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
