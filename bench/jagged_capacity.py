"""Packed-layout capacity per tower (issue #28): padded vs packed fill on the synthetic lengths.

For the data presets tiny / dev / mid (``data.synthetic`` length draw, kept length T of the model
preset of the same name) and batch 256 / 1024, per tower: T, mean kept length, padded fill
(mean / T), the capacity N = ``data.jagged.capacity_for`` at quantile 0.999 from a sample, the
packed fill (mean * B / N), and by simulation on fresh batches: overflow rate and dropped events.

    python -m bench.jagged_capacity            # bench/results/jagged_capacity.json
    python -m bench.jagged_capacity --quick    # smoke test
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np

from bench.output import at_least, result_path, write_json
from data import jagged, synthetic
from kunlun.configs import dev, mid, tiny
from kunlun.configs.types import seq_lens

PRESETS = {"tiny": tiny, "dev": dev, "mid": mid}     # data preset -> model preset (kept lengths)
BATCHES = (256, 1024)
QUANTILE = 0.999
OTHER_QUANTILES = (0.99, 0.9999)                     # the trade-off either side (exact, no sim)


def kept_lengths(spec, T: int, n: int, seed) -> np.ndarray:
  """i64[n] kept lengths of one stream: the generator's draw, truncated to the kept length T."""
  return np.minimum(synthetic.stream_lengths(spec, n, np.random.default_rng(seed)), T)


def simulate(spec, T: int, B: int, N: int, batches: int, seed, chunk: int = 2000) -> dict:
  """Fresh batches of B: overflow rate over N and events dropped (``fit_lengths``) per batch."""
  sums, dropped = [], []
  for i, start in enumerate(range(0, batches, chunk)):
    n = min(chunk, batches - start)
    L = kept_lengths(spec, T, n * B, list(seed) + [i]).reshape(n, B)
    s = L.sum(1)
    over = np.flatnonzero(s > N)
    d = np.zeros(n, np.int64)
    d[over] = [int(L[j].sum() - jagged.fit_lengths(L[j], N).sum()) for j in over]
    sums.append(s)
    dropped.append(d)
  s, d = np.concatenate(sums), np.concatenate(dropped)
  return {"mean_tokens": float(s.mean()), "overflow_rate": float(np.mean(s > N)),
          "dropped_per_batch": float(d.mean()), "dropped_fraction": float(d.sum() / s.sum()),
          "max_dropped": int(d.max())}


def measure(preset: str, B: int, sample: int, batches: int) -> dict:
  T_of = seq_lens(PRESETS[preset].get_config())
  towers, pad_tokens, cap_tokens, real = {}, 0, 0, 0.0
  for k, spec in enumerate(synthetic.PRESETS[preset].streams):
    T = T_of[spec.name]
    L = kept_lengths(spec, T, sample, [0, k])
    t = time.perf_counter()
    N = jagged.capacity_for(L, B, QUANTILE)
    cap_s = time.perf_counter() - t
    sim = simulate(spec, T, B, N, batches, [1, k, B])
    mean = sim["mean_tokens"] / B
    surv = jagged.batch_sum_survival(L, B)
    other = {}
    for q in OTHER_QUANTILES:
      n = jagged.capacity_for(L, B, q)
      other[str(q)] = {"capacity": n, "packed_fill": sim["mean_tokens"] / n,
                       "overflow_p_exact": float(surv[n])}
    towers[spec.name] = {
        "T": T, "mean_len": mean, "padded_fill": mean / T, "capacity": N,
        "packed_fill": sim["mean_tokens"] / N, "padded_tokens": B * T,
        "overflow_p_exact": float(surv[N]), "capacity_s": cap_s, **sim,
        "other_quantiles": other}
    pad_tokens += B * T
    cap_tokens += N
    real += sim["mean_tokens"]
  return {"preset": preset, "batch": B, "towers": towers, "padded_tokens": pad_tokens,
          "packed_tokens": cap_tokens, "padded_fill": real / pad_tokens,
          "packed_fill": real / cap_tokens, "token_ratio": pad_tokens / cap_tokens}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true", help="small sample and few batches")
  ap.add_argument("--sample", type=at_least(1), default=200_000,
                  help="lengths per tower for capacity")
  ap.add_argument("--batches", type=at_least(1), default=20_000, help="simulated batches per case")
  ap.add_argument("--out", default=None)
  a = ap.parse_args(argv)
  sample, batches = (5_000, 200) if a.quick else (a.sample, a.batches)
  t0 = time.perf_counter()
  rows = [measure(p, B, sample, batches) for p in PRESETS for B in BATCHES]
  hdr = (f"{'preset':6s} {'B':>5s} {'tower':11s} {'T':>5s} {'mean':>7s} {'pad fill':>8s} "
         f"{'N':>7s} {'pack fill':>9s} {'overflow':>9s} {'drop/batch':>10s} "
         f"{'N@.99':>7s} {'N@.9999':>7s}")
  print(hdr)
  for r in rows:
    for name, t in r["towers"].items():
      print(f"{r['preset']:6s} {r['batch']:5d} {name:11s} {t['T']:5d} {t['mean_len']:7.1f} "
            f"{t['padded_fill']:8.3f} {t['capacity']:7d} {t['packed_fill']:9.3f} "
            f"{t['overflow_rate']:9.5f} {t['dropped_per_batch']:10.3f} "
            + " ".join(f"{t['other_quantiles'][str(q)]['capacity']:7d}" for q in OTHER_QUANTILES))
    print(f"{r['preset']:6s} {r['batch']:5d} {'(all)':11s} {'':5s} {'':7s} "
          f"{r['padded_fill']:8.3f} {r['packed_tokens']:7d} {r['packed_fill']:9.3f}   "
          f"padded/packed tokens {r['token_ratio']:.2f}x")
  result = {
      "bench": "jagged_capacity", "quick": a.quick,
      "device": f"CPU ({platform.machine()}, numpy; no accelerator involved)",
      "target": f"issue #28: packed capacity per tower at quantile {QUANTILE} (overflow "
                f"probability <= {1 - QUANTILE:g} per batch), multiple of 64",
      "versions": {"numpy": np.__version__, "python": platform.python_version()},
      "method": "capacity: exact distribution of the batch sum of B lengths drawn with "
                "replacement from the sample (FFT of the length pmf to the B-th power, "
                "data.jagged.batch_sum_survival); overflow and drops: fresh batches from the "
                "generator, dropped events by data.jagged.fit_lengths",
      "seeds": {"sample": "[0, tower]", "simulation": "[1, tower, B, chunk]"},
      "shapes": {"batches": list(BATCHES), "sample_per_tower": sample,
                 "simulated_batches": batches},
      "wall_s": time.perf_counter() - t0, "results": rows}
  path = result_path("jagged_capacity", a.quick, a.out)
  write_json(path, result)
  print("wrote", path)
  return result


if __name__ == "__main__":
  main()
