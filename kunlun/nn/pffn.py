"""GDPA-enhanced personalized FFN block (spec c.3).

``u = LN(s)``; ``g = GDPA(Q=u, K, V; act, scale=1/sqrt(d_h), out_scale=1)``;
``s' = RMSNorm(g + u) + s``. Norms are affine-free, span all heads and run in float32; ``u`` is
kept in the compute dtype (it is the GDPA query; with bfloat16 the residual ``g + u`` adds the
rounded ``u``), and the tail is one pass with a hand-written VJP (``kunlun.nn.fused``). Rows at or
beyond ``lengths`` are zero in the output (and so receive no gradient). ``norm_affine=True``
adds learned per-channel scales (LN and RMSNorm) and a bias (LN), the ablation of Meta's
affine-free default. ``time_buckets`` adds per-head time/position bucket embeddings to the GDPA
query (spec b.5-2; ``u`` in the residual is unchanged).

Request-level sharing (serving, spec d.6, ``kunlun.serving.score``): with ``q_index i32[N]`` the
sequence side (``s``, ``lengths``, ``age``: ``R`` request rows) is normalised once per request
and output row ``b`` combines request ``q_index[b]``'s sequence with ad ``b``'s K/V (``N`` rows),
which equals the PFFN of ``N`` separate examples. Packed request histories reach it as padded
request rows (``kunlun.nn.rows.padded``).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from kunlun.configs.types import BucketSpec
from kunlun.nn import packed
from kunlun.nn.fused import norm_residual
from kunlun.nn.gdpa import gdpa_op
from kunlun.nn.norms import EPS, layer_norm, layer_norm_pair, rms_norm
from kunlun.nn.time_encoding import add_bucket_embedding
from pallas_kernels.activations import per_head
from sharding import shard, with_axes


def query_in_kernels(backend: str, d: int, x_dtype, dtype, time_buckets=None,
                     norm_affine: bool = False) -> bool:
  """Whether a packed PFFN of width ``d`` normalises its query inside the GDPA kernels and its
  tail's (``q_norm``, ``u_norm``): the fused tail, no bucket embedding on the query, tokens in
  the compute dtype. Only then does it read a pool's pass-through (``PFFN(tokens=...)``)."""
  return (not norm_affine and packed.fuse_tail(backend, d) and time_buckets is None
          and jnp.dtype(x_dtype) == jnp.dtype(dtype))


def take_rows(x, index):
  """``x[index]`` along the leading (batch) axis; ``x`` itself when ``index`` is None."""
  return x if index is None else jnp.take(x, index, axis=0)


