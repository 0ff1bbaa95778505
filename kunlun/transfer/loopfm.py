"""LoopFM (spec g.3): a vertical model (VM) that reads logged FM embeddings as input features.

``LoopFMKunlun`` is the Kunlun VM (a subclass of ``kunlun.models.kunlun.Kunlun`` filling its
``extra_inputs`` hook; with both inputs off it is the plain VM) plus two optional inputs:

  (a) context: ``fm_ctx f32[B, d_fm]`` with ``fm_ctx_present bool[B]`` -> one extra token appended
      to X0 (``[B, N_ns + 1, d_ns]``) through ``FMAdapter``; it reaches the trunk through the first
      layer's WeightGen (PFFN K/V) and MoWE;
  (b) history: ``fm_events {stream: f32[B, T, d_fm]}`` with
      ``fm_events_present {stream: bool[B, T]}`` -> ``FMAdapter`` output added to each event
      embedding of that stream's tower (a linear adapter in the event encoder); padded events
      stay zero. A packed stream (``data.jagged_capacity``, ``kunlun.nn.packed``) takes its FM
      rows packed like its tokens: ``fm_events[stream] f32[N, d_fm]``, ``fm_events_present[stream]
      bool[N]`` (``EmbeddingLog.join_batch`` on the packed batch gives them), added to each real
      token; padding tokens stay zero.

Missing embeddings are masked: where ``present`` is False the FM value is never read (it may be
anything, NaN included) and a learned per-input "missing" vector is used instead. The inputs come
from ``kunlun.transfer.join.EmbeddingLog.join_batch`` (training) or ``cache.SpeculativeCache``
(serving; a miss takes this masked path).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from data.schema import Schema
from kunlun.configs.transfer import parse_transfer
from kunlun.configs.types import parse
from kunlun.models.kunlun import Kunlun
from kunlun.nn import packed
from kunlun.nn.layer import COMPUTE_DTYPES
from sharding import shard, with_axes

F32 = jnp.float32


class FMAdapter(nn.Module):
  """``(emb f32[..., d_fm], present bool[...]) -> [..., out_dim]``.

  Present: ``Dense(LayerNorm(emb))`` (scale-free norm: FM embeddings come in any scale, e.g.
  dequantised int8). Missing: a learned vector ``missing [out_dim]``.
  """
  out_dim: int
  dtype: jnp.dtype = F32

  @nn.compact
  def __call__(self, emb, present):
    present = jnp.asarray(present, bool)
    emb = jnp.where(present[..., None], jnp.asarray(emb, F32), 0.0)  # never read missing values
    h = nn.LayerNorm(use_scale=False, use_bias=False, dtype=F32)(emb)
    y = nn.Dense(self.out_dim, dtype=self.dtype, param_dtype=F32, name="proj",
                 kernel_init=with_axes(nn.initializers.lecun_normal(), (None, "embed")))(h)
    missing = self.param("missing", with_axes(nn.initializers.normal(0.02), ("embed",)),
                         (self.out_dim,), F32)
    return jnp.where(present[..., None], y, missing.astype(y.dtype))


class LoopFMKunlun(Kunlun):
  """Kunlun VM with LoopFM inputs (through ``Kunlun.extra_inputs``, so the trunk, heads and
  parameter names are exactly Kunlun's). ``apply(..., batch, train) -> logits f32[B, K]``;
  ``method="representations"`` as ``Kunlun``. Extra batch keys are needed only for enabled
  inputs (``use_ctx``: fm_ctx, fm_ctx_present; ``use_events``: fm_events, fm_events_present for
  every tower's stream)."""
  use_ctx: bool = True
  use_events: bool = True
  packed_extra_inputs = True      # extra_inputs takes packed towers (kunlun.nn.packed.Packed)

  def extra_inputs(self, batch, x_bnd, seqs, lengths):
    cfg, dt = self.cfg, COMPUTE_DTYPES[self.cfg.dtype]
    if self.use_events and cfg.seq_mode != "towers":
      raise ValueError("LoopFM per-event inputs need config.model.seq_mode = 'towers', got "
                       f"{cfg.seq_mode!r}")
    with jax.named_scope("LoopFM"):
      if self.use_ctx:
        _require(batch, ("fm_ctx", "fm_ctx_present"))
        tok = FMAdapter(cfg.d_ns, dt, name="loopfm_ctx")(batch["fm_ctx"], batch["fm_ctx_present"])
        x_bnd = shard(jnp.concatenate([x_bnd, tok[:, None].astype(x_bnd.dtype)], 1),
                      ("batch", "tokens", "embed"))
      if self.use_events:
        _require(batch, ("fm_events", "fm_events_present"))
        seqs = dict(seqs)
        for t in cfg.towers:
          if t.name not in batch["fm_events"]:
            raise ValueError(f"LoopFM: batch['fm_events'] lacks stream {t.name!r} "
                             f"(has {sorted(batch['fm_events'])})")
          s, fm, present = (seqs[t.name], batch["fm_events"][t.name],
                            batch["fm_events_present"][t.name])
          if packed.is_packed(s):
            _check_packed_rows(t.name, s.jag.capacity, fm, present)
            value, valid = s.value, s.jag.valid
          else:
            T = s.shape[1]
            value, valid, fm, present = (s, jnp.arange(T)[None, :] < lengths[t.name][:, None],
                                         fm[:, :T], present[:, :T])
          a = FMAdapter(t.width, dt, name=f"loopfm_{t.name}")(fm, present)
          value = value + jnp.where(valid[..., None], a, 0).astype(value.dtype)
          seqs[t.name] = (packed.Packed(value, s.jag) if packed.is_packed(s)
                          else shard(value, ("batch", "seq", "embed")))
    return x_bnd, seqs


def _check_packed_rows(stream, capacity, fm, present):
  """A packed stream's FM rows are packed like its tokens (module docstring)."""
  if jnp.ndim(fm) != 2 or jnp.shape(fm)[0] != capacity or jnp.shape(present) != (capacity,):
    raise ValueError(f"LoopFM: stream {stream!r} is packed (N = {capacity} tokens): "
                     f"fm_events / fm_events_present must be packed like its tokens, [N, d_fm] / "
                     f"[N], got {jnp.shape(fm)} / {jnp.shape(present)}")


def _require(batch, keys):
  missing = [k for k in keys if k not in batch]
  if missing:
    raise ValueError(f"LoopFM: batch lacks {missing} (add them with EmbeddingLog.join_batch or "
                     "SpeculativeCache.augment)")


def build_loopfm(config, schema: Schema, *, use_ctx=None, use_events=None) -> LoopFMKunlun:
  """Builds the LoopFM VM; flags default to ``config.transfer.loopfm_ctx / loopfm_events``
  (validated by ``kunlun.configs.transfer.parse_transfer``)."""
  cfg = parse(config, schema)
  if cfg.arch != "kunlun":
    raise ValueError(f"LoopFM wraps config.model.arch = 'kunlun', got {cfg.arch!r}")
  tr = parse_transfer(config)
  use_ctx = tr.loopfm_ctx if use_ctx is None else use_ctx
  use_events = tr.loopfm_events if use_events is None else use_events
  return LoopFMKunlun(cfg, schema, use_ctx=use_ctx, use_events=use_events)
