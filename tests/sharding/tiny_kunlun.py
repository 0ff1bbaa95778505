"""A small tiny-preset Kunlun model for the sharding tests, and host (numpy) parameters for it.

``small()`` -> ``(config, schema, model)`` (one layer, one event stream);
``host_params(model, batch)`` -> its ``params`` tree (numpy, the model's shapes) drawn on the host:
no compiled init (a jitted ``model.init`` is ~34k lines of threefry HLO, ~8 s to compile at -O0).
"""

import dataclasses

import flax.linen as nn
import jax
import numpy as np

from data.fake import tiny_schema
from kunlun.configs import tiny
from kunlun.configs.fit import fit_towers
from kunlun.models.build import build_model


def small():
  """The tiny preset with one layer, depth-1 towers and one event stream (click: the stream with
  every kind of event table, an extra field's included): every kind of parameter and table (all
  in layer 0 and the input stage) at about a third of the compile time of two layers and two
  streams (a second stream's tower repeats the first's kinds)."""
  cfg, schema = tiny.get_config(), tiny_schema()
  schema = dataclasses.replace(schema, streams=schema.streams[:1])
  fit_towers(cfg, schema)
  cfg.model.num_layers = 1
  for t in cfg.model.towers.values():
    t.depth = 1
  return cfg, schema, build_model(cfg, schema)


def host_params(model, batch, seed=0):
  """Random params of the model's shapes (traced, not compiled): tables ``N(0, 1 / dim)`` (the
  model's own initializer), other matrices ``N(0, 1 / fan_in)`` (fan_in: the second-to-last dim),
  norm scales ``1 + N(0, 0.1^2)``, other vectors ``N(0, 0.1^2)``; deterministic in ``seed``."""
  shapes = nn.meta.unbox(jax.eval_shape(lambda k: model.init(k, batch, train=False),
                                        jax.random.key(0))["params"])
  rng = np.random.default_rng(seed)

  def draw(path, s):
    name = str(path[-1].key)
    if len(s.shape) >= 2:
      x = rng.normal(0.0, s.shape[-1 if name.startswith("embedding_") else -2] ** -0.5, s.shape)
    else:
      x = rng.normal(0.0, 0.1, s.shape) + (name == "scale")
    return x.astype(s.dtype)
  return jax.tree_util.tree_map_with_path(draw, shapes)