class PFFN(nn.Module):
  """``(s [B,T,d], lengths i32[B], k, v [B, n_kv, heads, d//heads], age f32[B, T] | None,
  q_index i32[B] | None) -> [B, T, d]``; with ``q_index``, ``s, lengths, age`` have request rows
  (any count) and ``k, v`` and the output one row per ``q_index`` entry. ``tokens``: a packed
  tower's ``(x_ln, x_id)`` from the HSP before it (``HSP(pass_tokens=True)``, where
  ``query_in_kernels``), read in place of ``s``'s tokens by the query's norm (its statistics
  held, ``ln_split``) and by the tail."""
  heads: int
  activation: Any = "fast_gelu"
  backend: str = "xla"
  dtype: Any = jnp.float32
  norm_affine: bool = False
  score_clip: float | None = None   # clamp GDPA scores to [-c, c] (spec h-13); None/0: off
  time_buckets: BucketSpec | None = None   # per-head query bucket embeddings (b.5-2); None: off

  @nn.compact
  def __call__(self, s, lengths, k, v, age=None, q_index=None, tokens=None):
    if packed.is_packed(s):
      if q_index is not None:
        raise ValueError("PFFN: with q_index the request rows must be padded [R, T, d] "
                         "(kunlun.nn.rows.padded lays packed request tokens out so)")
      return self._packed(s, k, v, age, tokens)
    if tokens is not None:
      raise ValueError("PFFN: tokens passed through come with a packed tower only")
    _, T, d = s.shape
    B = s.shape[0] if q_index is None else q_index.shape[0]
    dh = self._check(d, k, v, B)
    with jax.named_scope("PFFN"):
      # u in the compute dtype (float32 with the affine norms): it is both GDPA's query and the
      # residual of the RMSNorm below (kunlun.nn.fused.norm_residual)
      u = self._norm(s)                                      # [B or R, T, d]
      q = u.astype(self.dtype).reshape(u.shape[0], T, self.heads, dh)
      q = add_bucket_embedding(self, "time_bucket_q", q, age, lengths, self.time_buckets)
      q = shard(q, ("batch", "seq", "heads", "head_dim"))
      lengths = jnp.asarray(lengths, jnp.int32)
      g = gdpa_op(q, k.astype(self.dtype), v.astype(self.dtype), activation=self.activation,
               out_scale=1.0, q_lengths=lengths, backend=self.backend,
               score_clip=self.score_clip, q_index=q_index)            # [B, T, H, dh]
      u, s, lengths = (take_rows(a, q_index) for a in (u, s, lengths))
      return shard(self._tail(g.reshape(B, T, d), u, s, lengths), ("batch", "seq", "embed"))

  def _packed(self, s, k, v, age, tokens=None):
    """A packed tower (``kunlun.nn.packed``): ``s.value [N, d]``, ``age f32[N]``."""
    x, jag = s.value, s.jag
    N, d = x.shape
    dh = self._check(d, k, v, jag.batch)
    with jax.named_scope("PFFN"):
      tail = not self.norm_affine and packed.fuse_tail(self.backend, d)
      k, v = k.astype(self.dtype), v.astype(self.dtype)
      kw = dict(activation=self.activation, score_clip=self.score_clip)
      if query_in_kernels(self.backend, d, x.dtype, self.dtype, self.time_buckets,
                          self.norm_affine):
        # u = LN(x) inside GDPA's kernels and the tail's, both ways: never written nor read.
        # With the pool's pass-throughs the query's norm holds its statistics (GDPA's kernels
        # write r du) and the pool's backward kernel takes the rest, the residual's with it
        xq, xr = (x, x) if tokens is None else tokens
        g = packed.gdpa_cross(xq.reshape(N, self.heads, dh), k, v, jag, backend=self.backend,
                              out_scale=1.0, q_norm=EPS, ln_split=tokens is not None, **kw)
        return packed.Packed(packed.fused_norm_residual(g.reshape(N, d), None, xr, jag, eps=EPS,
                                                        u_norm=EPS), jag)
      if tokens is not None:
        raise ValueError("PFFN: tokens passed through need the query normalised in the kernels "
                         "(query_in_kernels)")
      # the fused tail reads the query itself as its residual u (no bucket embedding on it):
      # GDPA passes q through, and its backward kernels add the tail's cotangent of u to dq
      q_shape = jax.ShapeDtypeStruct((N, self.heads, dh), self.dtype)
      through = (tail and self.time_buckets is None
                 and packed.gdpa_cross_through(q_shape, k, backend=self.backend, **kw))
      uq, u = (self._norm(x),) * 2 if through else self._norms(x)
      q = uq.astype(self.dtype).reshape(N, self.heads, dh)
      q = add_bucket_embedding(self, "time_bucket_q", q, age, None, self.time_buckets, jag)
      g = packed.gdpa_cross(q, k, v, jag, backend=self.backend, out_scale=1.0, through=through,
                            **kw)                                      # [N, H, dh]
      if through:
        g, u = g[0], g[1].reshape(N, d)
      if tail:
        y = packed.fused_norm_residual(g.reshape(N, d), u, x, jag, eps=EPS)
        return packed.Packed(y, jag)
      return packed.Packed(packed.rowwise(self._tail, jag, g.reshape(N, d), u, x), jag)

  def _check(self, d, k, v, B):
    if d % self.heads:
      raise ValueError(f"PFFN: heads={self.heads} does not divide width d={d}")
    per_head(self.activation, self.heads)                   # validates names / tuple length
    dh = d // self.heads
    if k.shape[0] != B or k.shape[2:] != (self.heads, dh) or v.shape != k.shape:
      raise ValueError(f"PFFN: k{k.shape}/v{v.shape} must be [B={B}, n_kv, {self.heads}, {dh}]")
    return dh

  def _norm(self, s):
    return (self._affine("ln", layer_norm(s), bias=True) if self.norm_affine
            else layer_norm(s, dtype=self.dtype))

  def _norms(self, s):
    """``u = LN(s)`` for its two readers on a packed tower, GDPA's query and the tail's residual:
    without the affine norm ``norms.layer_norm_pair``, whose backward adds their cotangents in its
    own pass. (The padded path keeps one output: there the pair made XLA's mid b256 padded
    program 0.3 GB larger.)"""
    if self.norm_affine:
      return (self._norm(s),) * 2
    return layer_norm_pair(s, dtype=self.dtype)

  def _tail(self, g, u, s, lengths):
    """``RMSNorm(g + u) + s`` with rows at or past ``lengths`` zero (``[B, T, d]``)."""
    if not self.norm_affine:
      return norm_residual(g, u, s, lengths)
    y = self._affine("rms", rms_norm(g.astype(jnp.float32) + u), bias=False)
    y = y + s.astype(jnp.float32)
    valid = jnp.arange(s.shape[1])[None, :] < lengths[:, None]
    return jnp.where(valid[..., None], y, 0.0).astype(s.dtype)

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
