"""Event-level personalization: per-tower schedule, shallow towers keep feeding their last
summary, gradients reach every tower."""

import flax.linen as nn
import jax
import numpy as np
import pytest

from data.fake import random_batch, tiny_schema
from kunlun.configs import tiny
from kunlun.configs.types import TowerConfig, parse, seq_lens
from kunlun.models.build import build_model
from kunlun.nn.losses import masked_bce
from kunlun.nn.towers import schedule


def _t(depth):
  return TowerConfig("x", 8, 2, 4, 2, 8, 4, 2, depth)


def test_schedule_table():
  names = ("weightgen", "hsp", "pffn", "attention", "final_hsp")
  runs = lambda t, l, cs, f=True: {n for n in names if getattr(schedule(t, l, cs, f), n)}
  t = _t(3)
  # final_hsp on: every layer's blocks run, the last layer summarises the output again
  assert runs(t, 0, True) == {"weightgen", "hsp", "pffn"}
  assert runs(t, 1, True) == {"attention"}
  assert runs(t, 2, True) == {"weightgen", "hsp", "pffn", "final_hsp"}
  assert runs(t, 3, True) == set() and not schedule(t, 3, True, True).active
  full = {"weightgen", "hsp", "pffn", "attention"}
  assert runs(t, 0, False) == full and runs(t, 1, False) == full
  assert runs(t, 2, False) == full | {"final_hsp"} and runs(t, 5, False) == set()


def test_schedule_table_spec_default():
  """final_hsp off (spec d.1 / d.4): blocks whose output no later HSP reads are not built."""
  names = ("weightgen", "hsp", "pffn", "attention", "final_hsp")
  runs = lambda t, l, cs: {n for n in names if getattr(schedule(t, l, cs), n)}
  for depth in (3, 4):                  # last HSP in layer 2: layers 2 (and 3) run no block
    t = _t(depth)
    assert runs(t, 0, True) == {"weightgen", "hsp", "pffn"}
    assert runs(t, 1, True) == {"attention"}
    assert runs(t, 2, True) == {"hsp"}
    assert runs(t, 3, True) == set()
  for depth in (1, 2):                  # embedding + one HSP
    assert runs(_t(depth), 0, True) == {"hsp"} and runs(_t(depth), 1, True) == set()
  t = _t(3)                             # CompSkip off: an HSP in every layer, the last one alone
  full = {"weightgen", "hsp", "pffn", "attention"}
  assert runs(t, 0, False) == full and runs(t, 1, False) == full
  assert runs(t, 2, False) == {"hsp"}


def _init(cfg, schema):
  """``(model, batch, params, representations, intermediates, grads)``: the parameters from a
  compiled init (no forward: XLA drops it), then the representations, every module's output and
  the loss gradient from one compiled forward + backward (``__call__`` is the representations'
  logits)."""
  model = build_model(cfg, schema)
  batch = random_batch(schema, 8, seq_lens(cfg), seed=5, min_len=1)
  params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0, impl="unsafe_rbg"), batch))

  def loss(p):
    rep, v = model.apply({"params": p}, batch, True, method="representations",
                         capture_intermediates=True, mutable=["intermediates"])
    return masked_bce(rep["logits"], batch["labels"], batch["label_mask"])[0], (rep, v)
  (_, (rep, v)), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(params["params"])
  return model, batch, params["params"], rep, v["intermediates"], g


@pytest.fixture(scope="module")
def spec_default():
  """3-layer tiny, click tower depth 3, impression depth 1, final_hsp off."""
  cfg, schema = tiny.get_config(), tiny_schema()
  cfg.model.num_layers, cfg.model.towers.click.depth = 3, 3
  cfg.model.final_hsp = False
  return _init(cfg, schema)


def test_spec_default_summaries_and_gradients(spec_default):
  model, batch, params, rep, inter, g = spec_default
  assert sorted(k for k in params["layer_2"] if k.startswith("click")) == ["click_hsp",
                                                                            "click_proj"]
  assert sorted(k for k in params["layer_0"] if k.startswith("impression")) == [
      "impression_hsp", "impression_proj"]
  assert not any("final_hsp" in k for l in range(3) for k in params[f"layer_{l}"])
  # the summaries leaving the towers are their last HSPs' (layer 2 for click, 0 for impression)
  for tower, layer in (("click", 2), ("impression", 0)):
    want = np.asarray(inter[f"layer_{layer}"][f"{tower}_hsp"]["__call__"][0])
    np.testing.assert_allclose(np.asarray(rep["summaries"][tower]), want, rtol=1e-6)
  for path, x in jax.tree_util.tree_flatten_with_path(g)[0]:   # no dead (untrained) parameter
    if "surface" in jax.tree_util.keystr(path):                  # event surface ids may miss rows
      continue
    assert np.abs(np.asarray(x)).sum() > 0, jax.tree_util.keystr(path)


@pytest.fixture(scope="module")
def setup():
  """tiny with final_hsp on."""
  cfg, schema = tiny.get_config(), tiny_schema()
  cfg.model.final_hsp = True
  m = parse(cfg, schema)
  assert m.num_layers == 2 and m.tower("impression").depth == 1 and m.tower("click").depth == 2
  return _init(cfg, schema)


def test_shallow_tower_keeps_feeding_last_summary(setup):
  model, batch, params, rep, inter, _ = setup
  # layer 1 holds nothing of the depth-1 impression tower except its summary projection
  imp = sorted(k for k in params["layer_1"] if k.startswith("impression"))
  assert imp == ["impression_proj"], imp

  last_imp = np.asarray(inter["layer_0"]["impression_final_hsp"]["__call__"][0])
  proj_in_layer1 = np.asarray(inter["layer_1"]["impression_proj"]["__call__"][0])
  kernel = np.asarray(params["layer_1"]["impression_proj"]["kernel"])
  # layer 1's MoWE input for the shallow tower = Proj(summary of its last layer)
  np.testing.assert_allclose(proj_in_layer1, last_imp @ kernel, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(np.asarray(rep["summaries"]["impression"]), last_imp, rtol=1e-6)
  # the full-depth click tower's final summary comes from its last layer (layer 1)
  last_click = np.asarray(inter["layer_1"]["click_final_hsp"]["__call__"][0])
  np.testing.assert_allclose(np.asarray(rep["summaries"]["click"]), last_click, rtol=1e-6)


def test_gradients_reach_every_tower(setup):
  model, batch, params, _, _, g = setup
  for tower in ("click", "impression"):
    leaves = jax.tree.leaves(g[f"embed_{tower}"])
    for l in ("layer_0", "layer_1"):
      leaves += jax.tree.leaves({k: v for k, v in g[l].items() if k.startswith(tower)})
    assert leaves
    for x in leaves:
      assert np.isfinite(np.asarray(x)).all() and np.abs(np.asarray(x)).sum() > 0, tower
  # the shallow tower's summary projection in a later layer is trained too
  assert np.abs(np.asarray(g["layer_1"]["impression_proj"]["kernel"])).sum() > 0
