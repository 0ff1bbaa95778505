"""Flat buffers for a multi-tensor optimizer update: leaves grouped by dtype and sharding.

  layout = Layout.build(shapes, shardings)        # shapes: [(shape, dtype) or None] per leaf
  bufs = layout.pack(leaves)                      # one buffer per group
  leaf = layout.unpack(bufs[g], member)           # a member's leaf back, in its own shape

A group holds the leaves that have the same dtype and are sharded over the same mesh axes (in
any dimensions). Inside its group a leaf is laid out as its **local block**: each sharded
dimension ``d`` (``n`` shards) is split into ``(n, d / n)``, the shard axes are moved to the
front in the group's axis order and the rest is flattened, giving ``[n_1, ..., n_k, l]``
(``l`` = the leaf's elements per device). The group's buffer concatenates its members on the last
axis, ``[n_1, ..., n_k, L]``, with the spec ``P(axes_1, ..., axes_k, None)``: every device holds
exactly its own shard of every member, so packing and unpacking move no data between devices
(an FSDP / tensor-sharded parameter keeps its shards where they are). Unsharded leaves (or
leaves on a mesh whose axes have size 1) form one ``[L]`` buffer per dtype; ``build(...,
align=, max_members=)`` puts their members at offsets that are multiples of ``align`` (zero
between them) in groups of at most ``max_members`` (the layout ``pallas_kernels.adamw`` reads).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class Member:
  """One leaf of a group: ``index`` among the tree's leaves, its ``shape``, ``split`` (the
  sharded dimensions and shard counts, in the group's axis order), its ``offset`` and ``size``
  (elements per device) on the buffer's last axis."""
  index: int
  shape: tuple
  split: tuple
  offset: int
  size: int


@dataclasses.dataclass(frozen=True)
class Group:
  """Leaves of one dtype sharded over the same mesh axes: buffer ``lead + (size,)``."""
  dtype: str
  axes: tuple          # per lead dimension: the mesh axes that shard it
  lead: tuple          # per lead dimension: its shard count
  members: tuple
  size: int
  align: int = 1       # members' offsets are multiples of it (``build(align=)``)

  @property
  def shape(self) -> tuple:
    return self.lead + (self.size,)

  def sharding(self, mesh):
    """The buffer's ``NamedSharding`` on ``mesh`` (None without a mesh)."""
    if mesh is None:
      return None
    return NamedSharding(mesh, P(*[a if len(a) > 1 else a[0] for a in self.axes], None))


def _dims(spec, ndim: int, mesh) -> list[tuple[tuple[str, ...], int]]:
  """``[(mesh axes, shard count)]`` per dimension of a leaf with PartitionSpec ``spec``."""
  entries = tuple(spec) + (None,) * (ndim - len(spec))
  out = []
  for e in entries[:ndim]:
    axes = () if e is None else (e,) if isinstance(e, str) else tuple(e)
    n = math.prod(mesh.shape[a] for a in axes) if axes and mesh is not None else 1
    out.append((axes, n) if n > 1 else ((), 1))
  return out


def unsplit(sharding, ndim: int) -> bool:
  """Whether a leaf of ``ndim`` dimensions with this sharding (a ``NamedSharding`` or None) is
  whole on every device: no dimension split over a mesh axis of more than one device."""
  if sharding is None:
    return True
  return all(n == 1 for _, n in _dims(sharding.spec, ndim, sharding.mesh))


