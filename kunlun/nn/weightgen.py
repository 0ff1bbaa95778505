"""Personalized weight generation (spec c.2, h-2): non-sequence tokens -> per-example K, V.

``X~ = RMSNorm(X)``; ``Z = W_tok^T X~`` (token-axis mix ``N_ns -> n_kv``); ``h = GELU(Z A1 + b)``;
``K = h A_K``, ``V = h A_V`` reshaped to ``[B, n_kv, heads, d_seq // heads]``. K and V are the
columns of the first and the rows of the second layer of a per-example, per-head FFN (c.2), the
GDPA-PFFN's keys and values. ``key_norm`` RMS-normalises each key over ``head_dim``. On the
Pallas backend (``auto`` on a GPU) the chain is one kernel pass per example forward and one
backward (``pallas_kernels.weightgen``; ``kernel``), per device on its examples.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from kunlun.nn import packed
from kunlun.nn.activations import gelu
from kunlun.nn.dense import DenseParams, dense
from kunlun.nn.fused import apart, token_mix
from kunlun.nn.norms import rms_norm
from pallas_kernels import weightgen
from sharding import shard, with_axes
from sharding.packed import per_shard

F32 = jnp.float32


def kernel(backend: str, key_norm: bool, N: int, n_kv: int, d_ns: int, d_seq: int) -> bool:
  """Whether WeightGen runs as ``pallas_kernels.weightgen``'s kernels: backend "pallas", or
  "auto" compiling for a GPU, no key norm, at widths the kernels take."""
  return (packed.pallas_backend(backend) and not key_norm
          and weightgen.supported(N, n_kv, d_ns, d_ns, d_seq))


def gen_pallas(x, w_tok, a1, b1, a_k, a_v, *, dtype):
  """``pallas_kernels.weightgen.weightgen_pallas`` per device on its examples (global shapes
  here: ``bench.profiling.roofline.record_kernels`` counts its FLOPs at this call)."""
  interpret = packed.interpret_kernels()
  op = lambda *a: weightgen.weightgen_pallas(*a, dtype=dtype, interpret=interpret)
  return per_shard(op, (True,) + (False,) * 5, "batch")(x, w_tok, a1, b1, a_k, a_v)


class WeightGen(nn.Module):
  """``x [B, N_ns, d_ns]`` -> ``(k, v)``, each ``[B, n_kv, heads, d_seq // heads]``."""
  n_kv: int
  heads: int
  d_seq: int
  key_norm: bool = False
  dtype: Any = F32
  backend: str = "xla"

  @nn.compact
  def __call__(self, x):
    if self.d_seq % self.heads:
      raise ValueError(f"WeightGen: heads={self.heads} does not divide d_seq={self.d_seq}")
    with jax.named_scope("WeightGen"):
      B, N, d_ns = x.shape
      dh = self.d_seq // self.heads
      w_tok = self.param("tok", with_axes(nn.initializers.normal(N ** -0.5), ("tokens", "kv")),
                         (N, self.n_kv), F32)
      # parameters in nn.Dense's and the earlier layout (names, initialisers, order): one tree
      a1, b1 = DenseParams(d_ns, d_ns, name="hidden")()     # nn.Dense's, for both paths
      kv_init = with_axes(nn.initializers.lecun_normal(in_axis=0, out_axis=(1, 2)),
                          ("mlp", "heads", "head_dim"))
      w_k, w_v = (self.param(n, kv_init, (d_ns, self.heads, dh), F32) for n in ("key", "value"))
      axes = ("batch", "kv", "heads", "head_dim")
      if kernel(self.backend, self.key_norm, N, self.n_kv, d_ns, self.d_seq):
        flat = lambda w: w.reshape(d_ns, self.d_seq)
        k, v = gen_pallas(x, w_tok, a1, b1, flat(w_k), flat(w_v), dtype=self.dtype)
        split = lambda t: shard(t.reshape(B, self.n_kv, self.heads, dh), axes)
        return split(k), split(v)
      dt = self.dtype
      z = token_mix(rms_norm(x).astype(dt), w_tok.astype(dt))
      z = shard(z, ("batch", "kv", "embed"))
      h = gelu(dense(z, a1, b1, dt))
      k, v = (jnp.einsum("bme,ehc->bmhc", hi, w.astype(hi.dtype))
              for hi, w in zip(apart(h, 2), (w_k, w_v), strict=True))
      if self.key_norm:
        k = rms_norm(k).astype(self.dtype)
      return shard(k, axes), shard(v, axes)
