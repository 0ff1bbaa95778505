"""The optimizer update driven by the looked-up rows' gradients (``make_sparse_update``,
``config.train.sparse_embedding_update``): the same update and state as
``kunlun.train.optim.make_optimizer``, reading and writing only the touched table rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from kunlun.nn.inputs import GROUP_SEP
from kunlun.train import optim
from sharding.embedding import (
    SMALL_TABLE_ROWS,
    group_dense_grad,
    sparse_adagrad_update_group,
    split_tables,
    sums_densely,
)


def make_sparse_update(train_cfg, total_steps: int, param_shardings=None, backend: str = "xla"):
  """The update of ``make_optimizer`` for a step that has row gradients of its embedding tables.

  Returns ``update(params, opt_state, grads, rows, ok, prepared=None) -> (params, opt_state,
  table_sq_norm)``:
    grads: ``{keystr(path): gradient}`` for every parameter that is not a looked-up table;
    rows:  ``{group: (gids i32[...], row_grads f32[..., D])}`` for each table group a
           ``kunlun.nn.inputs`` look-up read; ``group`` is the member tables' keystrs joined by
           ``kunlun.nn.inputs.GROUP_SEP`` ("+"), ``gids`` the ``sharding.embedding.group_ids`` ids
           into the members' concatenation, ``row_grads`` the gradient w.r.t. the looked-up rows;
    ok:    ``bool[]``; False keeps every parameter and state leaf;
    prepared: ``update.prepare(params, grads)`` (the packed dense gradients and their squared
           norms, computed once per step; ``dense_sq`` = the dense leaves', ``emb_sq`` = the
           gradients of "emb" leaves that are not looked up); computed here when None.
  ``update.bind(param_shardings)`` groups the dense leaves as ``optim.Optimizer.bind`` does (the
  train step binds the shardings it is given).
  ``opt_state`` is ``make_optimizer(...).init(params)``'s layout, unchanged, so checkpoints and the
  dense path are interchangeable (the state's 16-bit param copies, ``optim.FlatAdamWState.copies``,
  are written from the new params). Dense leaves get AdamW exactly as in ``make_optimizer``; each
  looked-up group gets ``sharding.embedding.sparse_adagrad_update_group`` (only rows in the ids
  are read or written; repeated ids summed first, as the dense gradient sums them), except a small
  group (rows <= ids in the step, rows not sharded), whose row gradients are scatter-added into
  table-shaped gradients for the dense row-wise Adagrad (cheaper than the sparse path's sorts at
  that size; same result). An "emb" leaf that is not looked up (read some other way) gets the
  dense row-wise Adagrad from its autodiff gradient. The dense-style updates run inside one
  ``lax.cond(ok, ...)`` (no select over the state; a group of small tables sums its table-shaped
  gradient before it); the sparse groups are switched off by ``ok``.
  ``table_sq_norm``: sum over tables of the squared norm of their (dense-equivalent) gradient.
  """
  opt = optim.Optimizer(train_cfg, total_steps, param_shardings, backend=backend)
  lr = train_cfg.emb_lr
  is_mn = optim.is_masked

  def prepare(params, grads) -> optim.Prepared:
    keys = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(params)]
    layout, labels = opt.layout(params)
    g = [grads.get(k) for k in keys]
    emb = [optim.f32_sq(x) for x, lab in zip(g, labels, strict=True)
           if lab == "emb" and x is not None]
    dense, sq = opt.pack(layout, g)
    return optim.Prepared(dense, sq, optim.sum_or_zero(emb))

  def update(params, opt_state, grads, rows, ok, prepared=None):
    rows = {gk: (tuple(gk.split(GROUP_SEP)),) + tuple(v) for gk, v in rows.items()}
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    keys = [jax.tree_util.keystr(k) for k, _ in leaves]
    index = {k: i for i, k in enumerate(keys)}
    p = [v for _, v in leaves]
    layout, labels = opt.layout(params)
    member = {m: gk for gk, (members, _, _) in rows.items() for m in members}
    missing = [k for k in keys if k not in member and k not in grads]
    unknown = sorted(set(member) - set(keys))
    if missing or unknown:
      raise ValueError(f"sparse update: no gradient for {missing}; tables not in params "
                       f"{unknown} (params must be unboxed: nn.meta.unbox)")
    prep = prepare(params, grads) if prepared is None else prepared
    small, sparse = [], []
    for gk, (members, gids, _) in rows.items():
      table_rows = [p[index[m]].shape[0] for m in members]
      (small if sums_densely(table_rows, jnp.size(gids)) else sparse).append(gk)
    d_state = opt_state.inner_states["dense"].inner_state
    acc_def = jax.tree.structure(opt_state.inner_states["emb"].inner_state.acc, is_leaf=is_mn)
    acc = jax.tree.leaves(opt_state.inner_states["emb"].inner_state.acc, is_leaf=is_mn)
    g = [grads.get(k) for k in keys]
    in_sparse = {index[m] for gk in sparse for m in rows[gk][0]}
    mine = [i for i in range(len(keys)) if i not in in_sparse]       # updated inside the cond
    rows_of = lambda gk: sum(p[index[m]].shape[0] for m in rows[gk][0])
    # a group of small tables (SMALL_TABLE_ROWS rows in all at most) sums its table-shaped
    # gradient before the cond: the sort and scatter-add read its rows' gradients where the
    # backward wrote them, which as operands of the cond XLA wrote out first. Larger groups sum
    # theirs inside (a float32 [V, D] held from the backward to the cond raised prod's peak)
    early = {gk: group_dense_grad(rows[gk][1], rows[gk][2], rows_of(gk)) for gk in small
             if rows_of(gk) <= SMALL_TABLE_ROWS}

    def dense_step(state):
      """AdamW, small groups and unlooked-up tables; returns the new (params, acc) of ``mine``,
      the new AdamW state and the small groups' squared gradient norm."""
      p_mine, acc_mine, d_st, bufs = state
      cur_p, cur_acc = dict(zip(mine, p_mine, strict=True)), dict(zip(mine, acc_mine, strict=True))
      cur = [cur_p.get(i, p[i]) for i in range(len(keys))]
      d_new, _, new_d = opt.adamw(layout, bufs, prep.dense_sq, d_st, cur)
      on = set(opt.tables_on_kernel(params, [i for i in mine if labels[i] != "dense"]))
      sq = jnp.zeros((), jnp.float32)
      g_tab, at = {}, {}                # at: a kernel table's gradient source and first row
      for gk in small:
        members, gids, g_rows = rows[gk]
        idx = [index[m] for m in members]
        g_vd = early[gk] if gk in early else group_dense_grad(gids, g_rows, rows_of(gk))
        r0 = 0
        for i, gt in zip(idx, split_tables(g_vd, [p[i].shape[0] for i in idx]), strict=True):
          if i in on:
            at[i] = (g_vd, r0)
          else:
            g_tab[i] = gt.astype(p[i].dtype)
            sq = sq + jnp.sum(jnp.square(gt.astype(jnp.float32)))
          r0 += p[i].shape[0]
      kern = [i for i in mine if i in on]
      vals, accs, k_sq = opt.rowwise_tables([(*at.get(i, (g[i], 0)), cur_p[i], cur_acc[i],
                                              i in at) for i in kern])
      for i, v, a in zip(kern, vals, accs, strict=True):
        cur_p[i], cur_acc[i] = v, a
      for i in mine:
        if labels[i] == "dense":
          cur_p[i] = d_new[i]
        elif i not in on:
          u, cur_acc[i] = optim.rowwise_adagrad_leaf(g_tab.get(i, g[i]), cur_acc[i], lr)
          cur_p[i] = optax.apply_updates(cur_p[i], u)
      return [cur_p[i] for i in mine], [cur_acc[i] for i in mine], new_d, sq + k_sq

    def skip(state):
      p_mine, acc_mine, d_st, _ = state
      return p_mine, acc_mine, d_st, jnp.zeros((), jnp.float32)

    p_mine, acc_mine, new_d, sq = jax.lax.cond(
        ok, dense_step, skip, ([p[i] for i in mine], [acc[i] for i in mine], d_state,
                               prep.dense))
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
        "emb": optax.MaskedState(optim.RowwiseAdagradState(jax.tree.unflatten(acc_def, new_acc)))})
    return treedef.unflatten(new_p), new_state, sq

  update.prepare, update.bind = prepare, opt.bind
  update.reads_grads_as_given = opt.reads_grads_as_given
  return update
