"""Training/eval helpers of the transfer experiment (used by ``bench/experiments/transfer.py``).

A VM step supports KD (student-adapter soft targets, weight ``lam``) and LoopFM inputs; the
plain VM is the same code with ``lam = 0`` and LoopFM off (``test_loopfm`` checks that the LoopFM
wrapper with both inputs off is exactly ``kunlun.models.kunlun.Kunlun``).
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
from kunlun.transfer.cache import SpeculativeCache
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
               max_age=None, fm_cutoff: int | None = None):
    self.log, self.logits, self.adapter = log, logits, adapter
    self.join_key, self.max_age, self.fm_cutoff = join_key, max_age, fm_cutoff
    self.present = {"ctx": [0, 0], "events": [0, 0]}
    if adapter is not None:
      m, p = adapter
      self._adapt = jax.jit(lambda lg, s, age: soft_targets(m, p, lg, s, age))

  def staleness(self, batch) -> np.ndarray:
    """f32[B] seconds between the end of the FM's training window and each request (0 if the
    cutoff is unknown): the adapter's staleness input."""
    t = np.asarray(batch["request_ts"], np.int64)
    if self.fm_cutoff is None:
      return np.zeros(t.shape, np.float32)
    return np.maximum(t - self.fm_cutoff, 0).astype(np.float32)

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
      q = np.asarray(self._adapt(lg, np.asarray(batch["surface"], np.int32),
                                 self.staleness(batch)))
    mask = label_mask(batch) * present[:, None]
    return q.astype(np.float32), np.asarray(mask, np.float32)

  def loopfm(self, batch, streams, ctx_dropout: float = 0.0, rng=None):
    """LoopFM inputs of a batch (as-of joins). ``ctx_dropout``: fraction of context embeddings
    marked missing at random (training only), so the VM learns its non-FM path for cache misses."""
    out = self.log.join_batch(batch, streams, key=self.join_key, max_age=self.max_age)
    self.present["ctx"][0] += int(out["fm_ctx_present"].sum())
    self.present["ctx"][1] += out["fm_ctx_present"].size
    for s in streams:                # real events: the lengths' sum (padded or packed stream)
      self.present["events"][0] += int(out["fm_events_present"][s].sum())
      self.present["events"][1] += int(np.sum(batch["events"][s]["length"]))
    if ctx_dropout > 0:         # after the join statistics: those describe the log itself
      keep = rng.uniform(size=out["fm_ctx_present"].shape) >= ctx_dropout
      out["fm_ctx_present"] = out["fm_ctx_present"] & keep
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


def make_init(model):
  """``init(batch, seed=0) -> params``, jitted once per model (every variant sharing the model
  reuses the compiled init)."""
  init = jax.jit(lambda r, b: nn.meta.unbox(model.init(r, b)["params"]))
  return lambda batch, seed=0: init(jax.random.key(seed), batch)


def make_predict(model):
  return jax.jit(lambda p, b: jax.nn.sigmoid(model.apply({"params": p}, b).astype(jnp.float32)))


def evaluate(predict, params, batches, surfaces, tasks):
  """Per surface x task metrics over host batches (holding any extra model inputs)."""
  acc = EvalAccumulator(surfaces, tasks)
  for b in batches:
    acc.add(np.asarray(predict(params, b)), b)
  return acc.result()


def serve_through_cache(user_id, ad_id, request_ts, emb, *, budget_frac: float,
                        refresh_s: int = 3600, decoy_ratio: float = 1.0, noise: float = 1.0,
                        seed: int = 0):
  """Simulated Solaris serving of the current-example FM embeddings of one time window.

  Time is cut into ``refresh_s`` intervals. Before interval k a request predictor scores
  candidate (user, ad) pairs: the pairs requested during k and ``decoy_ratio`` times as many
  random decoy pairs, score = 1[requested] + noise * N(0, 1) (the synthetic world has no
  request clustering to learn a predictor from, so its quality is a knob). A
  ``SpeculativeCache`` pre-computes the top ``budget = budget_frac * (requests per interval)``
  pairs at the interval start (the FM "run" = that pair's exported embedding); the requests of
  interval k are then served from the cache at their own time; a miss takes the VM's non-FM path.

  Args: ``user_id, ad_id, request_ts [N]``; ``emb f32[N, d]`` the FM embedding of each request.
  Returns ``(emb f32[N, d], present bool[N], age f32[N], stats)`` aligned with the inputs.
  """
  rng = np.random.default_rng(seed)
  user_id, ad_id = np.asarray(user_id, np.int64), np.asarray(ad_id, np.int64)
  t = np.asarray(request_ts, np.int64)
  keys = pair_key(user_id, ad_id)
  nxt = AsOfIndex(keys, -t, emb)            # as-of on -t: a pair's next request at or after now

  def compute(u, a, now):
    e, _, _ = nxt.lookup(pair_key(u, a), -now)
    return e

  t0 = int(t.min())
  interval = (t - t0) // refresh_s
  n_int = int(interval.max()) + 1
  budget = int(round(budget_frac * len(t) / n_int))
  cache = SpeculativeCache(compute, emb.shape[1], budget)
  out_e = np.zeros(emb.shape, np.float32)
  out_p, out_a = np.zeros(len(t), bool), np.zeros(len(t), np.float32)
  for k in range(n_int):
    rows = np.flatnonzero(interval == k)
    now = t0 + k * refresh_s
    n_dec = int(round(decoy_ratio * len(rows)))
    cu = np.concatenate([user_id[rows], rng.choice(user_id, n_dec)])
    ca = np.concatenate([ad_id[rows], rng.choice(ad_id, n_dec)])
    score = np.concatenate([np.ones(len(rows)), np.zeros(n_dec)]) + noise * rng.normal(
        size=len(cu))
    cache.refresh(cu, ca, score, now)
    if len(rows):
      out_e[rows], out_p[rows], out_a[rows] = cache.lookup(user_id[rows], ad_id[rows], t[rows])
  stats = {**cache.stats(), "budget_per_refresh": budget,
           "budget_use_mean": cache.total_evaluations / max(budget * n_int, 1),
           "budget_frac": budget_frac,
           "refresh_s": refresh_s, "decoy_ratio": decoy_ratio, "predictor_noise": noise}
  return out_e, out_p, out_a, stats
