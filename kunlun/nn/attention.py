"""Sequence self-attention of an event tower (spec c.4, h-4, h-5, h-12):
``(s [B, T, d], lengths i32[B], age f32[B, T]) -> [B, T, d]``, pre-norm and residual, with
QK-norm, rotary time encoding and kinds "swa" / "block" / "full" (``q, k, v [B, T, H, d_h]``).
Notes: docs/architecture.md, ``kunlun/nn/attention.py``."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

import pallas_kernels
from kunlun.configs.types import BucketSpec
from kunlun.nn import packed
from kunlun.nn.fused import apart, masked_residual, masked_residual_pass, qk_norm_rotary
from kunlun.nn.gdpa import gdpa_op
from kunlun.nn.norms import rms_norm
from kunlun.nn.time_encoding import bucket_embedding, rotary_time
from pallas_kernels.activations import per_head
from pallas_kernels.reference import (  # noqa: F401  (re-exported: apply_rotary, masked_...)
  apply_rotary,
  band_chunk,
  masked_softmax_attention,
  softmax_attention_reference,
)
from sharding import context, shard, with_axes

F32 = jnp.float32
KINDS = ("swa", "block", "full")
_ACT_AXES = ("batch", "seq", "heads", "head_dim")


def banded_softmax_attention(q, k, v, lengths, window: int, chunk: int | None = None):
  """Softmax attention restricted to ``|i - j| <= window`` and valid keys, in ``O(T * 3c)``
  (``pallas_kernels.reference.softmax_attention_reference``; ``chunk`` is its ``band_chunk``).

  ``q, k, v [B, T, H, D]``, ``lengths i32[B]``.
  """
  if chunk is not None and chunk != band_chunk(window):
    raise ValueError(f"chunk {chunk}: the banded path uses band_chunk(window) = "
                     f"{band_chunk(window)}")
  return softmax_attention_reference(q, k, v, window=window, q_lengths=lengths,
                                     kv_lengths=lengths)


def softmax_attention_op(q, k, v, lengths, window: int | None, backend: str):
  """Bidirectional softmax self-attention over valid keys (``window``: the band ``|i - j| <=
  window``; None: full). ``backend`` as ``pallas_kernels.softmax_attention`` ("auto" resolved
  here); "xla" is the banded reference, left to XLA's SPMD partitioner; kernel backends run per
  shard through ``sharding.context`` when the mesh splits the operands."""
  if backend == "auto":
    backend = pallas_kernels.api.select_backend("softmax_attention", q.shape[1], k.shape[1],
                                                window=window, dtype=q.dtype,
                                                head_dim=q.shape[-1])
  if backend == "xla":
    return softmax_attention_reference(q, k, v, window=window, q_lengths=lengths,
                                       kv_lengths=lengths)
  return context.context_parallel_softmax_attention(q, k, v, lengths, window, backend=backend)


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
    """``s``: ``[B, T, d]`` or a packed tower (``kunlun.nn.packed.Packed``, ``age f32[N]``)."""
    jag = s.jag if packed.is_packed(s) else None
    x = s if jag is None else s.value
    d = x.shape[-1]
    self._check(d)
    H, dh = self.heads, d // self.heads
    with jax.named_scope("SeqAttention"):
      h = rms_norm(x, dtype=self.dtype)
      w_qkv = self.param("qkv", with_axes(nn.initializers.lecun_normal(0, (1, 2, 3)),
                                          ("embed", None, "heads", "head_dim")), (d, 3, H, dh), F32)
      w = w_qkv.astype(self.dtype)        # q, k, v as three projections: separate buffers
      sc = lambda n: (self.param(n, with_axes(nn.initializers.ones, ("head_dim",)), (dh,), F32)
                      if self.qk_norm else None)
      if jag is not None:
        return packed.Packed(self._packed(x, h, jag, age, w, sc), jag)
      B, T, _ = s.shape
      lengths = jnp.asarray(lengths, jnp.int32)
      q, k, v = (shard(jnp.einsum("btd,dhc->bthc", hi, w[:, i]), _ACT_AXES)
                 for i, hi in enumerate(apart(h, 3)))
      emb = bucket_embedding(self, "time_bucket_q", q, age, lengths, self.time_buckets)
      rot, rot_age = None, age if self.rotary else None
      if self.rotary and self.kind == "block":         # the block kernel rotates in-kernel
        rot, rot_age = rotary_time(age, H, dh, self.t_scale), None
      q = qk_norm_rotary(q, sc("q_scale"), rot_age, dtype=self.dtype, t_scale=self.t_scale,
                         emb=emb)
      k = qk_norm_rotary(k, sc("k_scale"), rot_age, dtype=self.dtype, t_scale=self.t_scale)
      o = self._attend(q, k, v, lengths, rot, T)
      o = shard(o, _ACT_AXES)
      out = jnp.einsum("bthc,hcd->btd", o.astype(self.dtype), self._w_out(H, dh, d))
      return shard(masked_residual(s, out, lengths), ("batch", "seq", "embed"))

  def _w_out(self, H, dh, d):
    w_o = self.param("out", with_axes(nn.initializers.lecun_normal((0, 1), 2),
                                      ("heads", "head_dim", "embed")), (H, dh, d), F32)
    return w_o.astype(self.dtype)

  def _packed(self, x, h, jag, age, w, sc):
    """A packed tower: ``x [N, d]``, ``h = rms_norm(x)``, ``age f32[N]`` -> ``[N, d]``; the
    rotation (by ``age`` and the tokens' ``pos``) happens before the jagged op for every kind."""
    if self.kind != "block" and self.activation != "softmax":
      raise ValueError(f"attention.kind = {self.kind!r} with activation {self.activation!r} has "
                       "no jagged op (packed towers: softmax, or kind 'block')")
    d = x.shape[-1]
    if self._fused_input(d) and self.kind != "block" and packed.fuse_qkv_attention(
        self.backend, d, self.heads, self.dtype):       # and the attention: one backward kernel
      o, xr = packed.fused_qkv_attention(x, w, sc("q_scale"), sc("k_scale"), age, jag,
                                         window=self.window if self.kind == "swa" else None,
                                         t_scale=self.t_scale, dtype=self.dtype)
      return self._packed_out(xr, o, jag, fused=True)
    if self._fused_input(d):      # norm -> q / k / v -> QK-norm -> rotary in one pass
      q, k, v, xr = packed.fused_qkv(x, w, sc("q_scale"), sc("k_scale"), age, jag,
                                     t_scale=self.t_scale, dtype=self.dtype)
      return self._packed_attend(xr, q, k, v, jag, fused=True)
    q, k, v = (jnp.einsum("nd,dhc->nhc", hi, w[:, i]) for i, hi in enumerate(apart(h, 3)))
    emb = bucket_embedding(self, "time_bucket_q", q, age, None, self.time_buckets, jag)
    # as one row [1, N, H, dh]: the rotation by age and the tokens' pos, angles recomputed in
    # the backward (kunlun.nn.fused.rotary)
    age_r, pos_r = (jnp.asarray(age, F32)[None], jag.pos[None]) if self.rotary else (None, None)
    prep = lambda a, name, e=None: qk_norm_rotary(
        a[None], sc(name), age_r, dtype=self.dtype, t_scale=self.t_scale,
        emb=None if e is None else e[None], positions=pos_r)[0]
    q, k = prep(q, "q_scale", emb), prep(k, "k_scale")
    return self._packed_attend(x, q, k, v, jag)

  def _fused_input(self, d) -> bool:
    """Whether the packed input side runs as ``pallas_kernels.norm_qkv``'s kernels: the Pallas
    backend, QK-norm and rotary on, no query bucket embedding, widths the kernels take."""
    return (self.qk_norm and self.rotary and self.time_buckets is None
            and packed.fusable(self.backend, d, self.heads, self.dtype))

  def _packed_attend(self, x, q, k, v, jag, fused=False):
    """The jagged attention of rotated ``q, k`` and ``v [N, H, D]``, projected out and added to
    ``x [N, d]``. ``fused``: ``x`` is the fused input side's pass-through, whose cotangent goes
    on unmasked (``kunlun.nn.fused.masked_residual_pass``), the projection and the add one Pallas
    pass where the widths fit (``packed.fused_out``)."""
    if self.kind == "block":
      o = packed.block_attention(q, k, v, jag, backend=self.backend, block_size=self.block_size,
                                 activation=self.activation, score_clip=self.score_clip)
    else:
      o = packed.softmax_attention(q, k, v, jag, backend=self.backend,
                                   window=self.window if self.kind == "swa" else None)
    return self._packed_out(x, o, jag, fused)

  def _packed_out(self, x, o, jag, fused=False):
    """``x + o w_out`` (``o [N, H, D]``), each block's tail zero (``_packed_attend``)."""
    d = x.shape[-1]
    H, dh = self.heads, d // self.heads
    w_o = self._w_out(H, dh, d)
    if fused and packed.fuse_out(self.backend, H * dh, d):
      return packed.fused_out(x, o, w_o, jag, dtype=self.dtype)
    out = jnp.einsum("nhc,hcd->nd", o.astype(self.dtype), w_o)
    return packed.rowwise(masked_residual_pass if fused else masked_residual, jag, x, out)

  def _attend(self, q, k, v, lengths, rot, T):
    """The attention proper (q, k already rotated unless ``kind="block"``, whose kernel rotates
    with ``rot``)."""
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
    window = self.window if self.kind == "swa" else None
    if self.activation != "softmax":
      n = self.t_max or (T if window is None else min(T, 2 * window + 1))
      return gdpa_op(q, k, v, activation=self.activation, out_scale=1.0 / n, q_lengths=lengths,
                  kv_lengths=lengths, window=window, backend=self.backend,
                  score_clip=self.score_clip)
    with jax.named_scope("SoftmaxAttention"):
      return softmax_attention_op(q, k, v, lengths, window, self.backend)
