"""DLRM (``config.model.arch = "dlrm"``), a reference model built from the project's parts.

The same context tokens as Kunlun (sparse embeddings + dense tokens + LCE + surface embedding),
each stream embedded at width ``dlrm.seq_dim`` and mean-pooled over its valid events, then an MLP
(``dlrm.mlp``) and the same heads.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from data.schema import Schema
from kunlun.configs.types import ModelConfig
from kunlun.nn.heads import MLP
from kunlun.nn.inputs import EventEmbed
from kunlun.nn.layer import COMPUTE_DTYPES
from kunlun.nn.stages import apply_heads, embed_context
from sharding import shard


class DLRM(nn.Module):
  """``apply(params, batch, train) -> logits [B, K]``; ``method="representations"`` as Kunlun."""
  cfg: ModelConfig
  schema: Schema

  def __call__(self, batch, train: bool = False):
    return self.representations(batch, train)["logits"]

  @nn.compact
  def representations(self, batch, train: bool = False):
    del train
    cfg, dt = self.cfg, COMPUTE_DTYPES[self.cfg.dtype]
    with jax.named_scope("DLRM"):
      x = embed_context(cfg, self.schema, batch, dt)
      pooled = {}
      for st in self.schema.streams:
        ev = batch["events"][st.name]
        s = EventEmbed(st, len(self.schema.surfaces), cfg.dlrm.seq_dim, cfg.num_time_buckets, dt,
                       name=f"embed_{st.name}")(ev)                  # padded rows are zero
        n = jnp.maximum(jnp.asarray(ev["length"], jnp.float32), 1.0)
        pooled[st.name] = (jnp.sum(s.astype(jnp.float32), axis=1) / n[:, None])[:, None, :]
      B = x.shape[0]
      z = jnp.concatenate([x.reshape(B, -1).astype(jnp.float32)]
                          + [p.reshape(B, -1) for p in pooled.values()], axis=1)
      h = MLP(cfg.dlrm.mlp, dtype=dt, name="bottom_mlp")(shard(z, ("batch", None)).astype(dt))
      # the heads flatten (x, summaries): feed the MLP output as one token and the pooled streams
      out = apply_heads(cfg, h[:, None, :], {}, batch["surface"], dt)
      out["summaries"] = pooled
      return out
