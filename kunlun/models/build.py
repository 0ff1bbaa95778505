"""``build_model``: the one entry point for every architecture (``config.model.arch``)."""

from __future__ import annotations

import flax.linen as nn

from data.schema import Schema
from kunlun.configs.types import ARCHS, parse
from kunlun.models.ablated import ablated_config
from kunlun.models.dlrm import DLRM
from kunlun.models.interformer import InterFormer
from kunlun.models.kunlun import Kunlun
from kunlun.nn import remat as remat_lib


def build_model(config, schema: Schema, remat: str | None = None) -> nn.Module:
  """Validates ``config.model`` against ``schema`` and builds ``config.model.arch``: Kunlun,
  InterFormer, DLRM or the ablated Kunlun trunk. ``remat``: the policy (default
  ``config.train.remat``; its ``auto`` builds ``none``: the train set-up measures and picks,
  ``kunlun.train.step.pick_remat``, and nothing else trains).

  Raises ValueError naming the offending field and the allowed values.
  """
  cfg = parse(config, schema)
  train = config.get("train") if "model" in config else None
  if remat is None:
    remat = str(train.get("remat", "none")) if train is not None else "none"
    remat = "none" if remat == "auto" else remat
  scope = str(train.get("remat_scope", "layer")) if train is not None else "layer"
  remat_lib.check(remat, scope)
  if cfg.arch == "kunlun":
    return Kunlun(cfg, schema, remat, scope)
  if cfg.arch == "interformer":
    return InterFormer(cfg, schema)
  if cfg.arch == "kunlun_ablated":
    return Kunlun(ablated_config(cfg), schema, remat, scope)
  if cfg.arch == "dlrm":
    return DLRM(cfg, schema)
  raise ValueError(f"config.model.arch = {cfg.arch!r}; allowed: {ARCHS}")
