"""The ablated Kunlun (``kunlun/models/ablated.py``): every Kunlun change switched off."""

import jax

from data.fake import random_batch, tiny_schema
from data.synthetic import PRESETS, preset_schema
from kunlun.configs import mid, tiny
from kunlun.configs.types import seq_lens
from kunlun.models.build import build_model
from kunlun.models.flops import model_flops
from kunlun.models.kunlun import Kunlun
from tests.kunlun.jaxpr_scopes import name_stacks

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
