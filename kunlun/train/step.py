"""The jitted train and predict steps.

Mixed precision is the model's business (``config.model.dtype`` = "bfloat16" computes in bf16;
parameters, optimizer state, norms and the loss stay float32). A step whose loss or gradient
global norm is not finite keeps the old params and optimizer state (the update is skipped) and
reports ``ok = False``; the host counts these and stops after too many in a row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from kunlun.losses import masked_bce


def _per_task_sums(logits_bk, labels_bk, mask_bk):
  """Per-task log-loss sum, positive count and valid count (for the running NE)."""
  x = logits_bk.astype(jnp.float32)
  bce = jax.nn.relu(x) - x * labels_bk + jax.nn.softplus(-jnp.abs(x))
  return (jnp.sum(bce * mask_bk, 0), jnp.sum(labels_bk * mask_bk, 0), jnp.sum(mask_bk, 0))


def label_mask(batch):
  """``label_mask`` with padded rows (``example_mask == 0``) removed, f32[B, K]."""
  mask = batch["label_mask"]
  if "example_mask" in batch:
    mask = mask * batch["example_mask"][:, None]
  return mask


def make_train_step(model, tx, task_weights=None, *, param_shardings=None, opt_shardings=None,
                    batch_sharding=None):
  """Returns ``train_step(params, opt_state, batch, rng, step) -> (params, opt_state, stats)``.

  ``stats``: loss f32[], per_task f32[K], grad_norm f32[], ok bool[], and per-task sums
  ``loss_sum``, ``pos_sum``, ``count`` f32[K]. Params and optimizer state are donated.
  """

  def train_step(params, opt_state, batch, rng, step):
    mask = label_mask(batch)

    def loss_fn(p):
      logits = model.apply({"params": p}, batch, train=True,
                           rngs={"dropout": jax.random.fold_in(rng, step)})
      loss, per_task = masked_bce(logits, batch["labels"], mask, task_weights)
      return loss, (per_task, logits)

    (loss, (per_task, logits)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    grad_norm = optax.tree.norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, new_opt = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
    loss_sum, pos_sum, count = _per_task_sums(logits, batch["labels"], mask)
    stats = {"loss": loss, "per_task": per_task, "grad_norm": grad_norm, "ok": ok,
             "loss_sum": loss_sum, "pos_sum": pos_sum, "count": count}
    return keep(new_params, params), keep(new_opt, opt_state), stats

  kw = {}
  if param_shardings is not None:
    kw["in_shardings"] = (param_shardings, opt_shardings, batch_sharding, None, None)
    kw["out_shardings"] = (param_shardings, opt_shardings, None)
  return jax.jit(train_step, donate_argnums=(0, 1), **kw)


def make_predict_step(model):
  """``predict(params, batch) -> probabilities f32[B, K]`` (sigmoid of the eval-mode logits)."""

  @jax.jit
  def predict(params, batch):
    logits = model.apply({"params": params}, batch, train=False)
    return jax.nn.sigmoid(logits.astype(jnp.float32))

  return predict
