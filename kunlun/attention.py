"""Sequence self-attention of an event tower (spec c.4, h-4, h-5, h-12).

``h = RMSNorm(s)``; ``q, k, v = h W_qkv`` (``[B, T, H, d_h]``); QK-norm (RMSNorm over ``d_h`` with a
learned per-channel scale); rotary time encoding (ROTE on half the heads, positional RoPE on the
rest); bidirectional attention; ``s' = s + o W_o``; rows ``>= lengths`` are zero. With
``time_buckets`` the queries get per-head additive time/position bucket embeddings (spec b.5-2,
``kunlun.time_encoding``) after the QK-norm and before the rotary encoding.

Scopes (``kind``):
  * ``"swa"``: ``|i - j| <= window``. Softmax runs as a banded computation (chunks of
    ``c >= window`` queries see their own and both neighbouring chunks; cost ``O(T * 3c)``).
  * ``"block"``: independent ``block_size`` blocks via ``pallas_kernels.block_attention``
    (``T`` is padded internally to a multiple of ``block_size``).
  * ``"full"``: every valid key (short sequences).

``activation="softmax"`` or a GDPA activation (name or per-head tuple), then through
``kunlun.gdpa.gdpa`` with ``out_scale = 1/n``, ``n`` the most keys a query can see: ``T`` for
"full", ``min(T, 2 window + 1)`` for "swa" (the kernel uses ``1/block_size`` for "block").
``t_max`` overrides ``n`` (set it to the kept length to make outputs independent of padding).
``score_clip`` clamps the scores of a GDPA activation to ``[-c, c]`` first (spec h-13; softmax
scores are never clipped).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

import pallas_kernels
from kunlun.gdpa import gdpa
from kunlun.norms import rms_norm
from kunlun.time_encoding import BucketSpec, add_bucket_embedding, rotary_time
from pallas_kernels.activations import per_head
from pallas_kernels.reference import apply_rotary
from sharding import context, shard, with_axes

F32 = jnp.float32
KINDS = ("swa", "block", "full")
_ACT_AXES = ("batch", "seq", "heads", "head_dim")


def masked_softmax_attention(q, k, v, mask):
  """Masked softmax attention, ``[..., Tq, H, D]`` output.

  ``q [..., Tq, H, D]``, ``k, v [..., Tk, H, D]``, ``mask bool[..., Tq, Tk]``.

  Scores and softmax in float32 with scale ``1/sqrt(D)``; rows without a valid key give zeros.
  """
  D = q.shape[-1]
  s = jnp.einsum("...qhd,...khd->...hqk", q, k, preferred_element_type=F32) * D ** -0.5
  m = mask[..., None, :, :]
  s = jnp.where(m, s, -jnp.inf)
  mx = jnp.max(s, axis=-1, keepdims=True)
  e = jnp.where(m, jnp.exp(s - jnp.where(jnp.isfinite(mx), mx, 0.0)), 0.0)
  den = jnp.sum(e, axis=-1, keepdims=True)
  p = e / jnp.where(den > 0, den, 1.0)
  return jnp.einsum("...hqk,...khd->...qhd", p.astype(v.dtype), v,
                    preferred_element_type=F32).astype(q.dtype)


def banded_softmax_attention(q, k, v, lengths, window: int, chunk: int):
  """Softmax attention restricted to ``|i - j| <= window`` and valid keys, in ``O(T * 3 chunk)``.

  ``q, k, v [B, T, H, D]``, ``lengths i32[B]``, ``chunk >= window``. Rows of chunk ``n`` see
  keys of chunks ``n - 1, n, n + 1``, which cover the whole band.
  """
  if chunk < window:
    raise ValueError(f"chunk {chunk} must be >= window {window}")
  B, T, H, D = q.shape
  nb = -(-T // chunk)
  pad = nb * chunk - T
  padt = lambda x: jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))
  blk = lambda x: padt(x).reshape(B, nb, chunk, H, D)
  qb = blk(q)
  nbr = lambda x: jnp.pad(blk(x), ((0, 0), (1, 1), (0, 0), (0, 0), (0, 0)))
  three = lambda x: jnp.concatenate([x[:, :-2], x[:, 1:-1], x[:, 2:]], axis=2)   # [B, nb, 3c, H, D]
  kx, vx = three(nbr(k)), three(nbr(v))
  qpos = jnp.arange(nb * chunk).reshape(nb, chunk)                                 # [nb, c]
  kpos = (jnp.arange(nb)[:, None] - 1) * chunk + jnp.arange(3 * chunk)[None, :]    # [nb, 3c]
  band = jnp.abs(qpos[:, :, None] - kpos[:, None, :]) <= window                    # [nb, c, 3c]
  kval = (kpos[None] >= 0) & (kpos[None] < jnp.asarray(lengths, jnp.int32)[:, None, None])
  mask = band[None] & kval[:, :, None, :]                                          # [B, nb, c, 3c]
  o = masked_softmax_attention(qb, kx, vx, mask)
  return o.reshape(B, nb * chunk, H, D)[:, :T]


class SeqAttention(nn.Module):
  """``(s [B, T, d], lengths i32[B], age f32[B, T]) -> [B, T, d]`` (pre-norm, residual)."""
  heads: int
  kind: str = "swa"
  window: int = 64
  block_size: int = 64
  activation: Any = "softmax"
  qk_norm: bool = True
  rotary: bool = True
  backend: str = "xla"
  t_scale: float = 60.0
  t_max: int | None = None
  dtype: Any = F32
  score_clip: float | None = None   # GDPA activations: clamp scores to [-c, c]; softmax: unused
  time_buckets: BucketSpec | None = None   # per-head query bucket embeddings (b.5-2); None: off

  def _check(self, d):
    if self.kind not in KINDS:
      raise ValueError(f"SeqAttention.kind={self.kind!r}; allowed: {KINDS}")
    if d % self.heads:
      raise ValueError(f"SeqAttention: heads={self.heads} does not divide width d={d}")
    if self.rotary and (d // self.heads) % 2:
      raise ValueError(f"SeqAttention: rotary needs an even head_dim, got {d // self.heads}")
    if self.kind == "swa" and self.window < 0:
      raise ValueError(f"SeqAttention.window must be >= 0, got {self.window}")
    if self.kind == "block" and self.block_size < 1:
      raise ValueError(f"SeqAttention.block_size must be >= 1, got {self.block_size}")
    if self.activation != "softmax":
      try:
        per_head(self.activation, self.heads)
      except ValueError as e:
        raise ValueError(f"SeqAttention.activation: {e} (or 'softmax')") from None

  @nn.compact
  def __call__(self, s, lengths, age):
    B, T, d = s.shape
    self._check(d)
    H, dh = self.heads, d // self.heads
    lengths = jnp.asarray(lengths, jnp.int32)
    with jax.named_scope("SeqAttention"):
      h = rms_norm(s).astype(self.dtype)
      w_qkv = self.param("qkv", with_axes(nn.initializers.lecun_normal(0, (1, 2, 3)),
                                          ("embed", None, "heads", "head_dim")), (d, 3, H, dh), F32)
      qkv = jnp.einsum("btd,dihc->btihc", h, w_qkv.astype(self.dtype))
      q, k, v = (shard(qkv[:, :, i], _ACT_AXES) for i in range(3))
      if self.qk_norm:
        sc = lambda n: self.param(n, with_axes(nn.initializers.ones, ("head_dim",)), (dh,), F32)
        q = (rms_norm(q) * sc("q_scale")).astype(self.dtype)
        k = (rms_norm(k) * sc("k_scale")).astype(self.dtype)
      q = add_bucket_embedding(self, "time_bucket_q", q, age, lengths, self.time_buckets)
      rot = rotary_time(age, H, dh, self.t_scale) if self.rotary else None
      o = self._attend(q, k, v, lengths, rot, T)
      o = shard(o, _ACT_AXES)
      w_o = self.param("out", with_axes(nn.initializers.lecun_normal((0, 1), 2),
                                        ("heads", "head_dim", "embed")), (H, dh, d), F32)
      out = jnp.einsum("bthc,hcd->btd", o.astype(self.dtype), w_o.astype(self.dtype))
      y = s.astype(F32) + out.astype(F32)
      valid = jnp.arange(T)[None, :] < lengths[:, None]
      y = jnp.where(valid[..., None], y, 0.0).astype(s.dtype)
      return shard(y, ("batch", "seq", "embed"))

  def _attend(self, q, k, v, lengths, rot, T):
    if self.kind == "block":
      bs = self.block_size
      pad = -T % bs
      if pad:
        padt = lambda x: jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
        q, k, v = padt(q), padt(k), padt(v)
        rot = None if rot is None else (padt(rot[0]), padt(rot[1]))
      if self.backend == "xla":
        o = pallas_kernels.block_attention(q, k, v, block_size=bs, activation=self.activation,
                                           lengths=lengths, rotary=rot, backend=self.backend,
                                           score_clip=self.score_clip)
      else:                            # kernel per shard; blocks never straddle context shards
        o = context.block_attention(q, k, v, lengths, block_size=bs, activation=self.activation,
                                    rotary=rot, backend=self.backend,
                                    score_clip=self.score_clip)
      return o[:, :T]
    if rot is not None:
      q, k = apply_rotary(q, rot), apply_rotary(k, rot)
    window = self.window if self.kind == "swa" else None
    if self.activation != "softmax":
      n = self.t_max or (T if window is None else min(T, 2 * window + 1))
      return gdpa(q, k, v, activation=self.activation, out_scale=1.0 / n, q_lengths=lengths,
                  kv_lengths=lengths, window=window, backend=self.backend,
                  score_clip=self.score_clip)
    chunk = max(self.window, 16)
    if window is None or T <= 3 * chunk:
      i = jnp.arange(T)
      m = (i[None, :] < lengths[:, None])[:, None, :]                             # keys [B,1,T]
      if window is not None:
        m = m & (jnp.abs(i[:, None] - i[None, :]) <= window)[None]
      return masked_softmax_attention(q, k, v, jnp.broadcast_to(m, (q.shape[0], T, T)))
    return banded_softmax_attention(q, k, v, lengths, window, chunk)


