"""InterFormer (arXiv 2411.09852; spec A.1, h-17), the baseline Kunlun is measured against.
Layer ``l``: ``X^l [B, N_ns, d_ns]`` and per stream ``S_e^l [B, n_cls + T_e, d_e]`` (CLS tokens
first). Notes: docs/architecture.md, ``kunlun/models/interformer.py``."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from data.schema import Schema
from kunlun.configs.types import ModelConfig
from kunlun.models.dhen import DHEN
from kunlun.nn.attention import masked_softmax_attention
from kunlun.nn.hsp import PMA
from kunlun.nn.inputs import LCE
from kunlun.nn.layer import COMPUTE_DTYPES
from kunlun.nn.norms import rms_norm
from kunlun.nn.stages import apply_heads, embed_context, embed_streams
from kunlun.nn.time_encoding import rope_frequencies
from pallas_kernels.reference import apply_rotary
from sharding import shard, with_axes

F32 = jnp.float32
_SEQ = ("batch", "seq", "embed")
_TOK = ("batch", "tokens", "embed")


def _dense(features, axes, dtype, name, use_bias=True, bias_init=nn.initializers.zeros,
           kernel_init=None):
  return nn.Dense(features, use_bias=use_bias, dtype=dtype, param_dtype=F32, name=name,
                  kernel_init=with_axes(kernel_init or nn.initializers.lecun_normal(), axes),
                  bias_init=with_axes(bias_init, axes[-1:]))


def valid_rows(T: int, lengths):
  """``bool[B, T]``: row ``t`` is valid when ``t < lengths``."""
  return jnp.arange(T)[None, :] < jnp.asarray(lengths, jnp.int32)[:, None]


def recent_tokens(s, lengths, n_cls: int, n_recent: int):
  """The ``n_recent`` most recent events of ``s [B, n_cls + T, d]`` (events valid at
  ``[n_cls, n_cls + lengths)``, oldest first), oldest of them first: ``[B, n_recent, d]``; slots
  without an event (``lengths < n_recent``) are zero."""
  j = jnp.asarray(lengths, jnp.int32)[:, None] - n_recent + jnp.arange(n_recent)[None, :]
  idx = jnp.clip(n_cls + j, 0, s.shape[1] - 1)
  out = jnp.take_along_axis(s, idx[:, :, None], axis=1)
  return jnp.where((j >= 0)[:, :, None], out, 0).astype(s.dtype)


def rope(T: int, head_dim: int):
  """Positional RoPE ``(cos, sin)``, each ``f32[1, T, head_dim // 2]`` (half-split convention of
  ``pallas_kernels.reference.apply_rotary``)."""
  ang = jnp.arange(T, dtype=F32)[:, None] * rope_frequencies(head_dim)[None, :]
  return jnp.cos(ang)[None], jnp.sin(ang)[None]


class Gate(nn.Module):
  """``Gate(Z) = sigmoid(Z W + b) * Z``, token-wise: ``[..., d] -> [..., d]``."""
  dtype: Any = F32

  @nn.compact
  def __call__(self, z):
    g = _dense(z.shape[-1], ("embed", None), self.dtype, "dense")(z.astype(self.dtype))
    return (jax.nn.sigmoid(g.astype(F32)) * z.astype(F32)).astype(self.dtype)


class CrossSeq(nn.Module):
  """``(s [B, n_cls + T, d], lengths i32[B] (events)) -> S_sum [B, n_cls + n_pma + n_recent, d]``:
  ``Gate([CLS || PMA(s) || recent(s)])``; PMA attends to every valid token (CLS included)."""
  n_cls: int
  n_pma: int
  n_recent: int
  heads: int
  dtype: Any = F32

  @nn.compact
  def __call__(self, s, lengths):
    with jax.named_scope("CrossArch"):
      parts = [s[:, :self.n_cls],
               PMA(self.n_pma, self.heads, dtype=self.dtype, name="pma")(
                   s, self.n_cls + jnp.asarray(lengths, jnp.int32)).astype(s.dtype)]
      if self.n_recent:
        parts.append(recent_tokens(s, lengths, self.n_cls, self.n_recent))
      return shard(Gate(self.dtype, name="gate")(jnp.concatenate(parts, axis=1)), _TOK)


class PersonalizedFFN(nn.Module):
  """InterFormer's PFFN: ``(s [B, T, d], x_sum [B, n, d_x], valid bool[B, T]) -> [B, T, d]``,
  ``RMSNorm(s) W(x_sum)`` with ``W = reshape(GELU(flatten(RMSNorm(x_sum)) A + a) G + g, [d, d])``
  (``A [n d_x, hidden]``, ``G [hidden, d d]``, ``g`` starts at ``vec(I)``); padded rows zero."""
  hidden: int
  dtype: Any = F32

  @nn.compact
  def __call__(self, s, x_sum, valid):
    B, T, d = s.shape
    dt = self.dtype
    with jax.named_scope("PFFN_generated"):
      h = rms_norm(x_sum).reshape(B, -1).astype(dt)
      h = nn.gelu(_dense(self.hidden, (None, "mlp"), dt, "gen_hidden")(h))
      eye = lambda key, shape, dtype=F32: jnp.eye(d, dtype=dtype).reshape(shape)
      w = _dense(d * d, ("mlp", None), dt, "gen_out", bias_init=eye,
                 kernel_init=nn.initializers.normal(0.1 * self.hidden ** -0.5))(h)
      w = shard(w.reshape(B, d, d), ("batch", "embed", None))
      y = jnp.einsum("btd,bde->bte", rms_norm(s).astype(dt), w)
      return shard(jnp.where(valid[..., None], y, 0).astype(s.dtype), _SEQ)


class RoPEAttention(nn.Module):
  """Full multi-head softmax self-attention with positional RoPE, pre-norm and residual:
  ``(s [B, T, d], valid bool[B, T]) -> s + Attn(RMSNorm(s)) W_o``; padded rows zero."""
  heads: int
  dtype: Any = F32

  @nn.compact
  def __call__(self, s, valid):
    B, T, d = s.shape
    if d % self.heads or (d // self.heads) % 2:
      raise ValueError(f"RoPEAttention: heads={self.heads} must divide d={d} into an even "
                       "head_dim")
    H, dh, dt = self.heads, d // self.heads, self.dtype
    with jax.named_scope("MHA"):
      w_qkv = self.param("qkv", with_axes(nn.initializers.lecun_normal(0, (1, 2, 3)),
                                          ("embed", None, "heads", "head_dim")), (d, 3, H, dh), F32)
      qkv = jnp.einsum("btd,dihc->btihc", rms_norm(s).astype(dt), w_qkv.astype(dt))
      rot = rope(T, dh)
      q, k = apply_rotary(qkv[:, :, 0], rot), apply_rotary(qkv[:, :, 1], rot)
      mask = jnp.broadcast_to(valid[:, None, :], (B, T, T))
      o = masked_softmax_attention(q, k, qkv[:, :, 2], mask)
      o = shard(o, ("batch", "seq", "heads", "head_dim"))
      w_o = self.param("out", with_axes(nn.initializers.lecun_normal((0, 1), 2),
                                        ("heads", "head_dim", "embed")), (H, dh, d), F32)
      y = s.astype(F32) + jnp.einsum("bthc,hcd->btd", o.astype(dt), w_o.astype(dt)).astype(F32)
      return shard(jnp.where(valid[..., None], y, 0).astype(s.dtype), _SEQ)


class CrossX(nn.Module):
  """``X_sum = Gate(LCE(x))``: ``x [B, N_ns, d_ns] -> [B, n_cls, d_ns]``."""
  n_cls: int
  dtype: Any = F32

  @nn.compact
  def __call__(self, x):
    with jax.named_scope("CrossArch"):
      return shard(Gate(self.dtype, name="gate")(LCE(self.n_cls, self.dtype, name="lce")(x)), _TOK)


def cross_seq(cfg: ModelConfig, tower, dt, name: str):
  i = cfg.interformer
  return CrossSeq(i.n_cls, tower.n_sum, i.n_recent, tower.heads, dt, name=name)


class InterFormerLayer(nn.Module):
  """``(x [B, N_ns, d_ns], seqs {e: [B, n_cls + T_e, d_e]}, lengths {e: i32[B]})``
  -> ``(x', seqs')``."""
  cfg: ModelConfig
  index: int

  @nn.compact
  def __call__(self, x, seqs, lengths):
    cfg, dt = self.cfg, COMPUTE_DTYPES[self.cfg.dtype]
    n_cls = cfg.interformer.n_cls
    with jax.named_scope(f"InterFormerLayer_{self.index}"):
      x_sum = CrossX(n_cls, dt, name="x_cross")(x)
      tokens = [x.astype(dt)]
      for t in cfg.towers:
        s_sum = cross_seq(cfg, t, dt, f"{t.name}_cross")(seqs[t.name], lengths[t.name])
        tokens.append(_dense(cfg.d_ns, ("embed", None), dt, f"{t.name}_proj", use_bias=False)(
            s_sum))
      z = shard(jnp.concatenate(tokens, axis=1), _TOK)
      m = cfg.mowe
      x_new = DHEN(m.layers_per_expert, cfg.n_ns, m.rank, m.mlp_hidden, dt, name="dhen")(z)
      out = {}
      for t in cfg.towers:
        s = seqs[t.name]
        valid = valid_rows(s.shape[1], n_cls + jnp.asarray(lengths[t.name], jnp.int32))
        s = PersonalizedFFN(cfg.d_ns, dt, name=f"{t.name}_pffn")(s, x_sum, valid)
        out[t.name] = RoPEAttention(t.heads, dt, name=f"{t.name}_mha")(s, valid)
      return x_new, out


class InterFormer(nn.Module):
  """``apply({"params": p}, batch, train) -> logits f32[B, K]``; ``method="representations"`` ->
  ``{"pooled", "summaries" {stream: S_sum^L [B, n_cls + n_sum + n_recent, d_e]}, "logits"}``."""
  cfg: ModelConfig
  schema: Schema

  def __call__(self, batch, train: bool = False):
    return self.representations(batch, train)["logits"]

  @nn.compact
  def representations(self, batch, train: bool = False):
    del train
    cfg, dt = self.cfg, COMPUTE_DTYPES[self.cfg.dtype]
    with jax.named_scope("InterFormer"):
      x = embed_context(cfg, self.schema, batch, dt)
      ev, lengths, _ = embed_streams(cfg.towers, self.schema, batch, dt, cfg.num_time_buckets)
      x_sum0 = CrossX(cfg.interformer.n_cls, dt, name="cls_cross")(x)
      seqs = {}
      for t in cfg.towers:                                   # the first X_sum as CLS tokens
        cls = _dense(t.width, ("embed", None), dt, f"cls_{t.name}", use_bias=False)(x_sum0)
        seqs[t.name] = shard(jnp.concatenate([cls.astype(dt), ev[t.name].astype(dt)], 1), _SEQ)
      for l in range(cfg.num_layers):
        x, seqs = InterFormerLayer(cfg, l, name=f"layer_{l}")(x, seqs, lengths)
      x_sum = CrossX(cfg.interformer.n_cls, dt, name="final_x_cross")(x)
      s_sum = {t.name: cross_seq(cfg, t, dt, f"final_{t.name}_cross")(seqs[t.name],
                                                                       lengths[t.name])
               for t in cfg.towers}
      return apply_heads(cfg, x_sum, s_sum, batch["surface"], dt)
