"""Packed (jagged) towers on a sharded mesh: how the active rules split them, and kernels per shard.

A packed tower's buffers lead with its blocks (``pallas_kernels.jagged.Jagged.blocks``: ``[S,
Ns, ...]`` tokens, ``[S, Bs, ...]`` examples); the logical ``blocks`` axis splits S over the
batch's mesh axes and then the sequence's (context parallelism), each device holding whole
blocks, so the per-block ops need no communication.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
from jax.sharding import PartitionSpec as P

from sharding.partition import fit_spec


def _active():
  """(abstract mesh, rules) when both are set, else None."""
  mesh = jax.sharding.get_abstract_mesh()
  rules = nn.get_logical_axis_rules()
  return None if mesh is None or mesh.empty or not rules else (mesh, rules)


def one_device() -> bool:
  """Whether the computation being traced runs on one device: no active mesh, or a mesh of one
  device (a Pallas call on values nothing splits; rules or not)."""
  mesh = jax.sharding.get_abstract_mesh()
  return mesh is None or mesh.empty or mesh.size == 1


def split_count(logical: str, mesh=None, rules=None) -> int:
  """Devices ``rules`` split the logical axis ``logical`` over on ``mesh`` (default: the active
  mesh and rules; 1 when none are set)."""
  if mesh is None or rules is None:
    act = _active()
    if act is None:
      return 1
    mesh, rules = act
  entry = nn.logical_to_mesh_axes((logical,), rules)[0]
  axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
  return math.prod(mesh.shape[a] for a in axes)


def blocks_per_batch_shard(mesh, rules) -> int:
  """Packed blocks each batch shard is cut into on ``mesh`` under ``rules``: the devices the
  ``blocks`` axis splits beyond the batch's (the context shards; 1 without context parallelism)."""
  n_blocks, n_batch = split_count("blocks", mesh, rules), split_count("batch", mesh, rules)
  if n_blocks % n_batch:
    raise ValueError(f"sharding rules split packed blocks over {n_blocks} devices, not a "
                     f"multiple of the batch's {n_batch}")
  return n_blocks // n_batch


def per_shard(fn, blocked, logical: str = "blocks"):
  """``fn`` run per device under ``jax.shard_map`` over the mesh axes of the logical axis
  ``logical`` (Pallas calls are opaque to the partitioner): the packed ``blocks``, or ``batch``
  for per-example kernels. ``blocked``: per argument, whether it leads with that axis (split over
  its mesh axes) or is shared (replicated; its cotangent summed over the devices); every output
  leads with it. ``fn`` itself when no mesh / rules are active or the axis is not split."""
  act = _active()
  if act is None or split_count(logical) == 1:
    return fn
  mesh, rules = act

  def call(*args):
    S = next(jax.tree.leaves(a)[0].shape[0] for a, b in zip(args, blocked, strict=True) if b)
    spec = fit_spec(nn.logical_to_mesh_axes((logical,), rules), (S,), mesh)
    specs = tuple(spec if b else P() for b in blocked)
    return jax.shard_map(fn, in_specs=specs, out_specs=spec, check_vma=False)(*args)
  return call
