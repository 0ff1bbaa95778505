"""bench/jagged_buckets.py: K bucket programs combined over drawn batches, against a plain loop."""

import numpy as np
import pytest

from bench import jagged_buckets as JB
from bench import train_step as TS
from data.synthetic import PRESETS, preset_schema
from kunlun.configs import types as model_config
from kunlun.models.flops import batch_flops

B = 16


def _run(name, tokens, flops, nbytes, bound_s, bucket=None, caps=None, rows=()):
  return {"name": name, "config": "tiny", "backend": "xla", "global_batch": B,
          "target": {"name": "h200"}, "lengths": "preset", "overrides": [],
          "layout": "padded" if bucket is None else "packed",
          "jagged_buckets": None if caps is None else {"count": 3, "bucket": bucket,
                                                       "capacities": caps},
          "useful": {"tokens": tokens, "flops_compiled": flops, "bytes": nbytes,
                     "bound_s": bound_s},
          "roofline": {"device": {"peak_flops": 1e15, "bandwidth": 1e12, "launch_s": 1e-6},
                       "xla": {"launches": 10}, "rows": list(rows)}}


def test_combine_against_a_loop():
  cfg = TS.load_config("tiny", [])
  schema = preset_schema(PRESETS[cfg.data.preset])
  seq = model_config.seq_lens(cfg)
  caps = {"click": [320, 384, B * 32], "impression": [448, 448, B * 32]}   # the last: no drop
  progs = [(1e9, 2e8, 1e-3), (1.2e9, 2.3e8, 1.1e-3), (1.5e9, 2.6e8, 1.3e-3)]
  runs = [_run(f"b{i}", {s: c[i] for s, c in caps.items()}, *progs[i], bucket=i,
               caps=caps if i < 2 else None) for i in range(3)]
  padded = _run("pad", {s: B * T for s, T in seq.items()}, 4e9, 9e8, 4e-3)
  r = JB.combine(padded, runs, batches=40, seed=7)
  # the same batches by hand: smallest bucket with every stream's total <= its capacity
  use, real, comp, byt, bound, picks = 0.0, 0.0, 0.0, 0.0, 0.0, []
  for b in range(40):
    L = TS.draw_lengths(schema, seq, B, "preset", 7 + b)
    i = next((i for i in range(3) if all(L[s].sum() <= c[i] for s, c in caps.items())), 2)
    picks.append(i)
    batch = {"surface": np.zeros(B, np.int32), "events": {s: {"length": v} for s, v in L.items()}}
    use += batch_flops(cfg, schema, batch)["train_step"]
    real += sum(float(v.sum()) for v in L.values())
    comp, byt, bound = comp + progs[i][0], byt + progs[i][1], bound + progs[i][2]
  assert len(set(picks)) > 1, picks
  np.testing.assert_allclose(r["bucket_share"], np.bincount(picks, minlength=3) / 40)
  q = r["buckets"]
  np.testing.assert_allclose(q["useful_share"], use / comp, rtol=1e-9)
  np.testing.assert_allclose(q["bytes_per_real_event"], byt / real, rtol=1e-9)
  np.testing.assert_allclose(q["useful_mfu_bound"], use / (bound * 1e15), rtol=1e-9)
  np.testing.assert_allclose(r["one_bucket"]["useful_share"], use / (40 * progs[2][0]))
  np.testing.assert_allclose(r["padded"]["useful_share"], use / (40 * 4e9))
  assert r["dropped_events_per_batch"] == 0
  bad = [dict(x) for x in runs]
  bad[1] = dict(bad[1], useful=dict(bad[1]["useful"], tokens={"click": 999, "impression": 448}))
  with pytest.raises(SystemExit, match="bucket 1 is"):
    JB.combine(padded, bad, batches=2, seed=7)


