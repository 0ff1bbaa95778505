"""Defaults shared by every preset: the seed, data, train and sharding sections and an empty
``model``, all from the table ``kunlun.configs.fields`` (descriptions: ``train.py --show_config``).

Preset files call ``base_config()`` and then fill ``config.model`` and override what differs.
Presets describe sizes: on a dataset whose streams / surfaces have other names than the synthetic
ones, towers, heads and surface weights follow the data's schema (kunlun/configs/fit.py).
"""

import ml_collections

from kunlun.configs.fields import default, defaults


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = default("seed")
  for section in ("data", "train", "sharding"):
    c[section] = defaults(section)
  c.model = ml_collections.ConfigDict()
  return c
