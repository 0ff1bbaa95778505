"""Optimizer: AdamW (warm-up + schedule + global-norm clipping) on dense parameters, row-wise
Adagrad on embedding tables (spec §e.3), as a multi-tensor update.

A parameter is an embedding table when its path contains "embedding" (the model's naming rule).
The row-wise Adagrad keeps one accumulator per table row (the mean of the squared gradient over
the row). ``make_optimizer`` writes it as a dense update: rows that a step does not touch have a
zero gradient, so their accumulator and value do not change, but every row is read and written
each step. ``make_sparse_update`` (``config.train.sparse_embedding_update``) is the same update,
and the same optimizer-state layout, driven by the looked-up rows' gradients: it reads and writes
only the touched rows of each table.

AdamW runs on flat buffers (``Optimizer``, ``kunlun.train.flat``): the dense leaves are grouped
by dtype and sharding, the moments are stored as one buffer per group (``FlatAdamWState``), the
clipping / moment / bias-correction arithmetic is a few fusions per group, and each leaf is read
and written once, by its fused ``p + update``. The updates equal those of
``optax.chain(clip_by_global_norm, adamw(mask=ndim >= 2))`` leaf by leaf (``legacy_optimizer``);
only the global norm's sum is reassociated. The gradients' squared norms (dense and "emb") are
computed once per step (``Optimizer.prepare``): the clipping and the step's ``grad_norm`` share
them.

State layout: ``optax.PartitionState({"dense": MaskedState(FlatAdamWState), "emb":
MaskedState(RowwiseAdagradState)})``. The flat buffers depend on the mesh, so checkpoints store
the per-leaf state of ``legacy_optimizer`` instead (``to_per_leaf`` / ``from_per_leaf``, called
by ``kunlun.train.checkpoint``): checkpoints restore onto another mesh, and those written before
the flat layout restore unchanged.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from kunlun.train import flat


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


class FlatAdamWState(NamedTuple):
  """AdamW state of the "dense" leaves in flat buffers (``kunlun.train.flat``)."""
  count: jax.Array   # i32[]: updates applied (the schedule's step; bias correction uses count + 1)
  mu: tuple          # first moments, one buffer per layout group
  nu: tuple          # second moments, likewise


class Prepared(NamedTuple):
  """A step's gradients ready for the update: the "dense" gradients packed into the layout's
  buffers and the squared global norms of the "dense" and "emb" gradients (computed once)."""
  dense: tuple
  dense_sq: jax.Array
  emb_sq: jax.Array


def _f32_sq(x):
  x = x.astype(jnp.float32)
  return jnp.sum(x * x)


class Optimizer:
  """AdamW with global-norm clipping on the "dense" leaves as a multi-tensor update, row-wise
  Adagrad on the "emb" leaves (``make_optimizer``).

  optax protocol: ``init(params)`` and ``update(grads, state, params) -> (updates, state)``. The
  train step's path: ``prepare(grads)`` (pack the dense gradients, global norms) outside the
  skip-``cond``, then ``updates(prepared, grads, state, params)`` inside it.

  The dense leaves are grouped by dtype and sharding (``kunlun.train.flat.Layout``): moments and
  the Adam arithmetic run on one buffer per group (a few fusions per group), the leaves are
  touched once, by the fused ``p + update`` of each. The layout needs the parameter shardings:
  ``make_optimizer(..., param_shardings=)`` or ``bind`` (``opt_state_shardings`` and
  ``step.make_train_step`` bind the shardings they are given); without them every dense leaf of a
  dtype is in one unsharded group (right on one device; on a sharded mesh ``bind`` first).
  """

  def __init__(self, train_cfg, total_steps: int, param_shardings=None):
    self.cfg = train_cfg
    self.schedule = lr_schedule(train_cfg, total_steps)
    self.emb_lr = float(train_cfg.emb_lr)
    self._shardings = {}          # treedef -> per-leaf NamedSharding list
    self._layouts = {}            # (treedef, shapes) -> (Layout, labels)
    if param_shardings is not None:
      self.bind(param_shardings)

  # ---- layout ----------------------------------------------------------------------------------
  def bind(self, param_shardings) -> None:
    """Groups the dense leaves of params with this tree structure by these shardings (a tree of
    ``NamedSharding``). Raises if a layout of that structure was already used with others."""
    if param_shardings is None:
      return
    leaves, treedef = jax.tree.flatten(param_shardings)
    if not all(isinstance(s, NamedSharding) for s in leaves):
      return
    for (td, shapes), (layout, labels) in self._layouts.items():
      if td == treedef:
        if _signature(_build(shapes, labels, leaves)) != _signature(layout):
          raise ValueError("optimizer: bind() the parameter shardings before init/update; this "
                           "optimizer already laid out its state for other shardings")
    self._shardings[treedef] = leaves

  def layout(self, params):
    """``(Layout, labels)`` of a params tree (arrays or ShapeDtypeStructs): the layout groups
    the "dense" leaves; ``labels`` per leaf."""
    leaves, treedef = jax.tree.flatten(params)
    key = (treedef, tuple((tuple(x.shape), jnp.dtype(x.dtype).name) for x in leaves))
    if key not in self._layouts:
      labels = jax.tree.leaves(param_labels(params))
      self._layouts[key] = (_build(key[1], labels, self._shardings.get(treedef)), labels)
    return self._layouts[key]

  # ---- optax protocol --------------------------------------------------------------------------
  def init(self, params):
    layout, labels = self.layout(params)
    leaves, treedef = jax.tree.flatten(params)
    dense = FlatAdamWState(jnp.zeros([], jnp.int32), layout.zeros(), layout.zeros())
    acc = treedef.unflatten([jnp.zeros_like(p[..., 0], jnp.float32) if lab == "emb"
                             else optax.MaskedNode() for p, lab in zip(leaves, labels,
                                                                       strict=True)])
    return optax.PartitionState({"dense": optax.MaskedState(dense),
                                 "emb": optax.MaskedState(RowwiseAdagradState(acc))})

  def update(self, grads, state, params=None):
    if params is None:
      raise ValueError("optimizer: update needs params (weight decay)")
    return self.updates(self.prepare(grads, params), grads, state, params)

  # ---- the step's path -------------------------------------------------------------------------
  def prepare(self, grads, params=None) -> Prepared:
    """Packs the dense gradients and computes both squared norms (``params``: only for the
    layout; default: ``grads``, which has the params' structure, shapes and dtypes)."""
    layout, labels = self.layout(grads if params is None else params)
    g = jax.tree.leaves(grads)
    bufs = layout.pack(g)
    emb = [_f32_sq(x) for x, lab in zip(g, labels, strict=True) if lab == "emb"]
    return Prepared(bufs, _sum([_f32_sq(b) for b in bufs]), _sum(emb))

  def updates(self, prepared: Prepared, grads, state, params):
    """``(updates, new_state)``: the optax updates (``params + updates`` is the step)."""
    layout, labels = self.layout(params)
    p, treedef = jax.tree.flatten(params)
    g = jax.tree.leaves(grads)
    d_state = state.inner_states["dense"].inner_state
    acc_tree = state.inner_states["emb"].inner_state.acc
    acc = jax.tree.leaves(acc_tree, is_leaf=_is_masked)
    upd, new_d = self.adamw(layout, prepared.dense, prepared.dense_sq, d_state, p)
    new_acc = list(acc)
    for i, lab in enumerate(labels):
      if lab == "emb":
        upd[i], new_acc[i] = rowwise_adagrad_leaf(g[i], acc[i], self.emb_lr)
    new_state = optax.PartitionState({
        "dense": optax.MaskedState(new_d),
        "emb": optax.MaskedState(RowwiseAdagradState(
            jax.tree.unflatten(jax.tree.structure(acc_tree, is_leaf=_is_masked), new_acc)))})
    return treedef.unflatten([upd[i] for i in range(len(p))]), new_state

  def adamw(self, layout, g_bufs, dense_sq, state: FlatAdamWState, p_leaves):
    """Clipping + AdamW on the flat buffers: ``({leaf index: update}, new state)``; the updates
    are those of ``optax.chain(clip_by_global_norm, adamw(mask=ndim >= 2))`` (same operations,
    elementwise; the global norm is a reassociated sum)."""
    c = self.cfg
    b1, b2, wd, clip = float(c.b1), float(c.b2), float(c.weight_decay), float(c.clip_norm)
    norm = jnp.sqrt(dense_sq)
    trigger = norm < clip
    count = optax.safe_int32_increment(state.count)
    lr = self.schedule(state.count)
    out, mus, nus = {}, [], []
    for grp, g, mu, nu in zip(layout.groups, g_bufs, state.mu, state.nu, strict=True):
      g = jnp.where(trigger, g, (g / norm.astype(g.dtype)) * clip)
      mu = (1 - b1) * g + b1 * mu
      nu = (1 - b2) * (g * g) + b2 * nu
      mu_hat = mu / (1 - b1 ** count).astype(mu.dtype)
      nu_hat = nu / (1 - b2 ** count).astype(nu.dtype)
      u = mu_hat / (jnp.sqrt(nu_hat) + 1e-8)
      mus.append(mu)
      nus.append(nu)
      for m in grp.members:
        um = layout.unpack(u, m)
        if len(m.shape) >= 2:                   # weight decay on matrices, not biases / scales
          um = um + wd * p_leaves[m.index]
        out[m.index] = um * (-lr).astype(um.dtype)
    return out, FlatAdamWState(count, tuple(mus), tuple(nus))


def _build(shapes, labels, shardings):
  return flat.Layout.build([sd if lab == "dense" else None
                            for sd, lab in zip(shapes, labels, strict=True)], shardings)


def _sum(xs):
  return sum(xs[1:], xs[0]) if xs else jnp.zeros((), jnp.float32)


def _is_masked(x):
  return isinstance(x, optax.MaskedNode)


def _signature(layout) -> tuple:
  return tuple((g.dtype, g.axes, g.lead, g.members) for g in layout.groups)


def rowwise_adagrad_leaf(g, acc, lr: float, eps: float = 1e-8):
  """``(update, new acc)`` of ``rowwise_adagrad`` for one table."""
  acc = acc + jnp.mean(jnp.square(g.astype(jnp.float32)), axis=-1)
  return (-lr * g / (jnp.sqrt(acc)[..., None] + eps)).astype(g.dtype), acc


def make_optimizer(train_cfg, total_steps: int, param_shardings=None) -> Optimizer:
  """AdamW + clipping on "dense" leaves, row-wise Adagrad on "emb" leaves (``Optimizer``)."""
  return Optimizer(train_cfg, total_steps, param_shardings)


# ---- the per-leaf layout: checkpoints (and the optimizer of before) ----------------------------
def legacy_optimizer(train_cfg, total_steps: int) -> optax.GradientTransformation:
  """The per-leaf optax optimizer the flat one replaced (``optax.partition`` of
  ``chain(clip_by_global_norm, adamw)`` and ``rowwise_adagrad``): the same updates, and its state
  layout is the one checkpoints store (``to_per_leaf``)."""
  dense = optax.chain(
      optax.clip_by_global_norm(train_cfg.clip_norm),
      optax.adamw(lr_schedule(train_cfg, total_steps), b1=train_cfg.b1, b2=train_cfg.b2,
                  eps=1e-8, weight_decay=train_cfg.weight_decay,
                  mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)))
  return optax.partition({"dense": dense, "emb": rowwise_adagrad(train_cfg.emb_lr)},
                         param_labels)


