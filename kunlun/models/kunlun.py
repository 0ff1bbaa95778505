"""The Kunlun model (spec d.2).

Batch (``data/schema.py``) -> logits ``[B, K]``: context tokens, event embeddings, ``L`` Kunlun
layers, shared top MLP and per-(surface, task) heads; packed streams (``data.jagged_capacity``)
run as packed towers (``kunlun.nn.packed``). Notes: docs/architecture.md."""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from data.schema import Schema
from kunlun.configs.types import ModelConfig
from kunlun.nn import oneseq, packed, rows
from kunlun.nn import remat as remat_lib
from kunlun.nn.inputs import EventEmbed
from kunlun.nn.layer import COMPUTE_DTYPES, KunlunLayer
from kunlun.nn.stages import apply_heads, embed_context, embed_streams
from sharding.packed import split_count

__all__ = ["Kunlun", "embed_sequences", "embed_context", "apply_heads"]


def embed_sequences(cfg: ModelConfig, schema: Schema, batch, dtype, remat: str = "none"):
  """Per tower: ``(seqs {name: [B, T, d]}, lengths {name: i32[B]}, ages {name: f32[B, T]})``
  (a packed tower: ``Packed([N, d])``, ``f32[N]``). OneSeq: the streams embedded at the merged
  width and merged (``kunlun.nn.oneseq``); with a packed stream the merged tower is packed at
  ``oneseq.merged_capacity``. ``remat``: a ``kunlun.nn.remat`` policy applied to each stream's
  EventEmbed."""
  Embed = functools.partial(remat_lib.wrap(EventEmbed, remat), backend=cfg.backend)
  if cfg.seq_mode != "oneseq":
    return embed_streams(cfg.towers, schema, batch, dtype, cfg.num_time_buckets, embed=Embed,
                         packed_ok=True)
  t, names = cfg.oneseq, schema.stream_names
  seqs, lengths, ages = embed_streams([SimpleNamespace(name=n, width=t.width) for n in names],
                                      schema, batch, dtype, cfg.num_time_buckets, embed=Embed,
                                      packed_ok=True)
  kept = {x.name: x.kept_len for x in cfg.towers}
  padded = [oneseq.stream_rows(seqs[n], ages[n], kept.get(n)) for n in names]
  shards = {v.jag.shards for v in seqs.values() if packed.is_packed(v)}
  axes = ("blocks", None, "embed") if shards else ("batch", "seq", "embed")
  s, length, age, _ = oneseq.StreamMerge(len(names), t.kept_len, axes, name="oneseq_merge")(
      [p[0] for p in padded], [lengths[n] for n in names], [p[1] for p in padded])
  if shards:
    S = max(shards)                             # the pipeline packs every stream in S blocks
    cap = oneseq.merged_capacity(seqs.values(), length.shape[0], t.kept_len, shards=S)
    s, length, age = oneseq.pack_merged(s, length, age, cap, shards=S)
  return {t.name: s}, {t.name: length}, {t.name: age}


class Kunlun(nn.Module):
  """``apply({"params": p}, batch, train) -> logits f32[B, K]``;
  ``method="representations"`` -> ``{"pooled" [B, d_rep], "summaries" {tower: [B, n_sum, d_e]},
  "logits" [B, K]}``; with ``request_index`` (serving) ``B`` is the number of ads (module doc).
  ``remat`` / ``remat_scope``: ``kunlun.nn.remat`` policy and scope (training)."""
  cfg: ModelConfig
  schema: Schema
  remat: str = "none"
  remat_scope: str = "layer"
  packed_extra_inputs: ClassVar[bool] = False   # a subclass's extra_inputs takes packed towers

  def __call__(self, batch, train: bool = False):
    return self.representations(batch, train)["logits"]

  @nn.compact
  def representations(self, batch, train: bool = False, request_index=None):
    del train                                   # no dropout / batch statistics
    cfg, dt = self.cfg, COMPUTE_DTYPES[self.cfg.dtype]
    with jax.named_scope("Kunlun"):
      x = embed_context(cfg, self.schema, batch, dt)
      remat = self.remat if request_index is None else "none"
      seqs, lengths, ages = embed_sequences(cfg, self.schema, batch, dt, remat)
      shards = {v.jag.shards for v in seqs.values() if packed.is_packed(v)}
      if shards:
        self._check_packed(shards, request_index)
      if request_index is None:
        x, seqs = self.extra_inputs(batch, x, seqs, lengths)
      else:                                     # shared serving path: sequences per request
        if type(self).extra_inputs is not Kunlun.extra_inputs:
          raise ValueError(f"{type(self).__name__} adds model inputs (extra_inputs); the shared "
                           "serving path supports the plain Kunlun model only")
        ri = jnp.asarray(request_index, jnp.int32)
        seqs, lengths, ages = rows.requests(seqs, lengths, ages,
                                            {t.name: t.kept_len for t in cfg.seq_towers})
      summaries = {}
      per_layer = self.remat_scope == "layer"
      Layer = remat_lib.wrap(KunlunLayer, remat if per_layer else "none")
      inner = "none" if per_layer else remat
      for l in range(cfg.num_layers):
        x, seqs, summaries = Layer(cfg, l, inner, name=f"layer_{l}")(
            x, seqs, lengths, ages, summaries, *(() if request_index is None else (ri,)))
      if request_index is not None:
        summaries = {n: rows.to_ads(v, ri) for n, v in summaries.items()}
      return apply_heads(cfg, x, summaries, batch["surface"], dt)

  def _check_packed(self, shards, request_index):
    """Packed (jagged) towers: the combinations they do not support yet, as one-line errors.
    ``shards``: the packed streams' block counts S (``pallas_kernels.jagged.Jagged.shards``)."""
    del request_index                            # the shared serving path packs per request
    if type(self).extra_inputs is not Kunlun.extra_inputs and not self.packed_extra_inputs:
      raise ValueError(f"{type(self).__name__} adds model inputs (extra_inputs) that do not take "
                       "packed (jagged) towers (packed_extra_inputs)")
    n_seq, n_blocks = split_count("seq"), split_count("blocks")
    if n_seq > 1 and n_blocks % (split_count("batch") * n_seq):
      raise ValueError(f"packed (jagged) towers: the rules split the sequence axis over {n_seq} "
                       f"devices but not the packed blocks ('blocks' over {n_blocks}); map "
                       "'blocks' to the batch's mesh axes then the sequence's (sharding.rules)")
    if any(S % n_blocks for S in shards):
      raise ValueError(f"packed (jagged) towers: the blocks are split over {n_blocks} devices "
                       f"(batch x context shards) but packed in {sorted(shards)} blocks; pack a "
                       f"multiple of {n_blocks} blocks (data.pipeline jagged_shards: "
                       "kunlun.train.capacity.local_blocks)")

  def extra_inputs(self, batch, x_bnd, seqs, lengths):
    """Hook for subclasses that add model inputs before the trunk (e.g. LoopFM's FM features,
    ``kunlun.transfer.loopfm``): may append context tokens to ``x_bnd [B, N, d_ns]`` and change
    the event embeddings ``seqs {stream: [B, T, d_e]}``, or ``Packed([N, d_e])`` for a packed
    stream where the subclass sets ``packed_extra_inputs``. Identity here."""
    del batch, lengths
    return x_bnd, seqs

