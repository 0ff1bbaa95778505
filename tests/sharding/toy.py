"""A small Linen ranker touching every logical axis, for sharding tests (not a kunlun model).

Batch: ``ids i32[B, F]`` (one embedding table), ``seq f32[B, T, C]``, ``lengths i32[B]``,
``labels f32[B, K]``. Output: logits ``f32[B, K]``.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from sharding.axes import shard, with_axes

INIT = nn.initializers.normal(0.2)


class Expert(nn.Module):
  mlp: int

  @nn.compact
  def __call__(self, x_bnd):
    d = x_bnd.shape[-1]
    w_dm = self.param("w_in", with_axes(INIT, ("embed", "mlp")), (d, self.mlp))
    w_md = self.param("w_out", with_axes(INIT, ("mlp", "embed")), (self.mlp, d))
    h = shard(jax.nn.gelu(x_bnd @ w_dm), ("batch", "tokens", "mlp"))
    return h @ w_md


class Toy(nn.Module):
  vocab: int = 64
  dim: int = 16
  heads: int = 4
  mlp: int = 32
  experts: int = 2
  tasks: int = 2
  lookup: object = None      # (table, ids) -> rows; default jnp.take

  @nn.compact
  def __call__(self, batch, train: bool = False):
    d, H = self.dim, self.heads
    table = self.param("embedding", with_axes(INIT, ("table_rows", "table_dim")), (self.vocab, d))
    look = self.lookup or (lambda t, i: jnp.take(t, i, axis=0))
    e_bfd = shard(look(table, batch["ids"]), ("batch", "tokens", "embed"))

    x = batch["seq"]
    w_cd = self.param("seq_in", with_axes(INIT, (None, "embed")), (x.shape[-1], d))
    s_btd = shard(x @ w_cd, ("batch", "seq", "embed"))
    T = s_btd.shape[1]
    valid_bt = jnp.arange(T)[None] < batch["lengths"][:, None]
    # attention over heads (full, masked)
    w_q, w_k, w_v = (self.param(n, with_axes(INIT, ("embed", "heads", "head_dim")), (d, H, d // H))
                     for n in ("wq", "wk", "wv"))
    q, k, v = (shard(jnp.einsum("btd,dhk->bthk", s_btd, w), ("batch", "seq", "heads", "head_dim"))
               for w in (w_q, w_k, w_v))
    a = jnp.einsum("bqhk,bthk->bhqt", q, k) * (d // H) ** -0.5
    a = jnp.where(valid_bt[:, None, None, :], a, -1e9)
    o = jnp.einsum("bhqt,bthk->bqhk", jax.nn.softmax(a, -1), v)
    w_o = self.param("wo", with_axes(INIT, ("heads", "head_dim", "embed")), (H, d // H, d))
    s_btd = shard(s_btd + jnp.einsum("bqhk,hkd->bqd", o, w_o), ("batch", "seq", "embed"))
    w1 = self.param("mlp_in", with_axes(INIT, ("embed", "mlp")), (d, self.mlp))
    w2 = self.param("mlp_out", with_axes(INIT, ("mlp", "embed")), (self.mlp, d))
    h = shard(jax.nn.gelu(s_btd @ w1), ("batch", "seq", "mlp"))
    s_btd = shard(s_btd + h @ w2, ("batch", "seq", "embed"))
    pooled_bd = jnp.sum(s_btd * valid_bt[..., None], 1) / jnp.maximum(batch["lengths"], 1)[:, None]

    x_bnd = jnp.concatenate([e_bfd, pooled_bd[:, None]], axis=1)
    Experts = nn.vmap(Expert, variable_axes={"params": 0}, split_rngs={"params": True},
                      in_axes=None, out_axes=0, axis_size=self.experts,
                      metadata_params={nn.PARTITION_NAME: "exp"})
    y_ebnd = shard(Experts(self.mlp)(x_bnd), ("exp", "batch", "tokens", "embed"))
    y_bd = jnp.mean(y_ebnd, axis=(0, 2))
    w_head = self.param("head", with_axes(INIT, ("embed", None)), (d, self.tasks))
    return y_bd @ w_head


def toy_batch(B=16, F=3, T=16, C=8, vocab=64, tasks=2, seed=0):
  rng = np.random.default_rng(seed)
  return {
      "ids": rng.integers(0, vocab, (B, F)).astype(np.int32),
      "seq": rng.normal(size=(B, T, C)).astype(np.float32),
      "lengths": rng.integers(1, T + 1, B).astype(np.int32),
      "labels": (rng.uniform(size=(B, tasks)) < 0.3).astype(np.float32),
  }