def test_gemm_only_floor_charges_attention_and_gdpa_only_their_gemms():
  """The floor: attention and GDPA rows' bytes replaced by their GEMM bytes, other groups kept,
  bound = max(compute, memory) + launches; absent without roofline rows."""
  caps = {"click": [B * 32], "impression": [B * 32]}
  rows = [{"group": "attention", "bytes": 6e7, "gemm_bytes": 2e7},
          {"group": "GDPA", "bytes": 3e7, "gemm_bytes": 1e7},
          {"group": "MoWE", "bytes": 5e7, "gemm_bytes": 4e7}]
  run = _run("b0", {s: c[0] for s, c in caps.items()}, 1e9, 2e8, 2e-4, bucket=0, caps=caps,
             rows=rows)
  padded = _run("pad", {"click": B * 32, "impression": B * 32}, 4e9, 9e8, 4e-3)
  r = JB.combine(padded, [run], batches=3, seed=7)
  floor_bytes = 2e8 - 9e7 + 3e7
  floor_s = max(1e9 / 1e15, floor_bytes / 1e12) + 10 * 1e-6
  real = 2e8 / r["buckets"]["bytes_per_real_event"]         # mean real events per batch
  g = r["buckets_gemm_only"]
  np.testing.assert_allclose(g["bytes_per_real_event"], floor_bytes / real, rtol=1e-9)
  np.testing.assert_allclose(g["useful_mfu_bound"] / r["buckets"]["useful_mfu_bound"],
                             2e-4 / floor_s, rtol=1e-9)
  assert "buckets_gemm_only" not in JB.combine(padded, [dict(run, roofline=dict(
      run["roofline"], rows=[]))], batches=3, seed=7)


def test_group_floors_follow_the_bucket_each_batch_takes():
  """Per scope group: the mean over the batches of the bytes, compulsory bytes and launches of
  the program each batch takes, their ratio; the floor's bytes per real event and bound."""
  caps = {"click": [320, B * 32], "impression": [448, B * 32]}
  groups = [{"MoWE": {"bytes": 8e7, "floor_bytes": 1e7, "launches": 6, "pallas_bytes": 3e7,
                      "gemm_bytes": 1e7, "saved_bytes": 2e7},
             "HSP": {"bytes": 4e7, "floor_bytes": 2e7, "launches": 4}},
            {"MoWE": {"bytes": 9e7, "floor_bytes": 1e7, "launches": 6, "pallas_bytes": 4e7,
                      "gemm_bytes": 2e7, "saved_bytes": 3e7},
             "HSP": {"bytes": 6e7, "floor_bytes": 3e7, "launches": 5}}]
  runs = []
  for i in range(2):
    r = _run(f"b{i}", {s: c[i] for s, c in caps.items()}, 1e9 * (i + 1), 2e8, 1e-3, bucket=i,
             caps=caps if i < 1 else None)
    r["roofline"]["groups"] = groups[i]
    r["roofline"]["xla"]["launches"] = 10 + i
    runs.append(r)
  padded = _run("pad", {"click": B * 32, "impression": B * 32}, 4e9, 9e8, 4e-3)
  r = JB.combine(padded, runs, batches=30, seed=7)
  share = r["bucket_share"]
  assert 0 < share[0] < 1, share
  mowe = r["groups"]["MoWE"]
  np.testing.assert_allclose(mowe["bytes"], share[0] * 8e7 + share[1] * 9e7, rtol=1e-9)
  np.testing.assert_allclose(mowe["floor_ratio"], mowe["bytes"] / 1e7, rtol=1e-9)
  # the kernels' and GEMMs' bytes alone, where the programs carry them
  np.testing.assert_allclose(mowe["kernel_gemm_ratio"], (share[0] * 4e7 + share[1] * 6e7) / 1e7,
                             rtol=1e-9)
  assert "kernel_gemm_ratio" not in r["groups"]["HSP"]
  # the values kept for the backward, where the programs carry them: the least ratio
  np.testing.assert_allclose(mowe["least_ratio"], 1 + (share[0] * 2e7 + share[1] * 3e7) / 1e7,
                             rtol=1e-9)
  assert "least_ratio" not in r["groups"]["HSP"]
  np.testing.assert_allclose(r["groups"]["HSP"]["launches"], share[0] * 4 + share[1] * 5)
  np.testing.assert_allclose(r["launches_per_batch"], share[0] * 10 + share[1] * 11)
  floor = share[0] * 3e7 + share[1] * 4e7                 # mean compulsory bytes per batch
  real = 2e8 / r["buckets"]["bytes_per_real_event"]
  np.testing.assert_allclose(r["floor"]["bytes_per_real_event"], floor / real, rtol=1e-9)
  bound = (share[0] * (max(1e9 / 1e15, 3e7 / 1e12) + 10e-6)
           + share[1] * (max(2e9 / 1e15, 4e7 / 1e12) + 11e-6))
  np.testing.assert_allclose(r["floor"]["useful_mfu_bound"] / r["buckets"]["useful_mfu_bound"],
                             r["buckets"]["bound_ms_mean"] / 1e3 / bound, rtol=1e-9)
  # every group at most FLOOR_RATIO x its floor (what issue #38's last target would buy): MoWE
  # down to that, HSP (under it) as it is
  R = TS.FLOOR_RATIO
  capped = [min(8e7, R * 1e7) + min(4e7, R * 2e7), min(9e7, R * 1e7) + min(6e7, R * 3e7)]
  assert capped[0] < 1.2e8 and capped[1] < 1.5e8
  at = r["at_floor_ratio"]
  assert at["ratio"] == R
  np.testing.assert_allclose(at["bytes_per_real_event"],
                             (share[0] * capped[0] + share[1] * capped[1]) / real, rtol=1e-9)
  bound = (share[0] * (max(1e9 / 1e15, capped[0] / 1e12) + 10e-6)
           + share[1] * (max(2e9 / 1e15, capped[1] / 1e12) + 11e-6))
  np.testing.assert_allclose(at["useful_mfu_bound"] / r["buckets"]["useful_mfu_bound"],
                             r["buckets"]["bound_ms_mean"] / 1e3 / bound, rtol=1e-9)
  # each group over the ratio alone: only MoWE is (its ratio 8.x), so the same figures
  assert set(at["alone"]) == {"MoWE"}
  np.testing.assert_allclose(at["alone"]["MoWE"]["useful_mfu_bound"], at["useful_mfu_bound"],
                             rtol=1e-12)


