"""The whole tiny Kunlun model composed from the numpy references its modules are tested against.

The input stage (ContextEncoder, EventEmbed, tested in test_inputs) is taken from the model's
own intermediates; every Kunlun layer and the heads are then rebuilt in numpy from the spec's
wiring (spec c.7 / d.1 / d.2, towers' schedule c.8) with the references of test_weightgen,
test_hsp, test_pffn, test_attention, test_wukong (MoWE = mean of experts) and test_heads, and the
logits must match the model's, with CompSkip on and off. A wiring bug (a summary from the wrong
layer or sequence, a skipped module run, tokens in another order, a tower active past its depth)
changes the logits by far more than the tolerance.
"""

import flax.linen as nn
import jax
import numpy as np
import pytest

from data.fake import random_batch, tiny_schema
from kunlun.configs import tiny
from kunlun.configs.types import parse, seq_lens
from kunlun.models.build import build_model
from kunlun.nn.wukong import split_tokens
from tests.kunlun.nn.test_attention import np_attention
from tests.kunlun.nn.test_heads import np_heads
from tests.kunlun.nn.test_hsp import np_hsp
from tests.kunlun.nn.test_pffn import fast_gelu, np_pffn
from tests.kunlun.nn.test_weightgen import gelu_tanh, rms
from tests.kunlun.nn.test_wukong import np_wukong_layer


def np_weightgen(p, x, heads, key_norm):
  """test_weightgen's reference: K, V ``[B, n_kv, H, d / H]`` generated from ``x``."""
  z = np.einsum("bnd,nm->bmd", rms(x), p["tok"])
  h = gelu_tanh(z @ p["hidden"]["kernel"] + p["hidden"]["bias"])
  k = np.einsum("bme,ehc->bmhc", h, p["key"])
  v = np.einsum("bme,ehc->bmhc", h, p["value"])
  return (rms(k) if key_norm else k), v


def np_mowe(p, x, n_out):
  """Mean over experts (leading parameter axis) of one Wukong layer each (layers_per_expert 1)."""
  n_fm, _ = split_tokens(n_out)
  E = jax.tree.leaves(p)[0].shape[0]
  return np.mean([np_wukong_layer(jax.tree.map(lambda a, e=e: a[e], p["layer_0"]), x, n_fm)
                  for e in range(E)], 0)


def np_model(m, P, x, seqs, lengths, ages, surface):
  """Spec wiring of the Kunlun trunk + heads; ``m`` the parsed model config, ``P`` the params."""
  summaries = {}
  for l in range(m.num_layers):
    p = P[f"layer_{l}"]
    kv = {}
    for t in m.seq_towers:                                       # interaction block
      if l >= t.depth or (m.comp_skip and l % 2):
        continue                                                 # inactive / odd: reuse summary
      kv[t.name] = np_weightgen(p[f"{t.name}_weightgen"], x, t.heads, m.key_norm)
      summaries[t.name] = np_hsp(p[f"{t.name}_hsp"], seqs[t.name], lengths[t.name], t.kept_len,
                                 score_clip=m.score_clip)
    tokens = [x] + [summaries[t.name] @ p[f"{t.name}_proj"]["kernel"] for t in m.seq_towers]
    x_new = np_mowe(p["mowe"]["experts"], np.concatenate(tokens, 1), m.n_ns)
    for t in m.seq_towers:                                       # transformer block
      if l >= t.depth:
        continue
      s = seqs[t.name]
      if not (m.comp_skip and l % 2):
        k, v = kv[t.name]
        s = np_pffn(s, lengths[t.name], k, v, fast_gelu, m.score_clip)
      if not m.comp_skip or l % 2:
        s = np_attention(p[f"{t.name}_attention"], s, lengths[t.name], ages[t.name], "swa",
                         window=t.window)
      if l == t.depth - 1:
        summaries[t.name] = np_hsp(p[f"{t.name}_final_hsp"], s, lengths[t.name], t.kept_len,
                                   score_clip=m.score_clip)
      seqs[t.name] = s
    x = x_new
  B = x.shape[0]
  z = np.concatenate([x.reshape(B, -1)] + [summaries[t.name].reshape(B, -1)
                                           for t in m.seq_towers], 1)
  logits, _ = np_heads(P["heads"], z, surface, m.heads.kind)
  return logits


def _random_params(shapes, seed=7):
  """Random values of the model's parameter shapes (no init compile): norm scales ~1, vectors
  ~0.1 (biases, zero-initialised logits take part), matrices ~1/sqrt(fan-in)."""
  rng = np.random.default_rng(seed)

  def one(path, a):
    name = jax.tree_util.keystr(path)
    if name.endswith("scale']"):
      v = 1.0 + 0.1 * rng.normal(size=a.shape)
    elif len(a.shape) == 1:
      v = 0.1 * rng.normal(size=a.shape)
    else:
      v = rng.normal(size=a.shape) / np.sqrt(np.prod(a.shape[:-1]))
    return v.astype(a.dtype)
  return jax.tree_util.tree_map_with_path(one, shapes)


@pytest.mark.parametrize("comp_skip", [True, False])
def test_model_equals_composition_of_module_references(comp_skip):
  cfg, schema = tiny.get_config(), tiny_schema()
  cfg.model.comp_skip = comp_skip
  cfg.model.towers.impression.depth = 1                 # towers of different depths (c.8)
  m = parse(cfg, schema)
  assert [t.depth for t in m.seq_towers] == [2, 1] and m.num_layers == 2
  model = build_model(cfg, schema)
  batch = random_batch(schema, 4, seq_lens(cfg), seed=2, min_len=1)
  shapes = jax.eval_shape(lambda b: nn.meta.unbox(model.init(jax.random.key(0), b)), batch)
  params = _random_params(shapes["params"])
  logits, state = jax.jit(lambda p, b: model.apply(            # no init compile: ~4 CPU-s
      {"params": p}, b, capture_intermediates=True, mutable=["intermediates"]))(params, batch)
  inter = state["intermediates"]
  x0 = np.asarray(inter["context"]["__call__"][0], np.float64)          # [B, n_ns, d_ns]
  seqs = {t.name: np.asarray(inter[f"embed_{t.name}"]["__call__"][0], np.float64)
          for t in m.seq_towers}
  ev = batch["events"]
  lengths = {t.name: np.asarray(ev[t.name]["length"]) for t in m.seq_towers}
  ages = {t.name: np.asarray(ev[t.name]["age"], np.float64) for t in m.seq_towers}
  P = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  want = np_model(m, P, x0, seqs, lengths, ages, np.asarray(batch["surface"]))
  got = np.asarray(logits, np.float64)
  assert got.shape == (4, 2) and np.abs(got).max() > 0.05
  np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-4)
