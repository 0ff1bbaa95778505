"""OneSeq (spec h-18): merge all event streams into one time-ordered sequence, one tower.

Each stream is embedded by its own ``EventEmbed`` (their fields differ) to the merged tower's
width; a learned stream-type embedding is added to every valid event; the streams are merged by
event age (oldest first, as in the per-stream layout), valid events packed at the front, and the
most recent ``kept_len`` events are kept. Packed (jagged) streams: each stream's packed
embeddings ``[N_e, d]`` are unpacked to rows for the merge (a sort and gathers, no matmul FLOPs)
and the merged sequence is packed again at ``merged_capacity`` (``kunlun.models.kunlun``), so the
tower runs packed. ``equal_flops_config`` picks the merged tower's width so that the model's FLOPs
match the per-stream-tower model (the "equal FLOPs" switch), from a FLOP formula it is given
(``kunlun.models.flops``), so the model's import chain holds no FLOP counter.
"""

from __future__ import annotations

import copy

import flax.linen as nn
import jax
import jax.numpy as jnp

from kunlun.nn import packed
from pallas_kernels import jagged
from sharding import shard, with_axes


def merge_streams(s_list, lengths_list, age_list, kept_len: int):
  """Merges jagged streams by time.

  Args:
    s_list: per stream ``[B, T_e, d]`` (same d); padded rows arbitrary.
    lengths_list: per stream ``i32[B]`` valid counts (valid events are ``[0, length)``).
    age_list: per stream ``f32[B, T_e]`` request time - event time (seconds; larger = older).
    kept_len: merged length T.
  Returns:
    ``(s [B, T, d], lengths i32[B], age f32[B, T], source i32[B, T])``: valid events ordered
    oldest first (ties keep stream order, then position), the most recent ``kept_len`` of them;
    ``source`` is the stream index of each merged event (0 on padding); padded rows are zero.
  """
  B = s_list[0].shape[0]
  s = jnp.concatenate(s_list, axis=1)
  age = jnp.concatenate([a.astype(jnp.float32) for a in age_list], axis=1)
  valid = jnp.concatenate([jnp.arange(a.shape[1])[None, :] < l[:, None]
                           for a, l in zip(age_list, lengths_list, strict=True)], axis=1)
  src = jnp.concatenate([jnp.full((B, a.shape[1]), i, jnp.int32)
                         for i, a in enumerate(age_list)], axis=1)
  total = s.shape[1]
  key = jnp.where(valid, -age, jnp.inf)               # oldest (largest age) first; padding last
  order = jnp.argsort(key, axis=1, stable=True)        # [B, total]
  n = jnp.sum(valid, axis=1).astype(jnp.int32)
  new_len = jnp.minimum(n, kept_len)
  start = jnp.maximum(n - kept_len, 0)
  pos = jnp.minimum(start[:, None] + jnp.arange(kept_len)[None, :], total - 1)
  sel = jnp.take_along_axis(order, pos, axis=1)        # [B, kept_len]
  keep = jnp.arange(kept_len)[None, :] < new_len[:, None]
  s_out = jnp.take_along_axis(s, sel[:, :, None], axis=1) * keep[:, :, None].astype(s.dtype)
  age_out = jnp.where(keep, jnp.take_along_axis(age, sel, axis=1), 0.0)
  src_out = jnp.where(keep, jnp.take_along_axis(src, sel, axis=1), 0)
  return s_out, new_len, age_out, src_out


class StreamMerge(nn.Module):
  """Adds a stream-type embedding and merges: ``(s_list, lengths_list, age_list) -> merged``.
  ``axes``: the logical axes of the merged rows ``[B, T, d]`` (packed streams: the examples on
  ``blocks``, each device merging its own blocks' examples whole, under context parallelism too)."""
  num_streams: int
  kept_len: int
  axes: tuple = ("batch", "seq", "embed")

  @nn.compact
  def __call__(self, s_list, lengths_list, age_list):
    with jax.named_scope("OneSeq"):
      d = s_list[0].shape[-1]
      table = self.param("stream_type_embedding",
                         with_axes(nn.initializers.normal(0.02), (None, "embed")),
                         (self.num_streams, d))
      s_list = [s + table[i].astype(s.dtype) for i, s in enumerate(s_list)]
      s, lengths, age, src = merge_streams(s_list, lengths_list, age_list, self.kept_len)
      return shard(s, self.axes), lengths, age, src


