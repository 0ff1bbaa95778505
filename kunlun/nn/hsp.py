"""Hierarchical Seed Pooling (spec c.5, h-6, h-7) and PMA (the ablation).

HSP: learnable seeds ``E [n_seed, d]`` (shared by the batch, GDPA ``broadcast_q``) attend to the
sequence, ``Hs = E + GDPA(RMSNorm(E) W_q, RMSNorm(s) W_k, RMSNorm(s) W_v; act, 1/T_max) W_o``, then
``SumKronLinear`` compresses ``RMSNorm(Hs)`` to ``n_sum`` summary tokens. With ``time_buckets``
the keys (the per-event side; the queries are the seeds) get per-head additive time/position
bucket embeddings (spec b.5-2, ``kunlun.nn.time_encoding``). Both also pool a packed tower
(``kunlun.nn.packed.Packed`` tokens ``[N, d]``) per example: HSP through ``jagged_gdpa_pool``, PMA
through ``jagged_softmax_pool``.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from kunlun.configs.types import BucketSpec
from kunlun.nn import packed
from kunlun.nn.attention import masked_softmax_attention
from kunlun.nn.fused import add_rms_norm, apart, batched_mixes
from kunlun.nn.gdpa import gdpa_op
from kunlun.nn.norms import EPS, rms_norm
from kunlun.nn.time_encoding import add_bucket_embedding
from pallas_kernels import seed_kron, seed_query
from pallas_kernels.activations import per_head
from sharding import shard, with_axes
from sharding.packed import one_device, per_shard

F32 = jnp.float32


def _head_weights(mod, name, d, heads):
  """The parameter ``name``: ``W [d, heads, d // heads]``."""
  init = with_axes(nn.initializers.lecun_normal(0, (1, 2)), ("embed", "heads", "head_dim"))
  return mod.param(name, init, (d, heads, d // heads), F32)


def _to_heads(mod, name, x, heads, dtype):
  """``x [..., d] @ W [d, heads, d // heads]`` with ``W`` the parameter ``name``."""
  w = _head_weights(mod, name, x.shape[-1], heads)
  return jnp.einsum("...d,dhc->...hc", x.astype(dtype), w.astype(dtype))


def _seed_queries(mod, e, heads, dtype, backend="xla"):
  """``_to_heads(mod, "query", rms_norm(e), heads, dtype)``: the seeds ``e f32[S, d]``' queries
  ``[S, H, D]``; on the Pallas backend one kernel each way (``pallas_kernels.seed_query``) where
  it takes the shapes and the step runs on one device (its operands are parameters, which a mesh
  may split). The weight is cast here, its only use, which the optimizer's 16-bit copy replaces
  (``kunlun.train.param_copies``)."""
  S, d = e.shape
  if (packed.pallas_backend(backend) and one_device()
          and seed_query.supported(S, d, heads, d // heads)):
    w = _head_weights(mod, "query", d, heads).astype(dtype)
    return seed_query.seed_query_pallas(e, w, eps=EPS, dtype=dtype,
                                        interpret=packed.interpret_kernels())
  return _to_heads(mod, "query", rms_norm(e), heads, dtype)


def _from_heads(mod, name, o, out_dim, dtype, backend="xla"):
  """``o [B, ..., H, dh] @ W [H, dh, out_dim]`` (``W``'s gradient on ``pallas_kernels.wgrad``
  where ``packed.wgrad_kernel`` holds)."""
  init = with_axes(nn.initializers.lecun_normal((0, 1), 2), ("heads", "head_dim", "embed"))
  w = mod.param(name, init, o.shape[-2:] + (out_dim,), F32)
  K = o.shape[-2] * o.shape[-1]
  if packed.wgrad_kernel(backend, K, out_dim, dtype):
    return packed.dense_kernel(o.reshape(o.shape[:-2] + (K,)),
                               w.astype(dtype).reshape(K, out_dim), dtype=dtype)
  return jnp.einsum("...hc,hcd->...d", o.astype(dtype), w.astype(dtype))


def kron_pallas(a, e, z, *, dtype):
  """``pallas_kernels.seed_kron.seed_kron_pallas`` per device on its examples (global shapes
  here: ``bench.profiling.roofline.record_kernels`` counts its FLOPs at this call)."""
  interpret = packed.interpret_kernels()
  op = lambda a, e, z: seed_kron.seed_kron_pallas(a, e, z, eps=EPS, dtype=dtype,
                                                  interpret=interpret)
  return per_shard(op, (True, False, False), "batch")(a, e, z)


class SumKronLinear(nn.Module):
  """``Y = sum_i Z_i^T H W_i``: ``h [B, n_in, d]`` -> ``[B, n_out, out_dim or d]``.

  ``Z [rank, n_in, n_out] ~ N(0, 1/n_in)``, ``W [rank, d, d'] ~ N(0, 1/(d rank))`` (spec h-7).
  Equals ``vec(Y) = (sum_i Z_i^T kron W_i^T) vec(H)`` with row-major ``vec``. With ``seeds e
  [n_in, d]``, ``H = RMSNorm(h + e)`` (``fused.add_rms_norm``, HSP's seeds); on the Pallas
  backend that norm and the first product are one kernel pass each way
  (``pallas_kernels.seed_kron``) where it takes the shapes.
  """
  n_out: int
  rank: int
  out_dim: int | None = None
  dtype: Any = F32
  backend: str = "xla"

  @nn.compact
  def __call__(self, h, seeds=None):
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
      B = h.shape[0]
      if (seeds is not None and packed.pallas_backend(self.backend) and h.ndim == 3
          and seed_kron.supported(n_in, self.rank, self.n_out, d)):
        t = kron_pallas(h, seeds, z, dtype=dt)        # [B, n_out, rank d]; Z as it is stored
        t = shard(t, ("batch", "seeds", None))
        wk = w.astype(dt).reshape(self.rank * d, do)
        y = (packed.dense_kernel(t, wk, dtype=dt)
             if packed.wgrad_kernel(self.backend, self.rank * d, do, dt)
             else jnp.einsum("bmq,qe->bme", t, wk))
        return shard(y, ("batch", "seeds", "embed"))
      if seeds is not None:
        h = shard(add_rms_norm(h, seeds, dt), ("batch", "seeds", "embed"))
      if not batched_mixes():        # XLA:CPU: the unbatched contraction is faster
        t = jnp.einsum("rnm,bnd->bmrd", z.astype(dt), h.astype(dt))
        t = shard(t, ("batch", "seeds", None, "embed"))
        y = jnp.einsum("bmrd,rde->bme", t, w.astype(dt))
        return shard(y, ("batch", "seeds", "embed"))
      # t [B, n_out, rank * d] from a batched matmul over examples (Z, tiny, broadcast to every
      # example): h keeps its [B, n_in, d] layout, where contracting Z over the seeds of an
      # unbatched Z makes XLA transpose h (and its gradient) to [n_in, B, d]; the second product
      # is then one matmul over (rank, d) per row
      zb = jnp.broadcast_to(z.astype(dt).transpose(1, 2, 0).reshape(n_in, self.n_out * self.rank),
                            (B, n_in, self.n_out * self.rank))
      t = jnp.einsum("bnk,bnd->bkd", zb, h.astype(dt)).reshape(B, self.n_out, self.rank * d)
      t = shard(t, ("batch", "seeds", None))
      y = jnp.einsum("bmq,qe->bme", t, w.astype(dt).reshape(self.rank * d, do))
      return shard(y, ("batch", "seeds", "embed"))


class HSP(nn.Module):
  """``(s [B, T, d], lengths i32[B], age f32[B, T] | None) -> [B, n_sum, out_dim or d]``
  (``age`` is needed with ``time_buckets`` only).

  ``out_scale = 1 / t_max`` (default ``t_max = T``, the padded/kept length, spec h-1).
  ``pass_tokens``: returns ``(summary, tokens)``, ``tokens`` the packed tower's ``(x_ln, x_id)
  [N, d]`` (x passed through the fused pool for the PFFN after it,
  ``pallas_kernels.jagged_pallas.jagged_gdpa_pool_proj_pallas(through=EPS)``: its query's
  LayerNorm statistics and its residual take their cotangents back to the pool's backward
  kernel), or None where the pool is not that kernel.
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
  score_clip: float | None = None   # clamp GDPA scores to [-c, c] (spec h-13); None/0: off
  time_buckets: BucketSpec | None = None   # per-head key bucket embeddings (b.5-2); None: off
  pass_tokens: bool = False

  @nn.compact
  def __call__(self, s, lengths, age=None):
    """``s``: ``[B, T, d]`` or a packed tower (``kunlun.nn.packed.Packed``, ``age f32[N]``)."""
    y, tokens = self._pool(s, lengths, age)
    return (y, tokens) if self.pass_tokens else y

  def _pool(self, s, lengths, age):
    """``(summary, tokens or None)`` (``pass_tokens``)."""
    jag = s.jag if packed.is_packed(s) else None
    if jag is not None:
      s = s.value
      if self.t_max is None:
        raise ValueError("HSP: a packed tower needs t_max (the tower's kept length)")
    d = s.shape[-1]
    if d % self.heads:
      raise ValueError(f"HSP: heads={self.heads} does not divide width d={d}")
    per_head(self.activation, self.heads)
    H, dt = self.heads, self.dtype
    with jax.named_scope("HSP"):
      e = self.param("seeds", with_axes(nn.initializers.normal(0.02), ("seeds", "embed")),
                     (self.n_seed, d), F32)
      q = _seed_queries(self, e, H, dt, self.backend)
      gdpa = dict(activation=self.activation, out_scale=1.0 / (self.t_max or s.shape[1]),
                  score_clip=self.score_clip)
      if jag is not None and packed.fusable(self.backend, d, H, dt):
        # two weight operands, cast here (the kernels read them in dt): no stacking pass, and
        # the optimizer's 16-bit copies stand in for the casts
        ws = tuple(_head_weights(self, n, d, H).astype(dt) for n in ("key", "value"))
        if self.time_buckets is None:        # norm -> k, v -> pool: one pass (k, v stored)
          if self.pass_tokens:
            o, *tokens = packed.gdpa_pool_proj(q, s, ws, jag, through=EPS, **gdpa)
            return self._tail(o, d, e), tuple(tokens)
          return self._tail(packed.gdpa_pool_proj(q, s, ws, jag, **gdpa), d, e), None
        k, v = packed.fused_proj(s, ws, jag, dtype=dt)                # norm -> k, v: one pass
      else:
        hk, hv = apart(rms_norm(s, dtype=dt), 2)         # k and v: their own buffers
        k, v = _to_heads(self, "key", hk, H, dt), _to_heads(self, "value", hv, H, dt)
      k = add_bucket_embedding(self, "time_bucket_k", k, age, lengths, self.time_buckets, jag)
      if jag is not None:
        o = packed.gdpa_pool(q, k, v, jag, backend=self.backend, **gdpa)      # [B, S, H, dh]
      else:
        k = shard(k, ("batch", "seq", "heads", "head_dim"))
        v = shard(v, ("batch", "seq", "heads", "head_dim"))
        o = gdpa_op(q[None], k, v, kv_lengths=lengths, broadcast_q=True, backend=self.backend,
                    seq="kv", **gdpa)
      return self._tail(o, d, e), None

  def _tail(self, o, d, e):
    """The pooled ``o [B, S, H, D]`` -> ``[B, n_sum, out_dim or d]``: output projection, then
    ``rms_norm(e + o W_o)`` and the seeds' Kronecker map (``SumKronLinear``)."""
    o = shard(o, ("batch", "seeds", "heads", "head_dim"))
    a = _from_heads(self, "out", o, d, self.dtype, self.backend)
    return SumKronLinear(self.n_sum, self.rank, self.out_dim, self.dtype, self.backend,
                         name="kron")(a, seeds=e)


class PMA(nn.Module):
  """Pooling by multi-head attention (InterFormer's PMA; HSP ablation).

  ``n_sum`` learnable queries softmax-attend to the valid events: ``Y = E + MHA(E, s)``, then
  a linear map to ``out_dim`` when given. ``(s [B, T, d], lengths) -> [B, n_sum, out_dim or d]``
  (or a packed tower, ``__call__``); an empty sequence gives ``Y = E``-based output.
  ``time_buckets``: key bucket embeddings as HSP.
  """
  n_sum: int
  heads: int
  out_dim: int | None = None
  dtype: Any = F32
  time_buckets: BucketSpec | None = None

  @nn.compact
  def __call__(self, s, lengths, age=None):
    """``s``: ``[B, T, d]`` or a packed tower (``kunlun.nn.packed.Packed``, ``age f32[N]``):
    each example's softmax runs over its own tokens (``jagged_softmax_pool``)."""
    jag = s.jag if packed.is_packed(s) else None
    if jag is not None:
      s = s.value
    d = s.shape[-1]
    if d % self.heads:
      raise ValueError(f"PMA: heads={self.heads} does not divide width d={d}")
    H, dt = self.heads, self.dtype
    with jax.named_scope("PMA"):
      e = self.param("queries", with_axes(nn.initializers.normal(0.02), ("seeds", "embed")),
                     (self.n_sum, d), F32)
      q = _to_heads(self, "query", rms_norm(e), H, dt)
      hs = rms_norm(s, dtype=dt)
      k, v = _to_heads(self, "key", hs, H, dt), _to_heads(self, "value", hs, H, dt)
      k = add_bucket_embedding(self, "time_bucket_k", k, age, lengths, self.time_buckets, jag)
      if jag is not None:
        o = packed.softmax_pool(q, k, v, jag)                                 # [B, S, H, dh]
      else:
        B, T = s.shape[:2]
        valid = jnp.arange(T)[None, :] < jnp.asarray(lengths, jnp.int32)[:, None]  # [B, T]
        mask = jnp.broadcast_to(valid[:, None, :], (B, self.n_sum, T))
        o = masked_softmax_attention(jnp.broadcast_to(q[None], (B,) + q.shape), k, v, mask)
      h = e + _from_heads(self, "out", o, d, dt).astype(F32)
      if self.out_dim:
        w = self.param("final", with_axes(nn.initializers.lecun_normal(), ("embed", None)),
                       (d, self.out_dim), F32)
        h = jnp.einsum("bnd,de->bne", rms_norm(h).astype(dt), w.astype(dt))
      return shard(h, ("batch", "seeds", "embed"))