_SHAPE_CFG = {"lr": 1.0, "warmup_steps": 0, "schedule": "constant", "weight_decay": 0.0,
              "b1": 0.9, "b2": 0.999, "clip_norm": 1.0, "emb_lr": 1.0}


def is_flat(state) -> bool:
  """Whether an optimizer state is ``make_optimizer``'s (flat AdamW buffers)."""
  try:
    return isinstance(state.inner_states["dense"].inner_state, FlatAdamWState)
  except (AttributeError, KeyError, TypeError):
    return False


def per_leaf_abstract(abstract_params):
  """``ShapeDtypeStruct``s of the per-leaf (``legacy_optimizer``) state of ``abstract_params``,
  with the shardings ``opt_state_shardings`` gives per-leaf state (when the params have
  ``NamedSharding``s): the layout checkpoints store, independent of the mesh."""
  import ml_collections
  tx = legacy_optimizer(ml_collections.ConfigDict(_SHAPE_CFG), 1)
  state = jax.eval_shape(tx.init, abstract_params)
  shardings = [getattr(x, "sharding", None) for x in jax.tree.leaves(abstract_params)]
  mesh = next((s.mesh for s in shardings if isinstance(s, NamedSharding)), None)
  if mesh is None:
    return state
  shard = _match_param_shardings(state, abstract_params,
                                 jax.tree.map(lambda x: x.sharding, abstract_params), mesh)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state,
                      shard)


