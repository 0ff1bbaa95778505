"""Input stage (spec b.2, b.4, c.0b): sparse and dense tokens, LCE, per-event embeddings.

Every embedding table is a parameter whose name starts with ``embedding`` and carries the logical
axes ``(table_rows, table_dim)``; all row look-ups go through ``_embed_many`` /
``sharding.embedding``, which batch a module's tables of equal width into one gather and one
backward segment-sum per group (table-batched embeddings) and swap in the sharded exchange under
a mesh.
"""

from __future__ import annotations

from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from data.schema import EventStream, SparseFeature
from kunlun.nn import packed
from kunlun.nn.activations import gelu
from kunlun.nn.dense import DenseParams, dense
from kunlun.nn.time_encoding import log_time_bucket
from pallas_kernels import event_mlp
from sharding import embedding as sharded_embedding
from sharding import shard, with_axes

F32 = jnp.float32


# Sparse embedding update (``config.train.sparse_embedding_update``, kunlun/train/step.py): when
# the train step applies the model with LOOKUP_IDS mutable, every table-group look-up
# (``_embed_many``) records the group ids it read (``sharding.embedding.group_ids``) in LOOKUP_IDS
# and adds a zero "tap" from ROW_TAPS to the flat rows it returns (flax ``Module.perturb``
# semantics: a pass with ROW_TAPS mutable creates the zero taps; a pass given them adds them), so
# the gradient w.r.t. the taps is dLoss/d(looked-up rows). Both collections mirror the params
# tree: entry ``<module path>/<key>`` with ``key`` the group's table names joined by "+"
# (``embedding_a+embedding_b``; one table: its own name). Init and every other apply
# (LOOKUP_IDS not mutable) are unaffected.
LOOKUP_IDS = "embedding_ids"
ROW_TAPS = "embedding_row_taps"
GROUP_SEP = "+"


def lookup(table, ids):
  """Rows of ``table [V, d]`` at ``ids i32[...]`` (in range; negative: zero rows) -> ``[..., d]``.

  With no mesh this is a plain gather. Under an active mesh + logical rules whose ``table_rows``
  shard the table, rows are fetched with the all-to-all id-bucket exchange of
  ``sharding.embedding.lookup`` (no table-sized collective; overflow falls back correctly).
  """
  return sharded_embedding.lookup(table, ids)


def _table(mod: nn.Module, name: str, rows: int, dim: int):
  init = nn.initializers.normal(stddev=dim ** -0.5)
  axes = ("table_rows", "table_dim")
  return mod.param(f"embedding_{name}", with_axes(init, axes), (rows, dim), F32)


def _embed_many(mod: nn.Module, specs, tap_dtype=F32):
  """Looks up ``specs = [(name, rows, dim, ids i32[...])]`` in ``mod``'s tables
  ``embedding_<name> [rows, dim]`` (negative ids: zero rows), batched per table group
  (``sharding.embedding.plan_groups``), with the sparse update's id record and row tap per group
  (see LOOKUP_IDS above). Returns the rows ``[..., dim]`` of each spec, in order (float32).
  ``tap_dtype``: the taps', so the row gradients' dtype. A caller whose rows' cotangents are
  values of a 16-bit dtype (each row rounded to it where it is read) takes that dtype: the
  sparse update reads half the bytes, and sums and applies them in float32."""
  tables = [_table(mod, name, rows, dim) for name, rows, dim, _ in specs]
  ids = [jnp.asarray(i, jnp.int32) for *_, i in specs]
  record = not mod.is_initializing() and mod.is_mutable_collection(LOOKUP_IDS)
  out = [None] * len(specs)
  for grp in sharded_embedding.plan_groups(tables):
    tg = [tables[i] for i in grp]
    gids = sharded_embedding.group_ids([ids[i] for i in grp], [t.shape[0] for t in tg])
    rows = sharded_embedding.lookup_flat(tg, gids)
    if record:
      key = GROUP_SEP.join(f"embedding_{specs[i][0]}" for i in grp)
      if mod.has_variable(LOOKUP_IDS, key):
        raise ValueError(f"table(s) {key!r} of {mod.name or type(mod).__name__} looked up twice "
                         "in one call; the sparse embedding update needs one lookup per table "
                         "per call")
      mod.put_variable(LOOKUP_IDS, key, gids)
      if mod.is_mutable_collection(ROW_TAPS):
        mod.put_variable(ROW_TAPS, key, jnp.zeros(rows.shape, tap_dtype))
      elif mod.has_variable(ROW_TAPS, key):
        rows = rows + mod.get_variable(ROW_TAPS, key)
    parts = sharded_embedding.split_rows(rows, [ids[i].shape for i in grp])
    for i, r in zip(grp, parts, strict=True):
      out[i] = r
  return out


