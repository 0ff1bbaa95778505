"""Personalized weight generation (spec c.2, h-2): non-sequence tokens -> per-example K, V.

``X~ = RMSNorm(X)``; ``Z = W_tok^T X~`` (token-axis mix ``N_ns -> n_kv``); ``h = GELU(Z A1 + b)``;
``K = h A_K``, ``V = h A_V`` reshaped to ``[B, n_kv, heads, d_seq // heads]``. K and V are the
columns of the first and the rows of the second layer of a per-example, per-head FFN (c.2), the
GDPA-PFFN's keys and values. ``key_norm`` RMS-normalises each key over ``head_dim``.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from kunlun.nn.activations import gelu
from kunlun.nn.fused import apart, token_mix
from kunlun.nn.norms import rms_norm
from sharding import shard, with_axes

F32 = jnp.float32


class WeightGen(nn.Module):
  """``x [B, N_ns, d_ns]`` -> ``(k, v)``, each ``[B, n_kv, heads, d_seq // heads]``."""
  n_kv: int
  heads: int
  d_seq: int
  key_norm: bool = False
  dtype: Any = F32

  @nn.compact
  def __call__(self, x):
    if self.d_seq % self.heads:
      raise ValueError(f"WeightGen: heads={self.heads} does not divide d_seq={self.d_seq}")
    with jax.named_scope("WeightGen"):
      B, N, d_ns = x.shape
      dh = self.d_seq // self.heads
      w_tok = self.param("tok", with_axes(nn.initializers.normal(N ** -0.5), ("tokens", "kv")),
                         (N, self.n_kv), F32)
      z = token_mix(rms_norm(x).astype(self.dtype), w_tok.astype(self.dtype))
      z = shard(z, ("batch", "kv", "embed"))
      h = nn.Dense(d_ns, dtype=self.dtype, param_dtype=F32, name="hidden",
                   kernel_init=with_axes(nn.initializers.lecun_normal(), ("embed", "mlp")),
                   bias_init=with_axes(nn.initializers.zeros, ("mlp",)))(z)
      h = gelu(h)
      kv_init = with_axes(nn.initializers.lecun_normal(in_axis=0, out_axis=(1, 2)),
                          ("mlp", "heads", "head_dim"))
      shape = (d_ns, self.heads, dh)
      proj = lambda name, h: jnp.einsum("bme,ehc->bmhc", h,
                                        self.param(name, kv_init, shape, F32).astype(h.dtype))
      k, v = (proj(n, hi) for n, hi in zip(("key", "value"), apart(h, 2), strict=True))
      if self.key_norm:
        k = rms_norm(k).astype(self.dtype)
      axes = ("batch", "kv", "heads", "head_dim")
      return shard(k, axes), shard(v, axes)