def test_fused_targets_by_config_and_batch():
  """Issue #38's targets: mid b256 MFU >= 15% and <= 1,200 launches, each group <= 2.5x its
  floor; a config without targets gets only the floor ratios."""
  r = {"config": "mid", "global_batch": 256, "launches_per_batch": 1300.0,
       "buckets": {"useful_mfu_bound": 0.151, "bytes_per_real_event": 2e5},
       "groups": {"MoWE": {"floor_ratio": 2.6, "least_ratio": 2.55},
                  "GDPA": {"floor_ratio": 2.5}}}
  t = JB.fused_targets(r)
  assert t["useful_mfu_bound"]["met"] and not t["launches_per_batch"]["met"]
  assert not t["floor_ratio/MoWE"]["met"] and t["floor_ratio/GDPA"]["met"]
  assert t["floor_ratio/MoWE"]["least"] == 2.55 and "least" not in t["floor_ratio/GDPA"]
  assert "bytes_per_real_event" not in t
  assert set(JB.fused_targets(dict(r, config="tiny"))) == {"floor_ratio/MoWE", "floor_ratio/GDPA"}


def test_groups_brought_to_the_floor_ratio_together_and_alone():
  """Every group over FLOOR_RATIO x its floor brought down to it, the others as they are; and
  each such group alone: bytes and bound (max(compute, memory) + launches) by hand."""
  caps = {"click": [B * 32], "impression": [B * 32]}
  run = _run("b0", {s: c[0] for s, c in caps.items()}, 1e9, 1.7e8, 2e-4, bucket=0, caps=caps)
  run["roofline"]["groups"] = {"A": {"bytes": 1e8, "floor_bytes": 1e7, "launches": 4},
                               "B": {"bytes": 6e7, "floor_bytes": 1e7, "launches": 3},
                               "C": {"bytes": 1e7, "floor_bytes": 1e7, "launches": 3}}
  padded = _run("pad", {"click": B * 32, "impression": B * 32}, 4e9, 9e8, 4e-3)
  r = JB.combine(padded, [run], batches=3, seed=7)
  R = TS.FLOOR_RATIO
  real = 1.7e8 / r["buckets"]["bytes_per_real_event"]
  mfu = lambda nbytes: (r["buckets"]["useful_mfu_bound"] * 2e-4
                        / (max(1e9 / 1e15, nbytes / 1e12) + 10e-6))
  at = r["at_floor_ratio"]
  for got, want in ((at, 2 * R * 1e7 + 1e7), (at["alone"]["A"], R * 1e7 + 6e7 + 1e7),
                    (at["alone"]["B"], 1e8 + R * 1e7 + 1e7)):
    np.testing.assert_allclose(got["bytes_per_real_event"], want / real, rtol=1e-9)
    np.testing.assert_allclose(got["useful_mfu_bound"], mfu(want), rtol=1e-9)
  assert set(at["alone"]) == {"A", "B"}