def _embed(mod: nn.Module, name: str, rows: int, dim: int, ids):
  """``_embed_many`` for one table."""
  return _embed_many(mod, [(name, rows, dim, ids)])[0]


def _dense(features, axes, dtype, use_bias=False, name=None, init=None):
  init = init or nn.initializers.lecun_normal()
  return nn.Dense(features, use_bias=use_bias, dtype=dtype, param_dtype=F32, name=name,
                  kernel_init=with_axes(init, axes),
                  bias_init=with_axes(nn.initializers.zeros, axes[-1:]))


class SparseEmbed(nn.Module):
  """One table per sparse feature; multi-hot bags are mean-pooled over valid slots.

  ``sparse {name: i32[B, L]}`` -> ``f32[B, F_sparse, dim]``. Ids are wrapped ``% vocab_size``
  (hashed features); negative ids (``-1``) are empty slots; an all-empty bag gives zeros.
  """
  features: tuple[SparseFeature, ...]
  dim: int

  @nn.compact
  def __call__(self, sparse: dict[str, Any]):
    with jax.named_scope("SparseEmbed"):
      specs, weights = [], []
      for f in self.features:
        if f.name not in sparse:
          raise ValueError(f"sparse feature {f.name!r} missing from batch (has {sorted(sparse)})")
        ids = jnp.asarray(sparse[f.name], jnp.int32)
        if ids.ndim == 1:
          ids = ids[:, None]
        valid_bl = ids >= 0
        specs.append((f.name, f.vocab_size, self.dim, jnp.where(valid_bl, ids % f.vocab_size, -1)))
        weights.append(valid_bl.astype(F32))
      out = []
      for rows_bld, w_bl in zip(_embed_many(self, specs), weights, strict=True):
        n_b = jnp.sum(w_bl, axis=1, keepdims=True)
        out.append(jnp.einsum("bld,bl->bd", rows_bld, w_bl) / jnp.maximum(n_b, 1.0))
      x_bfd = jnp.stack(out, axis=1)
      return shard(x_bfd, ("batch", "tokens", "embed"))


class DenseTokens(nn.Module):
  """Dense features -> ``num_tokens`` tokens: signed log1p, per-feature learned affine, linear.

  ``dense f32[B, F]`` -> ``[B, num_tokens, dim]``. The normalisation is per example (no batch
  statistics), so eval and train agree and examples never influence each other.
  """
  num_tokens: int
  dim: int
  dtype: Any = F32

  @nn.compact
  def __call__(self, dense):
    with jax.named_scope("DenseTokens"):
      x = jnp.asarray(dense, F32)
      F = x.shape[-1]
      x = jnp.sign(x) * jnp.log1p(jnp.abs(x))
      scale = self.param("scale", with_axes(nn.initializers.ones, (None,)), (F,), F32)
      bias = self.param("bias", with_axes(nn.initializers.zeros, (None,)), (F,), F32)
      x = x * scale + bias
      y = _dense(self.num_tokens * self.dim, (None, "embed"), self.dtype, use_bias=True)(x)
      y = y.reshape(x.shape[0], self.num_tokens, self.dim)
      return shard(y, ("batch", "tokens", "embed"))


