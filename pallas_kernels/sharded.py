"""Run a kernel per shard under ``jax.shard_map`` so custom kernels work on sharded meshes.

Pallas / Triton calls are opaque to the SPMD partitioner, so on a sharded mesh each device runs
the kernel on its local ``[B / nb, T, H / nh, D]`` slice: GDPA and block attention are independent
per example and per head, so sharding batch and heads needs no communication. Sequence axes stay
whole (context parallelism would need a ring over kv, not done here).

Per-head activation tuples are sliced per head shard: when the shards need different slices the
kernel is traced once per slice and picked with ``lax.switch`` on the head-shard index.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import PartitionSpec as P

from pallas_kernels import activations, api


def _axes(mesh, axes, what):
  axes = tuple(a for a in ((axes,) if isinstance(axes, str) else (axes or ())))
  for a in axes:
    if a not in mesh.axis_names:
      raise ValueError(f"{what} mesh axis {a!r} is not in the mesh axes {mesh.axis_names}")
  size = 1
  for a in axes:
    size *= mesh.shape[a]
  return (axes or None), size


def _check_div(n, size, what):
  if n % size:
    raise ValueError(f"{what} {n} is not divisible by the {size} mesh shards that split it")


def _per_head_call(fn, acts, head_axes, n_head_shards, *args, **kw):
  """Calls ``fn`` with this shard's slice of the per-head activations."""
  hs = len(acts) // n_head_shards
  slices = [acts[i * hs:(i + 1) * hs] for i in range(n_head_shards)]
  if len(set(slices)) == 1:
    return fn(*args, activation=slices[0], **kw)
  idx = jax.lax.axis_index(head_axes)
  branches = [functools.partial(lambda a, *xs: fn(*xs, activation=a, **kw), s) for s in slices]
  return jax.lax.switch(idx, branches, *args)


def sharded_gdpa(q, k, v, *, mesh, batch_axes=("data", "fsdp"), head_axes=("tensor",),
                 backend="pallas", activation="fast_gelu", q_lengths=None, kv_lengths=None,
                 broadcast_q=False, **kw):
  """``pallas_kernels.gdpa`` run per shard; batch split over ``batch_axes``, heads over
  ``head_axes`` (names of ``mesh`` axes, or None). Other kwargs as for ``gdpa``."""
  B, _, H, _ = k.shape
  bax, nb = _axes(mesh, batch_axes, "batch")
  hax, nh = _axes(mesh, head_axes, "heads")
  _check_div(B, nb, "batch")
  _check_div(H, nh, "heads")
  acts = activations.per_head(activation, H)
  x_spec = P(bax, None, hax, None)
  q_spec = P(None, None, hax, None) if broadcast_q else x_spec
  len_spec = P(bax)
  fn = functools.partial(api.gdpa, backend=backend, broadcast_q=broadcast_q, **kw)
  ops = [q, k, v]
  specs = [q_spec, x_spec, x_spec]
  for lens in (q_lengths, kv_lengths):
    if lens is not None:
      ops.append(lens)
      specs.append(len_spec)
  has_q, has_kv = q_lengths is not None, kv_lengths is not None

  def local(q, k, v, *lens):
    lens = list(lens)
    ql = lens.pop(0) if has_q else None
    kl = lens.pop(0) if has_kv else None
    return _per_head_call(fn, acts, hax, nh, q, k, v, q_lengths=ql, kv_lengths=kl)

  return jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=x_spec,
                       check_vma=False)(*ops)


def sharded_block_attention(q, k, v, *, mesh, batch_axes=("data", "fsdp"), head_axes=("tensor",),
                            backend="pallas", activation="softmax", lengths=None, rotary=None,
                            **kw):
  """``pallas_kernels.block_attention`` run per shard (see ``sharded_gdpa``)."""
  B, _, H, _ = q.shape
  bax, nb = _axes(mesh, batch_axes, "batch")
  hax, nh = _axes(mesh, head_axes, "heads")
  _check_div(B, nb, "batch")
  _check_div(H, nh, "heads")
  x_spec = P(bax, None, hax, None)
  ops, specs = [q, k, v], [x_spec, x_spec, x_spec]
  if lengths is not None:
    ops.append(lengths)
    specs.append(P(bax))
  if rotary is not None:
    cos = rotary[0]
    rb = bax if cos.shape[0] > 1 else None
    rspec = P(rb, None, None) if cos.ndim == 3 else P(rb, None, hax if cos.shape[2] > 1 else None,
                                                      None)
    ops += list(rotary)
    specs += [rspec, rspec]
  has_len, has_rot = lengths is not None, rotary is not None
  fn = functools.partial(api.block_attention, backend=backend, **kw)

  def local(q, k, v, *rest):
    rest = list(rest)
    lens = rest.pop(0) if has_len else None
    rot = (rest[0], rest[1]) if has_rot else None
    if activation == "softmax":
      return fn(q, k, v, activation="softmax", lengths=lens, rotary=rot)
    acts = activations.per_head(activation, H)
    return _per_head_call(fn, acts, hax, nh, q, k, v, lengths=lens, rotary=rot)

  return jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=x_spec,
                       check_vma=False)(*ops)