def _layout_of(params):
  """The flat layout of ``params`` for their own shardings (as ``Optimizer.bind`` gets them)."""
  shardings = jax.tree.map(lambda x: getattr(x, "sharding", None), params)
  import ml_collections
  opt = Optimizer(ml_collections.ConfigDict(_SHAPE_CFG), 1, shardings)
  return opt.layout(params)[0]


def _shardings_of(abstract):
  leaves = jax.tree.leaves(abstract)
  if all(isinstance(getattr(x, "sharding", None), NamedSharding) for x in leaves):
    return jax.tree.map(lambda x: x.sharding, abstract)
  return None


def to_per_leaf(state, params):
  """A flat state as the per-leaf ``legacy_optimizer`` state (what checkpoints store); any other
  state unchanged. ``params``: the parameters (their shardings define the flat layout)."""
  if not is_flat(state):
    return state
  layout = _layout_of(params)
  target = per_leaf_abstract(jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
      params))
  treedef = jax.tree.structure(target)

  def convert(state):
    d = state.inner_states["dense"].inner_state
    n = layout.num_leaves
    mu, nu = [optax.MaskedNode()] * n, [optax.MaskedNode()] * n
    for grp, bm, bn in zip(layout.groups, d.mu, d.nu, strict=True):
      for m in grp.members:
        mu[m.index], nu[m.index] = layout.unpack(bm, m), layout.unpack(bn, m)
    p_def = jax.tree.structure(params)
    adam = optax.ScaleByAdamState(d.count, p_def.unflatten(mu), p_def.unflatten(nu))
    inner = (optax.EmptyState(), (adam, optax.MaskedState(optax.EmptyState()),
                                  optax.ScaleByScheduleState(d.count)))
    out = optax.PartitionState({"dense": optax.MaskedState(inner),
                                "emb": state.inner_states["emb"]})
    return jax.tree.unflatten(treedef, jax.tree.leaves(out))

  return jax.jit(convert, out_shardings=_shardings_of(target))(state)


