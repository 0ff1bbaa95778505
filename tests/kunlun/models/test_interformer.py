"""InterFormer (spec A.1, h-17): each new component against a numpy reference, then the model."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from data.fake import random_batch, tiny_schema
from kunlun.configs import tiny
from kunlun.configs.types import seq_lens
from kunlun.models.build import build_model
from kunlun.models.interformer import (
  CrossSeq,
  InterFormer,
  PersonalizedFFN,
  RoPEAttention,
  recent_tokens,
)
from kunlun.nn.hsp import PMA
from kunlun.nn.losses import masked_bce

KEY = jax.random.key(0, impl="unsafe_rbg")
RNG = np.random.default_rng(0)
B, T, d, H = 3, 10, 8, 2
S = RNG.normal(size=(B, T, d)).astype(np.float32)
LENGTHS = np.array([10, 6, 1], np.int32)          # valid rows (CLS included)
VALID = np.arange(T)[None, :] < LENGTHS[:, None]


def _init_apply(module, *args):
  params = nn.meta.unbox(jax.jit(module.init)(KEY, *args))
  params = jax.tree.map(lambda p: p + 0.1 * RNG.normal(size=p.shape).astype(np.float32), params)
  return jax.tree.map(np.asarray, params["params"]), np.asarray(jax.jit(module.apply)(params,
                                                                                      *args))


def np_rms(x):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6)


def np_gelu(x):
  return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def test_recent_tokens_are_the_last_valid_events():
  n_cls, k = 2, 3
  s = RNG.normal(size=(4, n_cls + 6, 5)).astype(np.float32)
  lengths = np.array([6, 3, 2, 0], np.int32)                 # events after the CLS tokens
  got = np.asarray(recent_tokens(jnp.asarray(s), lengths, n_cls, k))
  for b, n in enumerate(lengths):
    for j in range(k):
      e = n - k + j                                          # event index (oldest first)
      want = s[b, n_cls + e] if e >= 0 else np.zeros(5)
      np.testing.assert_array_equal(got[b, j], want)


def test_personalized_ffn_is_a_generated_d_by_d_projection():
  x = RNG.normal(size=(B, 3, 4)).astype(np.float32)
  p, got = _init_apply(PersonalizedFFN(hidden=6), S, x, VALID)
  h = np_gelu(np_rms(x).reshape(B, -1) @ p["gen_hidden"]["kernel"] + p["gen_hidden"]["bias"])
  w = (h @ p["gen_out"]["kernel"] + p["gen_out"]["bias"]).reshape(B, d, d)
  want = np.einsum("btd,bde->bte", np_rms(S), w) * VALID[..., None]
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  # at init the generated matrix is the identity plus a small per-example perturbation
  p0 = nn.meta.unbox(PersonalizedFFN(hidden=6).init(KEY, S, x, VALID))["params"]
  np.testing.assert_array_equal(np.asarray(p0["gen_out"]["bias"]).reshape(d, d), np.eye(d))


def test_rope_attention_matches_dense_numpy():
  p, got = _init_apply(RoPEAttention(H), S, VALID)
  dh = d // H
  qkv = np.einsum("btd,dihc->btihc", np_rms(S), p["qkv"])
  q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]                 # [B, T, H, dh]
  freq = 10000.0 ** (-np.arange(dh // 2) * 2.0 / dh)
  ang = np.arange(T)[:, None] * freq[None, :]                        # [T, dh/2]

  def rot(x):                                                          # half-split rotation
    x1, x2 = x[..., :dh // 2], x[..., dh // 2:]
    c, s = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)
  q, k = rot(q), rot(k)
  want = np.zeros((B, T, d), np.float32)
  for b in range(B):
    n = LENGTHS[b]
    for h in range(H):
      sc = q[b, :n, h] @ k[b, :n, h].T / np.sqrt(dh)
      a = np.exp(sc - sc.max(-1, keepdims=True))
      a /= a.sum(-1, keepdims=True)
      o = a @ v[b, :n, h]                                                # [n, dh]
      want[b, :n] += o @ p["out"][h]
    want[b, :n] += S[b, :n]
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_cross_seq_gates_cls_pma_and_recent():
  n_cls, n_pma, n_rec = 2, 3, 2
  ev_len = LENGTHS - n_cls + 2                                         # events after the CLS
  ev_len = np.minimum(np.maximum(ev_len, 0), T - n_cls).astype(np.int32)
  mod = CrossSeq(n_cls, n_pma, n_rec, H)
  p, got = _init_apply(mod, S, ev_len)
  pma = np.asarray(PMA(n_pma, H).apply({"params": p["pma"]}, S, n_cls + ev_len))
  z = np.concatenate([S[:, :n_cls], pma, np.asarray(recent_tokens(S, ev_len, n_cls, n_rec))], 1)
  g = 1 / (1 + np.exp(-(z @ p["gate"]["dense"]["kernel"] + p["gate"]["dense"]["bias"])))
  np.testing.assert_allclose(got, g * z, rtol=1e-4, atol=1e-5)
  assert got.shape == (B, n_cls + n_pma + n_rec, d)


@pytest.fixture(scope="module")
def model_setup():
  c, schema = tiny.get_config(), tiny_schema()
  c.model.arch = "interformer"
  model = build_model(c, schema)
  batch = random_batch(schema, 4, seq_lens(c), seed=2, min_len=1)
  params = nn.meta.unbox(jax.jit(model.init)(KEY, batch))["params"]   # no forward: XLA drops it

  def loss(p, b):          # ``__call__`` is the representations' logits
    rep = model.apply({"params": p}, b, True, method="representations")
    return masked_bce(rep["logits"], b["labels"], b["label_mask"])[0], rep
  grad_fn = jax.jit(jax.value_and_grad(loss, has_aux=True))   # one program for both tests below
  (_, rep), _ = grad_fn(params, batch)
  return c, model, batch, params, rep, grad_fn


def test_model_structure_and_padding_is_inert(model_setup):
  c, model, batch, params, rep, grad_fn = model_setup
  assert isinstance(model, InterFormer)
  m = model.cfg
  n_s = {t.name: m.interformer.n_cls + t.n_sum + m.interformer.n_recent for t in m.towers}
  assert {k: v.shape for k, v in rep["summaries"].items()} == {
      t.name: (4, n_s[t.name], t.width) for t in m.towers}
  for l in range(m.num_layers):                  # every stream runs every layer, all arches
    assert {"x_cross", "dhen", "click_cross", "click_pffn", "click_mha", "impression_cross",
            "impression_pffn", "impression_mha"} <= set(params[f"layer_{l}"])
  # padded events never reach the output
  b2 = jax.tree.map(np.array, batch)
  for s in ("click", "impression"):
    ev, L = b2["events"][s], batch["events"][s]["length"]
    pad = np.arange(ev["item"].shape[1])[None, :] >= L[:, None]
    ev["item"] = np.where(pad, 7, ev["item"])
    ev["age"] = np.where(pad, 1e5, ev["age"])
  (_, rep2), _ = grad_fn(params, b2)
  np.testing.assert_allclose(np.asarray(rep2["logits"]), np.asarray(rep["logits"]),
                             rtol=1e-5, atol=1e-6)


def test_model_gradients_reach_every_parameter(model_setup):
  _, model, batch, params, _, grad_fn = model_setup
  _, g = grad_fn(params, batch)
  for path, x in jax.tree_util.tree_flatten_with_path(g)[0]:
    x, name = np.asarray(x), jax.tree_util.keystr(path)
    assert np.isfinite(x).all(), name
    if "surface" not in name:                     # surface tables: rows of unseen surfaces
      assert np.abs(x).sum() > 0, name
