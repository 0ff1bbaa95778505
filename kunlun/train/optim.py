"""Optimizer: AdamW (warm-up + schedule + global-norm clipping) on dense parameters, row-wise
Adagrad on embedding tables, combined with ``optax.partition`` (spec §e.3).

A parameter is an embedding table when its path contains "embedding" (the model's naming rule).
The row-wise Adagrad keeps one accumulator per table row (the mean of the squared gradient over
the row). ``make_optimizer`` writes it as a dense optax transform: rows that a step does not touch
have a zero gradient, so their accumulator and value do not change, but every row is read and
written each step. ``make_sparse_update`` (``config.train.sparse_embedding_update``) is the same
update, and the same optimizer-state layout, driven by the looked-up rows' gradients: it reads and
writes only the touched rows of each table.
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
        [optax.linear_schedule(0.0, train_cfg.lr, max(warm, 1)),
         optax.constant_schedule(train_cfg.lr)],
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


def dense_optimizer(train_cfg, total_steps: int) -> optax.GradientTransformation:
  """Global-norm clipping + AdamW with the LR schedule; weight decay only on leaves with
  ndim >= 2 (not on biases and norm scales)."""
  return optax.chain(
      optax.clip_by_global_norm(train_cfg.clip_norm),
      optax.adamw(lr_schedule(train_cfg, total_steps), b1=train_cfg.b1, b2=train_cfg.b2,
                  eps=1e-8, weight_decay=train_cfg.weight_decay,
                  mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)))


def make_optimizer(train_cfg, total_steps: int) -> optax.GradientTransformation:
  """AdamW + clipping on "dense" leaves, row-wise Adagrad on "emb" leaves."""
  return optax.partition({"dense": dense_optimizer(train_cfg, total_steps),
                          "emb": rowwise_adagrad(train_cfg.emb_lr)}, param_labels)


def make_sparse_update(train_cfg, total_steps: int):
  """The update of ``make_optimizer`` for a step that has row gradients of its embedding tables.

  Returns ``update(params, opt_state, grads, rows, ok) -> (params, opt_state, table_sq_norm)``:
    grads: ``{keystr(path): gradient}`` for every parameter that is not a looked-up table;
    rows:  ``{group: (gids i32[...], row_grads f32[..., D])}`` for each table group a
           ``kunlun.inputs`` look-up read; ``group`` is the member tables' keystrs joined by
           ``kunlun.inputs.GROUP_SEP`` ("+"), ``gids`` the ``sharding.embedding.group_ids`` ids
           into the members' concatenation, ``row_grads`` the gradient w.r.t. the looked-up rows;
    ok:    ``bool[]``; False keeps every parameter and state leaf.
  ``opt_state`` is ``make_optimizer(...).init(params)``'s layout, unchanged, so checkpoints and the
  dense path are interchangeable. Dense leaves get AdamW exactly as in ``make_optimizer``; each
  looked-up group gets ``sharding.embedding.sparse_adagrad_update_group`` (only rows in the ids
  are read or written; repeated ids summed first, as the dense gradient sums them), except a small
  group (rows <= ids in the step, rows not sharded), whose row gradients are scatter-added into
  table-shaped gradients for the dense row-wise Adagrad (cheaper than the sparse path's sorts at
  that size; same result). An "emb" leaf that is not looked up (read some other way) gets the
  dense row-wise Adagrad from its autodiff gradient. The dense-style updates run inside one
  ``lax.cond(ok, ...)`` (no select over the state); the sparse groups are switched off by ``ok``.
  ``table_sq_norm``: sum over tables of the squared norm of their (dense-equivalent) gradient.
  """
  from kunlun.inputs import GROUP_SEP
  from sharding.embedding import group_dense_grads, row_axes, sparse_adagrad_update_group
  dense_tx, lr = dense_optimizer(train_cfg, total_steps), train_cfg.emb_lr
  emb_tx = rowwise_adagrad(lr)
  is_mn = lambda x: isinstance(x, optax.MaskedNode)

  def update(params, opt_state, grads, rows, ok):
    rows = {gk: (tuple(gk.split(GROUP_SEP)),) + tuple(v) for gk, v in rows.items()}
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    keys = [jax.tree_util.keystr(k) for k, _ in flat]
    index = {k: i for i, k in enumerate(keys)}
    p = [v for _, v in flat]
    labels = jax.tree.leaves(param_labels(params))
    member = {m: gk for gk, (members, _, _) in rows.items() for m in members}
    missing = [k for k in keys if k not in member and k not in grads]
    unknown = sorted(set(member) - set(keys))
    if missing or unknown:
      raise ValueError(f"sparse update: no gradient for {missing}; tables not in params "
                       f"{unknown} (params must be unboxed: nn.meta.unbox)")
    small, sparse = [], []
    for gk, (members, gids, _) in rows.items():
      V = sum(p[index[m]].shape[0] for m in members)
      sharded = bool(row_axes(p[index[members[0]]].shape[0]))
      (sparse if V > jnp.size(gids) or sharded else small).append(gk)
    masked = lambda leaves, group: treedef.unflatten(
        [x if lab == group else optax.MaskedNode()
         for x, lab in zip(leaves, labels, strict=False)])
    d_state = opt_state.inner_states["dense"].inner_state
    acc_def = jax.tree.structure(opt_state.inner_states["emb"].inner_state.acc, is_leaf=is_mn)
    acc = jax.tree.leaves(opt_state.inner_states["emb"].inner_state.acc, is_leaf=is_mn)
    g = [grads.get(k) for k in keys]
    in_sparse = {index[m] for gk in sparse for m in rows[gk][0]}
    mine = [i for i in range(len(keys)) if i not in in_sparse]       # updated inside the cond

    def dense_step(state):
      """AdamW, small groups and unlooked-up tables; returns the new (params, acc) of ``mine``,
      the new AdamW state and the small groups' squared gradient norm."""
      p_mine, acc_mine, d_st = state
      cur_p, cur_acc = dict(zip(mine, p_mine, strict=True)), dict(zip(mine, acc_mine, strict=True))
      leaves = [cur_p.get(i, p[i]) for i in range(len(keys))]
      d_upd, new_d = dense_tx.update(masked(g, "dense"), d_st, masked(leaves, "dense"))
      d_upd = jax.tree.leaves(d_upd, is_leaf=is_mn)
      sq = jnp.zeros((), jnp.float32)
      g_tab = {}
      for gk in small:
        members, gids, g_rows = rows[gk]
        idx = [index[m] for m in members]
        parts = group_dense_grads(gids, g_rows, [p[i].shape[0] for i in idx])
        for i, gt in zip(idx, parts, strict=True):
          g_tab[i] = gt.astype(p[i].dtype)
          sq = sq + jnp.sum(jnp.square(gt.astype(jnp.float32)))
      for i in mine:
        if labels[i] == "dense":
          cur_p[i] = optax.apply_updates(cur_p[i], d_upd[i])
        else:
          u, st = emb_tx.update(g_tab.get(i, g[i]), RowwiseAdagradState(cur_acc[i]))
          cur_p[i], cur_acc[i] = optax.apply_updates(cur_p[i], u), st.acc
      return [cur_p[i] for i in mine], [cur_acc[i] for i in mine], new_d, sq

    def skip(state):
      p_mine, acc_mine, d_st = state
      return p_mine, acc_mine, d_st, jnp.zeros((), jnp.float32)

    p_mine, acc_mine, new_d, sq = jax.lax.cond(
        ok, dense_step, skip, ([p[i] for i in mine], [acc[i] for i in mine], d_state))
    new_p, new_acc = list(p), list(acc)
    for i, v, a in zip(mine, p_mine, acc_mine, strict=True):
      new_p[i], new_acc[i] = v, a
    for gk in sparse:
      members, gids, g_rows = rows[gk]
      idx = [index[m] for m in members]
      tabs, accs, s = sparse_adagrad_update_group(
          [p[i] for i in idx], [acc[i] for i in idx], gids, g_rows, lr, enabled=ok,
          with_sq_norm=True)
      for i, t, a in zip(idx, tabs, accs, strict=True):
        new_p[i], new_acc[i] = t, a
      sq = sq + s
    new_state = type(opt_state)({
        "dense": optax.MaskedState(new_d),
        "emb": optax.MaskedState(RowwiseAdagradState(jax.tree.unflatten(acc_def, new_acc)))})
    return treedef.unflatten(new_p), new_state, sq

  return update


def opt_state_shardings(tx, params_abstract, param_shardings, mesh):
  """Shardings for ``tx.init(params)``: a state leaf whose key path ends with a parameter's path
  and has its shape gets that parameter's sharding; a row-wise Adagrad accumulator (shape
  ``param.shape[:-1]``) gets the parameter's spec without its last entry; the rest is replicated.
  """
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  p_leaves = {jax.tree_util.keystr(k): (v, s) for (k, v), s in zip(
      jax.tree_util.tree_leaves_with_path(params_abstract), jax.tree.leaves(param_shardings),
      strict=False)}
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
