"""Hierarchical Seed Pooling (spec c.5, h-6, h-7) and PMA (the ablation).

HSP: learnable seeds ``E [n_seed, d]`` (shared by the batch, GDPA ``broadcast_q``) attend to the
sequence, ``Hs = E + GDPA(RMSNorm(E) W_q, RMSNorm(s) W_k, RMSNorm(s) W_v; act, 1/T_max) W_o``, then
``SumKronLinear`` compresses ``RMSNorm(Hs)`` to ``n_sum`` summary tokens.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from kunlun.attention import masked_softmax_attention
from kunlun.gdpa import gdpa
from kunlun.norms import rms_norm
from pallas_kernels.activations import per_head
from sharding import shard, with_axes

F32 = jnp.float32


def _proj(features, in_axes, out_axes, dtype, name, axis=-1):
  return nn.DenseGeneral(features, axis=axis, use_bias=False, dtype=dtype, param_dtype=F32,
                         kernel_init=with_axes(nn.initializers.lecun_normal(), in_axes + out_axes),
                         name=name)


class SumKronLinear(nn.Module):
  """``Y = sum_i Z_i^T H W_i``: ``h [B, n_in, d]`` -> ``[B, n_out, out_dim or d]``.

  ``Z [rank, n_in, n_out] ~ N(0, 1/n_in)``, ``W [rank, d, d'] ~ N(0, 1/(d rank))`` (spec h-7).
  Equals ``vec(Y) = (sum_i Z_i^T kron W_i^T) vec(H)`` with row-major ``vec``.
  """
  n_out: int
  rank: int
  out_dim: int | None = None
  dtype: Any = F32

  @nn.compact
  def __call__(self, h):
    if self.rank < 1 or self.n_out < 1:
      raise ValueError(f"SumKronLinear: rank={self.rank} and n_out={self.n_out} must be >= 1")
    with jax.named_scope("SumKronLinear"):
      n_in, d = h.shape[-2:]
      do = self.out_dim or d
      z = self.param("Z", with_axes(nn.initializers.normal(n_in ** -0.5), (None, None, "seeds")),
                     (self.rank, n_in, self.n_out), F32)
      w = self.param("W", with_axes(nn.initializers.normal((d * self.rank) ** -0.5),
                                    (None, "embed", None)), (self.rank, d, do), F32)
      dt = self.dtype
      t = jnp.einsum("rnm,bnd->brmd", z.astype(dt), h.astype(dt))
      y = jnp.einsum("brmd,rde->bme", t, w.astype(dt))
      return shard(y, ("batch", "seeds", "embed"))


class HSP(nn.Module):
  """``(s [B, T, d], lengths i32[B]) -> [B, n_sum, out_dim or d]``.

  ``out_scale = 1 / t_max`` (default ``t_max = T``, the padded/kept length, spec h-1).
  """
  n_seed: int
  n_sum: int
  heads: int
  rank: int = 4
  out_dim: int | None = None
  activation: Any = "fast_gelu"
  backend: str = "xla"
  t_max: int | None = None
  dtype: Any = F32

  @nn.compact
  def __call__(self, s, lengths):
    B, T, d = s.shape
    if d % self.heads:
      raise ValueError(f"HSP: heads={self.heads} does not divide width d={d}")
    per_head(self.activation, self.heads)
    H, dh, dt = self.heads, d // self.heads, self.dtype
    with jax.named_scope("HSP"):
      e = self.param("seeds", with_axes(nn.initializers.normal(0.02), ("seeds", "embed")),
                     (self.n_seed, d), F32)
      q = _proj((H, dh), ("embed",), ("heads", "head_dim"), dt, "query")(rms_norm(e).astype(dt))
      hs = rms_norm(s).astype(dt)
      k = _proj((H, dh), ("embed",), ("heads", "head_dim"), dt, "key")(hs)
      v = _proj((H, dh), ("embed",), ("heads", "head_dim"), dt, "value")(hs)
      k = shard(k, ("batch", "seq", "heads", "head_dim"))
      v = shard(v, ("batch", "seq", "heads", "head_dim"))
      o = gdpa(q[None], k, v, activation=self.activation, out_scale=1.0 / (self.t_max or T),
               kv_lengths=lengths, broadcast_q=True, backend=self.backend)
      o = shard(o, ("batch", "seeds", "heads", "head_dim"))
      h = e + _proj(d, ("heads", "head_dim"), ("embed",), dt, "out", axis=(-2, -1))(o).astype(F32)
      h = shard(h, ("batch", "seeds", "embed"))
      return SumKronLinear(self.n_sum, self.rank, self.out_dim, dt, name="kron")(rms_norm(h))


class PMA(nn.Module):
  """Pooling by multi-head attention (InterFormer's PMA; HSP ablation).

  ``n_sum`` learnable queries softmax-attend to the valid events: ``Y = E + MHA(E, s)``, then
  a linear map to ``out_dim`` when given. ``(s [B, T, d], lengths) -> [B, n_sum, out_dim or d]``;
  an empty sequence gives ``Y = E``-based output.
  """
  n_sum: int
  heads: int
  out_dim: int | None = None
  dtype: Any = F32

  @nn.compact
  def __call__(self, s, lengths):
    B, T, d = s.shape
    if d % self.heads:
      raise ValueError(f"PMA: heads={self.heads} does not divide width d={d}")
    H, dh, dt = self.heads, d // self.heads, self.dtype
    with jax.named_scope("PMA"):
      e = self.param("queries", with_axes(nn.initializers.normal(0.02), ("seeds", "embed")),
                     (self.n_sum, d), F32)
      q = _proj((H, dh), ("embed",), ("heads", "head_dim"), dt, "query")(rms_norm(e).astype(dt))
      hs = rms_norm(s).astype(dt)
      k = _proj((H, dh), ("embed",), ("heads", "head_dim"), dt, "key")(hs)
      v = _proj((H, dh), ("embed",), ("heads", "head_dim"), dt, "value")(hs)
      valid = jnp.arange(T)[None, :] < jnp.asarray(lengths, jnp.int32)[:, None]    # [B, T]
      mask = jnp.broadcast_to(valid[:, None, :], (B, self.n_sum, T))
      o = masked_softmax_attention(jnp.broadcast_to(q[None], (B,) + q.shape), k, v, mask)
      h = e + _proj(d, ("heads", "head_dim"), ("embed",), dt, "out", axis=(-2, -1))(o).astype(F32)
      if self.out_dim:
        h = _proj(self.out_dim, ("embed",), (None,), dt, "final")(rms_norm(h).astype(dt))
      return shard(h, ("batch", "seeds", "embed"))
