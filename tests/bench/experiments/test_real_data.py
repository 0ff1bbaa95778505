"""bench/experiments/real_data.py --quick end to end on a small RecBole-format file: ingest (MovieLens recipe),
train.py with the tiny preset on streams / surface it has never heard of (size templates, 'auto'
surface weights), epochs + per-epoch validation + keep-best, eval.py --best --predictions, and the
logistic-regression baseline. The eval NE is recomputed here from the predictions file."""

import json
import math
import os
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests import subproc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _inter(path, n_users=40, per_user=12, seed=0):
  """RecBole .inter rows with a learnable, additive pattern: user taste + movie quality."""
  rng = np.random.default_rng(seed)
  taste, quality = rng.normal(size=n_users + 1), rng.normal(size=60)
  rows = []
  for u in range(1, n_users + 1):
    t = 880_000_000 + rng.integers(0, 10**6)
    for _ in range(per_user):
      m = int(rng.integers(1, 60))
      good = taste[u] + quality[m] + 0.3 * rng.normal() > 0
      r = int(rng.integers(4, 6) if good else rng.integers(1, 4))
      t += int(rng.integers(60, 5000))
      rows.append(f"{u}\t{m}\t{r}\t{t}")
  path.write_text("user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
                  + "\n".join(rows) + "\n")


@pytest.mark.slow
def test_real_data_bench_quick(tmp_path):
  inter = tmp_path / "mini.inter"
  _inter(inter)
  out, work = tmp_path / "r.json", tmp_path / "work"
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "KUNLUN_COMPILATION_CACHE": subproc.compile_cache(tmp_path / "xla")}
  subproc.run([sys.executable, os.path.join(ROOT, "bench", "experiments", "real_data.py"), "--quick",
               "--inter", str(inter), "--archs", "kunlun,lr", "--workdir", str(work),
               "--out", str(out)], check=True, env=env, cwd=ROOT)
  r = json.loads(out.read_text())
  assert set(r["models"]) == {"kunlun", "logreg"} and r["quick"]
  k = r["models"]["kunlun"]["seeds"]["0"]
  lr = r["models"]["logreg"]["seeds"]["all"]
  for m in (k, lr):
    assert math.isfinite(m["ne"]) and 0 < m["ne"] < 2 and 0 <= m["auc"] <= 1
  assert lr["best_C"] in r["setup"]["logreg_C"] and lr["ne"] < 0.95  # ids carry the signal
  assert list(k["valid_ne_by_epoch"]) == ["1.00"] and k["best_epoch"] == 1.0
  wd = work / "kunlun_s0"
  log = (wd / "train.log").read_text()
  assert "tower 'liked' (stream 0) takes the sizes of template 'click'" in log
  assert "names none of the data's surfaces" not in log  # one surface: 'auto' changes nothing
  assert "validation step" in log and (wd / "best" / "best.json").exists()
  assert any("valid_ne" in json.loads(x) for x in (wd / "metrics.jsonl").read_text().splitlines())
  ev = json.loads((wd / "eval.json").read_text())
  assert ev["best"] and "own base rate" in ev["ne_normalisation"]
  # the per-example predictions reproduce the reported NE (independent numpy computation)
  t = pq.read_table(wd / "predictions.parquet").to_pydict()
  assert set(t) == {"user_id", "ad_id", "request_ts", "surface", "label.click", "prob.click"}
  assert len(t["prob.click"]) == ev["examples"] == r["dataset"]["examples"]["eval"]
  assert set(t["surface"]) == {"movielens"}
  p = np.clip(np.asarray(t["prob.click"], np.float64), 1e-7, 1 - 1e-7)
  y = np.asarray(t["label.click"], np.float64)
  rate = y.mean()
  ne = -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)) / -(
      rate * np.log(rate) + (1 - rate) * np.log(1 - rate))
  assert ne == pytest.approx(ev["overall"]["click"]["ne"], rel=1e-4) == pytest.approx(k["ne"])
