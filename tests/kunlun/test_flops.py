"""Analytic FLOPs against XLA's cost analysis (forward only, XLA-only configs, matmul-dominated)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from data.fake import random_batch, tiny_schema
from kunlun import flops as F
from kunlun.attention import SeqAttention
from kunlun.config import seq_lens, tower
from kunlun.configs import tiny
from kunlun.hsp import HSP
from kunlun.model import build_model
from kunlun.mowe import MoWE
from kunlun.pffn import PFFN
from kunlun.weightgen import WeightGen

KEY = jax.random.key(0, impl="unsafe_rbg")


def xla_flops(fn, *args):
  return jax.jit(fn).lower(*args).cost_analysis()["flops"]


def module_flops(module, *args):
  params = jax.eval_shape(module.init, KEY, *args)
  return xla_flops(lambda p, *a: module.apply(p, *a), params, *args)


def xla_config():
  """Matmul-dominated, XLA-only (full softmax attention: XLA computes exactly the counted band)."""
  c = tiny.get_config()
  m = c.model
  m.d_ns, m.n_ns = 64, 8
  m.attention.kind = "full"
  m.towers.click = tower(width=128, heads=2, n_kv=32, window=8, kept_len=32, n_seed=8, n_sum=2,
                         depth=2)
  m.towers.impression = tower(width=128, heads=2, n_kv=32, window=8, kept_len=32, n_seed=8,
                              n_sum=2, depth=1)
  m.mowe.update(mlp_hidden=128, rank=8)
  m.heads.update(top_mlp=(128,), tower_hidden=32)
  m.dlrm.update(seq_dim=128, mlp=(512, 256))
  return c


@pytest.mark.parametrize("arch,comp_skip,cross_layer", [
    ("kunlun", True, False), ("kunlun", False, False), ("kunlun", True, True),
    ("interformer", True, False), ("dlrm", True, False)])
def test_model_flops_match_xla(arch, comp_skip, cross_layer):
  c, schema, B = xla_config(), tiny_schema(), 8
  c.model.arch, c.model.comp_skip = arch, comp_skip
  if cross_layer:                                  # connections need >= 2 layers per expert
    c.model.mowe.update(layers_per_expert=3, cross_layer=True)
  model = build_model(c, schema)
  batch = random_batch(schema, B, seq_lens(c), seed=0)
  params = jax.eval_shape(model.init, KEY, batch, False)
  xf = xla_flops(lambda p, b: model.apply(p, b, False), params, batch) / B
  an = F.model_flops(c, schema)
  assert abs(an["forward"] / xf - 1) < 0.05, (an["forward"], xf)
  assert an["train_step"] == 3 * an["forward"]
  assert abs(sum(an["per_module"].values()) - an["forward"]) < 1e-6 * an["forward"]


def test_module_formulas_match_xla():
  rng = np.random.default_rng(0)
  B, T, d, H, n_kv, d_ns, N = 4, 32, 512, 2, 128, 64, 8   # d_h = 256: matmuls dominate
  s = jnp.asarray(rng.normal(size=(B, T, d)), jnp.float32)
  lengths = jnp.full((B,), T, jnp.int32)
  age = jnp.ones((B, T), jnp.float32)
  x = jnp.asarray(rng.normal(size=(B, N, d_ns)), jnp.float32)
  kv = jnp.ones((B, n_kv, H, d // H), jnp.float32)
  close = lambda a, b: abs(a / b - 1) < 0.05
  assert close(F.weightgen_flops(N, d_ns, n_kv, d) * B, module_flops(WeightGen(n_kv, H, d), x))
  assert close(F.pffn_flops(T, n_kv, d) * B, module_flops(PFFN(H), s, lengths, kv, kv))
  att = SeqAttention(H, kind="full", rotary=False)
  assert close(F.attention_flops(T, d, "full", 0, 64) * B, module_flops(att, s, lengths, age))
  # HSP: the seed query projection is batch-shared (not counted per example)
  hsp = HSP(n_seed=16, n_sum=4, heads=H, rank=4)
  q_shared = 2 * 16 * d * d
  assert close(F.hsp_flops(T, d, 16, 4, 4) * B + q_shared, module_flops(hsp, s, lengths))
  mw = MoWE(num_experts=2, layers_per_expert=2, n_out=N, rank=8, mlp_hidden=256)
  cfg = F.parse(xla_config(), tiny_schema())
  import dataclasses
  cfg = dataclasses.replace(cfg, d_ns=d_ns, n_ns=N, mowe=dataclasses.replace(
      cfg.mowe, num_experts=2, layers_per_expert=2, rank=8, mlp_hidden=256))
  x12 = jnp.asarray(rng.normal(size=(B, N + 4, d_ns)), jnp.float32)
  assert close(F.mowe_flops(cfg, N + 4) * B, module_flops(mw, x12))


def test_swa_and_block_counts_are_the_model_band():
  T, d, w, b = 1024, 256, 64, 64
  assert F.attention_flops(T, d, "swa", w, b) == 8 * T * d * d + 4 * T * (2 * w + 1) * d
  assert F.attention_flops(T, d, "block", w, b) == 8 * T * d * d + 4 * T * b * d
  assert F.attention_flops(T, d, "full", w, b) == 8 * T * d * d + 4 * T * T * d


@pytest.mark.parametrize("num_layers", [2, 3])
def test_mowe_cross_layer_flops_match_xla(num_layers):
  """The extra FLOPs of the cross-layer connections (h-19): analytic vs XLA, on vs off."""
  import dataclasses
  B, N, d_ns, n_in = 4, 8, 64, 12
  x = jnp.ones((B, n_in, d_ns), jnp.float32)
  cfg = F.parse(xla_config(), tiny_schema())
  got = {}
  for cross in (False, True):
    mowe = dataclasses.replace(cfg.mowe, num_experts=2, layers_per_expert=num_layers, rank=8,
                               mlp_hidden=256, cross_layer=cross)
    c = dataclasses.replace(cfg, d_ns=d_ns, n_ns=N, mowe=mowe)
    got[cross] = (F.mowe_flops(c, n_in) * B,
                  module_flops(MoWE(2, num_layers, N, 8, 256, cross_layer=cross), x))
  extra = 2 * (2 * n_in * N * d_ns + sum(2 * (l + 1) * N * d_ns for l in range(1, num_layers)))
  assert got[True][0] - got[False][0] == extra * B
  assert abs((got[True][1] - got[False][1]) / (extra * B) - 1) < 0.1, got   # + residual adds
  assert abs(got[True][0] / got[True][1] - 1) < 0.05, got
  assert F.wukong_cross_layer_flops(n_in, d_ns, N, 1) == 0.0
  assert F.wukong_cross_layer_flops(N, d_ns, N, 2) == 2 * 2 * N * d_ns     # no X_0 token map