def from_per_leaf(state, params, abstract_state=None):
  """A per-leaf ``legacy_optimizer`` state (a checkpoint's, also one written before the flat
  layout) in ``make_optimizer``'s flat layout for ``params`` (arrays or ShapeDtypeStructs with
  shardings); ``abstract_state``: the flat target (its shardings are kept). Same moments, count
  and accumulators: the next update is unchanged."""
  layout = _layout_of(params)

  def convert(state):
    adam = state.inner_states["dense"].inner_state[1][0]
    mu = jax.tree.leaves(adam.mu, is_leaf=_is_masked)
    nu = jax.tree.leaves(adam.nu, is_leaf=_is_masked)
    dense = FlatAdamWState(jnp.asarray(adam.count, jnp.int32), layout.pack(mu), layout.pack(nu))
    return optax.PartitionState({"dense": optax.MaskedState(dense),
                                 "emb": state.inner_states["emb"]})

  out_sh = _shardings_of(abstract_state) if abstract_state is not None else None
  return jax.jit(convert, out_shardings=out_sh)(state)


def make_sparse_update(train_cfg, total_steps: int, param_shardings=None):
  """The update of ``make_optimizer`` for a step that has row gradients of its embedding tables.

  Returns ``update(params, opt_state, grads, rows, ok, prepared=None) -> (params, opt_state,
  table_sq_norm)``:
    grads: ``{keystr(path): gradient}`` for every parameter that is not a looked-up table;
    rows:  ``{group: (gids i32[...], row_grads f32[..., D])}`` for each table group a
           ``kunlun.inputs`` look-up read; ``group`` is the member tables' keystrs joined by
           ``kunlun.inputs.GROUP_SEP`` ("+"), ``gids`` the ``sharding.embedding.group_ids`` ids
           into the members' concatenation, ``row_grads`` the gradient w.r.t. the looked-up rows;
    ok:    ``bool[]``; False keeps every parameter and state leaf;
    prepared: ``update.prepare(params, grads)`` (the packed dense gradients and their squared
           norms, computed once per step; ``dense_sq`` = the dense leaves', ``emb_sq`` = the
           gradients of "emb" leaves that are not looked up); computed here when None.
  ``update.bind(param_shardings)`` groups the dense leaves as ``Optimizer.bind`` does (the train
  step binds the shardings it is given).
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
  opt, lr = Optimizer(train_cfg, total_steps, param_shardings), train_cfg.emb_lr
  is_mn = _is_masked

  def prepare(params, grads) -> Prepared:
    keys = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(params)]
    layout, labels = opt.layout(params)
    g = [grads.get(k) for k in keys]
    emb = [_f32_sq(x) for x, lab in zip(g, labels, strict=True) if lab == "emb" and x is not None]
    bufs = layout.pack(g)
    return Prepared(bufs, _sum([_f32_sq(b) for b in bufs]), _sum(emb))

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
      V = sum(p[index[m]].shape[0] for m in members)
      sharded = bool(row_axes(p[index[members[0]]].shape[0]))
      (sparse if V > jnp.size(gids) or sharded else small).append(gk)
    d_state = opt_state.inner_states["dense"].inner_state
    acc_def = jax.tree.structure(opt_state.inner_states["emb"].inner_state.acc, is_leaf=is_mn)
    acc = jax.tree.leaves(opt_state.inner_states["emb"].inner_state.acc, is_leaf=is_mn)
    g = [grads.get(k) for k in keys]
    in_sparse = {index[m] for gk in sparse for m in rows[gk][0]}
    mine = [i for i in range(len(keys)) if i not in in_sparse]       # updated inside the cond

    def dense_step(state):
      """AdamW, small groups and unlooked-up tables; returns the new (params, acc) of ``mine``,
      the new AdamW state and the small groups' squared gradient norm."""
      p_mine, acc_mine, d_st, bufs = state
      cur_p, cur_acc = dict(zip(mine, p_mine, strict=True)), dict(zip(mine, acc_mine, strict=True))
      cur = [cur_p.get(i, p[i]) for i in range(len(keys))]
      d_upd, new_d = opt.adamw(layout, bufs, prep.dense_sq, d_st, cur)
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
          u, cur_acc[i] = rowwise_adagrad_leaf(g_tab.get(i, g[i]), cur_acc[i], lr)
          cur_p[i] = optax.apply_updates(cur_p[i], u)
      return [cur_p[i] for i in mine], [cur_acc[i] for i in mine], new_d, sq

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
        "emb": optax.MaskedState(RowwiseAdagradState(jax.tree.unflatten(acc_def, new_acc)))})
    return treedef.unflatten(new_p), new_state, sq

  update.prepare, update.bind = prepare, opt.bind
  return update


