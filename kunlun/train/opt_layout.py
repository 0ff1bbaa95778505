"""The optimizer state's per-leaf layout, the one checkpoints store: ``legacy_optimizer`` (the
per-leaf optax optimizer the flat one replaced) and the converters between it and
``kunlun.train.optim``'s flat buffers (``to_per_leaf`` / ``from_per_leaf``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import NamedSharding

from kunlun.train import optim


def legacy_optimizer(train_cfg, total_steps: int) -> optax.GradientTransformation:
  """The per-leaf optax optimizer the flat one replaced (``optax.partition`` of
  ``chain(clip_by_global_norm, adamw)`` and ``rowwise_adagrad``): the same updates, and its state
  layout is the one checkpoints store (``to_per_leaf``)."""
  dense = optax.chain(
      optax.clip_by_global_norm(train_cfg.clip_norm),
      optax.adamw(optim.lr_schedule(train_cfg, total_steps), b1=train_cfg.b1, b2=train_cfg.b2,
                  eps=1e-8, weight_decay=train_cfg.weight_decay,
                  mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)))
  return optax.partition({"dense": dense, "emb": optim.rowwise_adagrad(train_cfg.emb_lr)},
                         optim.param_labels)


_SHAPE_CFG = {"lr": 1.0, "warmup_steps": 0, "schedule": "constant", "weight_decay": 0.0,
              "b1": 0.9, "b2": 0.999, "clip_norm": 1.0, "emb_lr": 1.0}


def is_flat(state) -> bool:
  """Whether an optimizer state is ``make_optimizer``'s (flat AdamW buffers)."""
  try:
    return isinstance(state.inner_states["dense"].inner_state, optim.FlatAdamWState)
  except (AttributeError, KeyError, TypeError):
    return False


def per_leaf_abstract(abstract_params):
  """``ShapeDtypeStruct``s of the per-leaf (``legacy_optimizer``) state of ``abstract_params``,
  with the shardings ``opt_state_shardings`` gives per-leaf state (when the params have
  ``NamedSharding``s): the layout checkpoints store, independent of the mesh."""
  tx = legacy_optimizer(ml_collections.ConfigDict(_SHAPE_CFG), 1)
  state = jax.eval_shape(tx.init, abstract_params)
  shardings = [getattr(x, "sharding", None) for x in jax.tree.leaves(abstract_params)]
  mesh = next((s.mesh for s in shardings if isinstance(s, NamedSharding)), None)
  if mesh is None:
    return state
  shard = optim.match_param_shardings(state, abstract_params,
                                 jax.tree.map(lambda x: x.sharding, abstract_params), mesh)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state,
                      shard)


def _layout_of(params, buffers):
  """The flat layout of ``params`` for their own shardings (as ``Optimizer.bind`` gets them)
  whose groups have the shapes of ``buffers`` (a state's moments: the XLA layout or the one laid
  out for ``pallas_kernels.adamw``; None: the XLA layout)."""
  shardings = jax.tree.map(lambda x: getattr(x, "sharding", None), params)
  want = None if buffers is None else [tuple(b.shape) for b in buffers]
  for backend in ("xla", "pallas"):
    opt = optim.Optimizer(ml_collections.ConfigDict(_SHAPE_CFG), 1, shardings, backend=backend)
    layout = opt.layout(params)[0]
    if want is None or [tuple(g.shape) for g in layout.groups] == want:
      return layout
  raise ValueError(f"optimizer state: moment buffers {want} fit no layout of these parameters")


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
  layout = _layout_of(params, state.inner_states["dense"].inner_state.mu)
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


def from_per_leaf(state, params, abstract_state=None, values=None):
  """A per-leaf ``legacy_optimizer`` state (a checkpoint's, also one written before the flat
  layout) in ``make_optimizer``'s flat layout for ``params`` (arrays or ShapeDtypeStructs with
  shardings); ``abstract_state``: the flat target (its shardings are kept). Where the target
  holds 16-bit param copies (``optim.FlatAdamWState.copies``) they are cast from ``values``
  (the params' arrays; default ``params``). Same moments, count and accumulators: the next
  update is unchanged."""
  want = optim.state_copies(abstract_state) if abstract_state is not None else ()
  leaves = jax.tree.leaves(params if values is None else values) if want else []

  layout = _layout_of(params, None if abstract_state is None else     # the target's layout
                      abstract_state.inner_states["dense"].inner_state.mu)

  def convert(state, leaves):
    adam = state.inner_states["dense"].inner_state[1][0]
    mu = jax.tree.leaves(adam.mu, is_leaf=optim.is_masked)
    nu = jax.tree.leaves(adam.nu, is_leaf=optim.is_masked)
    copies = optim.refresh_copies(want, leaves)
    dense = optim.FlatAdamWState(jnp.asarray(adam.count, jnp.int32), layout.pack(mu),
                                 layout.pack(nu), copies)
    return optax.PartitionState({"dense": optax.MaskedState(dense),
                                 "emb": state.inner_states["emb"]})

  out_sh = _shardings_of(abstract_state) if abstract_state is not None else None
  return jax.jit(convert, out_shardings=out_sh)(state, leaves)
