"""Packed (jagged) towers on a sharded mesh: how the active rules split them, and kernels per shard.

A packed tower's buffers lead with the batch blocks (``pallas_kernels.jagged.Jagged.blocks``:
``[S, Ns, ...]`` tokens, ``[S, Bs, ...]`` examples); the logical ``batch`` axis splits S over the
mesh, each device holding whole blocks, so the per-block ops need no communication.
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


def split_count(logical: str) -> int:
  """Devices the active rules split the logical axis ``logical`` over (1: no mesh / rules)."""
  act = _active()
  if act is None:
    return 1
  mesh, rules = act
  entry = nn.logical_to_mesh_axes((logical,), rules)[0]
  axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
  return math.prod(mesh.shape[a] for a in axes)


def per_shard(fn, blocked):
  """``fn`` run per device under ``jax.shard_map`` over the mesh axes of the logical ``batch``
  (Pallas calls are opaque to the partitioner). ``blocked``: per argument, whether it leads with
  the S blocks (split over the batch axes) or is shared (replicated); the output leads with the
  blocks. ``fn`` itself when no mesh / rules are active or the batch is not split."""
  act = _active()
  if act is None or split_count("batch") == 1:
    return fn
  mesh, rules = act

  def call(*args):
    S = next(jax.tree.leaves(a)[0].shape[0] for a, b in zip(args, blocked, strict=True) if b)
    spec = fit_spec(nn.logical_to_mesh_axes(("batch",), rules), (S,), mesh)
    specs = tuple(spec if b else P() for b in blocked)
    return jax.shard_map(fn, in_specs=specs, out_specs=spec, check_vma=False)(*args)
  return call
