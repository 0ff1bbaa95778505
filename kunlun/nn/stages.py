"""The ends every architecture shares: context tokens X0, event embeddings and the heads.

``embed_context``: ``X0 [B, N_ns, d_ns]`` from sparse ids, dense features and the surface
(``kunlun.nn.inputs.ContextEncoder``: LCE tokens + per-surface embedding, spec c.0b, d.3).
``embed_streams``: one event embedding per stream tower (spec b.4).
``apply_heads``: ``z = concat(flatten(x), flatten(summaries))`` -> shared top MLP -> per-(surface,
task) heads (``kunlun.nn.heads.Heads``, spec d.2, d.3).

Kunlun (``model.py``), InterFormer and DLRM (``baselines/``) import these;
this module imports none of them, so the model files, the baselines and the FLOP counter form no
import cycle.
"""

from __future__ import annotations

import jax.numpy as jnp

from data.schema import Schema
from kunlun.configs.types import ModelConfig
from kunlun.nn import packed
from kunlun.nn.heads import Heads
from kunlun.nn.inputs import ContextEncoder, EventEmbed
from pallas_kernels.jagged import sharded
from sharding import shard


def embed_context(cfg: ModelConfig, schema: Schema, batch, dtype):
  """``X0 [B, n_ns, d_ns]`` (module name ``context``; call inside a compact module)."""
  return ContextEncoder(schema.sparse, cfg.n_dense_tokens, cfg.n_ns, cfg.d_ns,
                        len(schema.surfaces), dtype, name="context")(
      batch["sparse"], jnp.asarray(batch["dense"]), jnp.asarray(batch["surface"]))


def is_packed_stream(events) -> bool:
  """Whether one stream's batch fields are in the packed layout (``data/schema.py``)."""
  return "offsets" in events


def embed_streams(towers, schema: Schema, batch, dtype, num_time_buckets: int,
                  embed=EventEmbed, packed_ok: bool = False):
  """One ``embed`` (``EventEmbed`` or a rematerialised wrap of it) per tower (module
  ``embed_<stream>``, at the tower's width):
  ``(seqs {name: [B, T, d]}, lengths {name: i32[B]}, ages {name: f32[B, T]})``. A packed stream
  (``packed_ok``) gives ``seqs[name] = Packed([N, d], Jagged)`` and ``ages[name] f32[N]``
  (its shard count S = ``len(offsets) - B``, ``pallas_kernels.jagged.sharded``)."""
  ev = batch["events"]
  seqs, lengths, ages = {}, {}, {}
  for t in towers:
    st, e = schema.stream(t.name), ev[t.name]
    axes = EventEmbed.PACKED_AXES if is_packed_stream(e) else EventEmbed.axes
    mod = embed(st, len(schema.surfaces), t.width, num_time_buckets, dtype, axes,
                name=f"embed_{t.name}")
    lengths[t.name] = jnp.asarray(e["length"], jnp.int32)
    ages[t.name] = jnp.asarray(e["age"], jnp.float32)
    if not is_packed_stream(e):
      seqs[t.name] = mod(e)
      continue
    if not packed_ok:
      raise ValueError(f"event stream {t.name!r} is packed (data.jagged_capacity): only the "
                       "Kunlun model (towers mode) runs packed towers")
    jag = sharded(*(jnp.asarray(e[k], jnp.int32) for k in ("offsets", "seg", "pos")),
                  lengths[t.name].shape[0])
    rows = {k: packed.as_rows(jnp.asarray(v), jag)[0] for k, v in e.items()   # a row per block
            if k not in ("offsets", "seg", "pos", "length")}
    rows["length"] = jag.totals
    y = mod(rows)                                                    # [S, Ns, d]
    seqs[t.name] = packed.Packed(packed.shard_tokens(y.reshape(-1, y.shape[-1])), jag)
  return seqs, lengths, ages


def apply_heads(cfg: ModelConfig, x, summaries, surface, dtype):
  """``z = concat(flatten(x [B, N, d]), flatten(summaries {name: [B, n, d_e]}))`` -> heads.

  Returns ``{"pooled" [B, top_mlp[-1]], "logits" f32[B, K], "summaries" {name: f32}}``.
  """
  B = x.shape[0]
  z = jnp.concatenate([x.reshape(B, -1).astype(jnp.float32)]
                      + [summaries[n].reshape(B, -1).astype(jnp.float32) for n in summaries], 1)
  z = shard(z, ("batch", None))
  h = cfg.heads
  logits, pooled = Heads(len(cfg.surfaces), len(cfg.tasks), h.kind, h.top_mlp, h.tower_hidden,
                         h.num_experts, h.expert_hidden, dtype, name="heads")(
      z, jnp.asarray(surface, jnp.int32))
  return {"pooled": pooled, "logits": logits,
          "summaries": {n: s.astype(jnp.float32) for n, s in summaries.items()}}
