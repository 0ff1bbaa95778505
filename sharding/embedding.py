"""Embedding tables: table-batched look-ups (TBE), row-sharded exchange, sparse row-wise Adagrad.
Notes: docs/sharding.md, ``sharding/embedding.py``."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sharding.partition import fit_spec

CAPACITY_FACTOR = None       # bucket capacity: statistical bound (``capacity``)


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


def sums_densely(table_rows: list[int], num_ids: int) -> bool:
  """Whether the sparse update (``kunlun.train.sparse_update``) sums a table group's row
  gradients into a table-shaped gradient and updates it inside the optimizer's ``lax.cond``
  (``table_rows``: its tables' rows; ``num_ids``: the ids it looks up in a step): a group of no
  more rows than ids, its tables' rows not sharded. The rest it updates row by row."""
  return sum(table_rows) <= num_ids and not row_axes(table_rows[0])


def capacity(num_ids: int, num_shards: int, factor: float | None = None) -> int:
  """Bucket capacity per owner for ``num_ids`` ids on one device (never more than ``num_ids``).

  Default: the mean ``num_ids / num_shards`` plus 4 standard deviations of a uniform spread
  (``mean + 4 sqrt(mean) + 1``): about 1.2x the mean at ``mean = 512``, so the all-to-all
  carries little padding, while distinct hashed ids overflow a bucket (and take the fallback
  path) with probability ~1e-5. ``factor``: ``factor * mean`` instead (at least 4)."""
  mean = num_ids / num_shards
  c = math.ceil(factor * mean) if factor is not None else math.ceil(mean + 4 * math.sqrt(mean)) + 1
  return int(min(num_ids, max(4, c)))


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


# ---- sorted de-duplication -------------------------------------------------------------------

def _sorted_unique(ids_k, fill):
  """``jnp.unique(ids_k, size=k, fill_value=fill, return_inverse=True)`` from one stable sort,
  plus the sort's permutation and each sorted position's segment: ``(uid, inv, perm, seg)`` with
  ``ids_k[perm]`` sorted, ``uid[seg] = ids_k[perm]`` and ``inv[perm] = seg``."""
  k = ids_k.shape[0]
  sk, perm = jax.lax.sort((ids_k, jnp.arange(k, dtype=jnp.int32)), num_keys=1, is_stable=True)
  new = jnp.concatenate([jnp.ones((1,), bool), sk[1:] != sk[:-1]])
  seg = jnp.cumsum(new.astype(jnp.int32)) - 1
  uid = jnp.full((k,), fill, ids_k.dtype).at[seg].set(sk, indices_are_sorted=True)
  inv = jnp.zeros((k,), jnp.int32).at[perm].set(seg, unique_indices=True)
  return uid, inv, perm, seg


def _sum_dtype(dtype):
  """Float32 sums of 16-bit terms (row gradients may come in the model's compute dtype)."""
  return jnp.promote_types(dtype, jnp.float32)


def _segment_sum_sorted(x_kd, perm, seg, num_segments):
  """``segment_sum(x, inv)`` as a sorted scatter-add of ``x[perm]`` at ``seg`` (terms of each
  segment added in their original order: the sort is stable), at least in float32."""
  dt = _sum_dtype(x_kd.dtype)
  out = jnp.zeros((num_segments,) + x_kd.shape[1:], dt)
  return out.at[seg].add(jnp.take(x_kd, perm, axis=0).astype(dt), indices_are_sorted=True,
                         mode="drop")


@jax.custom_vjp
def _expand(rows_ud, inv, perm, seg):
  """``rows_ud[inv]`` whose backward is the sorted segment-sum (not an unsorted scatter-add)."""
  return jnp.take(rows_ud, inv, axis=0)


def _expand_fwd(rows_ud, inv, perm, seg):
  return jnp.take(rows_ud, inv, axis=0), (perm, seg, rows_ud.shape[0])


def _expand_bwd(res, g):
  perm, seg, u = res
  return _segment_sum_sorted(g, perm, seg, u).astype(g.dtype), None, None, None


_expand.defvjp(_expand_fwd, _expand_bwd)


# ---- table groups ----------------------------------------------------------------------------

SMALL_TABLE_ROWS = 1 << 16     # larger tables are looked up alone (never copied into a group)


def plan_groups(tables) -> list[tuple[int, ...]]:
  """Indices of ``tables`` (arrays or shape/dtype structs ``[V, D]``) grouped for batched
  look-ups: equal width, dtype and row sharding (``row_axes``); a table of more than
  ``SMALL_TABLE_ROWS`` rows forms its own group. Groups in order of their first table."""
  groups = {}
  for i, t in enumerate(tables):
    V, D = t.shape
    key = ("alone", i) if V > SMALL_TABLE_ROWS else (D, str(t.dtype), row_axes(V))
    groups.setdefault(key, []).append(i)
  return [tuple(g) for g in groups.values()]


def _lead(shape):
  """The leading (batch) dimension: an int, or a symbolic dimension under ``jax.export``."""
  return shape[0] if len(shape) else 1


def group_ids(ids_list, sizes) -> jax.Array:
  """Ids ``i32[L, N]`` into the concatenation of tables with ``sizes`` rows: table ``i``'s id
  ``r`` becomes ``sum(sizes[:i]) + r``; negative ids stay ``-1`` (no row). Each ``ids_i``
  (``[L, ...]``, one leading dimension ``L`` for all: the batch) is flattened to ``[L, N_i]`` and
  the tables are concatenated along the second axis, so the leading (batch) dimension and its
  sharding are kept and a device's share of the ids stays on that device."""
  out, off = [], 0
  L = {_lead(jnp.shape(i)) for i in ids_list}
  if len(L) != 1:
    raise ValueError(f"grouped ids need one leading dimension; got shapes "
                     f"{[jnp.shape(i) for i in ids_list]}")
  L = L.pop()
  for ids, V in zip(ids_list, sizes, strict=True):
    ids = jnp.asarray(ids, jnp.int32).reshape(L, -1)
    out.append(jnp.where(ids >= 0, ids + off, -1))
    off += int(V)
  return out[0] if len(out) == 1 else jnp.concatenate(out, axis=1)


def split_rows(rows_lnd, shapes) -> list:
  """Inverse of ``group_ids`` for looked-up rows: ``[L, N, D]`` -> ``[*shape_i, D]`` per table."""
  out, start = [], 0
  L, D = rows_lnd.shape[0], rows_lnd.shape[-1]
  for shape in shapes:
    n = math.prod(shape) // L if L else 0
    out.append(rows_lnd[:, start:start + n].reshape(tuple(shape) + (D,)))
    start += n
  return out


def lookup_tables(tables, ids_list, **kw) -> list:
  """Rows of each ``tables[i] [V_i, D_i]`` at ``ids_list[i] int[...]`` -> ``[..., D_i]``, one
  batched look-up per ``plan_groups`` group (negative ids give zero rows)."""
  out = [None] * len(tables)
  for grp in plan_groups(tables):
    tg = [tables[i] for i in grp]
    gids = group_ids([ids_list[i] for i in grp], [t.shape[0] for t in tg])
    rows = lookup_flat(tg, gids, **kw)
    for i, r in zip(grp, split_rows(rows, [jnp.shape(ids_list[i]) for i in grp]), strict=True):
      out[i] = r
  return out


def lookup(table, ids, *, capacity_factor: float | None = CAPACITY_FACTOR,
           force_fallback: bool = False):
  """Rows of ``table [V, D]`` at ``ids int[...]`` -> ``[..., D]``; negative ids give zero rows.

  Ids must be ``< V``. Sharded exchange under an active mesh + rules (see module doc), else a
  gather. ``force_fallback`` takes the overflow path unconditionally (for tests).
  """
  ids = jnp.asarray(ids, jnp.int32)
  rows = lookup_flat([table], ids, capacity_factor=capacity_factor,
                     force_fallback=force_fallback)
  return rows.reshape(ids.shape + (table.shape[1],))


def _group_layout(tables):
  """``(sizes, axes, n, R, RS)`` of a group: rows per table, the row axes (shared), the number of
  row shards, rows per shard per table and their sum (the virtual table's shard)."""
  sizes = [int(t.shape[0]) for t in tables]
  axes = row_axes(sizes[0])
  if any(row_axes(V) != axes for V in sizes[1:]) or len({t.shape[1] for t in tables}) > 1:
    raise ValueError(f"a table group needs equal widths and row shardings; got shapes "
                     f"{[tuple(t.shape) for t in tables]} (use plan_groups)")
  if not axes:
    return sizes, axes, 1, sizes, sum(sizes)
  mesh = _active_mesh()
  n = math.prod(mesh.shape[a] for a in axes)
  R = [V // n for V in sizes]
  return sizes, axes, n, R, sum(R)


def _id_axes(axes) -> tuple[str, ...]:
  """The row axes ordered batch axes first: how the flat ids are split over the devices of the
  exchange, so that each device's share of the ids comes from its own batch shard (no resharding
  of ids or rows; the buckets still go to the table owners in ``axes`` order)."""
  mesh, rules = _active_mesh(), nn.get_logical_axis_rules()
  spec = nn.logical_to_mesh_axes(("batch",), rules)[0] if rules else None
  batch = () if spec is None else (spec,) if isinstance(spec, str) else tuple(spec)
  first = tuple(a for a in batch if a in axes and mesh.shape[a] > 1)
  return first + tuple(a for a in axes if a not in first)


def _virtual_ids(gids, sizes, R, n):
  """Group ids (``group_ids``) -> ids of the virtual table sharded ``sum(R)`` rows per device:
  row ``r`` of table ``i`` lives on device ``r // R_i`` at local row ``sum(R[:i]) + r % R_i``.
  Negative ids -> ``n * sum(R)`` (none)."""
  RS = sum(R)
  none = n * RS
  if len(sizes) == 1:
    return jnp.where(gids >= 0, gids, none)
  offs = jnp.asarray([sum(sizes[:i]) for i in range(len(sizes))], jnp.int32)
  loffs = jnp.asarray([sum(R[:i]) for i in range(len(R))], jnp.int32)
  Rs = jnp.asarray(R, jnp.int32)
  t = jnp.searchsorted(offs[1:], gids, side="right")
  r = gids - offs[t]
  vid = (r // Rs[t]) * RS + loffs[t] + r % Rs[t]
  return jnp.where(gids >= 0, vid, none)


def _take_concat(tables, gids):
  """Gather from the concatenated tables; backward: one sorted segment-sum for the group."""
  sizes = tuple(int(t.shape[0]) for t in tables)
  dtypes = tuple(t.dtype for t in tables)

  @jax.custom_vjp
  def take(tables, gids):
    T = tables[0] if len(tables) == 1 else jnp.concatenate(tables)
    rows = jnp.take(T, jnp.maximum(gids, 0), axis=0)
    return jnp.where((gids >= 0)[..., None], rows, jnp.zeros((), T.dtype))

  def fwd(tables, gids):
    return take(tables, gids), gids

  def bwd(gids, g_md):
    parts = group_dense_grads(gids, g_md, sizes)
    return tuple(p.astype(d) for p, d in zip(parts, dtypes, strict=True)), None

  take.defvjp(fwd, bwd)
  return take(tuple(tables), gids)


def _batch_axes(lead: int) -> tuple[str, ...]:
  """Mesh axes (size > 1) that shard the batch under the active mesh and rules, when they divide
  ``lead``; ``()`` otherwise."""
  mesh, rules = _active_mesh(), nn.get_logical_axis_rules()
  if mesh is None or not rules:
    return ()
  spec = nn.logical_to_mesh_axes(("batch",), rules)[0]
  axes = () if spec is None else (spec,) if isinstance(spec, str) else tuple(spec)
  axes = tuple(a for a in axes if mesh.shape[a] > 1)
  n = math.prod(mesh.shape[a] for a in axes)
  # a symbolic (exported) batch is never split here: its divisibility is unknown at trace time
  return axes if axes and isinstance(lead, int) and lead % n == 0 else ()


def _sorted_dense_grad(gids_k, g_kd, V):
  key = jnp.where(gids_k >= 0, gids_k, V)
  sk, perm = jax.lax.sort((key, jnp.arange(key.shape[0], dtype=jnp.int32)), num_keys=1,
                          is_stable=True)
  dt = _sum_dtype(g_kd.dtype)
  return jnp.zeros((V, g_kd.shape[1]), dt).at[sk].add(
      jnp.take(g_kd, perm, axis=0).astype(dt), indices_are_sorted=True, mode="drop")


def group_dense_grads(gids, g, sizes) -> list:
  """Table-shaped gradients ``[V_i, D]`` of a group from its looked-up rows' gradients
  (``gids [L, ...]``, ``g [L, ..., D]``): ``group_dense_grad`` split per table."""
  return split_tables(group_dense_grad(gids, g, sum(int(v) for v in sizes)), sizes)


def split_tables(g_vd, sizes) -> list:
  """A group's table-shaped gradient ``[sum(sizes), D]`` -> ``[V_i, D]`` per table."""
  offs = [0]
  for v in sizes:
    offs.append(offs[-1] + int(v))
  return [g_vd[a:b] for a, b in zip(offs[:-1], offs[1:], strict=True)]


def group_dense_grad(gids, g, V: int):
  """The table-shaped gradient ``[V, D]`` of a group of ``V`` rows in all from its looked-up
  rows' gradients (``gids [L, ...]``, ``g [L, ..., D]``): one stable sort of the group ids and
  one sorted scatter-add (each row's terms summed in their original order). Negative ids
  contribute nothing. With the batch (``L``) sharded over devices each device sorts and sums its
  own ids, then the partial tables are summed over the batch axes (a psum of ``[V, D]``, what any
  replicated table's gradient needs)."""
  D = g.shape[-1]
  axes = _batch_axes(_lead(jnp.shape(gids)))
  if not axes:
    g_vd = _sorted_dense_grad(gids.reshape(-1), g.reshape(-1, D), V)
  else:
    L = _lead(jnp.shape(gids))
    local = lambda i, x: jax.lax.psum(_sorted_dense_grad(i.reshape(-1), x.reshape(-1, D), V),
                                      axes)
    g_vd = jax.shard_map(local, in_specs=(P(axes), P(axes)), out_specs=P(),
                         axis_names=set(axes))(gids.reshape(L, -1), g.reshape(L, -1, D))
  return g_vd


def lookup_flat(tables, gids, *, capacity_factor: float | None = CAPACITY_FACTOR,
                force_fallback: bool = False):
  """Rows ``[..., D]`` of one table group at group ids ``gids i32[...]`` (``group_ids``; ``-1`` =
  no row, a zero row). The tables must share width, dtype and row sharding (``plan_groups``)."""
  gids = jnp.asarray(gids, jnp.int32)
  sizes, axes, n, R, RS = _group_layout(tables)
  if not axes:
    return _take_concat(tables, gids)
  D = tables[0].shape[1]
  NV = n * RS                                                   # "no id" in virtual ids
  shape = gids.shape
  M = math.prod(shape)
  flat = _flat_padded(_virtual_ids(gids.reshape(-1), sizes, R, n), n, NV)
  m = flat.shape[0] // n
  C = capacity(m, n, capacity_factor)
  k = len(tables)

  def local(*args):
    tables_rd, ids_m = args[:k], args[k]
    table_rd = tables_rd[0] if k == 1 else jnp.concatenate(tables_rd)     # [RS, D]
    me = jax.lax.axis_index(axes)
    uid, inv, perm, seg = _sorted_unique(ids_m, NV)
    owner, pos, counts = _owners(uid, NV, RS, n)
    overflow = jax.lax.psum(jnp.any(counts > C).astype(jnp.int32), axes) > 0

    def exchange(_):
      send_nc = jnp.full((n, C), NV, jnp.int32).at[owner, pos].set(uid, mode="drop")
      recv_nc = jax.lax.all_to_all(send_nc, axes, 0, 0, tiled=True)
      loc = recv_nc - me * RS
      rows_ncd = jnp.where((loc < RS)[..., None], table_rd[jnp.clip(loc, 0, RS - 1)], 0)
      back_ncd = jax.lax.all_to_all(rows_ncd, axes, 0, 0, tiled=True)
      ok = (uid < NV) & (pos < C)
      rows_md = back_ncd[jnp.clip(owner, 0, n - 1), jnp.clip(pos, 0, C - 1)]
      return _expand(jnp.where(ok[:, None], rows_md, 0), inv, perm, seg)

    def masked(_):
      all_ids = jax.lax.all_gather(ids_m, axes, tiled=True)            # [n m]
      loc = all_ids - me * RS
      mine = (loc >= 0) & (loc < RS)
      rows = jnp.where(mine[:, None], table_rd[jnp.clip(loc, 0, RS - 1)], 0)
      return jax.lax.psum_scatter(rows, axes, scatter_dimension=0, tiled=True)

    if force_fallback:
      return masked(None)
    return jax.lax.cond(overflow, masked, exchange, None)

  ids_ax = _id_axes(axes)
  out = jax.shard_map(local, in_specs=(P(axes, None),) * k + (P(ids_ax),),
                      out_specs=P(ids_ax, None), axis_names=set(axes))(*tables, flat)
  return out[:M].reshape(shape + (D,))


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
  uid, _, perm, seg = _sorted_unique(ids_k, none)
  g = _segment_sum_sorted(jnp.where((ids_k < none)[:, None], g_kd, 0), perm, seg, k)
  return uid, g


def sparse_adagrad_update(table, acc, ids, row_grads, lr: float, eps: float = 1e-8, **kw):
  """Row-wise Adagrad applied only to the rows named in ``ids``.

  ``table [V, D]``, ``acc f32[V]`` (one accumulator per row), ``ids int[...]`` (negative = none),
  ``row_grads [..., D]`` = dLoss/d(looked-up row) for each id. Gradients of repeated ids are
  summed per row, then ``acc_r += mean_d g_rd^2`` and ``table_r -= lr g_r / (sqrt(acc_r) + eps)``.
  Rows not in ``ids`` are bitwise unchanged. Keywords: ``enabled`` (``bool[]``, traced;
  ``False`` leaves every row unchanged: a skipped step without a table-wide select),
  ``with_sq_norm`` (also return the squared L2 norm of the per-row summed gradient, i.e. of the
  dense table gradient; 0 when not enabled), ``capacity_factor``, ``force_fallback``.
  Returns ``(table, acc)`` or ``(table, acc, sq_norm)``.
  """
  out = sparse_adagrad_update_group([table], [acc], jnp.asarray(ids, jnp.int32).reshape(-1),
                                    row_grads, lr, eps, **kw)
  (t,), (a,) = out[0], out[1]
  return (t, a) + tuple(out[2:])


def sparse_adagrad_update_group(tables, accs, gids, row_grads, lr: float, eps: float = 1e-8, *,
                                capacity_factor: float | None = CAPACITY_FACTOR,
                                force_fallback: bool = False, enabled=None,
                                with_sq_norm: bool = False):
  """``sparse_adagrad_update`` for a table group (``plan_groups``) looked up with group ids
  ``gids i32[M]`` (``group_ids``) and row gradients ``row_grads [M, D]``: the ids are
  de-duplicated once for the group (one sort, one segment-sum, one exchange when sharded) and each
  table updates its own rows. Returns ``(tables, accs)`` (lists) or ``(tables, accs, sq_norm)``.
  """
  sizes, axes, n, R, RS = _group_layout(tables)
  D = tables[0].shape[1]
  gids = jnp.asarray(gids, jnp.int32).reshape(-1)
  keep = gids >= 0
  if enabled is not None:
    keep = keep & jnp.asarray(enabled, jnp.bool_)
  g = row_grads.reshape(-1, D)
  k = len(tables)
  if not axes:
    V = sum(sizes)
    uid, g_u = _dedup_sum(jnp.where(keep, gids, V), g, V)
    new_t, new_a, off = [], [], 0
    for t, a in zip(tables, accs, strict=True):
      t2, a2 = _apply_rows(t, a, uid - off, g_u, lr, eps)
      new_t.append(t2)
      new_a.append(a2)
      off += t.shape[0]
    return (new_t, new_a) + ((_sq_norm(g_u),) if with_sq_norm else ())
  NV = n * RS
  flat = _flat_padded(_virtual_ids(jnp.where(keep, gids, -1), sizes, R, n), n, NV)
  g = _flat_padded(g, n, 0)
  m = flat.shape[0] // n
  C = capacity(m, n, capacity_factor)
  loffs = [sum(R[:i]) for i in range(k)]

  def local(*args):
    tables_rd, accs_r, ids_m, g_md = args[:k], args[k:2 * k], args[2 * k], args[2 * k + 1]
    me = jax.lax.axis_index(axes)
    uid, g_u = _dedup_sum(ids_m, g_md, NV)
    owner, pos, counts = _owners(uid, NV, RS, n)
    overflow = jax.lax.psum(jnp.any(counts > C).astype(jnp.int32), axes) > 0

    def exchange(_):
      send_ids = jnp.full((n, C), NV, jnp.int32).at[owner, pos].set(uid, mode="drop")
      send_g = jnp.zeros((n, C, D), g_u.dtype).at[owner, pos].set(g_u, mode="drop")
      recv_ids = jax.lax.all_to_all(send_ids, axes, 0, 0, tiled=True).reshape(-1)
      recv_g = jax.lax.all_to_all(send_g, axes, 0, 0, tiled=True).reshape(-1, D)
      return recv_ids, recv_g

    def gathered(_):
      all_ids = jax.lax.all_gather(uid, axes, tiled=True)
      all_g = jax.lax.all_gather(g_u, axes, tiled=True)
      lo = all_ids - me * RS
      return jnp.where((lo >= 0) & (lo < RS), all_ids, NV), all_g     # [n m] >= [n C]

    if force_fallback:
      rid, rg = gathered(None)
    else:
      rid, rg = jax.lax.cond(
          overflow, lambda _: gathered(None),
          lambda _: tuple(_pad_to(x, n * m, NV) for x in exchange(None)), None)
    rid, rg = _dedup_sum(rid, rg, NV)         # each row now lives on its owner exactly once
    loc = rid - me * RS                        # NV - me RS >= RS: skipped
    outs = [_apply_rows(t, a, loc - lo, rg, lr, eps)
            for t, a, lo in zip(tables_rd, accs_r, loffs, strict=True)]
    return tuple(o[0] for o in outs) + tuple(o[1] for o in outs) + (
        jax.lax.psum(_sq_norm(rg), axes),)

  ids_ax = _id_axes(axes)
  res = jax.shard_map(
      local, in_specs=(P(axes, None),) * k + (P(axes),) * k + (P(ids_ax), P(ids_ax, None)),
      out_specs=(P(axes, None),) * k + (P(axes),) * k + (P(),), axis_names=set(axes))(
          *tables, *accs, flat, g)
  new_t, new_a, sq = list(res[:k]), list(res[k:2 * k]), res[2 * k]
  return (new_t, new_a, sq) if with_sq_norm else (new_t, new_a)


def _sq_norm(g_kd):
  return jnp.sum(jnp.square(g_kd.astype(jnp.float32)))


def _pad_to(x, k, none):
  pad = k - x.shape[0]
  if pad <= 0:
    return x
  fill = none if x.dtype == jnp.int32 else 0
  return jnp.concatenate([x, jnp.full((pad,) + x.shape[1:], fill, x.dtype)])
