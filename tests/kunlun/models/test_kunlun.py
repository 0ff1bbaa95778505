"""Whole-model checks on the tiny preset: shapes, gradients, padding invariance, bf16, learning."""

import copy

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from data.fake import random_batch, tiny_schema
from kunlun.configs import tiny
from kunlun.configs.types import seq_lens
from kunlun.models.build import build_model
from kunlun.nn.losses import masked_bce

B = 64             # the training test's batch size: its steps reuse the shared gradient program
KEY = lambda s=0: jax.random.key(s, impl="unsafe_rbg")   # cheap to compile on CPU


@pytest.fixture(scope="module")
def setup():
  cfg, schema = tiny.get_config(), tiny_schema()
  model = build_model(cfg, schema)
  batch = random_batch(schema, B, seq_lens(cfg), seed=3, min_len=1)
  params = nn.meta.unbox(jax.jit(model.init)(KEY(), batch))["params"]  # XLA drops the forward

  def loss_aux(p, b):      # aux: __call__'s logits and the representations (one forward in XLA)
    logits = model.apply({"params": p}, b, True)
    rep = model.apply({"params": p}, b, True, method="representations")
    return masked_bce(logits, b["labels"], b["label_mask"])[0], (logits, rep)
  grad_fn = jax.jit(jax.value_and_grad(loss_aux, has_aux=True))
  (_, (_, rep0)), _ = grad_fn(params, batch)
  return cfg, schema, model, batch, params, rep0, grad_fn


def test_representations(setup):
  cfg, schema, model, batch, params, rep, grad_fn = setup
  assert rep["logits"].shape == (B, 2) and rep["logits"].dtype == jnp.float32
  assert rep["pooled"].shape == (B, cfg.model.heads.top_mlp[-1])
  assert rep["summaries"]["click"].shape == (B, 2, 32)
  assert rep["summaries"]["impression"].shape == (B, 1, 16)
  (_, (logits, _)), _ = grad_fn(params, batch)              # __call__ returns the same logits
  np.testing.assert_allclose(np.asarray(logits), np.asarray(rep["logits"]), rtol=1e-5, atol=1e-5)


def test_every_parameter_gets_finite_nonzero_gradient(setup):
  _, _, model, batch, params, _, grad_fn = setup
  _, grads = grad_fn(params, batch)
  flat = jax.tree_util.tree_flatten_with_path(grads)[0]
  assert len(flat) > 50
  bad = [jax.tree_util.keystr(k) for k, g in flat if not np.all(np.isfinite(np.asarray(g)))]
  zero = [jax.tree_util.keystr(k) for k, g in flat if not np.any(np.asarray(g) != 0)]
  assert not bad, bad
  assert not zero, zero


def _pad_events(batch, extra, garbage_seed=None):
  """Pads every stream by ``extra`` slots; with a seed, fills all padded slots with garbage."""
  b = copy.deepcopy(batch)
  rng = np.random.default_rng(garbage_seed)
  for ev in b["events"].values():
    L = ev["length"]
    for k, v in list(ev.items()):
      if k == "length":
        continue
      v = np.concatenate([v, np.zeros((v.shape[0], extra), v.dtype)], axis=1)
      if garbage_seed is not None:
        pad = np.arange(v.shape[1])[None, :] >= L[:, None]
        junk = (rng.exponential(1e5, v.shape) if v.dtype.kind == "f"
                else rng.integers(0, 3, v.shape)).astype(v.dtype)
        v = np.where(pad, junk, v)
      ev[k] = v
  return b


def test_padding_invariance(setup):
  _, _, model, batch, params, rep, grad_fn = setup
  ref = np.asarray(rep["logits"])
  (_, (ref2, _)), g_ref = grad_fn(params, batch)
  garbage = _pad_events(batch, 0, garbage_seed=1)           # same shape, junk in padded slots
  (_, (out, _)), g = grad_fn(params, garbage)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref2), rtol=1e-5, atol=1e-5)
  # padded slots leak into no gradient either
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
  longer = _pad_events(batch, 16)                           # streams padded 16 slots longer
  out = jax.jit(lambda p, b: model.apply({"params": p}, b, False))(params, longer)
  np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)


def test_bf16_compute_close_to_fp32(setup):
  cfg, schema, _, batch, params, rep, _ = setup
  c16 = copy.deepcopy(cfg)
  c16.model.dtype = "bfloat16"
  m16 = build_model(c16, schema)
  out16 = jax.jit(lambda p, b: m16.apply({"params": p}, b, False))(params, batch)
  out32 = np.asarray(rep["logits"])
  assert out16.dtype == jnp.float32
  err = np.abs(np.asarray(out16) - out32)
  # stated tolerance: bf16 (8-bit mantissa) compute with fp32 norms/softmax/loss keeps logits
  # within 0.1 absolute (max) and 0.03 (mean) of fp32 at tiny scale (logits are O(1))
  assert err.max() < 0.1 and err.mean() < 0.03, (err.max(), err.mean())
  p16 = jax.nn.sigmoid(np.asarray(out16))
  p32 = jax.nn.sigmoid(out32)
  assert np.abs(p16 - p32).max() < 0.025


def planted_batches(schema, lens, n=4, batch_size=64):
  """Fixed stream with a learnable signal: click <- user_segment < 25; conversion <- the example
  has more than half its click stream filled."""
  out = []
  for i in range(n):
    b = random_batch(schema, batch_size, lens, seed=100 + i)
    seg = b["sparse"]["user_segment"][:, 0]
    b["labels"] = np.stack([(seg < 25), b["events"]["click"]["length"] > lens["click"] // 2],
                           axis=1).astype(np.float32)
    out.append(b)
  return out


@pytest.mark.slow
def test_training_reduces_loss(setup):
  """40 Adam steps (the loss is down to ~6% of its start; with the heads fed zeros it stays
  at ~99%) from the shared init (same key: the parameters do not depend on the batch)."""
  cfg, schema, model, _, params, _, grad_fn = setup
  batches = planted_batches(schema, seq_lens(cfg), batch_size=B)
  tx = optax.adam(3e-3)
  opt = tx.init(params)

  @jax.jit
  def update(params, opt, g):
    upd, opt = tx.update(g, opt, params)
    return optax.apply_updates(params, upd), opt

  losses = []
  for i in range(40):            # the step's gradient: the shared compiled program of ``setup``
    (loss, _), g = grad_fn(params, batches[i % len(batches)])
    params, opt = update(params, opt, g)
    losses.append(float(loss))
  start, end = np.mean(losses[:4]), np.mean(losses[-8:])
  assert np.isfinite(losses).all()
  assert end < 0.4 * start, (start, end)
