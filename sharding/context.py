"""Context (sequence) parallelism: attention and GDPA with the sequence axis sharded; operands
``[B, T, H, D]`` with logical axes ``(batch, seq, heads, head_dim)``.
Notes: docs/sharding.md, ``sharding/context.py``."""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import pallas_kernels
from pallas_kernels.activations import apply_per_head, per_head
from pallas_kernels.reference import apply_rotary, clip_scores
from sharding.partition import fit_spec

F32 = jnp.float32
SEQ_AXES = ("batch", "seq", "heads", "head_dim")


def _mesh():
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh is None or mesh.empty else mesh


def _axes(entry):
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _spec(shape, logical, mesh):
  rules = nn.get_logical_axis_rules()
  return fit_spec(nn.logical_to_mesh_axes(tuple(logical), rules), shape, mesh)


def _plan(q):
  """(mesh, spec of a [B, T, H, D] array, context axes) or None when nothing is sharded."""
  mesh = _mesh()
  if mesh is None or not nn.get_logical_axis_rules():
    return None
  spec = _spec(q.shape, SEQ_AXES, mesh)
  used = [a for e in spec for a in _axes(e) if mesh.shape[a] > 1]
  return (mesh, spec, _axes(spec[1])) if used else None


def is_sharded(x) -> bool:
  """Whether a ``[B, T, H, D]`` activation is split over any mesh axis under the active rules
  (then kernels must run per shard, through this module's functions)."""
  return _plan(x) is not None


def _ctx_index(cax):
  return (jax.lax.axis_index(cax), math.prod(jax.lax.axis_size(a) for a in cax)) if cax else (0, 1)


def _weights(s, mask, activation, out_scale, head_axis, score_clip=None):
  """Softmax over the last axis (masked), or ``act(clip(s)) * out_scale`` masked (``score_clip``
  clamps the scores of GDPA activations only; softmax is never clipped)."""
  if activation == "softmax":
    s = jnp.where(mask, s, -jnp.inf)
    mx = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.where(mask, jnp.exp(s - jnp.where(jnp.isfinite(mx), mx, 0.0)), 0.0)
    den = jnp.sum(e, axis=-1, keepdims=True)
    return e / jnp.where(den > 0, den, 1.0)
  acts = per_head(activation, s.shape[head_axis])
  p = apply_per_head(clip_scores(s, score_clip), acts, head_axis=head_axis)
  return jnp.where(mask, p, 0.0) * out_scale


# ---- sliding-window attention ---------------------------------------------------------------

def _swa_local(q, k, v, lengths, *, window, total, c, n, cax, activation, out_scale,
               score_clip=None):
  """One shard: ``q, k, v [b, Tl, H, D]`` at offset ``c * Tl`` of a ``total``-long sequence."""
  b, Tl, H, D = q.shape
  W = window
  if W > 0 and n > 1:
    right = [(i, i + 1) for i in range(n - 1)]
    left = [(i + 1, i) for i in range(n - 1)]
    halo = lambda x: jnp.concatenate([jax.lax.ppermute(x[:, Tl - W:], cax, right), x,
                                      jax.lax.ppermute(x[:, :W], cax, left)], axis=1)
  else:
    halo = lambda x: jnp.pad(x, ((0, 0), (W, W), (0, 0), (0, 0)))
  kx, vx = halo(k), halo(v)                                            # [b, Tl + 2W, H, D]
  start = c * Tl
  lengths = jnp.asarray(lengths, jnp.int32)
  # queries in chunks of ch rows; chunk j sees extended keys [j ch, j ch + ch + 2W)
  ch = W if (W > 0 and Tl % W == 0) else Tl
  nc = Tl // ch
  span = ch + 2 * W
  kidx = jnp.arange(nc)[:, None] * ch + jnp.arange(span)[None, :]     # [nc, span] into kx
  kc, vc = kx[:, kidx], vx[:, kidx]                                    # [b, nc, span, H, D]
  qc = q.reshape(b, nc, ch, H, D)
  qpos = start + jnp.arange(Tl).reshape(nc, ch)                        # global positions
  kpos = start - W + kidx
  band = jnp.abs(qpos[:, :, None] - kpos[:, None, :]) <= W             # [nc, ch, span]
  kval = (kpos >= 0) & (kpos < total)
  kvalid = kval[None, :, None, :] & (kpos[None, :, None, :] < lengths[:, None, None, None])
  mask = band[None] & kvalid
  s = jnp.einsum("bnqhd,bnkhd->bnhqk", qc.astype(F32), kc.astype(F32)) * D ** -0.5
  p = _weights(s, mask[:, :, None], activation, out_scale, head_axis=2, score_clip=score_clip)
  o = jnp.einsum("bnhqk,bnkhd->bnqhd", p, vc.astype(F32)).reshape(b, Tl, H, D)
  rows = (start + jnp.arange(Tl))[None, :] < lengths[:, None]
  return jnp.where(rows[..., None, None], o, 0.0).astype(q.dtype)


