"""Optimizer: AdamW (warm-up + schedule + global-norm clipping) on dense parameters, row-wise
Adagrad on embedding tables (spec §e.3), as a multi-tensor update.

A parameter is an embedding table when its path contains "embedding" (the model's naming rule).
The row-wise Adagrad keeps one accumulator per table row (the mean of the squared gradient over
the row). ``make_optimizer`` writes it as a dense update: rows that a step does not touch have a
zero gradient, so their accumulator and value do not change, but every row is read and written
each step. ``kunlun.train.sparse_update.make_sparse_update`` (the default) is the same update,
and the same optimizer-state layout, driven by the looked-up rows' gradients: it reads and writes
only the touched rows of each table.

AdamW runs on flat buffers (``Optimizer``, ``kunlun.train.flat``): the dense leaves are grouped
by dtype and sharding, the moments are stored as one buffer per group (``FlatAdamWState``), the
clipping / moment / bias-correction arithmetic is a few fusions per group, and each leaf is read
and written once, by its fused ``p + update``; with ``backend`` "pallas" (or "auto" compiling for
a GPU) each unsharded group is one ``pallas_kernels.adamw`` pass instead. The updates equal those of
``optax.chain(clip_by_global_norm, adamw(mask=ndim >= 2))`` leaf by leaf
(``kunlun.train.opt_layout.legacy_optimizer``);
only the global norm's sum is reassociated. The gradients' squared norms (dense and "emb") are
computed once per step (``Optimizer.prepare``): the clipping and the step's ``grad_norm`` share
them.

State layout: ``optax.PartitionState({"dense": MaskedState(FlatAdamWState), "emb":
MaskedState(RowwiseAdagradState)})``. ``FlatAdamWState.copies`` holds, for each "dense" leaf that
the model reads only through one cast to its 16-bit compute dtype
(``kunlun.train.param_copies``), the leaf in that dtype: the update writes it beside the leaf,
and the train step hands it to the model in the leaf's place (``with_copies``), so the step
does not launch a cast per weight. It is always ``leaf.astype(dtype)`` of the current params (the
skip-``cond`` keeps both); checkpoints do not store it (``opt_layout.from_per_leaf`` casts it
again). The flat buffers depend on the mesh, so checkpoints store the per-leaf state of
``legacy_optimizer`` instead (``kunlun.train.opt_layout``'s
``to_per_leaf`` / ``from_per_leaf``, called by ``kunlun.train.checkpoint``): checkpoints restore
onto another mesh, and those written before the flat layout restore unchanged.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kunlun.nn import packed
from kunlun.train import flat
from pallas_kernels import adagrad as adagrad_kernels
from pallas_kernels import adamw as adamw_kernels


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
  copies: tuple = ()  # per leaf: its 16-bit copy (``param_copies``) or None; () = no copies


class Prepared(NamedTuple):
  """A step's gradients ready for the update: the "dense" gradients packed into the layout's
  buffers and the squared global norms of the "dense" and "emb" gradients (computed once)."""
  dense: tuple
  dense_sq: jax.Array
  emb_sq: jax.Array


def f32_sq(x):
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
  ``copies``: per leaf, the 16-bit dtype of its copy in the state
  (``param_copies.copy_dtypes``) or None; only "dense" leaves get one.

  ``backend`` ("pallas" or "auto": ``model.backend``): the unsharded groups are laid out for
  ``pallas_kernels.adamw`` (members at aligned offsets, at most ``KERNEL_MEMBERS`` a group), and
  where the step compiles for a GPU ("auto") each such group's update runs as one kernel, the
  squared norm of them all as one more (``step``); the updates are the same.
  """

  def __init__(self, train_cfg, total_steps: int, param_shardings=None, copies=None,
               backend: str = "xla"):
    self.cfg = train_cfg
    self.copies = None if copies is None or not any(copies) else tuple(copies)
    self.schedule = lr_schedule(train_cfg, total_steps)
    self.emb_lr = float(train_cfg.emb_lr)
    self.backend = backend
    self.kernel_layout = backend in ("pallas", "auto")
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
        if (_signature(_build(shapes, labels, leaves, self.kernel_layout))
            != _signature(layout)):
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
      self._layouts[key] = (_build(key[1], labels, self._shardings.get(treedef),
                                   self.kernel_layout), labels)
    return self._layouts[key]

  # ---- optax protocol --------------------------------------------------------------------------
  def init(self, params):
    layout, labels = self.layout(params)
    leaves, treedef = jax.tree.flatten(params)
    copies = ()
    if self.copies is not None:
      if len(self.copies) != len(leaves):
        raise ValueError(f"optimizer: copies names {len(self.copies)} leaves; params have "
                         f"{len(leaves)}")
      copies = tuple(None if d is None or lab != "dense" else p.astype(d)
                     for p, d, lab in zip(leaves, self.copies, labels, strict=True))
    dense = FlatAdamWState(jnp.zeros([], jnp.int32), layout.zeros(), layout.zeros(), copies)
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
    emb = [f32_sq(x) for x, lab in zip(g, labels, strict=True) if lab == "emb"]
    dense, sq = self.pack(layout, g)
    return Prepared(dense, sq, sum_or_zero(emb))

  def kernels(self) -> bool:
    """Whether the step runs ``pallas_kernels.adamw`` (at trace time: the model's kernel rule,
    ``kunlun.nn.packed.pallas_backend``)."""
    return packed.pallas_backend(self.backend)

  def tables_on_kernel(self, params, idx) -> list[int]:
    """Those of the embedding tables ``idx`` (leaf indices of ``params``) whose row-wise Adagrad
    runs on ``pallas_kernels.adagrad`` (``rowwise_tables``): where the kernels run (``kernels``),
    the ``[V, D]`` tables whole on every device (a sharded one keeps XLA's update, which leaves
    every shard on its device)."""
    if not self.kernels():
      return []
    leaves, treedef = jax.tree.flatten(params)
    sh = self._shardings.get(treedef)
    return [i for i in idx if leaves[i].ndim == 2
            and flat.unsplit(sh[i] if sh is not None else None, 2)]

  def rowwise_tables(self, tables) -> tuple[tuple, tuple, jax.Array]:
    """Row-wise Adagrad of several tables in one ``pallas_kernels.adagrad`` launch: ``tables``
    ``[(gradient source [R, D], first row, table [V, D], accumulator f32[V], counts)]`` (tables
    of one source share its operand) -> ``(new tables, new accumulators, the float32 sum of the
    squares of the gradients of the tables that count)``; the same values as
    ``rowwise_adagrad_leaf`` then ``optax.apply_updates`` per table."""
    if not tables:
      return (), (), jnp.zeros((), jnp.float32)
    srcs, leaves = [], []
    for src, r0, *_ in tables:
      k = next((j for j, s in enumerate(srcs) if s is src), None)
      if k is None:
        k = len(srcs)
        srcs.append(src)
      leaves.append((k, r0))
    return adagrad_kernels.rowwise_adagrad_pallas(
        srcs, leaves, [t[2] for t in tables], [t[3] for t in tables], lr=self.emb_lr,
        sq=[t[4] for t in tables], interpret=packed.interpret_kernels())

  def reads_grads_as_given(self) -> bool:
    """Whether the train step may hand over the gradients of 16-bit param copies in their 16-bit
    dtype: the kernels read and widen them (exactly: the same update), so no float32 gradient
    is written first."""
    return self.kernels()

  def pack(self, layout, g) -> tuple[tuple, jax.Array]:
    """Per group, the packed gradient buffer, or for a kernel group (``kernels``, unsharded) its
    members' gradients as they are; and the dense gradients' squared norm."""
    kern = self.kernels()
    dense, sq, on_kernels = [], [], []
    for grp in layout.groups:
      if kern and grp.align > 1:
        gs = tuple(g[m.index] for m in grp.members)
        dense.append(gs)
        on_kernels += gs
      else:
        buf = layout.pack_group(g, grp)
        dense.append(buf)
        sq.append(f32_sq(buf))
    if on_kernels:                      # every kernel group's norm in one launch
      sq.append(adamw_kernels.sq_norm_pallas(on_kernels, interpret=packed.interpret_kernels()))
    return tuple(dense), sum_or_zero(sq)

  def updates(self, prepared: Prepared, grads, state, params):
    """``(updates, new_state)``: the optax updates (``params + updates`` is the step; where a
    kernel group computed the new values, the difference: the train step calls ``step``)."""
    new, upd, new_state = self._step(prepared, grads, state, params)
    p, treedef = jax.tree.flatten(params)
    return treedef.unflatten([upd[i] if i in upd else new[i] - x
                              for i, x in enumerate(p)]), new_state

  def step(self, prepared: Prepared, grads, state, params):
    """``(new params, new_state)``: ``params`` plus the updates (``optax.apply_updates``'s sum,
    in the params' dtypes)."""
    new, _, new_state = self._step(prepared, grads, state, params)
    treedef = jax.tree.structure(params)
    return treedef.unflatten([new[i] for i in range(len(new))]), new_state

  def _step(self, prepared: Prepared, grads, state, params):
    """``({leaf: new value}, {leaf: update, where computed}, new state)``."""
    layout, labels = self.layout(params)
    p = jax.tree.leaves(params)
    g = jax.tree.leaves(grads)
    d_state = state.inner_states["dense"].inner_state
    acc_tree = state.inner_states["emb"].inner_state.acc
    acc = jax.tree.leaves(acc_tree, is_leaf=is_masked)
    new, upd, new_d = self.adamw(layout, prepared.dense, prepared.dense_sq, d_state, p)
    new_acc = list(acc)
    emb = [i for i, lab in enumerate(labels) if lab == "emb"]
    on = self.tables_on_kernel(params, emb)
    vals, accs, _ = self.rowwise_tables([(g[i], 0, p[i], acc[i], False) for i in on])
    for i, v, a in zip(on, vals, accs, strict=True):
      new[i], new_acc[i] = v, a
    for i in emb:
      if i not in on:
        upd[i], new_acc[i] = rowwise_adagrad_leaf(g[i], acc[i], self.emb_lr)
        new[i] = optax.apply_updates(p[i], upd[i])
    new_state = optax.PartitionState({
        "dense": optax.MaskedState(new_d),
        "emb": optax.MaskedState(RowwiseAdagradState(
            jax.tree.unflatten(jax.tree.structure(acc_tree, is_leaf=is_masked), new_acc)))})
    return new, upd, new_state

  def adamw(self, layout, g_bufs, dense_sq, state: FlatAdamWState, p_leaves):
    """Clipping + AdamW on the flat buffers: ``({leaf index: new value}, {leaf index: update}
    (the XLA path's), new state)`` (the new 16-bit copies in the state); the updates are those
    of ``optax.chain(clip_by_global_norm, adamw(mask=ndim >= 2))`` (same operations,
    elementwise; the global norm is a reassociated sum), applied as ``optax.apply_updates``.
    ``g_bufs``: ``pack``'s (a kernel group's members' gradients run ``pallas_kernels.adamw``)."""
    c = self.cfg
    b1, b2, wd, clip = float(c.b1), float(c.b2), float(c.weight_decay), float(c.clip_norm)
    norm = jnp.sqrt(dense_sq)
    trigger = norm < clip
    count = optax.safe_int32_increment(state.count)
    lr = self.schedule(state.count)
    out, upd, mus, nus = {}, {}, [], []
    copies = list(state.copies)
    for grp, g, mu, nu in zip(layout.groups, g_bufs, state.mu, state.nu, strict=True):
      if isinstance(g, tuple):                  # a kernel group: its members' gradients
        sc = jnp.stack([norm, 1 - b1 ** count, 1 - b2 ** count, lr,
                        trigger]).astype(jnp.float32)
        ps = [p_leaves[m.index] for m in grp.members]
        cds = [copies[m.index].dtype if copies and copies[m.index] is not None else None
               for m in grp.members]
        vals, cps, mu, nu = adamw_kernels.adamw_pallas(
            g, ps, mu, nu, sc, hyper=adamw_kernels.Hyper(b1, b2, wd, clip), copy_dtypes=cds,
            old_copies=[copies[m.index] if copies else None for m in grp.members],
            interpret=packed.interpret_kernels())
        for m, v, cp in zip(grp.members, vals, cps, strict=True):
          out[m.index] = v
          if cp is not None:
            copies[m.index] = cp
        mus.append(mu)
        nus.append(nu)
        continue
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
        upd[m.index] = um * (-lr).astype(um.dtype)
        out[m.index] = optax.apply_updates(p_leaves[m.index], upd[m.index])
        if copies and copies[m.index] is not None:
          copies[m.index] = out[m.index].astype(copies[m.index].dtype)
    return out, upd, FlatAdamWState(count, tuple(mus), tuple(nus), tuple(copies))


