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


def make_train_step(model, tx, task_weights=None, *, sparse_update=None, param_shardings=None,
                    opt_shardings=None, batch_sharding=None):
  """Returns ``train_step(params, opt_state, batch, rng, step) -> (params, opt_state, stats)``.

  ``stats``: loss f32[], per_task f32[K], grad_norm f32[], ok bool[], and per-task sums
  ``loss_sum``, ``pos_sum``, ``count`` f32[K]. Params and optimizer state are donated.
  ``sparse_update``: ``optim.make_sparse_update(...)`` (``config.train.sparse_embedding_update``)
  switches to the sparse embedding step (``_sparse_train_step``); ``tx`` then only defines the
  optimizer-state layout (``tx.init``).
  """

  def train_step(params, opt_state, batch, rng, step):
    if sparse_update is not None:
      return _sparse_train_step(model, sparse_update, task_weights, params, opt_state, batch,
                                rng, step)
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


def _sparse_train_step(model, sparse_update, task_weights, params, opt_state, batch, rng, step):
  """The train step with sparse embedding-table updates.

  Tables read through ``kunlun.inputs`` look-ups are not differentiated: the model is applied with
  their ids recorded (``LOOKUP_IDS``) and a zero tap added to the looked-up rows (``ROW_TAPS``),
  and the gradient is taken w.r.t. the other parameters and the taps, i.e. w.r.t. the gathered
  rows ``[..., D]`` (no table-sized gradient exists). ``sparse_update`` then applies AdamW to the
  dense leaves and the row-wise Adagrad to the looked-up rows only. ``grad_norm`` is the dense
  path's norm (the per-row summed table gradients count once per row); on a skipped step it is
  computed from the unsummed row gradients instead (it is then non-finite or the loss is).
  A looked-up table must be read only through those look-ups: any other read of it would get no
  gradient here (the tiny-model equivalence test in tests/sharding/test_kunlun_lookup.py checks
  the real model).
  """
  from kunlun.inputs import LOOKUP_IDS, ROW_TAPS
  mask = label_mask(batch)
  rngs = {"dropout": jax.random.fold_in(rng, step)}
  apply = lambda variables, mutable: model.apply(variables, batch, train=True, rngs=rngs,
                                                 mutable=mutable)
  # which tables are looked up and the shapes of their rows (tracing only, no computation)
  taps = jax.eval_shape(lambda p: apply({"params": p}, [LOOKUP_IDS, ROW_TAPS])[1], params)
  taps = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), taps.get(ROW_TAPS, {}))
  tables = {jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(taps)}
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  keys = [jax.tree_util.keystr(k) for k, _ in flat]
  diff = {k: v for k, (_, v) in zip(keys, flat, strict=False) if k not in tables}

  def loss_fn(diff, taps):
    p = treedef.unflatten([diff[k] if k in diff else v
                           for k, (_, v) in zip(keys, flat, strict=False)])
    logits, state = apply({"params": p, ROW_TAPS: taps}, [LOOKUP_IDS])
    loss, per_task = masked_bce(logits, batch["labels"], mask, task_weights)
    return loss, (per_task, logits, state.get(LOOKUP_IDS, {}))

  (loss, (per_task, logits, ids)), (grads, g_taps) = jax.value_and_grad(
      loss_fn, argnums=(0, 1), has_aux=True)(diff, taps)
  key_of = lambda tree: {jax.tree_util.keystr(k): v
                         for k, v in jax.tree_util.tree_leaves_with_path(tree)}
  ids, g_taps = key_of(ids), key_of(g_taps)
  rows = {k: (ids[k], g_taps[k]) for k in tables}
  dense_sq = optax.tree.norm(grads, squared=True)
  rows_finite = jnp.all(jnp.asarray([jnp.all(jnp.isfinite(g)) for g in g_taps.values()]))
  ok = jnp.isfinite(loss) & jnp.isfinite(dense_sq) & rows_finite
  new_params, new_opt, table_sq = sparse_update(params, opt_state, grads, rows, ok)
  raw_sq = optax.tree.norm(g_taps, squared=True)
  grad_norm = jnp.sqrt(dense_sq + jnp.where(ok, table_sq, raw_sq))
  loss_sum, pos_sum, count = _per_task_sums(logits, batch["labels"], mask)
  stats = {"loss": loss, "per_task": per_task, "grad_norm": grad_norm, "ok": ok,
           "loss_sum": loss_sum, "pos_sum": pos_sum, "count": count}
  return new_params, new_opt, stats


def make_predict_step(model):
  """``predict(params, batch) -> probabilities f32[B, K]`` (sigmoid of the eval-mode logits)."""

  @jax.jit
  def predict(params, batch):
    logits = model.apply({"params": params}, batch, train=False)
    return jax.nn.sigmoid(logits.astype(jnp.float32))

  return predict
