import json
import os

import numpy as np
import pytest
from scipy import sparse
from scipy.optimize import minimize

from data import synthetic, verify
from data.schema import Schema


def _bytes(d):
  out = {}
  for root, _, files in os.walk(d):
    for f in files:
      if f.endswith(".arrayrecord"):
        out[os.path.relpath(os.path.join(root, f), d)] = open(os.path.join(root, f), "rb").read()
  return out


def test_deterministic_per_seed(tmp_path):
  a, b, c = (str(tmp_path / x) for x in "abc")
  synthetic.generate(a, "tiny", 300, seed=5)
  synthetic.generate(b, "tiny", 300, seed=5)
  synthetic.generate(c, "tiny", 300, seed=6)
  assert _bytes(a) == _bytes(b)
  assert _bytes(a) != _bytes(c)


def test_dev_preset_three_streams_long_tails(tmp_path):
  synthetic.generate(str(tmp_path), "dev", 400, seed=0)
  schema = Schema.load(str(tmp_path))
  assert schema.stream_names == ("click", "impression", "conversion")
  lens = [len(r["events/impression"]) for _, _, r in verify.read_split(str(tmp_path), "train")]
  assert min(lens) < 50 and max(lens) > 500          # tens to (near) a thousand events


def _load(d):
  schema = Schema.load(d)
  return {split: [r for _, _, r in verify.read_split(d, split, schema)]
          for split in ("train", "eval")}


@pytest.fixture(scope="module")
def big(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("tiny20k"))
  synthetic.generate(d, "tiny", 12_000, seed=1)
  return d, _load(d), json.load(open(os.path.join(d, "synthetic.json")))


def test_layout_and_time_windows(big):
  _, recs, info = big
  tr, ev = recs["train"], recs["eval"]
  assert len(tr) == 12_000 and len(ev) == 2_400 == info["num_eval"]
  assert max(int(r["request_ts"]) for r in tr) < min(int(r["request_ts"]) for r in ev)
  surf = np.bincount([int(r["surface"]) for r in tr], minlength=3) / len(tr)
  np.testing.assert_allclose(surf, synthetic.SHARES, atol=0.02)
  # conversion labels are valid exactly on clicked rows
  for r in tr[:2000]:
    assert r["label_mask"][1] == r["labels"][0] and r["labels"][1] <= r["labels"][0]


