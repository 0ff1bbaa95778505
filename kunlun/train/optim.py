"""Optimizer: AdamW (warm-up + schedule + global-norm clipping) on dense parameters, row-wise
Adagrad on embedding tables, combined with ``optax.partition`` (spec §e.3).

A parameter is an embedding table when its path contains "embedding" (the model's naming rule).
The row-wise Adagrad keeps one accumulator per table row (the mean of the squared gradient over
the row). It is written as a dense optax transform: rows that a step does not touch have a zero
gradient, so their accumulator and value do not change, which is the sparse update's result.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


def param_labels(params) -> dict:
  """"emb" for every leaf whose path contains "embedding", else "dense"."""
  def label(path, _):
    return "emb" if "embedding" in jax.tree_util.keystr(path).lower() else "dense"
  return jax.tree_util.tree_map_with_path(label, params)


def lr_schedule(train_cfg, total_steps: int) -> optax.Schedule:
  """Linear warm-up from 0 to ``train_cfg.lr`` over ``warmup_steps``, then cosine to 0 at
  ``total_steps`` or constant."""
  warm = max(int(train_cfg.warmup_steps), 0)
  if train_cfg.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(0.0, train_cfg.lr, warm, max(total_steps, warm + 1),
                                              end_value=0.0)
  if train_cfg.schedule == "constant":
    return optax.join_schedules(
        [optax.linear_schedule(0.0, train_cfg.lr, max(warm, 1)), optax.constant_schedule(train_cfg.lr)],
        [warm])
  raise ValueError(f"config.train.schedule={train_cfg.schedule!r}; allowed: 'cosine', 'constant'")


class RowwiseAdagradState(NamedTuple):
  acc: optax.Params  # per leaf f32[rows...] = leaf.shape[:-1]


def rowwise_adagrad(learning_rate: float, eps: float = 1e-8,
                    initial_accumulator: float = 0.0) -> optax.GradientTransformation:
  """Row-wise Adagrad: ``acc_r += mean_d g_rd^2``, ``u_rd = -lr g_rd / (sqrt(acc_r) + eps)``."""

  def init(params):
    # zeros_like of a slice keeps the table's row sharding under jit
    return RowwiseAdagradState(jax.tree.map(
        lambda p: jnp.zeros_like(p[..., 0], jnp.float32) + initial_accumulator, params))

  def update(grads, state, params=None):
    del params
    acc = jax.tree.map(lambda a, g: a + jnp.mean(jnp.square(g.astype(jnp.float32)), axis=-1),
                       state.acc, grads)
    upd = jax.tree.map(
        lambda g, a: (-learning_rate * g / (jnp.sqrt(a)[..., None] + eps)).astype(g.dtype),
        grads, acc)
    return upd, RowwiseAdagradState(acc)

  return optax.GradientTransformation(init, update)


def make_optimizer(train_cfg, total_steps: int) -> optax.GradientTransformation:
  """AdamW + clipping on "dense" leaves, row-wise Adagrad on "emb" leaves.

  Weight decay applies only to dense leaves with ndim >= 2 (not to biases and norm scales).
  """
  dense = optax.chain(
      optax.clip_by_global_norm(train_cfg.clip_norm),
      optax.adamw(lr_schedule(train_cfg, total_steps), b1=train_cfg.b1, b2=train_cfg.b2,
                  eps=1e-8, weight_decay=train_cfg.weight_decay,
                  mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)))
  return optax.partition({"dense": dense, "emb": rowwise_adagrad(train_cfg.emb_lr)}, param_labels)


def opt_state_shardings(tx, params_abstract, param_shardings, mesh):
  """Shardings for ``tx.init(params)``: a state leaf whose key path ends with a parameter's path
  and has its shape gets that parameter's sharding; a row-wise Adagrad accumulator (shape
  ``param.shape[:-1]``) gets the parameter's spec without its last entry; the rest is replicated.
  """
  from jax.sharding import NamedSharding, PartitionSpec as P
  p_leaves = {jax.tree_util.keystr(k): (v, s) for (k, v), s in zip(
      jax.tree_util.tree_leaves_with_path(params_abstract), jax.tree.leaves(param_shardings))}
  replicated = NamedSharding(mesh, P())

  def pick(path, leaf):
    key = jax.tree_util.keystr(path)
    for pk, (p, s) in p_leaves.items():
      if key.endswith(pk):
        if leaf.shape == p.shape:
          return s
        if leaf.shape == p.shape[:-1]:
          spec = tuple(s.spec) + (None,) * (len(p.shape) - len(s.spec))
          return NamedSharding(mesh, P(*spec[:-1]))
    return replicated

  state_abstract = jax.eval_shape(tx.init, params_abstract)
  return jax.tree_util.tree_map_with_path(pick, state_abstract)
