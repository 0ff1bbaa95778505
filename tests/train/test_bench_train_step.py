"""bench/train_step.py --small runs the real train step on CPU and writes a complete JSON; the HLO
counters and the scope grouping; bench/collectives.py's HLO accounting on a hand-written module."""

import json

from bench import collectives, hlo_stats, train_step


def test_small_run_writes_json_with_counts_memory_and_scopes(tmp_path, capsys):
  res = train_step.main(["--small", "--layers", "1", "--profile", "--profile_steps", "1",
                         "--steps", "2", "--out_dir", str(tmp_path)])
  (path,) = tmp_path.glob("train_step_tiny_xla_b16_L1_small.json")
  saved = json.loads(path.read_text())
  assert saved["name"] == res["name"] and saved["versions"]["jax"] and saved["platform"] == "cpu"
  assert saved["last_step_ok"] and saved["step_ms"] > 0 and saved["examples_per_s"] > 0
  assert saved["mfu_analytic"] is None                   # no peak FLOP/s for a CPU
  assert saved["flops"]["xla_per_device"] > saved["flops"]["analytic_padded"] > 0
  # random lengths: the model count at actual lengths is below the padded one
  assert 0 < saved["flops"]["analytic_actual_lengths"] < saved["flops"]["analytic_padded"]
  m = saved["memory"]
  assert m["peak_estimate"] >= m["temp"] > 0 and m["peak_per_example"] == m["peak_estimate"] / 16
  h = saved["hlo"]
  assert h["hlo_instructions"] > h["top_level_ops"] >= h["kernel_launches"] >= h["fusions"] > 100
  assert {"GDPA", "PFFN", "HSP", "embeddings", "optimizer", "MoWE"} <= set(h["launches_by_group"])
  prof = saved["profile"]
  assert prof["launches_per_step"] > 100 and prof["device_ms_per_step"] > 0
  assert {"GDPA", "optimizer", "embeddings"} <= set(prof["by_group_ms"])
  out = capsys.readouterr().out
  assert "tiny_xla_b16_L1_small" in out and "device ms/step by scope" in out


HLO = """HloModule m, entry_computation_layout={()->f32[8]}

%fused_add (p0: f32[8]) -> f32[8] {
  %p0 = f32[8]{0} parameter(0)
  ROOT %add.1 = f32[8]{0} add(%p0, %p0), metadata={op_name="jit(f)/Kunlun/PFFN/GDPA/add"}
}

%region_0 (a: (f32[16])) -> f32[16] {
  %a = (f32[16]{0}) parameter(0)
  %g = f32[16]{0} get-tuple-element(%a), index=0
  ROOT %ag = f32[16]{0} all-gather(%g), replica_groups=[1,8]<=[8], dimensions={0}
}

%region_1 (b: (f32[16])) -> f32[16] {
  %b = (f32[16]{0}) parameter(0)
  ROOT %h = f32[16]{0} get-tuple-element(%b), index=0
}

ENTRY %main (x: f32[64], q: pred[]) -> f32[8] {
  %x = f32[64]{0} parameter(0)
  %q = pred[] parameter(1)
  %ar = (f32[64]{0}, f32[16]{0}) all-reduce(%x, %x), replica_groups=[1,8]<=[8], to_apply=%sum
  %e0 = f32[64]{0} get-tuple-element(%ar), index=0
  %e1 = f32[16]{0} get-tuple-element(%ar), index=1
  %pid = u32[] partition-id()
  %off = u32[] multiply(%pid, %pid)
  %sl = f32[8]{0} fusion(%e0, %off), kind=kLoop, calls=%fused_add, metadata={op_name="jit(f)/optimizer/add"}
  %t = (f32[16]{0}) tuple(%e1)
  %c = f32[16]{0} conditional(%q, %t, %t), branch_computations={%region_0, %region_1}
  %f = f32[8]{0} fusion(%sl), kind=kLoop, calls=%fused_add, metadata={op_name="jit(f)/Kunlun/PFFN/GDPA/add"}
  ROOT %r = f32[8]{0} copy(%f)
}
"""


def test_hlo_counters_scopes_and_collective_accounting():
  h = hlo_stats.hlo_stats(HLO)
  assert h["fusions"] == 2 and h["hlo_instructions"] == 19
  # launches: all-reduce, multiply, 2 fusions, copy, the all-gather of the conditional's branch
  assert h["kernel_launches"] == 6, h["launches_by_opcode"]
  assert h["launches_by_group"] == {"GDPA": 1, "optimizer": 1, "other": 4}
  assert hlo_stats.scope_group("jit(s)/transpose(jvp(Kunlun))/layer_0/PFFN/GDPA/dot") == "GDPA"
  assert hlo_stats.scope_group("jit(s)/Kunlun/embed_click/EventEmbed/gather") == "embeddings"
  # the 64-element all-reduce result is sliced to 1/8 at partition-id (a reduce-scatter on GPU);
  # the 16-element one is not
  sliced = collectives.sliced_all_reduces(HLO)
  assert [(c["name"], c["bytes"], c["group"]) for c in sliced] == [("e0", 256, 8)]
  summary, cond = collectives.per_execution_summary(HLO)
  assert set(summary) == {"all-reduce"} and cond["conditionals"] == 1
  assert cond["fallback_wire_bytes"] == 64 * 7 / 8            # the skipped branch's all-gather
