"""GDPA-enhanced personalized FFN block (spec c.3).

``u = LN(s)``; ``g = GDPA(Q=u, K, V; act, scale=1/sqrt(d_h), out_scale=1)``;
``s' = RMSNorm(g + u) + s``. Norms are affine-free, span all heads and run in float32. Rows at or
beyond ``lengths`` are zero in the output (and so receive no gradient). ``norm_affine=True``
adds learned per-channel scales (LN and RMSNorm) and a bias (LN), the ablation of Meta's
affine-free default.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from kunlun.gdpa import gdpa
from kunlun.norms import layer_norm, rms_norm
from pallas_kernels.activations import per_head
from sharding import shard, with_axes


class PFFN(nn.Module):
  """``(s [B,T,d], lengths i32[B], k, v [B, n_kv, heads, d//heads]) -> [B, T, d]``."""
  heads: int
  activation: Any = "fast_gelu"
  backend: str = "xla"
  dtype: Any = jnp.float32
  norm_affine: bool = False
  score_clip: float | None = None   # clamp GDPA scores to [-c, c] (spec h-13); None/0: off

  @nn.compact
  def __call__(self, s, lengths, k, v):
    B, T, d = s.shape
    if d % self.heads:
      raise ValueError(f"PFFN: heads={self.heads} does not divide width d={d}")
    per_head(self.activation, self.heads)                   # validates names / tuple length
    dh = d // self.heads
    if k.shape[0] != B or k.shape[2:] != (self.heads, dh) or v.shape != k.shape:
      raise ValueError(f"PFFN: k{k.shape}/v{v.shape} must be [B={B}, n_kv, {self.heads}, {dh}]")
    with jax.named_scope("PFFN"):
      u = self._affine("ln", layer_norm(s), bias=True)        # f32 [B, T, d]
      q = shard(u.astype(self.dtype).reshape(B, T, self.heads, dh),
                ("batch", "seq", "heads", "head_dim"))
      g = gdpa(q, k.astype(self.dtype), v.astype(self.dtype), activation=self.activation,
               out_scale=1.0, q_lengths=lengths, backend=self.backend,
               score_clip=self.score_clip)
      y = self._affine("rms", rms_norm(g.reshape(B, T, d).astype(jnp.float32) + u), bias=False)
      y = y + s.astype(jnp.float32)
      valid = jnp.arange(T)[None, :] < jnp.asarray(lengths, jnp.int32)[:, None]
      y = jnp.where(valid[..., None], y, 0.0).astype(s.dtype)
      return shard(y, ("batch", "seq", "embed"))

  def _affine(self, name, x, bias):
    if not self.norm_affine:
      return x
    d = x.shape[-1]
    x = x * self.param(f"{name}_scale", with_axes(nn.initializers.ones, ("embed",)), (d,),
                       jnp.float32)
    if bias:
      x = x + self.param(f"{name}_bias", with_axes(nn.initializers.zeros, ("embed",)), (d,),
                         jnp.float32)
    return x
