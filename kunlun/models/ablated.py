"""The ablated Kunlun (``config.model.arch = "kunlun_ablated"``): the Kunlun trunk with its own
changes switched off, the floor of the ablation table (``bench/experiments/ablations.py``).

``SWITCHED_OFF`` lists every change switched off and the value it is set to; widths, heads, kept
lengths and summary tokens are the config's. Not InterFormer (``kunlun/models/interformer.py``);
runs stored as ``"interformer"`` before InterFormer existed load as this (``upgrade_stored``).
"""

from __future__ import annotations

import dataclasses

from kunlun.configs.types import ModelConfig

# config.model field -> (its value in the ablated model, the Kunlun change that switches off)
SWITCHED_OFF = {
    "comp_skip": (False, "Computation Skip: every layer runs every part"),
    "towers.*.depth": ("num_layers", "event-level depth: every tower runs all num_layers"),
    "seq_mode": ("towers", "OneSeq: one tower per stream"),
    "pooling": ("pma", "HSP summaries: PMA pooling"),
    "pffn_activation": ("identity", "GDPA PFFN: a generated rank-n_kv projection"),
    "attention.kind": ("full", "sliding-window attention: full self-attention"),
    "mowe.num_experts": (1, "Mixture of Wukong Experts: one Wukong stack"),
    "mowe.cross_layer": (False, "GEM cross-layer attention connections (spec h-19)"),
}


def switched_off() -> list[str]:
  """One line per switched-off change: ``field = value  (what)``."""
  return [f"{k} = {v!r}  ({why})" for k, (v, why) in SWITCHED_OFF.items()]


def ablated_config(cfg: ModelConfig) -> ModelConfig:
  """The Kunlun ModelConfig of ``"kunlun_ablated"``: ``cfg`` with ``SWITCHED_OFF`` applied."""
  off = {k: v for k, (v, _) in SWITCHED_OFF.items()}
  towers = tuple(dataclasses.replace(t, depth=cfg.num_layers) for t in cfg.towers)
  return dataclasses.replace(
      cfg, arch="kunlun_ablated", comp_skip=off["comp_skip"], seq_mode=off["seq_mode"],
      oneseq=None, towers=towers, pooling=off["pooling"], pffn_activation=off["pffn_activation"],
      attention=dataclasses.replace(cfg.attention, kind=off["attention.kind"]),
      mowe=dataclasses.replace(cfg.mowe, num_experts=off["mowe.num_experts"],
                               cross_layer=off["mowe.cross_layer"]))
