"""Event-level personalization (spec c.8, h-10): per-tower CompSkip schedule, module factories.
Notes: docs/architecture.md, ``kunlun/nn/towers.py``."""

from __future__ import annotations

import dataclasses

from kunlun.configs.types import ModelConfig, TowerConfig
from kunlun.nn.attention import SeqAttention
from kunlun.nn.hsp import HSP, PMA
from kunlun.nn.remat import wrap


@dataclasses.dataclass(frozen=True)
class Schedule:
  weightgen: bool = False
  hsp: bool = False
  pffn: bool = False
  attention: bool = False
  final_hsp: bool = False

  @property
  def active(self) -> bool:
    return self.pffn or self.attention


def schedule(tower: TowerConfig, layer: int, comp_skip: bool, final_hsp: bool = False) -> Schedule:
  """What tower ``tower`` runs in Kunlun layer ``layer`` (module docstring)."""
  if layer >= tower.depth:
    return Schedule()
  hsp_at = lambda l: not comp_skip or l % 2 == 0          # fresh summary (and PFFN) in layer l
  pffn, attention = hsp_at(layer), not comp_skip or layer % 2 == 1
  if final_hsp:
    return Schedule(pffn, pffn, pffn, attention, final_hsp=layer == tower.depth - 1)
  live = layer < max(l for l in range(tower.depth) if hsp_at(l))   # a later HSP reads the output
  return Schedule(weightgen=pffn and live, hsp=pffn, pffn=pffn and live,
                  attention=attention and live)


def attention_t_max(cfg: ModelConfig, tower: TowerConfig) -> int:
  """Key count used as the 1/n output scale of a softmax-free attention (fixed by the config so
  that padding a batch longer leaves the outputs unchanged)."""
  if cfg.attention.kind == "swa":
    return min(tower.kept_len, 2 * tower.window + 1)
  return tower.kept_len


def make_attention(cfg: ModelConfig, tower: TowerConfig, dtype, name: str, kind: str | None = None,
                   remat: str = "none"):
  """The tower's SeqAttention (``remat``: a ``kunlun.nn.remat`` policy wrapping it)."""
  Attention = wrap(SeqAttention, remat)
  return Attention(heads=tower.heads, kind=kind or cfg.attention.kind, window=tower.window,
                   block_size=cfg.attention.block_size, activation=cfg.attention.activation,
                   qk_norm=cfg.attention.qk_norm, rotary=cfg.attention.rotary,
                   backend=cfg.backend, t_max=attention_t_max(cfg, tower), dtype=dtype,
                   score_clip=cfg.score_clip or None,
                   time_buckets=cfg.time_buckets.spec(tower), name=name)


def make_pooling(cfg: ModelConfig, tower: TowerConfig, dtype, name: str,
                 pooling: str | None = None, remat: str = "none", pass_tokens: bool = False):
  """HSP (default) or PMA summarising ``[B, T, d_e]`` into ``[B, n_sum, d_e]`` (``remat``: a
  ``kunlun.nn.remat`` policy wrapping it; ``pass_tokens``: HSP's, the summary and the packed
  tokens passed through for the PFFN)."""
  tb = cfg.time_buckets.spec(tower)
  if (pooling or cfg.pooling) == "pma":
    if pass_tokens:
      raise ValueError("make_pooling: PMA passes no tokens through (HSP's fused pool does)")
    return wrap(PMA, remat)(n_sum=tower.n_sum, heads=tower.heads, dtype=dtype, time_buckets=tb,
                            name=name)
  Pooling = wrap(HSP, remat)
  return Pooling(n_seed=tower.n_seed, n_sum=tower.n_sum, heads=tower.heads, rank=cfg.hsp_rank,
                 activation=cfg.hsp_activation, backend=cfg.backend, t_max=tower.kept_len,
                 dtype=dtype, score_clip=cfg.score_clip or None, time_buckets=tb,
                 pass_tokens=pass_tokens, name=name)
