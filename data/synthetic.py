"""Synthetic multi-surface ads logs with a planted teacher (known click/conversion probabilities).

World (fixed per seed): ``C`` item categories with unit latent centres ``mu_c``; item ``i`` has
category ``i % C`` and latent ``v_i = mu_c + noise``; ads are items. Each user has two interest
categories, a segment and an account age. One example = a request of a user on a surface
(traffic shares ``SURFACES``) for a candidate ad (targeted at the user's interests with
probability ``p_targeted``, else random), with event streams whose items are drawn from the
user's interests (stream-specific focus) and whose lengths are heavy-tailed.

Teacher (what the model must learn)::

    u      = sum over the 32 most recent events of each stream: w_stream exp(-age / tau) v_item
    sim    = cos(u, v_ad)                                   (0 for an empty history)
    z_clk  = b_s + beta_s * sim + q_ad + q_cat + seg_bias + 0.3 sin(2 pi hour / 24)
             + 1.5 z(log bid) + 1.0 z(log account age)
    z_cvr  = c_s + gamma_s * sim + 0.6 (q_ad + q_cat) + r_ad  (conversion given click)

(a) the interest match needs the history; (b) ``sim`` is shared by every surface (events come
from all surfaces, surface-specific scale and bias only); (c) conversions (valid only on clicked
rows) reuse ``sim`` and ``q_ad`` from the data-rich click task. Context features (segment, noisy
declared interests, ad category/id, bid, hour) carry only part of the signal.

Requests are time-ordered; ``eval`` is the time window right after ``train``. Generation is
vectorised per chunk and streamed to ArrayRecord shards (``data.records.DatasetWriter``).

CLI: ``python -m data.synthetic --out DIR --preset tiny|dev|mid|prod [--num_examples N] [--seed S]
[--pretrain_examples M]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import numpy as np

from data import records
from data.schema import EventField, EventStream, Schema, SparseFeature, Task

SURFACES = ("feed", "stories", "reels")
SHARES = np.array([0.5, 0.3, 0.2])
CLICK_BIAS = np.array([-6.3, -7.0, -5.7])      # per surface (base click rates ~12% / 10% / 14%)
CLICK_BETA = np.array([6.0, 6.5, 5.5])         # interest-match scale per surface
CVR_BIAS = np.array([-4.5, -5.0, -4.0])         # conversion given click ~18%
CVR_GAMMA = np.array([3.5, 4.0, 3.0])
T0 = 1_700_000_000                              # first request (unix seconds)
DAY = 86_400


@dataclasses.dataclass(frozen=True)
class StreamSpec:
  name: str
  max_len: int
  median_len: float
  action_vocab: int
  focus: tuple[float, float]     # probability of the user's 1st / 2nd interest category
  mean_gap_s: float
  teacher_weight: float
  with_category: bool


@dataclasses.dataclass(frozen=True)
class Preset:
  name: str
  num_examples: int
  streams: tuple[StreamSpec, ...]
  n_items: int
  n_categories: int
  n_users: int
  n_segments: int
  n_topics: int
  topics_max_len: int
  ad_hash_vocab: int
  eval_frac: float = 0.2
  train_days: float = 14.0
  latent_dim: int = 16
  chunk: int = 4096
  records_per_shard: int = 200_000
  p_targeted: float = 0.6
  tau_days: float = 5.0
  recent: int = 32


PRESETS = {
    "tiny": Preset("tiny", 20_000, (
        StreamSpec("click", 64, 16, 3, (0.55, 0.25), 6 * 3600, 1.0, True),
        StreamSpec("impression", 128, 32, 2, (0.3, 0.15), 1800, 0.5, False)),
        n_items=500, n_categories=20, n_users=5000, n_segments=50, n_topics=30,
        topics_max_len=4, ad_hash_vocab=1000),
    "dev": Preset("dev", 100_000, (
        StreamSpec("click", 256, 60, 3, (0.55, 0.25), 6 * 3600, 1.0, True),
        StreamSpec("impression", 1024, 200, 2, (0.3, 0.15), 1800, 0.5, False),
        StreamSpec("conversion", 64, 8, 4, (0.7, 0.2), DAY, 1.5, True)),
        n_items=5000, n_categories=50, n_users=100_000, n_segments=200, n_topics=100,
        topics_max_len=8, ad_hash_vocab=20_000),
    "mid": Preset("mid", 50_000, (
        StreamSpec("click", 512, 100, 3, (0.55, 0.25), 6 * 3600, 1.0, True),
        StreamSpec("impression", 2048, 400, 2, (0.3, 0.15), 1800, 0.5, False),
        StreamSpec("conversion", 128, 12, 4, (0.7, 0.2), DAY, 1.5, True)),
        n_items=50_000, n_categories=100, n_users=1_000_000, n_segments=500, n_topics=200,
        topics_max_len=8, ad_hash_vocab=200_000, chunk=1024),
    "prod": Preset("prod", 50_000, (                 # production-shaped: ~half-filled streams
        StreamSpec("click", 1024, 512, 3, (0.55, 0.25), 6 * 3600, 1.0, True),
        StreamSpec("impression", 2048, 1024, 2, (0.3, 0.15), 1800, 0.5, False),
        StreamSpec("conversion", 256, 128, 4, (0.7, 0.2), DAY, 1.5, True)),
        n_items=100_000, n_categories=100, n_users=1_000_000, n_segments=500, n_topics=200,
        topics_max_len=8, ad_hash_vocab=1_000_000, chunk=512),
}


def preset_schema(p: Preset) -> Schema:
  return Schema(
      sparse=(SparseFeature("user_segment", p.n_segments),
              SparseFeature("ad_category", p.n_categories),
              SparseFeature("ad_id_hash", p.ad_hash_vocab, hashed=True),
              SparseFeature("user_interests", p.n_topics, max_len=p.topics_max_len)),
      dense=("user_age_days", "ad_bid", "hour_of_day"),
      streams=tuple(EventStream(s.name, s.max_len, item_vocab=p.n_items,
                                action_vocab=s.action_vocab,
                                extra_fields=((EventField("category", p.n_categories),)
                                              if s.with_category else ()))
                    for s in p.streams),
      surfaces=SURFACES,
      tasks=(Task("click"), Task("conversion", always_valid=False)),
  )


class World:
  """The fixed latent structure of one seed (items, ads, users)."""

  def __init__(self, p: Preset, seed: int):
    rng = np.random.default_rng([seed, 0])
    D, C = p.latent_dim, p.n_categories
    mu = rng.normal(size=(C, D))
    mu /= np.linalg.norm(mu, axis=1, keepdims=True)
    self.item_cat = np.arange(p.n_items) % C
    self.item_v = (mu[self.item_cat] + 0.5 * rng.normal(size=(p.n_items, D)) / np.sqrt(D)
                   ).astype(np.float32)
    self.item_v_unit = self.item_v / np.linalg.norm(self.item_v, axis=1, keepdims=True)
    self.ad_q = rng.normal(0, 0.3, p.n_items)           # click quality per ad
    self.cat_q = rng.normal(0, 1.5, C)                   # and per ad category
    self.ad_r = rng.normal(0, 0.5, p.n_items)           # conversion-specific quality
    self.ad_bid = rng.lognormal(0.0, 0.7, p.n_items)
    self.user_int = rng.integers(0, C, (p.n_users, 2))
    self.user_age = rng.lognormal(6.0, 1.0, p.n_users)
    self.seg_bias = rng.normal(0, 1.0, p.n_segments)


def _sigmoid(z):
  return 1.0 / (1.0 + np.exp(-z))


def stream_lengths(s: StreamSpec, n: int, rng: np.random.Generator) -> np.ndarray:
  """i64[n] history lengths of stream ``s``: floor of a lognormal (median ``s.median_len``,
  sigma 1), 3% empty, at most ``s.max_len`` (the generator's draw; ``bench.jagged_capacity``)."""
  L = np.floor(rng.lognormal(np.log(s.median_len), 1.0, n)).astype(np.int64)
  return np.where(rng.uniform(size=n) < 0.03, 0, np.minimum(L, s.max_len))


def _chunk(p: Preset, w: World, seed: int, split_id: int, c: int, n: int, t_start: float,
           dt: float):
  """Generates ``n`` examples (vectorised). Returns (fixed columns, ragged columns, surface)."""
  rng = np.random.default_rng([seed, 1 + split_id, c])
  C = p.n_categories
  ipc = p.n_items // C                                    # items per category
  user = rng.integers(0, p.n_users, n)
  surf = rng.choice(3, n, p=SHARES).astype(np.int32)
  req = (t_start + (np.arange(n) + rng.uniform(size=n)) * dt).astype(np.int64)
  ui = w.user_int[user]
  targeted = rng.uniform(size=n) < p.p_targeted
  ad_cat = np.where(targeted, ui[np.arange(n), rng.integers(0, 2, n)], rng.integers(0, C, n))
  ad = ad_cat + C * rng.integers(0, ipc, n)

  ragged, u = {}, np.zeros((n, p.latent_dim), np.float32)
  ui0, ui1 = ui[:, 0].copy(), ui[:, 1].copy()
  cum_share = np.cumsum(SHARES)[:-1].astype(np.float32)
  for s in p.streams:
    L = stream_lengths(s, n, rng)
    off = np.concatenate([[0], np.cumsum(L)])
    E = int(off[-1])
    ex = np.repeat(np.arange(n, dtype=np.int32), L)
    r = rng.random(E, dtype=np.float32)
    cat = np.where(r < s.focus[0], ui0[ex], np.where(r < s.focus[0] + s.focus[1], ui1[ex],
                                                     rng.integers(0, C, E)))
    ev = np.empty((E, 5 if s.with_category else 4), np.int32)
    ev[:, 0] = cat + C * rng.integers(0, ipc, E, dtype=np.int32)
    ev[:, 1] = rng.integers(0, s.action_vocab, E, dtype=np.int32)
    r = rng.random(E, dtype=np.float32)
    ev[:, 2] = (r >= cum_share[0]).astype(np.int32) + (r >= cum_share[1])
    gap = np.ceil(rng.standard_exponential(E, dtype=np.float32) * s.mean_gap_s).astype(np.int64)
    cs = np.cumsum(gap)                                    # integer seconds: exact, monotone
    age = cs[np.maximum(off[1:] - 1, 0)][ex] - cs + gap if E else gap   # seconds before request
    ev[:, 3] = req[ex] - age
    if s.with_category:
      ev[:, 4] = cat
    ragged[f"events/{s.name}"] = (ev, off)
    # teacher: recency-weighted interest from the most recent events of this stream
    idx = np.flatnonzero((off[1:][ex] - np.arange(E)) <= p.recent)
    wt = s.teacher_weight * np.exp(age[idx].astype(np.float32) / np.float32(-p.tau_days * DAY))
    contrib = w.item_v[ev[idx, 0]]
    contrib *= wt[:, None]
    r_off = np.searchsorted(idx, off[:-1])
    nonempty = L > 0
    if len(idx):
      u[nonempty] += np.add.reduceat(contrib, r_off[nonempty], axis=0)
  un = np.linalg.norm(u, axis=1)
  sim = np.where(un > 0, (u * w.item_v_unit[ad]).sum(1) / np.maximum(un, 1e-9), 0.0)

  seg = user % p.n_segments
  hour = (req // 3600) % 24
  bid = w.ad_bid[ad]
  q = w.ad_q[ad] + w.cat_q[ad_cat]
  z_clk = (CLICK_BIAS[surf] + CLICK_BETA[surf] * sim + q + w.seg_bias[seg]
           + 0.3 * np.sin(2 * np.pi * hour / 24) + 1.5 * np.log(bid) / 0.7
           + 1.0 * (np.log(w.user_age[user]) - 6.0))
  z_cvr = CVR_BIAS[surf] + CVR_GAMMA[surf] * sim + 0.6 * q + w.ad_r[ad]
  p_clk, p_cvr = _sigmoid(z_clk), _sigmoid(z_cvr)
  click = rng.uniform(size=n) < p_clk
  conv = click & (rng.uniform(size=n) < p_cvr)

  n_top = rng.integers(1, p.topics_max_len + 1, n)
  top_off = np.concatenate([[0], np.cumsum(n_top)])
  tex = np.repeat(np.arange(n), n_top)
  topics = np.where(rng.uniform(size=len(tex)) < 0.35, ui[tex, 0] % p.n_topics,
                    rng.integers(0, p.n_topics, len(tex)))
  ragged["sparse/user_interests"] = (topics.astype(np.int64), top_off)

  f32 = lambda x: np.asarray(x, np.float32)
  fixed = {
      "dense": f32(np.stack([w.user_age[user], bid, hour], 1)),
      "sparse/user_segment": seg.astype(np.int64)[:, None],
      "sparse/ad_category": ad_cat.astype(np.int64)[:, None],
      "sparse/ad_id_hash": (ad.astype(np.int64) * 1_000_003 + 17)[:, None],
      "surface": surf,
      "labels": f32(np.stack([click, conv], 1)),
      "label_mask": f32(np.stack([np.ones(n), click], 1)),
      "true_prob": f32(np.stack([p_clk, p_cvr], 1)),
      "user_id": user.astype(np.int32),
      "ad_id": ad.astype(np.int32),
      "request_ts": req.astype(np.int32),
  }
  return fixed, ragged, surf


def _ce(p, y):
  p = np.clip(p, 1e-7, 1 - 1e-7)
  return -(y * np.log(p) + (1 - y) * np.log(1 - p))


class _Stats:
  """Per (split, surface, task) sums for base rates and the Bayes NE of the true probabilities."""

  def __init__(self):
    self.s = {}

  def add(self, split, fixed):
    surf = fixed["surface"]
    for si, sname in enumerate(SURFACES):
      m = surf == si
      for k, task in enumerate(("click", "conversion")):
        valid = m & (fixed["label_mask"][:, k] > 0)
        y, pr = fixed["labels"][valid, k], fixed["true_prob"][valid, k]
        a = self.s.setdefault((split, sname, task), np.zeros(3))
        a += [valid.sum(), y.sum(), _ce(pr, y).sum()]

  def summary(self):
    out = {}
    for (split, sname, task), (n, pos, ce) in self.s.items():
      rate = pos / max(n, 1)
      h = _ce(np.array([rate]), np.array([rate]))[0] if 0 < rate < 1 else np.nan
      out.setdefault(split, {}).setdefault(sname, {})[task] = {
          "count": int(n), "rate": float(rate), "bayes_ne": float(ce / max(n, 1) / h)}
    return out


def generate(out_dir: str, preset: str = "tiny", num_examples: int | None = None,
             seed: int = 0, pretrain_examples: int = 0) -> Schema:
  """Writes ``train`` and ``eval`` (the next time window, ``eval_frac`` of train) to ``out_dir``.

  ``pretrain_examples > 0`` adds a ``pretrain`` split: the time window just *before* ``train``,
  at the same request rate (e.g. a foundation model's training window, so that its outputs on
  ``train``/``eval`` are out of sample). ``train``/``eval`` do not depend on it.
  Also writes ``schema.json``, ``manifest.json`` and ``synthetic.json`` (preset, seed, base
  rates and the teacher's Bayes NE per split / surface / task). Deterministic per seed.
  """
  if preset not in PRESETS:
    raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
  p = PRESETS[preset]
  n_train = p.num_examples if num_examples is None else int(num_examples)
  if n_train <= 0:
    raise ValueError(f"num_examples must be > 0, got {n_train}")
  n_eval = max(1, round(n_train * p.eval_frac))
  n_pre = int(pretrain_examples)
  if n_pre < 0:
    raise ValueError(f"pretrain_examples must be >= 0, got {n_pre}")
  schema = preset_schema(p)
  world = World(p, seed)
  writer = records.DatasetWriter(out_dir, schema, p.records_per_shard)
  stats = _Stats()
  dt = p.train_days * DAY / n_train
  t0 = time.perf_counter()
  windows = [(0, "train", n_train, T0), (1, "eval", n_eval, T0 + n_train * dt)]
  if n_pre:
    windows.append((2, "pretrain", n_pre, T0 - n_pre * dt))
  for split_id, split, n_total, t_start in windows:
    for c, start in enumerate(range(0, n_total, p.chunk)):
      n = min(p.chunk, n_total - start)
      fixed, ragged, surf = _chunk(p, world, seed, split_id, c, n, t_start + start * dt, dt)
      stats.add(split, fixed)
      recs = records.encode_columns(fixed, ragged)
      for si, sname in enumerate(SURFACES):
        writer.write(split, sname, [recs[i] for i in np.flatnonzero(surf == si)])
  writer.close(splits=tuple(w[1] for w in windows))
  info = {"preset": preset, "seed": seed, "num_train": n_train, "num_eval": n_eval,
          "num_pretrain": n_pre,
          "seconds": time.perf_counter() - t0, "stats": stats.summary()}
  with open(os.path.join(out_dir, "synthetic.json"), "w") as f:
    json.dump(info, f, indent=1)
  return schema


def main(argv=None):
  ap = argparse.ArgumentParser(prog="python -m data.synthetic", description=__doc__.split("\n")[0])
  ap.add_argument("--out", required=True)
  ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
  ap.add_argument("--num_examples", type=int, default=None)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--pretrain_examples", type=int, default=0,
                  help="also write a 'pretrain' split: the window before train")
  a = ap.parse_args(argv)
  try:
    generate(a.out, a.preset, a.num_examples, a.seed, a.pretrain_examples)
  except (ValueError, OSError) as e:      # bad sizes, an unwritable --out
    ap.exit(2, f"{ap.prog}: error: {' '.join(str(e).split())}\n")
  with open(os.path.join(a.out, "synthetic.json")) as f:
    info = json.load(f)
  pre = f" + {info['num_pretrain']} pretrain" if info["num_pretrain"] else ""
  print(f"wrote {info['num_train']} train + {info['num_eval']} eval{pre} examples to {a.out} "
        f"in {info['seconds']:.1f}s")
  for sname, d in info["stats"]["eval"].items():
    print(f"  eval {sname:8s} " + "  ".join(
        f"{t}: n={v['count']} rate={v['rate']:.3f} bayes_NE={v['bayes_ne']:.3f}"
        for t, v in d.items()))


if __name__ == "__main__":
  main()