def test_true_prob_recomputed_from_history(big):
  """true click probability = documented formula of the stored events (plain loop)."""
  _, recs, _ = big
  p = synthetic.PRESETS["tiny"]
  w = synthetic.World(p, 1)
  weight = {s.name: s.teacher_weight for s in p.streams}
  for r in recs["eval"][:200]:
    req = int(r["request_ts"])
    u = np.zeros(p.latent_dim)
    for s in p.streams:
      for item, *_, ts in [(e[0], e[3]) for e in r[f"events/{s.name}"][-p.recent:]]:
        u += weight[s.name] * np.exp(-(req - ts) / (p.tau_days * 86400)) * w.item_v[item]
    ad = int(r["ad_id"])
    v = w.item_v[ad] / np.linalg.norm(w.item_v[ad])
    sim = u @ v / np.linalg.norm(u) if np.linalg.norm(u) > 0 else 0.0
    s_ = int(r["surface"])
    seg = int(r["sparse/user_segment"][0])
    hour = (req // 3600) % 24
    assert r["dense"][2] == hour and int(r["sparse/ad_category"][0]) == ad % p.n_categories
    user = int(r["user_id"])
    assert r["dense"][0] == np.float32(w.user_age[user])
    z = (synthetic.CLICK_BIAS[s_] + synthetic.CLICK_BETA[s_] * sim + w.ad_q[ad]
         + w.cat_q[ad % p.n_categories] + w.seg_bias[seg] + 0.3 * np.sin(2 * np.pi * hour / 24)
         + 1.5 * np.log(w.ad_bid[ad]) / 0.7 + 1.0 * (np.log(w.user_age[user]) - 6.0))
    np.testing.assert_allclose(r["true_prob"][0], 1 / (1 + np.exp(-z)), rtol=2e-4, atol=1e-6)


def test_labels_follow_true_prob(big):
  _, recs, _ = big
  p = np.array([r["true_prob"][0] for r in recs["train"]])
  y = np.array([r["labels"][0] for r in recs["train"]])
  for lo, hi in ((0, .02), (.02, .1), (.1, .3), (.3, 1.01)):
    m = (p >= lo) & (p < hi)
    assert m.sum() > 300
    se = np.sqrt(p[m].mean() * (1 - p[m].mean()) / m.sum())
    assert abs(y[m].mean() - p[m].mean()) < 4 * se + 1e-3


def _features(recs, history):
  """Context features (one-hot ids, multi-hot interests, dense) [+ history-match features]."""
  rows = []
  for r in recs:
    cat = int(r["sparse/ad_category"][0])
    f = np.zeros(3 + 50 + 20 + 30 + 500 + 6 + 2 * history)
    f[int(r["surface"])] = 1
    f[3 + int(r["sparse/user_segment"][0])] = 1
    f[53 + cat] = 1
    f[73 + r["sparse/user_interests"]] = 1
    f[103 + int(r["ad_id"])] = 1
    age, bid, hour = r["dense"]
    f[603:609] = [np.log(age), np.log(bid), np.sin(2 * np.pi * hour / 24),
                  np.cos(2 * np.pi * hour / 24), float(cat in r["sparse/user_interests"]), 1.0]
    if history:
      for j, s in enumerate(("click", "impression")):
        ev = r[f"events/{s}"][-32:]
        f[609 + j] = (ev[:, 0] % 20 == cat).mean() if len(ev) else 0.0
    rows.append(f)
  return sparse.csr_matrix(np.array(rows))


def _fit_lr(X, y, l2=1.0):
  def loss(w):
    z = X @ w
    p = 1 / (1 + np.exp(-z))
    ll = np.logaddexp(0, z) - y * z
    return ll.sum() + 0.5 * l2 * w @ w, X.T @ (p - y) + l2 * w
  return minimize(loss, np.zeros(X.shape[1]), jac=True, method="L-BFGS-B",
                  options={"maxiter": 300}).x


def _ne(p, y):
  p = np.clip(p, 1e-7, 1 - 1e-7)
  rate = y.mean()
  ce = -(y * np.log(p) + (1 - y) * np.log(1 - p)).mean()
  return ce / -(rate * np.log(rate) + (1 - rate) * np.log(1 - rate))


def test_signal_lives_in_the_sequences(big):
  """Bayes NE < 1 on every surface; a logistic regression on all context features stays well
  above it, and adding two history-match features closes part of the gap."""
  _, recs, info = big
  ytr = np.array([r["labels"][0] for r in recs["train"]])
  yev = np.array([r["labels"][0] for r in recs["eval"]])
  sev = np.array([int(r["surface"]) for r in recs["eval"]])
  pev = np.array([r["true_prob"][0] for r in recs["eval"]])
  preds = {}
  for hist in (0, 1):
    w = _fit_lr(_features(recs["train"], hist), ytr)
    preds[hist] = 1 / (1 + np.exp(-_features(recs["eval"], hist) @ w))
  for s, name in enumerate(synthetic.SURFACES):
    m = sev == s
    bayes, ctx, hist = _ne(pev[m], yev[m]), _ne(preds[0][m], yev[m]), _ne(preds[1][m], yev[m])
    np.testing.assert_allclose(bayes, info["stats"]["eval"][name]["click"]["bayes_ne"],
                               rtol=1e-3)
    print(f"{name}: bayes NE {bayes:.3f}  context-only LR {ctx:.3f}  +history LR {hist:.3f}")
    assert bayes < 0.85, (name, bayes)
    assert ctx > bayes + 0.1, (name, bayes, ctx)
    assert hist < ctx, (name, ctx, hist)
  ctx, hist = _ne(preds[0], yev), _ne(preds[1], yev)
  assert hist < ctx - 0.05, (ctx, hist)


def test_pretrain_window_precedes_train_and_leaves_it_unchanged(tmp_path):
  a, b = str(tmp_path / "a"), str(tmp_path / "b")
  synthetic.generate(a, "tiny", 300, seed=3)
  synthetic.generate(b, "tiny", 300, seed=3, pretrain_examples=500)
  for split in ("train", "eval"):     # train/eval bytes do not depend on the pretrain window
    sa = {k: v for k, v in _bytes(a).items() if k.startswith(split + "/")}
    sb = {k: v for k, v in _bytes(b).items() if k.startswith(split + "/")}
    assert sa and sa == sb
  ts = lambda split: np.array([int(r["request_ts"])
                               for _, _, r in verify.read_split(b, split)])
  pre, train = ts("pretrain"), ts("train")
  assert len(pre) == 500 and pre.max() < train.min()
  # same request rate: the pretrain window spans ~500/300 of the train window's duration
  ratio = (pre.max() - pre.min()) / (train.max() - train.min())
  assert 1.5 < ratio < 1.8
  with pytest.raises(ValueError, match="pretrain_examples"):
    synthetic.generate(str(tmp_path / "c"), "tiny", 10, pretrain_examples=-1)