def opt_state_shardings(tx, params_abstract, param_shardings, mesh):
  """Shardings for ``tx.init(params)``. For an ``Optimizer`` (which this binds to
  ``param_shardings``): the flat AdamW buffers get their layout group's sharding (the shards of
  their members' parameters, ``kunlun.train.flat``). Any other leaf: a state leaf whose key path
  ends with a parameter's path and has its shape gets that parameter's sharding; a row-wise
  Adagrad accumulator (shape ``param.shape[:-1]``) gets the parameter's spec without its last
  entry; the rest is replicated.
  """
  from jax.sharding import PartitionSpec as P
  if isinstance(tx, Optimizer):
    tx.bind(param_shardings)
  state_abstract = jax.eval_shape(tx.init, params_abstract)
  out = _match_param_shardings(state_abstract, params_abstract, param_shardings, mesh)
  if isinstance(tx, Optimizer):
    layout, _ = tx.layout(params_abstract)
    rep = NamedSharding(mesh, P())
    bufs = tuple(g.sharding(layout.mesh or mesh) or rep for g in layout.groups)
    out = optax.PartitionState({"dense": optax.MaskedState(FlatAdamWState(rep, bufs, bufs)),
                                "emb": out.inner_states["emb"]})
  return out


def _match_param_shardings(state_abstract, params_abstract, param_shardings, mesh):
  """``opt_state_shardings``' rule for per-leaf state (matched to parameters by key path)."""
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

  return jax.tree_util.tree_map_with_path(pick, state_abstract)
