"""KunlunLayer / CompSkip: FLOP drop at the mid config, skipped modules absent from the jaxpr."""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from data.fake import tiny_schema
from data.synthetic import PRESETS, preset_schema
from kunlun.configs import mid, tiny
from kunlun.configs.types import parse
from kunlun.models.flops import layer_flops, model_flops
from kunlun.nn.layer import KunlunLayer
from tests.kunlun.jaxpr_scopes import name_stacks


def mid_schema():
  return preset_schema(PRESETS["mid"])            # the synthetic mid data preset's schema


def test_compskip_flop_drop_at_mid():
  S = mid_schema()
  on_cfg = mid.get_config()
  off_cfg = copy.deepcopy(on_cfg)
  off_cfg.model.comp_skip = False
  on, off = model_flops(on_cfg, S), model_flops(off_cfg, S)
  # whole model (includes the per-stream EventEmbed MLPs and heads, which CompSkip leaves alone):
  # 51.5 % at mid with the spec's dataflow (final_hsp off: without CompSkip the blocks of one more
  # layer reach the last HSP); 44.8 % with final_hsp on
  drop = 1 - on["forward"] / off["forward"]
  assert 0.45 <= drop <= 0.55, drop
  # per layer (spec Appendix C-6: ~45 +- 5 %): layers 0 + 1, where both settings run blocks:
  # 49.1 % at mid
  m_on, m_off = parse(on_cfg, S), parse(off_cfg, S)
  pair = lambda m: sum(layer_flops(m, 0).values()) + sum(layer_flops(m, 1).values())
  layer_drop = 1 - pair(m_on) / pair(m_off)
  assert 0.40 <= layer_drop <= 0.50, layer_drop
  # independent check of one term: an odd layer has no PFFN, weight generation or fresh HSP
  odd = layer_flops(m_on, 1)
  assert "pffn" not in odd and "weightgen" not in odd
  assert odd["attention"] > 0


def _layer_inputs(cfg, B=2):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(B, cfg.n_ns, cfg.d_ns)), jnp.float32)
  seqs, lengths, ages, summ = {}, {}, {}, {}
  for t in cfg.seq_towers:
    seqs[t.name] = jnp.asarray(rng.normal(size=(B, t.kept_len, t.width)), jnp.float32)
    lengths[t.name] = jnp.asarray(rng.integers(1, t.kept_len + 1, B), jnp.int32)
    ages[t.name] = jnp.asarray(np.sort(rng.exponential(1e4, (B, t.kept_len)))[:, ::-1], jnp.float32)
    summ[t.name] = jnp.asarray(rng.normal(size=(B, t.n_sum, t.width)), jnp.float32)
  return x, seqs, lengths, ages, summ


def _layer_jaxpr_names(cfg, index):
  layer = KunlunLayer(cfg, index)
  args = _layer_inputs(cfg)
  params = jax.eval_shape(layer.init, jax.random.key(0), *args)
  jaxpr = jax.make_jaxpr(lambda p, *a: layer.apply(p, *a))(params, *args)
  return name_stacks(jaxpr), params


def _tiny_cfg(comp_skip, depth=2):
  c = tiny.get_config()
  c.model.final_hsp = True          # every layer of the 2-layer towers runs its blocks
  c.model.comp_skip = comp_skip
  c.model.towers.impression.depth = depth
  return parse(c, tiny_schema())


@pytest.mark.parametrize("comp_skip", [True, False])
def test_skipped_modules_absent_from_layer_jaxpr(comp_skip):
  cfg = _tiny_cfg(comp_skip)
  even, p_even = _layer_jaxpr_names(cfg, 0)
  odd, p_odd = _layer_jaxpr_names(cfg, 1)
  for scope in ("PFFN", "GDPA", "WeightGen", "HSP", "MoWE"):
    assert scope in even, scope
  assert "SeqAttention" in odd and "MoWE" in odd
  if comp_skip:
    # layer 1 is both towers' last layer, so it holds their final HSP summaries, but no PFFN and
    # no weight generation; layer 0 runs no self-attention
    for scope in ("PFFN", "WeightGen"):
      assert scope not in odd, scope
    assert "SeqAttention" not in even
    assert not any("pffn" in k or "weightgen" in k for k in p_odd["params"])
    assert not any("attention" in k for k in p_even["params"])
  else:
    for scope in ("PFFN", "WeightGen", "SeqAttention"):
      assert scope in odd and scope in even, scope


def test_odd_layer_without_final_summary_runs_no_gdpa():
  # 4-layer model, towers at full depth: layer 1 is odd and not a tower's last layer, so under
  # CompSkip it runs only attention (softmax) and MoWE: no GDPA, no HSP at all.
  c = tiny.get_config()
  c.model.num_layers = 4
  c.model.towers.click.depth = 4
  c.model.towers.impression.depth = 4
  cfg = parse(c, tiny_schema())
  odd, _ = _layer_jaxpr_names(cfg, 1)
  for scope in ("GDPA", "PFFN", "HSP", "WeightGen"):
    assert scope not in odd, scope
  assert "SeqAttention" in odd