def swa_attention(q, k, v, lengths, window: int, *, activation="softmax", out_scale=None,
                  rotary=None, score_clip=None):
  """Bidirectional sliding-window attention ``|i - j| <= window`` over valid keys.

  ``q, k, v [B, T, H, D]``; ``lengths i32[B]``; ``activation`` "softmax" (scale 1/sqrt(D)) or a
  GDPA activation (``act(q.k / sqrt(D)) * out_scale``, default ``out_scale = 1 / min(T, 2W+1)``);
  ``rotary (cos, sin)`` as in ``pallas_kernels.reference.apply_rotary``. With ``seq`` sharded over
  ``n`` shards of ``T / n >= window`` rows, each shard exchanges ``window`` halo rows of k and v
  with each neighbour. ``score_clip``: clamp GDPA scores to ``[-c, c]`` before the activation
  (ignored for softmax). Returns ``[B, T, H, D]``; rows at or beyond ``lengths`` are zero.
  """
  B, T, H, D = q.shape
  if out_scale is None:
    out_scale = 1.0 / min(T, 2 * window + 1)
  if rotary is not None:
    q, k = apply_rotary(q, rotary), apply_rotary(k, rotary)
  kw = dict(window=window, total=T, activation=activation, out_scale=out_scale,
            score_clip=None if activation == "softmax" else score_clip)
  plan = _plan(q)
  if plan is None:
    return _swa_local(q, k, v, lengths, c=0, n=1, cax=(), **kw)
  mesh, spec, cax = plan
  n = math.prod(mesh.shape[a] for a in cax)
  if T % n or T // n < window:
    raise ValueError(f"swa_attention: {n} context shards of T={T} need T divisible by {n} and "
                     f"T/{n} >= window={window}")

  def local(q, k, v, lengths):
    c, n_ = _ctx_index(cax)
    return _swa_local(q, k, v, lengths, c=c, n=n_, cax=cax, **kw)

  return jax.shard_map(local, in_specs=(spec, spec, spec, P(spec[0])), out_specs=spec,
                       check_vma=False)(q, k, v, jnp.asarray(lengths, jnp.int32))


# ---- softmax attention through a kernel backend ----------------------------------------------