def refresh_copies(copies: tuple, leaves) -> tuple:
  """``copies`` (``FlatAdamWState.copies``) made again from the param ``leaves``."""
  if not copies:
    return copies
  return tuple(None if c is None else x.astype(c.dtype)
               for c, x in zip(copies, leaves, strict=True))


def state_copies(opt_state) -> tuple:
  """The per-leaf 16-bit copies of ``make_optimizer``'s state (() for any other state)."""
  try:
    d = opt_state.inner_states["dense"].inner_state
  except (AttributeError, KeyError, TypeError):
    return ()
  return getattr(d, "copies", ())


def with_copies(leaves: list, copies: tuple) -> list:
  """The param ``leaves`` with each copied leaf replaced by its copy (what the model reads)."""
  if not copies:
    return list(leaves)
  return [x if c is None else c for x, c in zip(leaves, copies, strict=True)]


# Members of a kernel group (``pallas_kernels.adamw``: 3 pointers each, 5 with a 16-bit copy;
# CUDA passes at most ~4 KB of kernel parameters).
KERNEL_MEMBERS = 64


def _build(shapes, labels, shardings, kernel: bool = False):
  kw = {"align": adamw_kernels.BLOCK, "max_members": KERNEL_MEMBERS} if kernel else {}
  return flat.Layout.build([sd if lab == "dense" else None
                            for sd, lab in zip(shapes, labels, strict=True)], shardings, **kw)


