"""DHEN interaction layer (spec A.4, c.6 "alternative ensemble"): InterFormer's Interaction Arch.

A DHEN layer runs heterogeneous interaction modules side by side on the same tokens
``Z [B, N, d]``, sums them with a shortcut and normalises; InterFormer's benchmarks use DOT + DCN
(spec A.1), followed by an MLP (``X^{l+1} = MLP(Interaction(Z))``):

  DOT    ``reshape(W_dot^T triu(Z Z^T / sqrt(d)), [n_out, d])``  pairwise inner products (upper
         triangle with the diagonal, ``N (N + 1) / 2`` values) -> a linear map to the output tokens
  DCN    ``P_dcn^T reshape(x0 * (U (V^T x0) + b) + x0, [N, d])``, ``x0 = flatten(Z)``: a low-rank
         DCN-v2 cross layer (``U [N d, r]``, ``V [N d, r]``), then a token map ``N -> n_out``
  y      ``LN(DOT + DCN + P_res^T Z)``  (``P_res`` the identity when ``N = n_out``)
  out    ``LN(y + MLP(y))``  token-wise 2-layer GELU MLP (hidden ``mlp_hidden``)

LayerNorms keep their affine parameters and run in float32 (as in Wukong). ``DHEN`` stacks
``num_layers`` of them (the first maps ``N -> n_out`` tokens).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from kunlun.nn.wukong import _LayerNorm
from sharding import shard, with_axes

F32 = jnp.float32
_TOK = ("batch", "tokens", "embed")


def _token_map(mod, name, x, n_out, dt):
  """``P^T x``: ``x [B, N, d]`` -> ``[B, n_out, d]`` with a learned ``P [N, n_out]``."""
  N = x.shape[1]
  p = mod.param(name, with_axes(nn.initializers.normal(N ** -0.5), ("tokens", None)), (N, n_out),
                F32)
  return jnp.einsum("bnd,nm->bmd", x.astype(dt), p.astype(dt))


class DHENLayer(nn.Module):
  """``z [B, N, d]`` -> ``[B, n_out, d]`` (module docstring)."""
  n_out: int
  rank: int
  mlp_hidden: int
  dtype: Any = F32

  @nn.compact
  def __call__(self, z):
    if self.n_out < 1 or self.rank < 1 or self.mlp_hidden < 1:
      raise ValueError(f"DHENLayer: need n_out, rank, mlp_hidden >= 1; got {self.n_out}, "
                       f"{self.rank}, {self.mlp_hidden}")
    B, N, d = z.shape
    dt, n_out = self.dtype, self.n_out
    with jax.named_scope("DHEN"):
      zc = z.astype(dt)
      # DOT: pairwise inner products -> output tokens
      gram = jnp.einsum("bnd,bmd->bnm", zc, zc) * d ** -0.5
      i, j = np.triu_indices(N)                                          # diagonal included
      pairs = gram[:, i, j]                                              # [B, N (N + 1) / 2]
      w_dot = self.param("dot", with_axes(nn.initializers.lecun_normal(), (None, "embed")),
                         (len(i), n_out * d), F32)
      dot = jnp.einsum("bp,pe->be", pairs, w_dot.astype(dt)).reshape(B, n_out, d)
      # DCN: low-rank cross layer on the flattened tokens, then a token map
      x0 = zc.reshape(B, N * d)
      u = self.param("dcn_u", with_axes(nn.initializers.lecun_normal(), (None, None)),
                     (N * d, self.rank), F32)
      v = self.param("dcn_v", with_axes(nn.initializers.normal(self.rank ** -0.5 * 0.1),
                                        (None, None)), (self.rank, N * d), F32)
      b = self.param("dcn_b", with_axes(nn.initializers.zeros, (None,)), (N * d,), F32)
      cross = x0 * (jnp.einsum("br,re->be", jnp.einsum("be,er->br", x0, u.astype(dt)),
                               v.astype(dt)) + b.astype(dt)) + x0
      dcn = _token_map(self, "dcn_tokens", cross.reshape(B, N, d), n_out, dt)
      res = zc if N == n_out else _token_map(self, "res_proj", zc, n_out, dt)
      y = _LayerNorm(name="norm")(dot.astype(F32) + dcn.astype(F32) + res.astype(F32))
      # token-wise MLP with a residual
      h = nn.Dense(self.mlp_hidden, dtype=dt, param_dtype=F32, name="mlp_in",
                   kernel_init=with_axes(nn.initializers.lecun_normal(), ("embed", "mlp")),
                   bias_init=with_axes(nn.initializers.zeros, ("mlp",)))(y.astype(dt))
      h = nn.Dense(d, dtype=dt, param_dtype=F32, name="mlp_out",
                   kernel_init=with_axes(nn.initializers.lecun_normal(), ("mlp", "embed")),
                   bias_init=with_axes(nn.initializers.zeros, ("embed",)))(nn.gelu(h))
      out = _LayerNorm(name="out_norm")(y + h.astype(F32)).astype(dt)
      return shard(out, _TOK)


class DHEN(nn.Module):
  """``num_layers`` DHEN layers: ``[B, N, d]`` -> ``[B, n_out, d]``."""
  num_layers: int
  n_out: int
  rank: int
  mlp_hidden: int
  dtype: Any = F32

  @nn.compact
  def __call__(self, z):
    if self.num_layers < 1:
      raise ValueError(f"DHEN.num_layers must be >= 1, got {self.num_layers}")
    for i in range(self.num_layers):
      z = DHENLayer(self.n_out, self.rank, self.mlp_hidden, self.dtype, name=f"layer_{i}")(z)
    return z