def context_parallel_softmax_attention(q, k, v, lengths, window=None, *, backend="pallas"):
  """``pallas_kernels.softmax_attention`` (self-attention: ``lengths`` for queries and keys) per
  shard, for kernel backends (XLA cannot partition a custom call).

  ``q, k, v [B, T, H, D]``; ``window`` None (full) or the band ``|i - j| <= window``. Batch and
  heads split as the rules say. With ``seq`` over ``n`` context shards: banded, each shard gets
  ``window`` halo rows of k and v from each neighbour (``ppermute``) and calls the kernel on its
  ``T/n`` queries against ``T/n + 2 window`` keys (``q_offset = window``; ``kv_start`` masks the
  missing halo of the first shard; cuDNN takes neither, so this case runs "pallas"); full, k and
  v are all-gathered. Rows at or beyond ``lengths`` are zero.
  """
  lengths = jnp.asarray(lengths, jnp.int32)
  call = functools.partial(pallas_kernels.softmax_attention, window=window, backend=backend)
  plan = _plan(q)
  if plan is None:
    return call(q, k, v, q_lengths=lengths, kv_lengths=lengths)
  mesh, spec, cax = plan
  T = q.shape[1]
  n = math.prod(mesh.shape[a] for a in cax)
  W = window or 0
  if n > 1 and window is not None and (T % n or T // n < W):
    raise ValueError(f"context_parallel_softmax_attention: {n} context shards of T={T} need T "
                     f"divisible by {n} and T/{n} >= window={W}")

  if n > 1 and window is not None and backend == "cudnn":
    call = functools.partial(call, backend="pallas")   # cuDNN takes no q_offset / kv_start

  def local(q, k, v, lengths):
    c, n_ = _ctx_index(cax)
    Tl = q.shape[1]
    q_len = jnp.clip(lengths - c * Tl, 0, Tl)
    if n_ == 1:
      return call(q, k, v, q_lengths=q_len, kv_lengths=q_len)
    if window is None:                               # full: every key of the sequence
      kg, vg = (jax.lax.all_gather(x, cax, axis=1, tiled=True) for x in (k, v))
      return call(q, kg, vg, q_lengths=q_len, kv_lengths=lengths)
    if W:
      right = [(i, i + 1) for i in range(n_ - 1)]
      left = [(i + 1, i) for i in range(n_ - 1)]
      k, v = (jnp.concatenate([jax.lax.ppermute(x[:, Tl - W:], cax, right), x,
                               jax.lax.ppermute(x[:, :W], cax, left)], axis=1) for x in (k, v))
    kv_start = jnp.broadcast_to(jnp.maximum(W - c * Tl, 0), lengths.shape).astype(jnp.int32)
    kv_len = jnp.clip(lengths - c * Tl + W, 0, Tl + 2 * W)
    return call(q, k, v, q_lengths=q_len, kv_lengths=kv_len, kv_start=kv_start, q_offset=W)

  return jax.shard_map(local, in_specs=(spec, spec, spec, P(spec[0])), out_specs=spec,
                       check_vma=False)(q, k, v, lengths)


# ---- block attention -------------------------------------------------------------------------

def block_attention(q, k, v, lengths, *, block_size=64, activation="softmax", rotary=None,
                    backend="xla", score_clip=None):
  """``pallas_kernels.block_attention`` per context shard, with no cross-shard traffic.

  ``q, k, v [B, T, H, D]``; each shard's ``T / n`` rows must be a multiple of ``block_size`` so
  blocks never straddle shards. ``rotary (cos, sin)`` is sharded along T like q. ``score_clip``
  as in ``pallas_kernels.block_attention`` (GDPA activations only).
  """
  plan = _plan(q)
  call = lambda q, k, v, lengths, rot: pallas_kernels.block_attention(
      q, k, v, block_size=block_size, activation=activation, lengths=lengths, rotary=rot,
      backend=backend, score_clip=score_clip)
  if plan is None:
    return call(q, k, v, lengths, rotary)
  mesh, spec, cax = plan
  B, T = q.shape[:2]
  n = math.prod(mesh.shape[a] for a in cax)
  if T % (n * block_size):
    raise ValueError(f"block_attention: T={T} over {n} context shards must be a multiple of "
                     f"{n} x block_size={block_size}")
  rot_spec = None
  if rotary is not None:   # cos/sin [B|1, T, (H,) D/2]
    bspec = lambda r: spec[0] if r.shape[0] == B else None
    rot_spec = tuple(P(bspec(r), spec[1], spec[2], None) if r.ndim == 4 else
                     P(bspec(r), spec[1], None) for r in rotary)

  def local(q, k, v, lengths, rot):
    c, _ = _ctx_index(cax)
    Tl = q.shape[1]
    return call(q, k, v, jnp.clip(lengths - c * Tl, 0, Tl), rot)

  return jax.shard_map(local, in_specs=(spec, spec, spec, P(spec[0]), rot_spec),
                       out_specs=spec, check_vma=False)(
      q, k, v, jnp.asarray(lengths, jnp.int32), rotary)


# ---- GDPA with the sequence sharded ------------------------------------------------------------

def context_parallel_gdpa(q, k, v, *, shard="q", activation="fast_gelu", scale=None,
                          out_scale=1.0, q_lengths=None, kv_lengths=None, broadcast_q=False,
                          backend="xla", score_clip=None):
  """``pallas_kernels.gdpa`` with the sequence axis of ``q`` (``shard="q"``) or of ``k, v``
  (``shard="kv"``) split over the context shards.

  ``shard="q"`` (PFFN): ``q [B, T, H, D]`` sharded on T, ``k, v [B, N, H, D]`` whole; local calls
  with per-shard ``q_lengths``; no communication. ``shard="kv"`` (HSP): ``k, v [B, T, H, D]``
  sharded on T, ``q [B|1, N, H, D]`` whole; each shard computes the partial sum over its keys
  (per-shard ``kv_lengths``) and a ``psum`` over the context axes adds them. Pointwise
  activations only (a softmax would need a log-sum-exp combine). ``score_clip`` as in
  ``pallas_kernels.gdpa`` (pointwise, so it commutes with the sharding).
  """
  if shard not in ("q", "kv"):
    raise ValueError(f"context_parallel_gdpa: shard={shard!r}; allowed: 'q', 'kv'")
  kw = dict(activation=activation, scale=scale, out_scale=out_scale, broadcast_q=broadcast_q,
            backend=backend, score_clip=score_clip)
  seq_x = q if shard == "q" else k
  plan = _plan(seq_x)
  if plan is None:
    return pallas_kernels.gdpa(q, k, v, q_lengths=q_lengths, kv_lengths=kv_lengths, **kw)
  mesh, spec, cax = plan
  other = q if shard == "kv" else k
  ospec = _spec(other.shape, SEQ_AXES, mesh)
  ospec = P(ospec[0], None, ospec[2], None)                           # its "seq" axis stays whole
  B = k.shape[0]
  lspec = P(spec[0])
  full = lambda n: jnp.full((B,), n, jnp.int32)
  ql = full(q.shape[1]) if q_lengths is None else jnp.asarray(q_lengths, jnp.int32)
  kl = full(k.shape[1]) if kv_lengths is None else jnp.asarray(kv_lengths, jnp.int32)

  def local(q, k, v, ql, kl):
    c, _ = _ctx_index(cax)
    if shard == "q":
      Tl = q.shape[1]
      return pallas_kernels.gdpa(q, k, v, q_lengths=jnp.clip(ql - c * Tl, 0, Tl), kv_lengths=kl,
                                 **kw)
    Tl = k.shape[1]
    part = pallas_kernels.gdpa(q, k, v, q_lengths=ql, kv_lengths=jnp.clip(kl - c * Tl, 0, Tl),
                               **kw)
    return jax.lax.psum(part.astype(F32), cax).astype(part.dtype) if cax else part

  qs, ks = (spec, ospec) if shard == "q" else (ospec, spec)
  if broadcast_q:
    qs = P(None, None, qs[2], None)
  out_spec = qs if shard == "q" else P(spec[0], None, spec[2], None)
  return jax.shard_map(local, in_specs=(qs, ks, ks, lspec, lspec), out_specs=out_spec,
                       check_vma=False)(q, k, v, ql, kl)
