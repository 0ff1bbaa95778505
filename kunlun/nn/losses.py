"""Masked multi-task binary cross-entropy (spec d.3 / e.2)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def masked_bce(logits, labels, label_mask, task_weights=None):
  """``loss = sum_k w_k * mean_{rows with mask=1}(BCE_k)`` computed in float32 from logits.

  Args:
    logits: ``f32[B, K]`` pre-sigmoid scores.
    labels: ``f32[B, K]`` in {0, 1}.
    label_mask: ``f32[B, K]``, 1 where the label is valid (multiply by an example mask first to
      drop padded rows); a task with no valid row contributes 0.
    task_weights: ``f32[K]`` per-task weights lambda_k (default all ones).
  Returns:
    ``(loss f32[], per_task f32[K])`` with ``per_task[k]`` the unweighted masked mean BCE.
  """
  logits = jnp.asarray(logits, jnp.float32)
  labels = jnp.asarray(labels, jnp.float32)
  mask = jnp.asarray(label_mask, jnp.float32)
  if logits.shape != labels.shape or logits.shape != mask.shape:
    raise ValueError(f"masked_bce: logits {logits.shape}, labels {labels.shape} and label_mask "
                     f"{mask.shape} must have the same [B, K] shape")
  # stable BCE with logits: max(x, 0) - x*y + log(1 + exp(-|x|))
  bce = jax.nn.relu(logits) - logits * labels + jax.nn.softplus(-jnp.abs(logits))
  count = jnp.sum(mask, axis=0)
  per_task = jnp.sum(bce * mask, axis=0) / jnp.maximum(count, 1.0)
  w = jnp.ones_like(per_task) if task_weights is None else jnp.asarray(task_weights, jnp.float32)
  if w.shape != per_task.shape:
    raise ValueError(f"masked_bce: task_weights shape {w.shape} != number of tasks "
                     f"{per_task.shape}")
  return jnp.sum(w * per_task), per_task