def stream_rows(s, age, max_len: int | None):
  """One stream for ``merge_streams``: a packed stream (``s = Packed([N, d])``, ``age f32[N]``,
  one or more blocks) unpacked to ``([B, T, d], f32[B, T])`` with ``T = min(max_len, N / S)``
  (``max_len``: its kept length, the longest row the pipeline packs; None: a block's N / S); a
  padded stream as it is."""
  if not packed.is_packed(s):
    return s, age
  jag = s.jag
  Ns = jag.capacity // jag.shards
  T = Ns if max_len is None else min(int(max_len), Ns)
  if jag.shards == 1:
    return jagged.unpack(s.value, jag, T), jagged.unpack(age, jag, T)
  cut = lambda x: x.reshape((jag.shards, Ns) + x.shape[1:])
  rows = jax.vmap(lambda x, j: jagged.unpack(x, j, T))
  flat = lambda y: y.reshape((jag.batch,) + y.shape[2:])
  return flat(rows(cut(s.value), jag.blocks())), flat(rows(cut(age), jag.blocks()))


def merged_capacity(seqs, batch: int, kept_len: int, multiple: int = 64, shards: int = 1) -> int:
  """Token capacity of the packed merged tower: per block of ``batch / shards`` examples
  ``min(the streams' tokens in a block, batch / shards x kept_len)`` (a packed stream's N / S, a
  padded one's ``B T / S``), rounded up to ``multiple``, times ``shards``. Each example keeps
  ``min(sum of its streams' lengths, kept_len)`` merged events, so no block overflows it: the
  packed tower holds exactly the padded merge's events."""
  tokens = sum(s.jag.capacity if packed.is_packed(s) else batch * s.shape[1] for s in seqs)
  per = min(tokens // shards, batch // shards * int(kept_len))
  return -(-per // multiple) * multiple * shards


def pack_merged(s, lengths, age, capacity: int, shards: int = 1):
  """The merged tower ``(s [B, T, d], lengths i32[B], age f32[B, T])`` as a packed tower
  ``(Packed([capacity, d]), lengths i32[B], age f32[capacity])`` in ``shards`` blocks (each the
  ``capacity / shards`` tokens of ``B / shards`` examples); ``capacity`` must hold every merged
  event (``merged_capacity``): then each token's ``pos`` is its merged-row column."""
  def one(s, lengths, age):
    tok, jag, _ = jagged.pack(s, lengths, capacity // shards)
    row = jnp.minimum(jag.seg, jag.batch - 1)
    return tok, jag, jnp.where(jag.valid, age[row, jag.pos], 0.0)

  if shards == 1:
    tok, jag, a = one(s, lengths, age)
    return packed.Packed(tok, jag), jag.lengths, a
  cut = lambda x: x.reshape((shards, -1) + x.shape[1:])
  tok, jb, a = jax.vmap(one)(cut(s), cut(lengths), cut(age))
  jag = jagged.Jagged(jb.offsets.reshape(-1), jb.seg.reshape(-1), jb.pos.reshape(-1), shards)
  flat = lambda x: x.reshape((-1,) + x.shape[2:])
  return packed.Packed(flat(tok), jag), jag.lengths, flat(a)


def equal_flops_config(config, forward_flops, widths=None):
  """Copy of ``config`` switched to OneSeq whose forward FLOPs best match the per-stream-tower
  model's: searches the merged tower's width over multiples of its head count (keeping
  ``oneseq.kept_len``, heads, depth and the other knobs). ``forward_flops(config) -> float`` is the
  count to match, e.g. ``lambda c: kunlun.models.flops.model_flops(c, schema)["forward"]``. Returns
  ``(config, ratio)`` with ``ratio = oneseq_flops / towers_flops``."""
  base = copy.deepcopy(config)
  base.model.seq_mode = "towers"
  target = forward_flops(base)
  heads = int(config.model.oneseq.heads)
  step = 2 * heads
  widths = widths or range(step, 8 * max(t.width for t in base.model.towers.values()) + 1, step)
  best = None
  for w in widths:
    c = copy.deepcopy(config)
    c.model.seq_mode = "oneseq"
    c.model.oneseq.width = int(w)
    f = forward_flops(c)
    if best is None or abs(f - target) < abs(best[1] - target):
      best = (c, f)
  return best[0], best[1] / target