class LCE(nn.Module):
  """Linear compressed embedding: learned token-axis map ``X <- W^T X``.

  ``x [B, N_raw, d]`` -> ``[B, num_tokens, d]``, ``W [N_raw, num_tokens]``.
  """
  num_tokens: int
  dtype: Any = F32

  @nn.compact
  def __call__(self, x):
    with jax.named_scope("LCE"):
      n_raw = x.shape[1]
      w = self.param("w", with_axes(nn.initializers.normal(n_raw ** -0.5), ("tokens", None)),
                     (n_raw, self.num_tokens), F32)
      y = jnp.einsum("bnd,nm->bmd", x.astype(self.dtype), w.astype(self.dtype))
      return shard(y, ("batch", "tokens", "embed"))


def event_side_dim(dim: int) -> int:
  """Width of an event stream's side-field tables (action, surface, extras, time bucket)."""
  return max(dim // 4, 8)


class EventEmbed(nn.Module):
  """Per-event embedding of one stream (spec b.4).

  ``e_t = MLP(concat(E_item, E_action, E_surface, sum_f E_f, E_timebucket))``: the item table
  has width ``dim``; the low-cardinality side fields (action, surface, extra fields, time bucket)
  use ``side_dim = max(dim // 4, 8)`` [D: they carry far fewer bits than the item id, and full-width
  side tables made this per-event MLP ~24 T d^2 FLOPs, a quarter of the mid model]; a 2-layer GELU
  MLP (hidden ``dim``) maps the concat back to ``dim`` (``2 T d (concat + d)`` FLOPs).
  ``events`` holds ``item, action, surface, age, length`` and the stream's extra fields
  (``[B, T]`` each, ``length i32[B]``); returns ``[B, T, dim]`` with rows ``>= length`` set to
  zero, on the logical ``axes`` (a packed tower's ``[S, Ns, dim]`` blocks: ``PACKED_AXES``).
  """
  stream: EventStream
  num_surfaces: int
  dim: int
  num_time_buckets: int = 32
  dtype: Any = F32
  axes: tuple = ("batch", "seq", "embed")
  backend: str = "xla"     # "pallas" / "auto" on a GPU: a packed stream's MLP as one kernel pass

  PACKED_AXES: ClassVar[tuple] = ("blocks", None, "embed")

  @nn.compact
  def __call__(self, events: dict[str, Any]):
    with jax.named_scope("EventEmbed"):
      s = self.stream
      need = ("item", "action", "surface", "age", "length") + tuple(f.name for f in s.extra_fields)
      missing = [k for k in need if k not in events]
      if missing:
        raise ValueError(f"events[{s.name!r}] lacks fields {missing}")
      side = event_side_dim(self.dim)
      ids = lambda name, rows: jnp.asarray(events[name], jnp.int32) % rows
      specs = [("item", s.item_vocab, self.dim, ids("item", s.item_vocab)),
               ("action", s.action_vocab, side, ids("action", s.action_vocab)),
               ("surface", self.num_surfaces, side, ids("surface", self.num_surfaces))]
      specs += [(f.name, f.vocab_size, side, ids(f.name, f.vocab_size)) for f in s.extra_fields]
      specs.append(("time", self.num_time_buckets, side,
                    log_time_bucket(events["age"], self.num_time_buckets)))
      # the row gradients in dtype: each row is rounded to dtype where the concatenation reads it
      # (the extra fields after their float32 sum, whose cotangent each of them gets)
      rows = _embed_many(self, specs, tap_dtype=self.dtype)
      parts = rows[:3]
      if s.extra_fields:
        parts.append(sum(rows[3:-1]))
      parts.append(rows[-1])
      # in the compute dtype before the concat (the MLP casts its input to it anyway): the
      # [B, T, d + sides] concat is written once, in bf16 under model.dtype = "bfloat16"
      K = sum(p.shape[-1] for p in parts)
      Kp = event_mlp.width(K)
      fused = (self.axes == self.PACKED_AXES and packed.pallas_backend(self.backend)
               and event_mlp.supported(Kp, self.dim, self.dim))
      if fused and Kp > K:          # the kernels' width: zero columns, zero rows of w1
        parts.append(jnp.zeros(parts[0].shape[:-1] + (Kp - K,), self.dtype))
      parts = [p.astype(self.dtype) for p in parts]
      T = parts[0].shape[1]
      valid_bt = jnp.arange(T)[None, :] < jnp.asarray(events["length"], jnp.int32)[:, None]
      # per-event MLP weights are ZeRO-sharded only, never tensor-parallel: a TP split of this
      # narrow MLP would all-reduce [B, T, d] activations in both passes for d^2 weights
      w1, b1 = DenseParams(K, self.dim, ("embed", None), name="mlp_in")()
      w2, b2 = DenseParams(self.dim, self.dim, (None, "embed"), name="mlp_out")()
      if fused:
        # the weights in dtype before the kernels (which round them to it and return their
        # gradients rounded to it): one cast each, which the optimizer's 16-bit copy replaces
        w1 = jnp.pad(w1.astype(self.dtype), ((0, Kp - K), (0, 0)))
        # where the sparse update sums the item table inside the optimizer's cond, its rows'
        # gradient is an operand of the cond, which XLA copied out of one dx: the item table's
        # columns and the side tables' go to the kernels as a pair, whose cotangents the
        # backward kernel writes apart (elsewhere one dx: a reduction fewer per stream)
        n_ids = parts[0].shape[0] * parts[0].shape[1]
        x = ((parts[0], jnp.concatenate(parts[1:], axis=-1))
             if sharded_embedding.sums_densely([s.item_vocab], n_ids)
             else jnp.concatenate(parts, axis=-1))
        y = packed.fused_event_mlp(x, w1, b1, w2.astype(self.dtype), b2, valid_bt,
                                   dtype=self.dtype)
        return shard(y, self.axes)
      x = jnp.concatenate(parts, axis=-1)
      y = dense(gelu(dense(x, w1, b1, self.dtype)), w2, b2, self.dtype)
      y = jnp.where(valid_bt[..., None], y, 0).astype(self.dtype)
      return shard(y, self.axes)


class ContextEncoder(nn.Module):
  """Non-sequence tokens ``X0 [B, num_tokens, dim]`` (spec c.0b, d.3).

  ``concat(SparseEmbed, DenseTokens)`` -> LCE -> plus a learned per-surface embedding broadcast
  over the tokens. Call with ``(sparse dict, dense f32[B, F], surface i32[B])``.
  """
  features: tuple[SparseFeature, ...]
  num_dense_tokens: int
  num_tokens: int
  dim: int
  num_surfaces: int
  dtype: Any = F32

  @nn.compact
  def __call__(self, sparse, dense, surface):
    with jax.named_scope("ContextEncoder"):
      parts = []
      if self.features:
        parts.append(SparseEmbed(self.features, self.dim, name="sparse")(sparse))
      if self.num_dense_tokens and dense.shape[-1]:
        parts.append(DenseTokens(self.num_dense_tokens, self.dim, self.dtype, name="dense")(dense))
      if not parts:
        raise ValueError("ContextEncoder needs at least one sparse or dense feature")
      x = jnp.concatenate([p.astype(self.dtype) for p in parts], axis=1)
      x = LCE(self.num_tokens, self.dtype, name="lce")(x)
      surf = _embed(self, "surface", self.num_surfaces, self.dim,
                    jnp.asarray(surface, jnp.int32) % self.num_surfaces)
      x = x + surf[:, None, :].astype(x.dtype)
      return shard(x, ("batch", "tokens", "embed"))
