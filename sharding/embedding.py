"""Row-sharded embedding tables: id-bucket exchange lookup and a sparse row-wise Adagrad update.

Tables are ``[V, D]`` with rows sharded over every mesh axis the rules give ``table_rows``
(``rules.py``: all five), so device ``s`` (the linear index over those axes) owns rows
``[s R, (s + 1) R)``, ``R = V / n``. Under an active mesh and rules, ``lookup`` runs inside
``jax.shard_map`` (jax_stack_notes §10.3):

  1. the flattened ids are split evenly over all n devices; each device deduplicates its ids
     (``jnp.unique`` with a fixed size) and buckets them by owner, ``owner = id // R``;
  2. ``all_to_all`` of fixed-capacity buckets ``[n, C]`` sends every id to its owner;
  3. the owner gathers the rows from its shard; 4. a second ``all_to_all`` returns ``[n, C, D]``;
  5. each device scatters the rows back to its ids.

When any device has more than ``C`` distinct ids for one owner, every device takes the fallback
path instead (a ``lax.cond`` on a psum'd flag): all-gather of the ids, masked local gather and a
reduce-scatter of the rows (correct for any ids, more traffic). Neither path moves a table-sized
array. Gradients flow by autodiff (the transposes of gather and all_to_all) into each owner's
shard only.

With no mesh, no rules, or rows that are not sharded, ``lookup`` is ``jnp.take``.

``sparse_adagrad_update`` applies row-wise Adagrad to the rows looked up in a step only
(the same exchange routes (id, gradient) pairs to their owners); other rows stay bitwise unchanged.
The train step uses it when ``config.train.sparse_embedding_update`` is on
(``kunlun/train/step.py``).
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sharding.partition import fit_spec

CAPACITY_FACTOR = 2.0


def _active_mesh():
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh is None or mesh.empty else mesh


def row_axes(num_rows: int, mesh=None, rules=None) -> tuple[str, ...]:
  """Mesh axes that shard the rows of a ``num_rows``-row table (``()`` = not sharded)."""
  mesh = mesh if mesh is not None else _active_mesh()
  rules = rules if rules is not None else nn.get_logical_axis_rules()
  if mesh is None or not rules:
    return ()
  spec = fit_spec(nn.logical_to_mesh_axes(("table_rows",), rules), (num_rows,), mesh)
  axes = spec[0]
  axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
  return tuple(a for a in axes if mesh.shape[a] > 1)


def capacity(num_ids: int, num_shards: int, factor: float = CAPACITY_FACTOR) -> int:
  """Bucket capacity per owner for ``num_ids`` ids on one device (never more than ``num_ids``)."""
  return int(min(num_ids, max(4, math.ceil(factor * num_ids / num_shards))))


def _owners(uid, num_rows, rows_per_shard, n):
  """Owner bucket and rank inside it of sorted unique ids (``num_rows`` = "none", sorted last)."""
  owner = jnp.where(uid < num_rows, uid // rows_per_shard, n)        # n = "no owner" bucket
  counts = jnp.zeros((n + 1,), jnp.int32).at[owner].add(1)
  pos = jnp.arange(uid.shape[0]) - (jnp.cumsum(counts) - counts)[owner]
  return owner, pos, counts[:n]


def _flat_padded(x, n, fill):
  """Flattens the leading ``ids`` dims of ``x`` and pads them to a multiple of ``n``."""
  m = x.shape[0]
  pad = (-m) % n
  return jnp.concatenate([x, jnp.full((pad,) + x.shape[1:], fill, x.dtype)]) if pad else x


def lookup(table, ids, *, capacity_factor: float = CAPACITY_FACTOR, force_fallback: bool = False):
  """Rows of ``table [V, D]`` at ``ids int[...]`` -> ``[..., D]``; negative ids give zero rows.

  Ids must be ``< V`` (internally ``V`` marks "no id"). Sharded exchange under an active mesh +
  rules (see module doc), else
  ``jnp.take``. ``force_fallback`` takes the overflow path unconditionally (for tests).
  """
  V, D = table.shape
  axes = row_axes(V)
  ids = jnp.asarray(ids, jnp.int32)
  if not axes:
    rows = jnp.take(table, jnp.maximum(ids, 0), axis=0)
    return jnp.where((ids >= 0)[..., None], rows, jnp.zeros((), table.dtype))
  mesh = _active_mesh()
  n = math.prod(mesh.shape[a] for a in axes)
  R = V // n
  flat = _flat_padded(jnp.where(ids >= 0, ids, V).reshape(-1), n, V)
  m = flat.shape[0] // n
  C = capacity(m, n, capacity_factor)

  def local(table_rd, ids_m):
    me = jax.lax.axis_index(axes)
    uid, inv = jnp.unique(ids_m, size=m, fill_value=V, return_inverse=True)
    owner, pos, counts = _owners(uid, V, R, n)
    overflow = jax.lax.psum(jnp.any(counts > C).astype(jnp.int32), axes) > 0

    def exchange(_):
      send_nc = jnp.full((n, C), V, jnp.int32).at[owner, pos].set(uid, mode="drop")
      recv_nc = jax.lax.all_to_all(send_nc, axes, 0, 0, tiled=True)
      loc = recv_nc - me * R
      rows_ncd = jnp.where((loc < R)[..., None], table_rd[jnp.clip(loc, 0, R - 1)], 0)
      back_ncd = jax.lax.all_to_all(rows_ncd, axes, 0, 0, tiled=True)
      ok = (uid < V) & (pos < C)
      rows_md = back_ncd[jnp.clip(owner, 0, n - 1), jnp.clip(pos, 0, C - 1)]
      return jnp.where(ok[:, None], rows_md, 0)[inv.reshape(-1)]

    def masked(_):
      all_ids = jax.lax.all_gather(ids_m, axes, tiled=True)            # [n m]
      loc = all_ids - me * R
      mine = (loc >= 0) & (loc < R)
      rows = jnp.where(mine[:, None], table_rd[jnp.clip(loc, 0, R - 1)], 0)
      return jax.lax.psum_scatter(rows, axes, scatter_dimension=0, tiled=True)

    if force_fallback:
      return masked(None)
    return jax.lax.cond(overflow, masked, exchange, None)

  out = jax.shard_map(local, in_specs=(P(axes, None), P(axes)), out_specs=P(axes, None),
                      axis_names=set(axes))(table, flat)
  return out[:ids.size].reshape(ids.shape + (D,))


# ---- sparse row-wise Adagrad -----------------------------------------------------------------

def _apply_rows(table_rd, acc_r, loc, g_kd, lr, eps):
  """Row-wise Adagrad on rows ``loc`` (unique; out-of-range = skip) of a local table shard."""
  R = table_rd.shape[0]
  ok = (loc >= 0) & (loc < R)
  idx = jnp.where(ok, loc, R)                                          # R: dropped by scatter
  g2 = jnp.mean(jnp.square(g_kd.astype(jnp.float32)), axis=-1)
  acc_r = acc_r.at[idx].add(g2, mode="drop")
  a_k = acc_r[jnp.clip(idx, 0, R - 1)]
  upd = (-lr * g_kd / (jnp.sqrt(a_k)[:, None] + eps)).astype(table_rd.dtype)
  return table_rd.at[idx].add(upd, mode="drop"), acc_r


def _dedup_sum(ids_k, g_kd, none):
  """Sorted unique ids (``none`` = no id, filled last) and the summed gradient of each."""
  k = ids_k.shape[0]
  uid, inv = jnp.unique(ids_k, size=k, fill_value=none, return_inverse=True)
  g = jax.ops.segment_sum(jnp.where((ids_k < none)[:, None], g_kd, 0), inv.reshape(-1),
                          num_segments=k)
  return uid, g


def sparse_adagrad_update(table, acc, ids, row_grads, lr: float, eps: float = 1e-8, *,
                          capacity_factor: float = CAPACITY_FACTOR, force_fallback: bool = False,
                          enabled=None, with_sq_norm: bool = False):
  """Row-wise Adagrad applied only to the rows named in ``ids``.

  ``table [V, D]``, ``acc f32[V]`` (one accumulator per row), ``ids int[...]`` (negative = none),
  ``row_grads [..., D]`` = dLoss/d(looked-up row) for each id. Gradients of repeated ids are
  summed per row, then ``acc_r += mean_d g_rd^2`` and ``table_r -= lr g_r / (sqrt(acc_r) + eps)``.
  Rows not in ``ids`` are bitwise unchanged. ``enabled`` (``bool[]``, traced): ``False`` leaves
  every row unchanged (a skipped step without a table-wide select). Returns ``(table, acc)``, or
  ``(table, acc, sq_norm f32[])`` with ``with_sq_norm``: the squared L2 norm of the per-row summed
  gradient, i.e. of the dense table gradient (0 when not enabled).
  """
  V, D = table.shape
  ids = jnp.asarray(ids, jnp.int32).reshape(-1)
  keep = ids >= 0
  if enabled is not None:
    keep = keep & jnp.asarray(enabled, jnp.bool_)
  ids = jnp.where(keep, ids, V)
  g = row_grads.reshape(-1, D)
  axes = row_axes(V)
  if not axes:
    uid, g_u = _dedup_sum(ids, g, V)
    out = _apply_rows(table, acc, uid, g_u, lr, eps)
    return out + (_sq_norm(g_u),) if with_sq_norm else out
  mesh = _active_mesh()
  n = math.prod(mesh.shape[a] for a in axes)
  R = V // n
  flat, g = _flat_padded(ids, n, V), _flat_padded(g, n, 0)
  m = flat.shape[0] // n
  C = capacity(m, n, capacity_factor)

  def local(table_rd, acc_r, ids_m, g_md):
    me = jax.lax.axis_index(axes)
    uid, g_u = _dedup_sum(ids_m, g_md, V)
    owner, pos, counts = _owners(uid, V, R, n)
    overflow = jax.lax.psum(jnp.any(counts > C).astype(jnp.int32), axes) > 0

    def exchange(_):
      send_ids = jnp.full((n, C), V, jnp.int32).at[owner, pos].set(uid, mode="drop")
      send_g = jnp.zeros((n, C, D), g_u.dtype).at[owner, pos].set(g_u, mode="drop")
      recv_ids = jax.lax.all_to_all(send_ids, axes, 0, 0, tiled=True).reshape(-1)
      recv_g = jax.lax.all_to_all(send_g, axes, 0, 0, tiled=True).reshape(-1, D)
      return recv_ids, recv_g

    def gathered(_):
      all_ids = jax.lax.all_gather(uid, axes, tiled=True)
      all_g = jax.lax.all_gather(g_u, axes, tiled=True)
      lo = all_ids - me * R
      return jnp.where((lo >= 0) & (lo < R), all_ids, V), all_g     # [n m] >= [n C]

    if force_fallback:
      rid, rg = gathered(None)
    else:
      rid, rg = jax.lax.cond(
          overflow, lambda _: gathered(None),
          lambda _: tuple(_pad_to(x, n * m, V) for x in exchange(None)), None)
    rid, rg = _dedup_sum(rid, rg, V)          # each row now lives on its owner exactly once
    out = _apply_rows(table_rd, acc_r, rid - me * R, rg, lr, eps)    # V - me R >= R: skipped
    return out + (jax.lax.psum(_sq_norm(rg), axes),)

  table, acc, sq = jax.shard_map(
      local, in_specs=(P(axes, None), P(axes), P(axes), P(axes, None)),
      out_specs=(P(axes, None), P(axes), P()), axis_names=set(axes))(table, acc, flat, g)
  return (table, acc, sq) if with_sq_norm else (table, acc)


def _sq_norm(g_kd):
  return jnp.sum(jnp.square(g_kd.astype(jnp.float32)))


def _pad_to(x, k, none):
  pad = k - x.shape[0]
  if pad <= 0:
    return x
  fill = none if x.dtype == jnp.int32 else 0
  return jnp.concatenate([x, jnp.full((pad,) + x.shape[1:], fill, x.dtype)])
