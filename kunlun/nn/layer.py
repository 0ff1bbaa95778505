"""One Kunlun layer with Computation Skip (spec c.7, d.1).
State ``(x [B, N_ns, d_ns], seqs, summaries)``: per tower ``s_e [B, T_e, d_e]``, ``lengths_e
i32[B]``, ``age_e f32[B, T_e]``, ``summary_e [B, n_sum_e, d_e]``; interaction block, then the
transformer block. A packed tower (``data.jagged_capacity``) is ``kunlun.nn.packed.Packed`` tokens
``[N, d_e]`` with ``age_e f32[N]``. Notes: docs/architecture.md, ``kunlun/nn/layer.py``."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from kunlun.configs.types import ModelConfig
from kunlun.nn import packed, rows
from kunlun.nn.mowe import MoWE
from kunlun.nn.pffn import PFFN, query_in_kernels
from kunlun.nn.remat import wrap
from kunlun.nn.towers import make_attention, make_pooling, schedule
from kunlun.nn.weightgen import WeightGen
from sharding import shard, with_axes

COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def summary_proj(d_ns: int, dtype, name: str):
  """Per-layer, per-tower ``Proj_e``: summary width ``d_e -> d_ns``."""
  return nn.Dense(d_ns, use_bias=False, dtype=dtype, param_dtype=jnp.float32, name=name,
                  kernel_init=with_axes(nn.initializers.lecun_normal(), (None, "embed")))


class KunlunLayer(nn.Module):
  """``(x, seqs, lengths, ages, summaries[, request_index]) -> (x', seqs', summaries')`` (dicts
  keyed by tower)."""
  cfg: ModelConfig
  index: int
  remat: str = "none"

  @nn.compact
  def __call__(self, x, seqs, lengths, ages, summaries, request_index=None):
    cfg, dt, rm = self.cfg, COMPUTE_DTYPES[self.cfg.dtype], self.remat
    ri, tb = request_index, cfg.time_buckets.enabled     # tb: HSP / PFFN read the ages
    seqs, summaries = dict(seqs), dict(summaries)
    # lengths / ages follow their sequence to ad rows (after an earlier layer's PFFN)
    lengths = {n: rows.like(seqs[n], v, ri) if n in seqs else v for n, v in lengths.items()}
    ages = {n: rows.like(seqs[n], v, ri) if n in seqs else v for n, v in ages.items()}
    with jax.named_scope(f"KunlunLayer_{self.index}"):
      plans = {t.name: schedule(t, self.index, cfg.comp_skip, cfg.final_hsp)
               for t in cfg.seq_towers}
      kv, passed = {}, {}
      for t in cfg.seq_towers:                                   # interaction block (1), (2)
        p = plans[t.name]
        if p.weightgen:
          kv[t.name] = wrap(WeightGen, rm)(t.n_kv, t.heads, t.width, cfg.key_norm, dt,
                                           backend=cfg.backend, name=f"{t.name}_weightgen")(x)
        if p.hsp:
          # HSP's fused pool passes the tokens through to this layer's PFFN: the norm's backward
          # and the sum of the three readers' cotangents join the pool's backward kernel
          s = seqs[t.name]
          through = (p.pffn and ri is None and cfg.pooling != "pma" and packed.is_packed(s)
                     and query_in_kernels(cfg.backend, t.width, s.value.dtype, dt,
                                          cfg.time_buckets.spec(t)))
          out = rows.apply(make_pooling(cfg, t, dt, f"{t.name}_hsp", remat=rm,
                                        pass_tokens=through), ri, s, lengths[t.name],
                           ages[t.name] if tb else None)
          summaries[t.name], passed[t.name] = out if through else (out, None)
        if t.name not in summaries:
          raise ValueError(f"tower {t.name!r} has no summary at layer {self.index}: layer 0 must "
                           "run its HSP (depth >= 1)")
      tokens = [x.astype(dt)] + [
          rows.to_ads(rows.apply(summary_proj(cfg.d_ns, dt, f"{t.name}_proj"), ri,
                                 summaries[t.name]), ri) for t in cfg.seq_towers]
      x_in = shard(jnp.concatenate(tokens, axis=1), ("batch", "tokens", "embed"))
      x_new = wrap(MoWE, rm)(cfg.mowe.num_experts, cfg.mowe.layers_per_expert, cfg.n_ns,
                             cfg.mowe.rank, cfg.mowe.mlp_hidden, dtype=dt,
                             cross_layer=cfg.mowe.cross_layer, backend=cfg.backend,
                             name="mowe")(x_in)                                      # (3)
      for t in cfg.seq_towers:                                   # transformer block (4), (5)
        p, s = plans[t.name], seqs[t.name]
        n_len, age = lengths[t.name], ages[t.name]
        if p.pffn:
          k, v = kv[t.name]
          pffn = wrap(PFFN, rm)(t.heads, cfg.pffn_activation, cfg.backend, dt,
                                score_clip=cfg.score_clip or None,
                                time_buckets=cfg.time_buckets.spec(t), name=f"{t.name}_pffn")
          if rows.is_shared(s):          # request-level sequence, ad-level K/V -> ad rows
            s, age = rows.padded(s, t.kept_len), rows.padded(age)   # packed: [R, T] rows
            s = pffn(s.value, n_len.value, k, v, age.value if tb else None, q_index=ri)
            n_len, age = rows.to_ads(n_len, ri), rows.to_ads(age, ri)
          else:
            s = pffn(s, n_len, k, v, age if tb else None, tokens=passed.get(t.name))
        if p.attention:
          s = rows.apply(make_attention(cfg, t, dt, f"{t.name}_attention", remat=rm), ri, s,
                         n_len, age)
        if p.final_hsp:
          summaries[t.name] = rows.apply(
              make_pooling(cfg, t, dt, f"{t.name}_final_hsp", remat=rm), ri, s, n_len,
              age if tb else None)
        seqs[t.name] = s
      return x_new, seqs, summaries
