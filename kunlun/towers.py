"""Event-level personalization (spec c.8, h-10): per-tower CompSkip schedule, module factories.

Each event tower has its own width, heads, PFFN keys, window, kept length, HSP seeds/summary
tokens and depth ``L_e``. In Kunlun layer ``l`` a tower runs only while ``l < L_e``; afterwards its
last summary keeps feeding the interaction block (MoWE) of every later layer and the heads.

Schedule of tower ``e`` in layer ``l`` (``schedule``):
  * CompSkip on (spec c.7, h-9): even ``l``: WeightGen + fresh HSP summary (interaction block) and
    GDPA-PFFN (transformer block); odd ``l``: self-attention, the previous summary is reused.
  * CompSkip off: every active layer runs WeightGen + HSP + PFFN + attention
    (``s' = SWA(PFFN(s))``).
  * ``final_hsp`` off (default, spec d.1 / d.4): the summary that leaves the tower is the one of
    its last HSP, which reads that layer's *input*. A transformer block at or after the tower's
    last HSP layer therefore reaches nothing (neither a summary nor the heads); it is not built
    (same function, no dead parameters or FLOPs), and neither is the WeightGen of such a PFFN. With
    CompSkip a tower of depth ``L_e`` runs the sequence blocks of the layers before its last even
    layer: depth 1 or 2 is embedding + HSP only, depth 3 and 4 run PFFN, SWA, then HSP.
  * ``final_hsp`` on ([D], the behaviour before it became a switch): the tower's last layer
    ``l = L_e - 1`` summarises its output sequence once more, so every layer's blocks run and a
    shallow tower's "last summary" is the summary of its final sequence (one more HSP per tower).
"""

from __future__ import annotations

import dataclasses

from kunlun.attention import SeqAttention
from kunlun.config import ModelConfig, TowerConfig
from kunlun.hsp import HSP, PMA
from kunlun.remat import wrap


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
  """The tower's SeqAttention (``remat``: a ``kunlun.remat`` policy wrapping it)."""
  Attention = wrap(SeqAttention, remat)
  return Attention(heads=tower.heads, kind=kind or cfg.attention.kind, window=tower.window,
                   block_size=cfg.attention.block_size, activation=cfg.attention.activation,
                   qk_norm=cfg.attention.qk_norm, rotary=cfg.attention.rotary,
                   backend=cfg.backend, t_max=attention_t_max(cfg, tower), dtype=dtype,
                   score_clip=cfg.score_clip or None,
                   time_buckets=cfg.time_buckets.spec(tower), name=name)


def make_pooling(cfg: ModelConfig, tower: TowerConfig, dtype, name: str,
                 pooling: str | None = None, remat: str = "none"):
  """HSP (default) or PMA summarising ``[B, T, d_e]`` into ``[B, n_sum, d_e]`` (``remat``: a
  ``kunlun.remat`` policy wrapping it)."""
  tb = cfg.time_buckets.spec(tower)
  if (pooling or cfg.pooling) == "pma":
    return wrap(PMA, remat)(n_sum=tower.n_sum, heads=tower.heads, dtype=dtype, time_buckets=tb,
                            name=name)
  Pooling = wrap(HSP, remat)
  return Pooling(n_seed=tower.n_seed, n_sum=tower.n_sum, heads=tower.heads, rank=cfg.hsp_rank,
                 activation=cfg.hsp_activation, backend=cfg.backend, t_max=tower.kept_len,
                 dtype=dtype, score_clip=cfg.score_clip or None, time_buckets=tb, name=name)
