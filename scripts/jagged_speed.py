"""CPU examples/second of a train step's forward + backward, padded vs packed (jagged) towers
(issue #28), on the synthetic data of a preset: ``python scripts/jagged_speed.py [tiny dev]``.
Prints a table (a measurement, not a test; the benchmarks with targets live in bench/)."""

import argparse
import sys
import tempfile
import time

import flax.linen as nn
import jax
import numpy as np

from data import pipeline, synthetic
from kunlun.configs import dev, tiny
from kunlun.configs.types import seq_lens
from kunlun.models.build import build_model
from kunlun.nn.losses import masked_bce
from kunlun.train.runtime import jagged_capacity, load_schema

PRESETS = {"tiny": tiny, "dev": dev}


def step_time(model, params, batches):
  """Median seconds of one jitted loss + gradient over ``batches`` (first call compiles)."""
  def loss(p, b):
    return masked_bce(model.apply({"params": p}, b, True), b["labels"], b["label_mask"])[0]
  f = jax.jit(jax.value_and_grad(loss))
  jax.block_until_ready(f(params, batches[0]))
  times = []
  for b in batches:
    t = time.perf_counter()
    jax.block_until_ready(f(params, b))
    times.append(time.perf_counter() - t)
  return float(np.median(times))


def main(argv):
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("presets", nargs="*", default=["tiny", "dev"], choices=sorted(PRESETS))
  ap.add_argument("--batch", type=int, default=64)
  ap.add_argument("--steps", type=int, default=5)
  a = ap.parse_args(argv)
  print(f"{'preset':8} {'batch':>5} {'padded ex/s':>12} {'jagged ex/s':>12} {'speed-up':>8}  "
        "capacity (tokens, padded B*T)")
  for name in a.presets:
    cfg = PRESETS[name].get_config()
    cfg.data.batch_size = a.batch
    cfg.data.jagged_capacity = "auto"
    with tempfile.TemporaryDirectory() as d:
      synthetic.generate(d, cfg.data.preset, num_examples=max(4096, a.batch * (a.steps + 1)))
      schema, lens = load_schema(d), seq_lens(cfg)
      cap = jagged_capacity(cfg.data, d, "train", lens, 1)
      take = lambda c: [b for _, b in zip(range(a.steps), pipeline.make_dataset(
          cfg.data, d, "train", lens, train=False, shard_index=0, shard_count=1,
          jagged_capacity=c))]
      padded, packed = take(None), take(cap)
    model = build_model(cfg, schema)
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), padded[0], False))["params"]
    tp, tj = step_time(model, params, padded), step_time(model, params, packed)
    full = {s: a.batch * t for s, t in lens.items()}
    print(f"{name:8} {a.batch:5d} {a.batch / tp:12.1f} {a.batch / tj:12.1f} {tp / tj:8.2f}  "
          f"{cap} / {full}", flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
