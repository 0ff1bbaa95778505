"""Baselines built from the same parts (spec A.1, h-17), selected by ``config.model.arch``.

* ``"interformer"``: InterFormer-style. The Kunlun trunk with InterFormer's choices substituted:
  the PFFN is one generated projection (GDPA with the identity activation: ``s (K^T V)`` per head,
  a personalized rank-``n_kv`` projection, spec c.2), PMA pooling, full self-attention, a single
  Wukong stack as the interaction (one "expert"), no CompSkip and no event-level depth (every tower
  runs all ``num_layers``). Widths, heads, kept lengths and summary tokens come from the config's
  towers, so the two architectures are compared on the same budget knobs.
* ``"dlrm"``: DLRM-style. The same context tokens (sparse embeddings + dense tokens + LCE +
  surface embedding), each stream embedded at width ``dlrm.seq_dim`` and mean-pooled over its
  valid events, then an MLP (``dlrm.mlp``) and the same heads.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from data.schema import Schema
from kunlun.common import apply_heads, embed_context
from kunlun.config import ModelConfig, MoWEConfig
from kunlun.heads import MLP
from kunlun.inputs import EventEmbed
from kunlun.layer import DTYPES
from sharding import shard


def interformer_config(cfg: ModelConfig) -> ModelConfig:
  """The Kunlun ModelConfig that realises the InterFormer-style baseline."""
  towers = tuple(dataclasses.replace(t, depth=cfg.num_layers) for t in cfg.towers)
  return dataclasses.replace(
      cfg, arch="interformer", comp_skip=False, seq_mode="towers", oneseq=None, towers=towers,
      pooling="pma", pffn_activation="identity",
      attention=dataclasses.replace(cfg.attention, kind="full"),
      mowe=MoWEConfig(num_experts=1, layers_per_expert=cfg.mowe.layers_per_expert,
                      rank=cfg.mowe.rank, mlp_hidden=cfg.mowe.mlp_hidden))


class DLRM(nn.Module):
  """``apply(params, batch, train) -> logits [B, K]``; ``method="representations"`` as Kunlun."""
  cfg: ModelConfig
  schema: Schema

  def __call__(self, batch, train: bool = False):
    return self.representations(batch, train)["logits"]

  @nn.compact
  def representations(self, batch, train: bool = False):
    del train
    cfg, dt = self.cfg, DTYPES[self.cfg.dtype]
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
