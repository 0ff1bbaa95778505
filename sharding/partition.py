"""Sharded parameter initialisation and batch shardings (jax_stack_notes §4.2 recipe).

  params, shardings = init_sharded(model, rng, batch, mesh, rules)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    logits = jax.jit(lambda p, b: model.apply({"params": p}, b, train=False))(params, batch)

``params`` is the plain (unboxed) ``"params"`` collection; ``shardings`` has the same structure
with one ``NamedSharding`` per leaf. The model is called as
``model.init(rng, batch, **call_kwargs)`` with ``call_kwargs={"train": False}`` by default
(the kunlun model signature).
"""

from __future__ import annotations

import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

_DEFAULT_CALL = {"train": False}


@contextlib.contextmanager
def activate(mesh, rules):
  """``with jax.set_mesh(mesh), nn.logical_axis_rules(rules):`` as one context manager."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    yield


def _abstract_batch(batch):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), batch)


def _boxed_init(model, example_batch, call_kwargs):
  """``rng -> boxed params``; the batch is zeros of the example's shapes (values never matter)."""
  batch_struct = _abstract_batch(example_batch)

  def init(rng):
    batch = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), batch_struct)
    return model.init(rng, batch, **call_kwargs)["params"]
  return init


def _init_fn(model, example_batch, call_kwargs):
  """``rng -> unboxed params`` (unboxing inside the traced function, §4.3)."""
  boxed = _boxed_init(model, example_batch, call_kwargs)
  return lambda rng: nn.meta.unbox(boxed(rng))


def fit_spec(spec: P, shape, mesh) -> P:
  """Drops mesh axes from ``spec`` until each dimension is divisible by its shard count.

  Stored arrays need evenly divisible shards; e.g. a 50-row table on an 8-device ``fsdp`` axis
  falls back to replicated rows (``checks.assert_params_sufficiently_sharded`` reports large
  fallbacks). Axes are kept greedily in order, so ``("fsdp", "tensor")`` on a dimension divisible
  by fsdp but not fsdp x tensor keeps ``fsdp``.
  """
  out = []
  entries = tuple(spec) + (None,) * (len(shape) - len(spec))
  for dim, entry in zip(shape, entries, strict=True):
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    kept, n = [], 1
    for a in axes:
      if dim % (n * mesh.shape[a]) == 0:
        kept.append(a)
        n *= mesh.shape[a]
    out.append(None if not kept else kept[0] if len(kept) == 1 and isinstance(entry, str)
               else tuple(kept))
  return P(*out)


def param_shardings(model, rng, example_batch, mesh, rules, call_kwargs=None):
  """NamedShardings of the ``params`` collection derived from the logical annotations + rules.

  Parameters created without ``with_axes`` get a fully replicated sharding; dimensions that do not
  divide evenly fall back as in ``fit_spec``.
  """
  call_kwargs = _DEFAULT_CALL if call_kwargs is None else call_kwargs
  with activate(mesh, rules):
    boxed = jax.eval_shape(_boxed_init(model, example_batch, call_kwargs), rng)
    specs = nn.get_partition_spec(boxed)
    shardings = nn.meta.unbox(nn.logical_to_mesh_sharding(specs, mesh, rules))
  shapes = nn.meta.unbox(boxed)
  return jax.tree.map(lambda a, s: NamedSharding(mesh, fit_spec(s.spec, a.shape, mesh)),
                      shapes, shardings)


def init_sharded(model, rng, example_batch, mesh, rules, call_kwargs=None):
  """Initialises the model's parameters directly into their sharded layout.

  Args:
    model: a Linen module called as ``model.init(rng, batch, **call_kwargs)``.
    rng: a PRNG key (or a dict of keys) for ``model.init``.
    example_batch: a pytree with the batch's shapes and dtypes (numpy arrays, jax arrays or
      ShapeDtypeStructs); only shapes are used, so a per-process batch is fine.
    mesh, rules: a ``sharding.mesh.make_mesh`` mesh and a ``sharding.rules`` rule set.
  Returns:
    ``(params, shardings)``: the unboxed ``params`` collection and its NamedShardings.
  """
  call_kwargs = _DEFAULT_CALL if call_kwargs is None else call_kwargs
  shardings = param_shardings(model, rng, example_batch, mesh, rules, call_kwargs)
  init = _init_fn(model, example_batch, call_kwargs)
  with activate(mesh, rules):
    params = jax.jit(init, out_shardings=shardings)(rng)
  return params, shardings


def abstract_params(model, rng, example_batch, mesh, rules, call_kwargs=None):
  """ShapeDtypeStructs (with shardings) of the ``params`` collection (e.g. an orbax target)."""
  call_kwargs = _DEFAULT_CALL if call_kwargs is None else call_kwargs
  shardings = param_shardings(model, rng, example_batch, mesh, rules, call_kwargs)
  init = _init_fn(model, example_batch, call_kwargs)
  with activate(mesh, rules):
    shapes = jax.eval_shape(init, rng)
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      shapes, shardings)


def batch_spec(rules) -> P:
  """PartitionSpec of an array whose leading axis is the batch (``P(batch_axes)``)."""
  return nn.logical_to_mesh_axes(("batch",), rules)


def batch_sharding(mesh, rules) -> NamedSharding:
  """NamedSharding for arrays whose leading axis is the batch (any rank; other axes replicated)."""
  return NamedSharding(mesh, batch_spec(rules))


def batch_shard_count(mesh, rules) -> int:
  """Number of batch shards (the global batch size must be a multiple of it)."""
  axes = batch_spec(rules)[0]
  axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
  n = 1
  for a in axes:
    n *= mesh.shape[a]
  return n


def logical_sharding(mesh, rules, logical_axes) -> NamedSharding:
  """NamedSharding of an array annotated with ``logical_axes`` under ``rules``."""
  return NamedSharding(mesh, nn.logical_to_mesh_axes(tuple(logical_axes), rules))


def state_shardings(init_fn, params):
  """Shardings for ``init_fn(params)`` (e.g. ``tx.init``) that mirror the parameters' shardings.

  A state leaf whose key path ends with a parameter's key path and has that parameter's shape
  gets the parameter's sharding; one with the parameter's shape minus its last axis (row-wise
  accumulators) gets the spec without its last entry; everything else is replicated. Needed
  because ``jax.jit(tx.init)`` alone may replicate zero-initialised moments.
  """
  p_flat = [(jax.tree_util.keystr(k), v) for k, v in jax.tree_util.tree_leaves_with_path(params)]
  mesh = p_flat[0][1].sharding.mesh
  replicated = NamedSharding(mesh, P())

  def pick(path, leaf):
    key = jax.tree_util.keystr(path)
    for pk, p in sorted(p_flat, key=lambda kv: -len(kv[0])):
      if not key.endswith(pk):
        continue
      if leaf.shape == p.shape:
        return p.sharding
      if leaf.shape == p.shape[:-1]:
        spec = tuple(p.sharding.spec) + (None,) * (p.ndim - len(p.sharding.spec))
        return NamedSharding(mesh, P(*spec[:-1]))
    return replicated

  return jax.tree_util.tree_map_with_path(pick, jax.eval_shape(init_fn, params))
