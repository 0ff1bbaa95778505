"""The ablated Kunlun (``config.model.arch = "kunlun_ablated"``): the Kunlun trunk with its own
changes switched off, the floor of the ablation table (``bench/ablations.py``).

A generated rank-``n_kv`` projection as the PFFN (GDPA with the identity activation), PMA pooling,
full self-attention, one Wukong stack (no mixture), no CompSkip and no event-level depth (every
tower runs all ``num_layers``). Widths, heads, kept lengths and summary tokens are the config's.
It is *not* InterFormer (that is ``kunlun/baselines/interformer.py``, arch ``"interformer"``);
runs stored as ``"interformer"`` before InterFormer existed load as this
(``kunlun.config.upgrade_stored``). The model is ``kunlun.model.Kunlun`` on ``ablated_config``.
"""

from __future__ import annotations

import dataclasses

from kunlun.config import ModelConfig, MoWEConfig


def ablated_config(cfg: ModelConfig) -> ModelConfig:
  """The Kunlun ModelConfig of ``"kunlun_ablated"`` (module docstring)."""
  towers = tuple(dataclasses.replace(t, depth=cfg.num_layers) for t in cfg.towers)
  return dataclasses.replace(
      cfg, arch="kunlun_ablated", comp_skip=False, seq_mode="towers", oneseq=None, towers=towers,
      pooling="pma", pffn_activation="identity",
      attention=dataclasses.replace(cfg.attention, kind="full"),
      mowe=MoWEConfig(num_experts=1, layers_per_expert=cfg.mowe.layers_per_expert,
                      rank=cfg.mowe.rank, mlp_hidden=cfg.mowe.mlp_hidden))
