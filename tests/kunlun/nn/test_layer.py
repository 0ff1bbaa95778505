"""KunlunLayer / CompSkip: FLOP drop at the mid config, skipped modules absent from the jaxpr."""

import copy

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from data.fake import tiny_schema
from data.synthetic import PRESETS, preset_schema
from kunlun.configs import mid, tiny
from kunlun.configs.types import parse
from kunlun.models.flops import layer_flops, model_flops
from kunlun.nn.layer import KunlunLayer, SummaryProj
from sharding import with_axes
from tests.kunlun.jaxpr_scopes import name_stacks
from tests.kunlun.nn.backends import pallas_matches_xla


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


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_summary_projection_takes_the_weight_gradient_kernel(dtype):
  """``SummaryProj`` keeps ``nn.Dense``'s parameter (name, shape, initial values: old checkpoints
  load). On the Pallas backend (interpret mode) its weight's gradient runs on
  ``pallas_kernels.wgrad`` (in the backward's jaxpr, not the XLA backend's); values and both
  gradients equal the XLA backend's (``pallas_matches_xla``) and float64 numpy's."""
  rng = np.random.default_rng(3)
  s = jnp.asarray(rng.normal(size=(4, 8, 64)), dtype)          # [B, n_sum, d_e]
  mods = {b: SummaryProj(32, dtype, b) for b in ("xla", "pallas")}
  v = mods["xla"].init(jax.random.key(5), s)
  dense = nn.Dense(32, use_bias=False, dtype=dtype, param_dtype=jnp.float32,   # as it was
                   kernel_init=with_axes(nn.initializers.lecun_normal(), (None, "embed")))
  ref = dense.init(jax.random.key(5), s)
  assert jax.tree.structure(v) == jax.tree.structure(ref)
  np.testing.assert_array_equal(v["params"]["kernel"].value, ref["params"]["kernel"].value)
  v = nn.unbox(v)
  g = jnp.asarray(rng.normal(size=(4, 8, 32)), jnp.float32)
  apply = lambda m, v, x: m.apply(v, x)
  loss = lambda m: lambda v, x: jnp.sum(apply(m, v, x).astype(jnp.float32) * g)
  bwd = lambda m: str(jax.make_jaxpr(jax.grad(loss(m)))(v, s))
  assert "row_scaled_wgrad" in bwd(mods["pallas"]) and "row_scaled_wgrad" not in bwd(mods["xla"])
  y = pallas_matches_xla(mods, v, s, apply, g, dtype)
  w = np.asarray(v["params"]["kernel"], np.float64)
  x64 = np.asarray(s.astype(jnp.float32), np.float64)
  if dtype == jnp.bfloat16:                                    # the weight as the GEMM reads it
    w = np.asarray(jnp.asarray(w, jnp.bfloat16).astype(jnp.float32), np.float64)
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  want = x64 @ w
  assert np.max(np.abs(np.asarray(y, np.float64) - want)) <= tol * np.max(np.abs(want))
  gw = jax.grad(loss(mods["pallas"]))(v, s)["params"]["kernel"]
  want_gw = np.einsum("bnk,bnc->kc", x64, np.asarray(g, np.float64))
  assert (np.max(np.abs(np.asarray(gw, np.float64) - want_gw))
          <= tol * np.max(np.abs(want_gw)))