class Layout:
  """Groups and members of a list of leaves (see module doc)."""

  def __init__(self, groups: tuple, mesh, num_leaves: int):
    self.groups, self.mesh, self.num_leaves = groups, mesh, num_leaves

  @classmethod
  def build(cls, shapes, shardings=None, *, align: int = 1,
            max_members: int | None = None) -> Layout:
    """``shapes``: ``[(shape, dtype)]`` per leaf (None: not in any group); ``shardings``: a
    ``NamedSharding`` per leaf (or None: all unsharded); ``align`` / ``max_members``: the
    unsharded groups' member offsets and size (see the module doc)."""
    keys, mesh = {}, None
    for i, sd in enumerate(shapes):
      if sd is None:
        continue
      shape, dtype = tuple(sd[0]), jnp.dtype(sd[1]).name
      sh = shardings[i] if shardings is not None else None
      if sh is not None and not isinstance(sh, NamedSharding):
        raise ValueError(f"flat layout: leaf {i} has sharding {sh!r}; need a NamedSharding")
      if sh is not None:
        if mesh is not None and sh.mesh != mesh:
          raise ValueError("flat layout: the leaves' shardings are on different meshes")
        mesh = sh.mesh
      dims = _dims(sh.spec if sh is not None else (), len(shape), mesh if sh is not None else None)
      split = sorted(((axes, j, n) for j, (axes, n) in enumerate(dims) if n > 1))
      for _, j, n in split:
        if shape[j] % n:
          raise ValueError(f"flat layout: leaf {i} dim {j} of {shape} is not divisible by {n}")
      axes = tuple(a for a, _, _ in split)
      key = (dtype, axes, align > 1 and not axes)
      keys.setdefault(key, []).append((i, shape, tuple((j, n) for _, j, n in split)))
    groups = []
    for (dtype, axes, aligned), members in sorted(keys.items(), key=lambda kv: str(kv[0])):
      a, most = (align, max_members or len(members)) if aligned else (1, len(members))
      for c in range(0, len(members), most):
        off, ms = 0, []
        for i, shape, split in members[c:c + most]:
          size = math.prod(shape) // math.prod(n for _, n in split)
          ms.append(Member(i, shape, split, off, size))
          off += -(-size // a) * a
        groups.append(Group(dtype, axes, tuple(n for _, n in members[0][2]), tuple(ms), off,
                            a))
    return cls(tuple(groups), mesh, len(shapes))

  def _constrain(self, x, group):
    s = group.sharding(self.mesh)
    return x if s is None else jax.lax.with_sharding_constraint(x, s)

  def pack(self, leaves) -> tuple:
    """One buffer per group from the full list of leaves (only members are read)."""
    return tuple(self.pack_group(leaves, g) for g in self.groups)

  def pack_group(self, leaves, g: Group):
    """Group ``g``'s buffer from the full list of leaves."""
    blocks = []
    for m, end in zip(g.members, [m.offset for m in g.members[1:]] + [g.size], strict=True):
      b = _block(leaves[m.index], m)
      blocks.append(b)
      if end > m.offset + m.size:                  # aligned members: zeros up to the next
        blocks.append(jnp.zeros(b.shape[:-1] + (end - m.offset - m.size,), b.dtype))
    buf = blocks[0] if len(blocks) == 1 else jnp.concatenate(blocks, axis=-1)
    return self._constrain(buf.astype(g.dtype), g)

  def zeros(self) -> tuple:
    return tuple(self._constrain(jnp.zeros(g.shape, g.dtype), g) for g in self.groups)

  def unpack(self, buf, m: Member):
    """Member ``m``'s leaf from its group's buffer."""
    return _unblock(jax.lax.slice_in_dim(buf, m.offset, m.offset + m.size, axis=buf.ndim - 1), m)

  def abstract(self) -> tuple:
    """``ShapeDtypeStruct``s (with shardings) of the buffers."""
    return tuple(jax.ShapeDtypeStruct(g.shape, g.dtype, sharding=g.sharding(self.mesh))
                 for g in self.groups)


def _block(x, m: Member):
  """Leaf ``x`` -> its local block ``[n_1, ..., n_k, size]``."""
  if not m.split:
    return jnp.reshape(x, (m.size,))
  n_of = dict(m.split)
  shape, pos = [], {}
  for j, d in enumerate(x.shape):
    if j in n_of:
      pos[j] = len(shape)
      shape += [n_of[j], d // n_of[j]]
    else:
      shape.append(d)
  front = [pos[j] for j, _ in m.split]
  rest = [a for a in range(len(shape)) if a not in front]
  y = jnp.transpose(jnp.reshape(x, shape), front + rest)
  return jnp.reshape(y, [n for _, n in m.split] + [m.size])


def _unblock(b, m: Member):
  """Local block ``[n_1, ..., n_k, size]`` -> the leaf (inverse of ``_block``)."""
  if not m.split:
    return jnp.reshape(b, m.shape)
  n_of = dict(m.split)
  k = len(m.split)
  lead = [n for _, n in m.split]
  local = [d // n_of.get(j, 1) for j, d in enumerate(m.shape)]
  y = jnp.reshape(b, lead + local)
  front = {j: i for i, (j, _) in enumerate(m.split)}
  perm = []
  for j in range(len(m.shape)):
    if j in n_of:
      perm.append(front[j])
    perm.append(k + j)
  return jnp.reshape(jnp.transpose(y, perm), m.shape)
