"""The Kunlun model (spec d.2).

Batch (``data/schema.py``) -> logits ``[B, K]``: context tokens, event embeddings, ``L`` Kunlun
layers, shared top MLP and per-(surface, task) heads; packed streams (``data.jagged_capacity``)
run as packed towers (``kunlun.nn.packed``). Notes: docs/architecture.md."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from data.schema import Schema
from kunlun.configs.types import ModelConfig
from kunlun.nn import remat as remat_lib
from kunlun.nn import packed, rows
from kunlun.nn.inputs import EventEmbed
from kunlun.nn.layer import COMPUTE_DTYPES, KunlunLayer
from kunlun.nn.oneseq import StreamMerge
from kunlun.nn.stages import apply_heads, embed_context, embed_streams, is_packed_stream
from sharding.packed import split_count

__all__ = ["Kunlun", "embed_sequences", "embed_context", "apply_heads"]


def embed_sequences(cfg: ModelConfig, schema: Schema, batch, dtype, remat: str = "none"):
  """Per tower: ``(seqs {name: [B, T, d]}, lengths {name: i32[B]}, ages {name: f32[B, T]})``.
  ``remat``: a ``kunlun.nn.remat`` policy applied to each stream's EventEmbed."""
  ev = batch["events"]
  Embed = remat_lib.wrap(EventEmbed, remat)
  if cfg.seq_mode == "oneseq":
    if any(is_packed_stream(ev[n]) for n in schema.stream_names):
      raise ValueError("model.seq_mode = 'oneseq' does not support packed (jagged) streams "
                       "(data.jagged_capacity)")
    t = cfg.oneseq
    s_list = [Embed(st, len(schema.surfaces), t.width, cfg.num_time_buckets, dtype,
                    name=f"embed_{st.name}")(ev[st.name]) for st in schema.streams]
    s, lengths, age, _ = StreamMerge(len(schema.streams), t.kept_len, name="oneseq_merge")(
        s_list, [jnp.asarray(ev[n]["length"], jnp.int32) for n in schema.stream_names],
        [jnp.asarray(ev[n]["age"], jnp.float32) for n in schema.stream_names])
    return {t.name: s}, {t.name: lengths}, {t.name: age}
  return embed_streams(cfg.towers, schema, batch, dtype, cfg.num_time_buckets, embed=Embed,
                       packed_ok=True)


class Kunlun(nn.Module):
  """``apply({"params": p}, batch, train) -> logits f32[B, K]``;
  ``method="representations"`` -> ``{"pooled" [B, d_rep], "summaries" {tower: [B, n_sum, d_e]},
  "logits" [B, K]}``; with ``request_index`` (serving) ``B`` is the number of ads (module doc).
  ``remat`` / ``remat_scope``: ``kunlun.nn.remat`` policy and scope (training)."""
  cfg: ModelConfig
  schema: Schema
  remat: str = "none"
  remat_scope: str = "layer"

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
        seqs, lengths, ages = ({n: rows.PerRequest(v) for n, v in d.items()}
                               for d in (seqs, lengths, ages))
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
    if request_index is not None:
      raise ValueError("packed (jagged) towers are not supported on the shared serving path "
                       "(request_index)")
    if type(self).extra_inputs is not Kunlun.extra_inputs:
      raise ValueError(f"{type(self).__name__} adds model inputs (extra_inputs, e.g. LoopFM); "
                       "packed (jagged) towers support the plain Kunlun model only")
    n_seq, n_batch = split_count("seq"), split_count("batch")
    if n_seq > 1:
      raise ValueError(f"packed (jagged) towers do not support context parallelism: the rules "
                       f"split the sequence axis over {n_seq} devices, and a packed tower has no "
                       "sequence axis (use a preset without 'seq' sharding, e.g. dp or fsdp)")
    if any(S % n_batch for S in shards):
      raise ValueError(f"packed (jagged) towers: the batch is split over {n_batch} devices but "
                       f"packed in {sorted(shards)} blocks; pack a multiple of {n_batch} blocks "
                       "(data.pipeline jagged_shards, the batch shards of the mesh)")

  def extra_inputs(self, batch, x_bnd, seqs, lengths):
    """Hook for subclasses that add model inputs before the trunk (e.g. LoopFM's FM features,
    ``kunlun.transfer.loopfm``): may append context tokens to ``x_bnd [B, N, d_ns]`` and change
    the event embeddings ``seqs {stream: [B, T, d_e]}``. Identity here."""
    del batch, lengths
    return x_bnd, seqs

