"""Train step: finite updates apply, non-finite loss/grad skips the update bitwise."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from kunlun.train import optim, step


class _Toy(nn.Module):
  """A two-task logistic model over dense features and one embedding table (test only)."""

  @nn.compact
  def __call__(self, batch, train: bool = False):
    table = self.param("user_embedding", nn.initializers.normal(0.1), (10, 4))
    h = jnp.concatenate([batch["dense"], table[batch["sparse"]["u"][:, 0]]], -1)
    return nn.Dense(2)(h)


def _batch(seed=0, B=16):
  rng = np.random.default_rng(seed)
  return {"dense": rng.normal(size=(B, 3)).astype(np.float32),
          "sparse": {"u": rng.integers(0, 10, (B, 1)).astype(np.int32)},
          "labels": (rng.uniform(size=(B, 2)) < 0.4).astype(np.float32),
          "label_mask": np.ones((B, 2), np.float32),
          "example_mask": np.r_[np.ones(B - 3), np.zeros(3)].astype(np.float32)}


def _setup():
  cfg = ml_collections.ConfigDict(dict(lr=1e-2, warmup_steps=0, schedule="constant", weight_decay=0.0,
                                       b1=0.9, b2=0.999, clip_norm=1.0, emb_lr=0.05))
  model = _Toy()
  params = model.init(jax.random.key(0), _batch())["params"]
  tx = optim.make_optimizer(cfg, 10)
  return model, tx, params, tx.init(params)


def test_finite_step_updates_and_sums_match_numpy():
  model, tx, params, opt = _setup()
  train_step = step.make_train_step(model, tx)
  b = _batch()
  logits = np.asarray(model.apply({"params": params}, b), np.float64)
  before = jax.tree.map(np.asarray, params)
  new_params, _, s = train_step(params, opt, b, jax.random.key(1), 0)
  assert bool(s["ok"])
  m = b["label_mask"] * b["example_mask"][:, None]
  p = 1 / (1 + np.exp(-logits))
  bce = -(b["labels"] * np.log(p) + (1 - b["labels"]) * np.log(1 - p))
  np.testing.assert_allclose(s["loss_sum"], (bce * m).sum(0), rtol=1e-5)
  np.testing.assert_allclose(s["count"], m.sum(0))
  np.testing.assert_allclose(s["loss"], ((bce * m).sum(0) / m.sum(0)).sum(), rtol=1e-5)
  assert not np.allclose(new_params["Dense_0"]["kernel"], before["Dense_0"]["kernel"])


def test_nonfinite_step_is_skipped_bitwise():
  model, tx, params, opt = _setup()
  train_step = step.make_train_step(model, tx)
  p_before = jax.tree.map(np.asarray, params)
  o_before = jax.tree.map(np.asarray, opt)
  b = _batch()
  b["dense"][0, 0] = np.nan
  new_params, new_opt, s = train_step(params, opt, b, jax.random.key(1), 0)
  assert not bool(s["ok"])
  for a, c in zip(jax.tree.leaves(new_params) + jax.tree.leaves(new_opt),
                  jax.tree.leaves(p_before) + jax.tree.leaves(o_before)):
    np.testing.assert_array_equal(np.asarray(a), c)
