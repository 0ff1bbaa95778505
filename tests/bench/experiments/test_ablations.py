"""bench/experiments/ablations.py: each variant flips exactly its switch, and the table pairs deltas by seed."""

import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)

from bench.experiments import ablations as A  # noqa: E402
from bench.experiments import scaling as S  # noqa: E402


def _flat(d, prefix=""):
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


@pytest.fixture(scope="module")
def schema(tmp_path_factory):
  from data import synthetic
  from data.schema import Schema
  d = str(tmp_path_factory.mktemp("abl_data"))
  synthetic.generate(d, "tiny", 64, seed=0)
  return Schema.load(d)


# the model fields each variant may change (everything else must stay as in the base)
CHANGED = {
    "pma": {"pooling"}, "sumkron_rank1": {"hsp_rank"}, "full_attention": {"attention.kind"},
    "block_attention": {"attention.kind", "attention.block_size"},
    "no_compskip": {"comp_skip"}, "final_hsp": {"final_hsp"}, "kunlun_ablated": {"arch"},
    "mowe_experts": {"mowe.num_experts"},
}


def test_each_variant_changes_only_its_switch(schema):
  from kunlun.configs.types import parse
  from kunlun.models.flops import model_flops
  base = S.size_config("kunlun", S.LADDERS["cpu"][3], "tiny", schema, batch_size=8, lr=1e-3,
                       warmup=1, seed=0)
  b = _flat(base.model.to_dict())
  for v in A.VARIANTS:
    cfg = A.variant_config(v, base, schema)
    parse(cfg.model, schema)                              # every variant is a valid config
    got = _flat(cfg.model.to_dict())
    diff = {k for k in set(b) | set(got) if b.get(k) != got.get(k)}
    if v == "base":
      assert not diff
    elif v in CHANGED:
      assert diff == CHANGED[v], (v, diff)
    elif v == "shared_tower":                             # towers take the high-value sizes
      assert diff and all(k.startswith("towers.") for k in diff)
      assert not any(k.endswith(".kept_len") for k in diff)
    elif v == "oneseq":                                   # matched forward FLOPs (within 25%)
      assert got["seq_mode"] == "oneseq"
      r = model_flops(cfg, schema)["forward"] / model_flops(base, schema)["forward"]
      assert 0.75 < r < 1.25, r
  assert base.model.mowe.num_experts == 1
  assert A.variant_config("mowe_experts", base, schema).model.mowe.num_experts == 2
  with pytest.raises(ValueError, match="unknown variant"):
    A.variant_config("nope", base, schema)


def _run(variant, seed, click, conv, ms, flops):
  return {"variant": variant, "seed": seed, "ne": {"click": click, "conversion": conv},
          "step_time_ms_median": ms, "train_flops_per_example": flops,
          "train_flops_per_example_padded": 1.5 * flops, "executed_flops_per_example": 2 * flops,
          "params": 10}


def test_summary_pairs_ne_deltas_by_seed_and_skips_unpaired():
  rng = np.random.default_rng(0)
  base_ne = rng.uniform(0.6, 0.7, (3, 2))
  pma_ne = rng.uniform(0.6, 0.7, (4, 2))
  runs = [_run("base", s, *base_ne[s], 10.0 + s, 100.0) for s in range(3)]
  runs += [_run("pma", s, *pma_ne[s], 20.0 + s, 80.0) for s in range(4)]   # seed 3: no base
  t = A.summarize(runs, [0, 1, 2, 3])
  for j, task in enumerate(S.TASKS):
    want = [100 * (base_ne[s, j] - pma_ne[s, j]) / base_ne[s, j] for s in range(3)]
    got = t["pma"]["ne_delta_pct"][task]
    np.testing.assert_allclose(got["per_seed"], want, rtol=1e-12)
    assert got["mean"] == pytest.approx(np.mean(want))
    assert got["std"] == pytest.approx(np.std(want, ddof=1))
    assert t["pma"]["ne"][task]["mean"] == pytest.approx(pma_ne[:, j].mean())
  assert t["pma"]["delta_pct"]["step_time_ms"] == pytest.approx(100 * (21.5 - 11.0) / 11.0)
  assert t["pma"]["delta_pct"]["train_flops_per_example"] == pytest.approx(-20.0)
  assert t["base"]["ne_delta_pct"]["click"]["mean"] == 0.0
  assert "pma" in A.format_table(t)
