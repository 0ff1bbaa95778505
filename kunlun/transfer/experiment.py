"""Training/eval helpers of the transfer experiment (used by ``bench/transfer.py``).

A VM step supports KD (student-adapter soft targets, weight ``lam``) and LoopFM inputs; the
plain VM is the same code with ``lam = 0`` and LoopFM off (``test_loopfm`` checks that the LoopFM
wrapper with both inputs off is exactly ``kunlun.model.Kunlun``).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from kunlun.train.metrics import EvalAccumulator
from kunlun.train.step import label_mask
from kunlun.transfer.adapter import distill_loss, soft_targets
from kunlun.transfer.join import AsOfIndex, EmbeddingLog, pair_key

FM_KEYS = ("fm_ctx", "fm_ctx_present", "fm_events", "fm_events_present")


class FMFeatures:
  """Per-batch FM inputs from an export: LoopFM features (as-of joins) and KD soft targets.

  Args:
    log: ``EmbeddingLog`` of exported pooled embeddings.
    logits: ``AsOfIndex`` over (pair_key, request_ts) -> FM logits ``[K]``.
    adapter: ``(module, params)`` of a fitted StudentAdapter, or None (raw FM sigmoid).
  """

  def __init__(self, log: EmbeddingLog, logits: AsOfIndex, adapter=None, join_key="user",
               max_age=None):
    self.log, self.logits, self.adapter = log, logits, adapter
    self.join_key, self.max_age = join_key, max_age
    self.present = {"ctx": [0, 0], "events": [0, 0]}
    if adapter is not None:
      m, p = adapter
      self._adapt = jax.jit(lambda lg, s: soft_targets(m, p, lg, s, jnp.zeros(lg.shape[0])))

  def teacher_logits(self, batch):
    """FM logits of the current example (exact key and time) and their presence."""
    keys = pair_key(batch["user_id"], batch["ad_id"])
    t = np.asarray(batch["request_ts"], np.int64)
    lg, present, _ = self.logits.lookup(keys, t, max_age=0)
    return lg, present

  def soft(self, batch):
    """``(soft f32[B, K], soft_mask f32[B, K])``: calibrated targets where the FM logit exists."""
    lg, present = self.teacher_logits(batch)
    if self.adapter is None:
      q = 1 / (1 + np.exp(-lg))
    else:
      q = np.asarray(self._adapt(lg, np.asarray(batch["surface"], np.int32)))
    mask = label_mask(batch) * present[:, None]
    return q.astype(np.float32), np.asarray(mask, np.float32)

  def loopfm(self, batch, streams):
    out = self.log.join_batch(batch, streams, key=self.join_key, max_age=self.max_age)
    self.present["ctx"][0] += int(out["fm_ctx_present"].sum())
    self.present["ctx"][1] += out["fm_ctx_present"].size
    for s in streams:
      valid = np.arange(out["fm_events_present"][s].shape[1])[None] < \
          np.asarray(batch["events"][s]["length"])[:, None]
      self.present["events"][0] += int(out["fm_events_present"][s].sum())
      self.present["events"][1] += int(valid.sum())
    return {k: out[k] for k in FM_KEYS}

  def present_rates(self):
    return {k: (a / b if b else 0.0) for k, (a, b) in self.present.items()}


def make_vm_step(model, tx):
  """``step(params, opt, batch, soft, soft_mask, lam) -> (params, opt, loss)`` (jitted)."""

  @jax.jit
  def step(params, opt, batch, soft, soft_mask, lam):
    mask = label_mask(batch)

    def loss_fn(p):
      logits = model.apply({"params": p}, batch, train=True)
      return distill_loss(logits, batch["labels"], mask, soft, lam, soft_mask=soft_mask)

    loss, g = jax.value_and_grad(loss_fn)(params)
    upd, opt = tx.update(g, opt, params)
    return optax.apply_updates(params, upd), opt, loss

  return step


def init_params(model, batch, seed=0):
  init = jax.jit(lambda r, b: nn.meta.unbox(model.init(r, b)["params"]))
  return init(jax.random.key(seed), batch)


def make_predict(model):
  return jax.jit(lambda p, b: jax.nn.sigmoid(model.apply({"params": p}, b).astype(jnp.float32)))


def evaluate(predict, params, batches, surfaces, tasks, extra=None):
  """Per surface x task metrics over host batches (``extra(batch)`` adds model inputs)."""
  acc = EvalAccumulator(surfaces, tasks)
  for b in batches:
    inp = {**b, **extra(b)} if extra else b
    acc.add(np.asarray(predict(params, inp)), b)
  return acc.result()