def sum_or_zero(xs):
  return sum(xs[1:], xs[0]) if xs else jnp.zeros((), jnp.float32)


def is_masked(x):
  return isinstance(x, optax.MaskedNode)


def _signature(layout) -> tuple:
  return tuple((g.dtype, g.axes, g.lead, g.members) for g in layout.groups)


def rowwise_adagrad_leaf(g, acc, lr: float, eps: float = 1e-8):
  """``(update, new acc)`` of ``rowwise_adagrad`` for one table."""
  acc = acc + jnp.mean(jnp.square(g.astype(jnp.float32)), axis=-1)
  return (-lr * g / (jnp.sqrt(acc)[..., None] + eps)).astype(g.dtype), acc


def make_optimizer(train_cfg, total_steps: int, param_shardings=None, copies=None,
                   backend: str = "xla") -> Optimizer:
  """AdamW + clipping on "dense" leaves, row-wise Adagrad on "emb" leaves (``Optimizer``);
  ``copies``: per leaf, the dtype of its 16-bit copy or None; ``backend``: ``model.backend``."""
  return Optimizer(train_cfg, total_steps, param_shardings, copies, backend)


def opt_state_shardings(tx, params_abstract, param_shardings, mesh):
  """Shardings for ``tx.init(params)``. For an ``Optimizer`` (which this binds to
  ``param_shardings``): the flat AdamW buffers get their layout group's sharding (the shards of
  their members' parameters, ``kunlun.train.flat``). Any other leaf: a state leaf whose key path
  ends with a parameter's path and has its shape gets that parameter's sharding; a row-wise
  Adagrad accumulator (shape ``param.shape[:-1]``) gets the parameter's spec without its last
  entry; the rest is replicated.
  """
  if isinstance(tx, Optimizer):
    tx.bind(param_shardings)
  state_abstract = jax.eval_shape(tx.init, params_abstract)
  out = match_param_shardings(state_abstract, params_abstract, param_shardings, mesh)
  if isinstance(tx, Optimizer):
    layout, _ = tx.layout(params_abstract)
    rep = NamedSharding(mesh, P())
    bufs = tuple(g.sharding(layout.mesh or mesh) or rep for g in layout.groups)
    copies = state_copies(state_abstract)
    if copies:
      copies = tuple(None if c is None else s for c, s in
                     zip(copies, jax.tree.leaves(param_shardings), strict=True))
    out = optax.PartitionState({"dense": optax.MaskedState(
        FlatAdamWState(rep, bufs, bufs, copies)),
                                "emb": out.inner_states["emb"]})
  return out


def match_param_shardings(state_abstract, params_abstract, param_shardings, mesh):
  """``opt_state_shardings``' rule for per-leaf state (matched to parameters by key path)."""
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
