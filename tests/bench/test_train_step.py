"""bench/train_step.py --small runs the real train step on CPU and writes a complete JSON; the HLO
counters and the scope grouping; bench/collectives.py's HLO accounting on a hand-written module."""

import argparse
import contextlib
import glob
import io
import json
import os
import re
import shutil

import pytest

from bench import collectives, train_step
from bench.profiling import hlo_stats, roofline
from data import jagged
from data.synthetic import PRESETS, preset_schema
from kunlun.configs import types as model_config
from kunlun.models.flops import batch_flops


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
  """One ``--small --layers 1`` run (padded; 2 timed steps, 1 profiled) shared by the tests
  below: its result, its JSON and what it printed."""
  out_dir = tmp_path_factory.mktemp("small_run")
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    res = train_step.main(["--small", "--layers", "1", "--profile", "--profile_steps", "1",
                           "--steps", "2", "--out_dir", str(out_dir),
                           "--trace_dir", str(out_dir / "traces")])
  (path,) = out_dir.glob("train_step_tiny_xla_b16_L1_small.json")
  return res, path, printed.getvalue()


def test_small_run_writes_json_with_counts_memory_and_scopes(small_run):
  res, path, out = small_run
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
  rl = saved["roofline"]                                 # kernel column: GDPA at kernel bytes
  gd = [r for r in rl["rows"] if r["group"] == "GDPA"]
  assert gd and all(r["kernel_calls"] > 0 and r["kernel_bytes"] < r["bytes"] for r in gd)
  assert rl["xla"]["bytes"] == sum(r["bytes"] for r in rl["rows"]) > 0
  assert rl["xla"]["launches"] == h["kernel_launches"]
  assert abs(rl["flops"] / rl["flops_xla_cost_analysis"] - 1) < 0.05   # HLO count vs XLA's
  prof = saved["profile"]
  assert prof["launches_per_step"] > 100 and prof["device_ms_per_step"] > 0
  # the trace is kept where --trace_dir says (not in the system's temp folder)
  assert os.path.dirname(prof["trace_dir"]) == str(path.parent / "traces")
  assert glob.glob(os.path.join(prof["trace_dir"], "**", "*.xplane.pb"), recursive=True)
  assert {"GDPA", "optimizer", "embeddings"} <= set(prof["by_group_ms"])
  assert "tiny_xla_b16_L1_small" in out and "device ms/step by scope" in out
  assert "CPU compile standing in for the GPU" in out


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
  # ops without metadata take a neighbour's scope: the copy its GDPA operand's, the multiply
  # and the all-reduce their optimizer user's (through the get-tuple-element)
  assert h["launches_by_group"] == {"GDPA": 2, "optimizer": 3, "other": 1}
  assert hlo_stats.scope_group("jit(s)/transpose(jvp(Kunlun))/layer_0/PFFN/GDPA/dot") == "GDPA"
  assert hlo_stats.scope_group("jit(s)/Kunlun/embed_click/EventEmbed/gather") == "embeddings"
  # the 64-element all-reduce result is sliced to 1/8 at partition-id (a reduce-scatter on GPU);
  # the 16-element one is not
  sliced = collectives.sliced_all_reduces(HLO)
  assert [(c["name"], c["bytes"], c["group"]) for c in sliced] == [("e0", 256, 8)]
  summary, cond = collectives.per_execution_summary(HLO)
  assert set(summary) == {"all-reduce"} and cond["conditionals"] == 1
  assert cond["fallback_wire_bytes"] == 64 * 7 / 8            # the skipped branch's all-gather


# ---- roofline: bytes and FLOPs per launched op, kernel column ------------------------------

_OPT = 'metadata={op_name="jit(f)/optimizer/mul"}'
_GDPA = 'metadata={op_name="jit(f)/jvp(Kunlun)/layer_0/click_hsp/HSP/GDPA/dot_general"}'
_ATT = ('metadata={op_name="jit(f)/jvp(Kunlun)/layer_1/click_attention/SeqAttention/'
        'click_attention._attend/SoftmaxAttention/convert_element_type"}')
_MOWE = 'metadata={op_name="jit(f)/transpose(jvp(Kunlun))/layer_0/mowe/MoWE/add"}'
ROOF_HLO = f"""HloModule m, entry_computation_layout={{()->f32[4,8]}}

%fused_mul (p0: f32[4,8], p1: f32[4,8]) -> f32[4,8] {{
  %p0 = f32[4,8]{{1,0}} parameter(0)
  %p1 = f32[4,8]{{1,0}} parameter(1)
  %m = f32[4,8]{{1,0}} multiply(%p0, %p1)
  ROOT %e = f32[4,8]{{1,0}} exponential(%m)
}}

%body (s: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {{
  %s = (s32[], f32[4,8]{{1,0}}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %y = f32[4,8]{{1,0}} get-tuple-element(%s), index=1
  %y2 = f32[4,8]{{1,0}} add(%y, %y), {_MOWE}
  ROOT %o = (s32[], f32[4,8]{{1,0}}) tuple(%i, %y2)
}}

%cond (s: (s32[], f32[4,8])) -> pred[] {{
  %s = (s32[], f32[4,8]{{1,0}}) parameter(0)
  ROOT %t = pred[] constant(true)
}}

ENTRY %main (x: f32[4,8], w: bf16[8,16]) -> f32[4,8] {{
  %x = f32[4,8]{{1,0}} parameter(0)
  %w = bf16[8,16]{{1,0}} parameter(1)
  %c = bf16[4,8]{{1,0}} convert(%x), {_ATT}
  %d = f32[4,16]{{1,0}} dot(%c, %w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, {_GDPA}
  %f = f32[4,8]{{1,0}} fusion(%x, %x), kind=kLoop, calls=%fused_mul, {_OPT}
  %z = s32[] constant(0)
  %t0 = (s32[], f32[4,8]{{1,0}}) tuple(%z, %f)
  %wh = (s32[], f32[4,8]{{1,0}}) while(%t0), condition=%cond, body=%body, backend_config={{"known_trip_count":{{"n":"3"}}}}
  ROOT %r = f32[4,8]{{1,0}} get-tuple-element(%wh), index=1
}}
"""


def test_roofline_bytes_flops_and_kernel_column_of_a_hand_written_module():
  costs = {c["name"]: c for c in roofline.op_costs(ROOF_HLO)}
  assert set(costs) == {"c", "d", "f", "y2"}                   # launches only
  # convert: reads f32[4,8] (128 B), writes bf16[4,8] (64 B)
  assert (costs["c"]["bytes_in"], costs["c"]["bytes_out"], costs["c"]["flops"]) == (128, 64, 0)
  # dot: bf16[4,8] + bf16[8,16] in, f32[4,16] out; 2 * 64 outputs * 8 contracted
  assert (costs["d"]["bytes_in"], costs["d"]["bytes_out"]) == (64 + 256, 256)
  assert costs["d"]["flops"] == 2 * 64 * 8
  # fusion(x, x): x read once; multiply = 32 FLOPs, exp = 32 transcendentals
  f = costs["f"]
  assert (f["bytes_in"], f["bytes_out"], f["flops"], f["transcendentals"]) == (128, 128, 32, 32)
  assert costs["y2"]["times"] == 3 and costs["f"]["times"] == 1   # while body: its trip count
  calls = [{"kind": "gdpa", "scope": "jvp(Kunlun)/layer_0/click_hsp/HSP/GDPA", "bytes": 1000,
            "launches": 3},
           {"kind": "attention", "scope": "jvp(Kunlun)/layer_1/click_attention/SeqAttention/"
            "click_attention._attend/SoftmaxAttention", "bytes": 50, "launches": 3}]
  rl = roofline.roofline(list(costs.values()), calls, towers=("click", "impression"), examples=2,
                         peak_flops=1e3, bandwidth=100.0, launch_s=1.0)
  rows = {(r["group"], r["tower"]): r for r in rl["rows"]}
  assert set(rows) == {("GDPA", "click"), ("attention", "click"), ("optimizer", ""),
                       ("MoWE", "")}
  g, a, m = rows[("GDPA", "click")], rows[("attention", "click")], rows[("MoWE", "")]
  assert (g["bytes"], g["kernel_bytes"], g["launches"], g["kernel_launches"]) == (576, 1000, 1, 3)
  assert (a["bytes"], a["kernel_bytes"], a["kernel_launches"]) == (192, 50, 3)
  assert (m["bytes"], m["kernel_bytes"], m["launches"], m["flops"]) == (3 * 256, 3 * 256, 3, 96)
  xla_bytes = 192 + 576 + 256 + 768
  assert rl["xla"]["bytes"] == xla_bytes and rl["xla"]["launches"] == 6
  assert rl["kernel"]["bytes"] == xla_bytes - 192 - 576 + 50 + 1000
  assert rl["flops"] == 1024 + 32 + 96 and rl["xla"]["bytes_per_example"] == xla_bytes / 2
  # bound = max(flops / peak, bytes / bandwidth) + launches * launch_s
  assert rl["xla"]["bound_s"] == max(1152 / 1e3, xla_bytes / 100.0) + 6.0
  assert "CPU compile" in rl["note"]
  assert roofline.scope_tower("a/layer_2/conversion_final_hsp/HSP", ("click", "conversion")) \
      == "conversion"
  assert roofline.scope_tower("a/Kunlun/embed_click/EventEmbed", ("click",)) == "click"
  assert roofline.scope_tower("a/layer_0/mowe/MoWE", ("click",)) == ""


def test_kernel_formulas_and_recorded_calls():
  """The kernel byte formulas by hand, and ``record_kernels`` on a differentiated trace of a
  banded softmax attention (T > 3 chunks) and an HSP (GDPA with a shared q)."""
  import jax
  import jax.numpy as jnp

  from kunlun.nn.attention import SeqAttention
  from kunlun.nn.hsp import HSP
  S = jax.ShapeDtypeStruct
  q, kv = S((2, 64, 2, 8), jnp.float32), S((2, 64, 2, 8), jnp.float32)
  one = 2 * 64 * 2 * 8 * 4
  lse = 2 * 2 * 64 * 4
  flash = roofline.flash_attention_kernel(q, kv, kv)
  assert flash["bytes"] == (3 * one + one + lse) + (3 * one + 2 * one + lse + 3 * one)
  # shared q [1, 4, 2, 8] bf16, k/v [3, 10, 2, 8] bf16, output batch 3
  qs, ks = S((1, 4, 2, 8), jnp.bfloat16), S((3, 10, 2, 8), jnp.bfloat16)
  g = roofline.gdpa_kernel(qs, ks, ks, out_batch=3, q_shared=True, kv_shared=False)
  qb, kb, ob, dq32 = 4 * 16 * 2, 3 * 10 * 16 * 2, 3 * 4 * 16 * 2, 3 * 4 * 16 * 4
  fwd = qb + 2 * kb + ob
  assert g == {"bytes": fwd + 2 * fwd + dq32 + 2 * kb + dq32 + qb, "launches": 4}

  att = SeqAttention(heads=2, window=4, dtype=jnp.float32)
  hsp = HSP(n_seed=4, n_sum=2, heads=2, rank=2)
  s = jnp.ones((2, 64, 16))
  lengths, age = jnp.array([64, 40]), jnp.zeros((2, 64))
  pa = jax.eval_shape(att.init, jax.random.key(0), s, lengths, age)      # shapes: tracing only
  ph = jax.eval_shape(hsp.init, jax.random.key(1), s, lengths)

  def loss(pa, ph):
    return (jnp.sum(att.apply(pa, s, lengths, age)) + jnp.sum(hsp.apply(ph, s, lengths)))

  with roofline.record_kernels() as calls:
    jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(pa, ph)
  kinds = sorted(c["kind"] for c in calls)
  assert kinds == ["attention", "gdpa"], calls          # QK-norm / rotary: XLA ops, not kernels
  att_call = next(c for c in calls if c["kind"] == "attention")
  assert att_call["bytes"] == roofline.flash_attention_kernel(q, kv, kv)["bytes"]
  assert "._attend/SoftmaxAttention" in att_call["scope"]
  gd = next(c for c in calls if c["kind"] == "gdpa")
  hq, hk = S((1, 4, 2, 8), jnp.float32), S((2, 64, 2, 8), jnp.float32)
  assert gd["bytes"] == roofline.gdpa_kernel(hq, hk, hk, 2, True, False)["bytes"]


def test_pool_projecting_its_keys_is_recorded_with_its_bytes_and_flops():
  """The fused HSP pool (``packed.gdpa_pool_proj``, Pallas backend, traced only): its byte
  formula by hand, k and v stored or (the seeds whole in the pool's backward) projected again,
  and ``record_kernels`` keeps one "gdpa" call with those bytes and the pool's FLOPs, and one
  "projection" with the projections' (forward, projected again, back-projected and the weight
  gradients, ``pallas_kernels.wgrad``'s: 2 N d H D each, 8 for the two); the output map's
  weight gradient (``wgrad`` through ``packed.dense_kernel``) one more; passing x through
  (``pass_tokens``) adds the two cotangents the backward reads."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from data.jagged import pack_events
  from kunlun.nn import packed
  from kunlun.nn.hsp import HSP
  from pallas_kernels import jagged_pallas
  from pallas_kernels.jagged import Jagged
  S = jax.ShapeDtypeStruct
  N, d, H, D, seeds, Bx = 64, 64, 2, 32, 4, 3
  q, x, o = S((seeds, H, D), jnp.float32), S((N, d), jnp.float32), S((Bx, seeds, H, D), jnp.float32)
  w = (S((d, H, D), jnp.float32),) * 2
  qb, xb, ob, wb, kv = seeds * H * D * 4, N * d * 4, Bx * seeds * H * D * 4, 2 * d * H * D * 4, \
      2 * N * H * D * 4
  rb = N * 4                                                   # the rows' r, float32
  stored = ((qb + xb + wb + ob + kv) + (qb + kv + ob + qb + kv) + (xb + kv + wb + xb + rb)
            + (xb + rb + kv + wb))
  assert roofline.pool_proj_kernel(q, x, w, o) == {"bytes": stored, "launches": 4}
  # 4 seeds: the pool's backward is one kernel, which projects k, v again: the forward writes
  # no k, v, and the pool's backward reads x and the weights in their place
  assert jagged_pallas.pool_proj_recomputes(q, x, w)
  want = ((qb + xb + wb + ob) + (qb + xb + wb + ob + qb + kv) + (xb + kv + wb + xb + rb)
          + (xb + rb + kv + wb))
  assert roofline.pool_proj_kernel(q, x, w, o, True) == {"bytes": want, "launches": 4}

  toks, offsets, seg, pos, _ = pack_events(
      {"s": np.ones((Bx, 30, d), np.float32)}, np.array([30, 0, 12], np.int32), N)
  jag = Jagged(*(jnp.asarray(a) for a in (offsets, seg, pos)))
  hsp = HSP(n_seed=seeds, n_sum=2, heads=H, rank=2, backend="pallas", t_max=30)
  s = packed.Packed(jnp.asarray(toks["s"]), jag)
  p = jax.eval_shape(hsp.init, jax.random.key(0), s, None)
  with roofline.record_kernels() as calls:
    jax.make_jaxpr(jax.grad(lambda p, x: jnp.sum(hsp.apply(p, packed.Packed(x, jag), None)),
                            argnums=(0, 1)))(p, s.value)
  gd = [c for c in calls if c["kind"] == "gdpa"]
  pr = [c for c in calls if c["kind"] == "projection" and "/HSP" in c["scope"]
        and "kron" not in c["scope"] and "_tail" not in c["scope"]]
  assert len(gd) == 1 and gd[0]["bytes"] == want, calls
  assert gd[0]["flops"] == roofline.attention_flops(1, seeds, N, H, D)
  # forward, projected again, back-projected, weight gradients: 2 N d H D each, 8 for the two
  assert len(pr) == 1 and pr[0]["flops"] == 8 * 2 * N * d * H * D, calls
  # the output map's weight gradient (packed.dense_kernel): 2 (examples x seeds) (H D) d
  (out,) = [c for c in calls if c["scope"].endswith("HSP._tail")]
  assert out["kind"] == "projection" and out["flops"] == 2 * Bx * seeds * H * D * d, calls
  # x passed through to the PFFN (HSP(pass_tokens=True)): the projections' backward kernel also
  # reads the two pass-throughs' cotangents
  through = want + 2 * xb
  assert roofline.pool_proj_kernel(q, x, w, o, True, True) == {"bytes": through, "launches": 4}
  hsp = hsp.clone(pass_tokens=True)

  def passed(p, x):
    y, (xl, xi) = hsp.apply(p, packed.Packed(x, jag), None)
    return jnp.sum(y) + jnp.sum(xl * xi)

  with roofline.record_kernels() as calls:
    jax.make_jaxpr(jax.grad(passed, argnums=(0, 1)))(p, s.value)
  gd = [c for c in calls if c["kind"] == "gdpa"]
  assert len(gd) == 1 and gd[0]["bytes"] == through, calls


def test_fused_qkv_attention_is_recorded_with_its_flops():
  """A packed softmax attention on the Pallas backend whose input side and attention are one op
  (``packed.fused_qkv_attention``, traced only): ``record_kernels`` keeps one "projection" call
  on the attention's scope with the attention's FLOPs (the band's pairs, as ``jagged_calls``)
  and the projections' (``fused_projection_flops``: forward, recomputed q and k, back-projected,
  weight gradients), and no separate attention call."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from data.jagged import pack_events
  from kunlun.nn import packed
  from kunlun.nn.attention import SeqAttention
  from pallas_kernels.jagged import Jagged
  N, d, H, window, Bx = 64, 64, 2, 5, 3
  D = d // H
  toks, offsets, seg, pos, _ = pack_events(
      {"s": np.ones((Bx, 30, d), np.float32)}, np.array([30, 0, 12], np.int32), N)
  jag = Jagged(*(jnp.asarray(a) for a in (offsets, seg, pos)))
  att = SeqAttention(heads=H, window=window, dtype=jnp.bfloat16, backend="pallas")
  s = packed.Packed(jnp.asarray(toks["s"]), jag)
  age = jnp.zeros((N,), jnp.float32)
  p = jax.eval_shape(att.init, jax.random.key(0), s, None, age)
  with roofline.record_kernels() as calls:
    jax.make_jaxpr(jax.grad(lambda p, x: jnp.sum(
        att.apply(p, packed.Packed(x, jag), None, age).value.astype(jnp.float32)),
        argnums=(0, 1)))(p, s.value)
  assert not [c for c in calls if c["kind"] == "attention"], calls
  (pr,) = [c for c in calls if c["kind"] == "projection" and "out" not in c["scope"]]
  assert "SeqAttention" in pr["scope"], pr
  want = (roofline.attention_flops(1, N, N, H, D, window)
          + roofline.fused_projection_flops(N, d, 3, H, D, 2))
  assert pr["flops"] == want


def test_record_kernels_sees_every_seq_attention_of_a_model():
  """On the tiny model's differentiated forward, ``record_kernels`` records one softmax-attention
  call per ``SeqAttention`` call (counted independently by flax's method interception), each in
  its tower's ``._attend`` scope: the kernel column cannot silently lose the attention."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp

  from data.synthetic import PRESETS, preset_schema
  from kunlun.configs import types as model_config
  from kunlun.models.build import build_model
  from kunlun.nn.attention import SeqAttention

  cfg = train_step.load_config("tiny", [])
  schema = preset_schema(PRESETS[cfg.data.preset])
  batch = train_step.synthetic_batch(schema, 2, model_config.seq_lens(cfg), "uniform")
  model = build_model(cfg, schema)
  params = jax.eval_shape(lambda b: model.init(jax.random.key(0), b, train=False), batch)
  seen = []

  def count(f, args, kwargs, context):
    if isinstance(context.module, SeqAttention) and context.method_name == "__call__":
      seen.append(context.module.name)
    return f(*args, **kwargs)

  def loss(p):
    out = model.apply(p, batch, train=True, rngs={"dropout": jax.random.key(1)})
    return sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(out))

  with roofline.record_kernels() as calls, nn.intercept_methods(count):
    jax.make_jaxpr(jax.grad(loss))(params)
  att = [c for c in calls if c["kind"] == "attention"]
  towers = list(cfg.model.towers.keys())
  assert seen and len(att) == len(seen), (seen, att)
  assert all("._attend" in c["scope"] and roofline.scope_tower(c["scope"], towers)
             for c in att)


def test_fenced_kernel_calls_keep_values_and_gradients():
  """``record_kernels`` fences the recorded calls with optimization barriers: the program
  traced under it computes the same output and gradients."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from kunlun.nn.attention import SeqAttention
  att = SeqAttention(heads=2, window=4, dtype=jnp.float32)
  rng = np.random.default_rng(0)
  s = jnp.asarray(rng.normal(size=(2, 64, 16)), jnp.float32)
  lengths, age = jnp.array([64, 40]), jnp.asarray(rng.uniform(0, 1e4, (2, 64)), jnp.float32)
  p = jax.jit(att.init)(jax.random.key(0), s, lengths, age)     # eager: ~100 op compiles
  f = lambda p, s: jax.value_and_grad(
      lambda p, s: jnp.sum(jnp.sin(att.apply(p, s, lengths, age))), argnums=(0, 1))(p, s)
  want = jax.jit(f)(p, s)
  with roofline.record_kernels() as calls:         # a new function: traced afresh, not cached
    lowered = jax.jit(lambda p, s: f(p, s)).lower(p, s)
  assert [c["kind"] for c in calls] == ["attention"]
  got = lowered.compile()(p, s)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_fence_leaves_the_query_norms_backward_to_fuse():
  """With the PFFN's LayerNorm inside the GDPA kernels (``q_norm``), ``record_kernels`` fences the
  op's keys, values and output but not its query input: the norm's backward (XLA's, inside the
  op) then fuses with the other cotangents of x, as the norm's did outside the op. In the
  differentiated jaxpr only the output's fence (its value and its cotangent) holds a token-sized
  ``[N, H, D]`` array; with the query fenced too there would be four."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from data.jagged import pack_events
  from kunlun.nn import packed
  from kunlun.nn.pffn import PFFN
  from pallas_kernels.jagged import Jagged
  N, d, H, Bx = 64, 32, 2, 3
  toks, offsets, seg, pos, _ = pack_events(
      {"s": np.ones((Bx, 30, d), np.float32)}, np.array([30, 0, 12], np.int32), N)
  jag = Jagged(*(jnp.asarray(a) for a in (offsets, seg, pos)))
  x = jnp.asarray(toks["s"]) * jnp.arange(d, dtype=jnp.float32)
  k = v = jnp.ones((Bx, 4, H, d // H), jnp.float32)
  m = PFFN(H, backend="pallas", dtype=jnp.float32)
  p = m.init(jax.random.key(0), packed.Packed(x, jag), None, k, v)
  f = lambda x, k, v: jnp.sum(m.apply(p, packed.Packed(x, jag), None, k, v).value)
  with roofline.record_kernels() as calls:
    jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2)))(x, k, v)
  assert [c["kind"] for c in calls] == ["gdpa"]

  def barriers(jx):
    for e in jx.eqns:
      if e.primitive.name == "optimization_barrier":
        yield e
      for v in e.params.values():                     # custom_vjp, pjit, ... bodies
        for j in (v if isinstance(v, (tuple, list)) else (v,)):
          inner = getattr(j, "jaxpr", None)
          if inner is not None and hasattr(inner, "eqns"):
            yield from barriers(inner)
          elif hasattr(j, "eqns"):
            yield from barriers(j)

  tok = [e for e in barriers(jaxpr.jaxpr)
         if any(getattr(a.aval, "shape", None) == (N, H, d // H) for a in e.invars)]
  assert len(tok) == 2, tok


def test_param_casts_counts_cast_sites():
  """``bench.profiling.param_casts``: a leaf cast to bf16 at one site, one cast at two sites (also inside
  a remat), one also read in float32, one never cast."""
  import jax
  import jax.numpy as jnp

  from bench.profiling import param_casts

  def f(p, x):
    a = x @ p["once"].astype(jnp.bfloat16)
    b = jax.checkpoint(lambda w: a @ w.astype(jnp.bfloat16))(p["twice"])
    c = b @ p["twice"].astype(jnp.bfloat16).T
    return jnp.sum(c.astype(jnp.float32) * p["mixed"][0, 0] + p["mixed"].astype(jnp.bfloat16)[0, 0]
                   + p["f32"][0, 0])

  S = jax.ShapeDtypeStruct
  p = {"f32": S((4, 4), jnp.float32), "mixed": S((4, 4), jnp.float32),
       "once": S((4, 4), jnp.float32), "twice": S((4, 4), jnp.float32)}
  res = dict(zip(sorted(p), param_casts.cast_uses(f, p, S((2, 4), jnp.bfloat16)), strict=True))
  assert res["once"] == (jnp.dtype(jnp.bfloat16), 1)
  assert res["twice"] == (jnp.dtype(jnp.bfloat16), 2)
  assert res["mixed"][0] is None and res["f32"][0] is None
  assert param_casts.summary(f, p, S((2, 4), jnp.bfloat16)) == {
      "leaves": 4, "cast_16bit": 2, "cast_sites": 3, "max_sites": 2}


SLICE_HLO = """HloModule s

%fused_slice (p0: f32[1000], p1: f32[10]) -> f32[10] {
  %p0 = f32[1000]{0} parameter(0)
  %p1 = f32[10]{0} parameter(1)
  %s = f32[10]{0} slice(%p0), slice={[20:30]}
  ROOT %a = f32[10]{0} add(%s, %p1)
}

%fused_dus (q0: f32[1000], q1: f32[10], q2: s32[]) -> f32[1000] {
  %q0 = f32[1000]{0} parameter(0)
  %q1 = f32[10]{0} parameter(1)
  %q2 = s32[] parameter(2)
  ROOT %d = f32[1000]{0} dynamic-update-slice(%q0, %q1, %q2)
}

ENTRY %main (x: f32[1000], y: f32[10], i: s32[]) -> f32[1000] {
  %x = f32[1000]{0} parameter(0)
  %y = f32[10]{0} parameter(1)
  %i = s32[] parameter(2)
  %f = f32[10]{0} fusion(%x, %y), kind=kLoop, calls=%fused_slice, metadata={op_name="jit(f)/optimizer/add"}
  ROOT %u = f32[1000]{0} fusion(%x, %f, %i), kind=kLoop, calls=%fused_dus, metadata={op_name="jit(f)/optimizer/dus"}
}
"""


def test_roofline_counts_sliced_operands_and_in_place_updates():
  """A fusion reading a slice of a buffer counts the slice; one updating a buffer in place
  (root dynamic-update-slice) reads nothing of it and writes only the update."""
  costs = {c["name"]: c for c in roofline.op_costs(SLICE_HLO)}
  assert (costs["f"]["bytes_in"], costs["f"]["bytes_out"]) == (40 + 40, 40)
  assert (costs["u"]["bytes_in"], costs["u"]["bytes_out"]) == (40 + 4, 40)


def test_packed_and_padded_runs_report_the_same_layout_fields(tmp_path, capsys, small_run):
  """``--jagged``: the synthetic batch packed at given capacities (below the batch's events: the
  oldest events of the longest histories dropped, the buffers exactly full) takes the packed
  path; padded and packed JSONs carry the same fields, checked against the batch's lengths
  (``data.jagged.fit_lengths``, independent of the bench), and the table prints the pair. The
  padded run is ``small_run``'s (the same program; its layout fields come before the steps)."""
  cap = {"click": 256, "impression": 320}
  base = ["--small", "--layers", "1", "--compile_only", "--out_dir", str(tmp_path)]
  packed = train_step.main(base + ["--jagged", ",".join(f"{s}={n}" for s, n in cap.items())])
  err = capsys.readouterr().err                    # progress: the long steps announced
  assert "train_step: compiling the train step for cpu" in err and "compiled in" in err, err
  padded, padded_path, _ = small_run
  shutil.copy(padded_path, tmp_path)
  assert packed["name"] == "tiny_xla_b16_L1_packed_small" and packed["layout"] == "packed"
  assert padded["name"] == "tiny_xla_b16_L1_small" and padded["layout"] == "padded"
  saved = json.loads((tmp_path / "train_step_tiny_xla_b16_L1_packed_small.json").read_text())
  cfg = train_step.load_config("tiny", [])
  train_step.clip_layers(cfg, 1)
  schema, T = preset_schema(PRESETS[cfg.data.preset]), model_config.seq_lens(cfg)
  batch = train_step.synthetic_batch(schema, 16, T, "preset")
  lengths = {s: batch["events"][s]["length"] for s in T}
  kept = {s: jagged.fit_lengths(lengths[s], cap[s]) for s in T}
  u, p = saved["useful"], padded["useful"]
  assert u["tokens"] == cap and p["tokens"] == {s: 16 * n for s, n in T.items()}
  assert u["real_events"] == {s: int(k.sum()) for s, k in kept.items()} == cap   # exactly full
  assert u["dropped_events"] == {s: int(lengths[s].sum() - cap[s]) for s in T}
  assert all(v > 0 for v in u["dropped_events"].values()) and p["dropped_events"] == {}
  assert p["real_events"] == {s: int(lengths[s].sum()) for s in T}
  for s in T:
    batch["events"][s]["length"] = kept[s]
  assert u["flops_useful"] == saved["flops"]["analytic_actual_lengths"] == batch_flops(
      cfg, schema, batch)["train_step"]
  for r in (u, p):
    rl = (saved if r is u else padded)["roofline"]
    n = sum(r["real_events"].values())
    assert r["flops_compiled"] == rl["flops"] and r["useful_share"] == r["flops_useful"] / rl["flops"]
    assert r["bytes_per_real_event"] == rl["xla"]["bytes"] / n and r["bound_s"] == rl["xla"]["bound_s"]
    assert r["useful_mfu_bound"] == r["flops_useful"] / (r["bound_s"] * rl["device"]["peak_flops"])
  # the packed path ran: jagged GDPA calls over the N-token buffers, none of the padded op
  pffn = [c for c in saved["kernel_calls"] if c["kind"] == "gdpa" and "/PFFN" in c["scope"]]
  assert len(pffn) == 2
  for c in pffn:
    t = cfg.model.towers[roofline.scope_tower(c["scope"], list(T))]
    assert c["flops"] == roofline.attention_flops(1, cap[roofline.scope_tower(c["scope"], list(T))],
                                                  t.n_kv, t.heads, t.width // t.heads)
  capsys.readouterr()
  train_step.main(["--table", str(tmp_path / "*.json")])
  out = capsys.readouterr().out
  assert "padded -> packed" in out and "tiny xla b16 cpu: useful share" in out


def test_no_config_on_a_cpu_host_is_the_smoke_run():
  """Without --config a CPU host gets the --small run and a line saying what to pass for more
  (mid at its full batch asks ~100 GB there); a GPU, a deviceless --target or an explicit
  --config keep mid or what was given."""
  ns = lambda **kw: argparse.Namespace(**{"config": None, "target": "cpu", "small": False, **kw})
  a = ns()
  assert "--config mid --batch" in train_step.default_config(a, "cpu")
  assert a.small and a.config == "mid"                    # --small then runs tiny, batch 16
  for a, platform in ((ns(), "gpu"), (ns(target="h200"), "cpu"), (ns(config="dev"), "cpu")):
    assert train_step.default_config(a, platform) is None and not a.small
    assert a.config in ("mid", "dev")


def test_merge_runs_keys_each_run_by_its_name(tmp_path):
  """``--merge DIR OUT``: DIR's train_step_*.json as {"runs": {name: run}}; other files left out."""
  for name in ("a", "b"):
    (tmp_path / f"train_step_{name}.json").write_text(json.dumps({"name": name, "step_ms": 1.0}))
  (tmp_path / "other.json").write_text("{}")
  out = tmp_path / "merged.json"
  train_step.main(["--merge", str(tmp_path), str(out)])
  assert json.loads(out.read_text()) == {"runs": {"a": {"name": "a", "step_ms": 1.0},
                                                  "b": {"name": "b", "step_ms": 1.0}}}


def test_output_folders_are_made_before_the_compile(tmp_path, monkeypatch):
  """``--dump_hlo`` and ``--out_dir`` into folders that do not exist yet: made before the
  (minutes-long) compile, not found missing after it; a folder that cannot be made is a one-line
  exit before any work."""
  seen = []

  def run(args):                          # stands in for the compile: what exists when it starts
    seen.append(((tmp_path / "hlo").is_dir(), (tmp_path / "out").is_dir()))
    raise SystemExit("stop")

  monkeypatch.setattr(train_step, "run", run)
  with pytest.raises(SystemExit, match="stop"):
    train_step.main(["--small", "--out_dir", str(tmp_path / "out"),
                     "--dump_hlo", str(tmp_path / "hlo" / "step.hlo")])
  assert seen == [(True, True)]
  (tmp_path / "file").write_text("")
  with pytest.raises(SystemExit, match="--dump_hlo .*file/step.hlo: cannot make its folder"):
    train_step.main(["--small", "--dump_hlo", str(tmp_path / "file" / "step.hlo")])
  assert len(seen) == 1



def _assert_one_line(exc_info, why: str) -> None:
  """A ``SystemExit`` whose message is one line matching the regex ``why``."""
  msg = str(exc_info.value.code)
  assert len(msg.splitlines()) == 1 and re.search(why, msg), msg

@pytest.mark.parametrize("name, overrides, why", [
    ("nope", [], r"--config nope: not a preset of kunlun/configs \(.*mid.*prod.*tiny.*\) nor a "
                 r"\.py file"),
    ("../../train", [], r"not a preset"),
    ("types", [], r"not a preset"),                        # a module of kunlun/configs, no config
    ("missing/cfg.py", [], r"--config missing/cfg.py: no such file"),
    ("tiny", ["model.no_such_field=1"], r"--set model.no_such_field=1: the config has no "
                                        r"field model.no_such_field"),
    ("tiny", ["model"], r"--set 'model': expected key=value"),
])
def test_bad_config_or_override_is_a_one_line_error(name, overrides, why):
  with pytest.raises(SystemExit) as e:
    train_step.load_config(name, overrides)
  _assert_one_line(e, why)


@pytest.mark.parametrize("argv, why", [
    (["--batch", "-3"], r"--batch -3: must be at least 1"),
    (["--devices", "0"], r"--devices 0: must be at least 1"),
    (["--layers", "0"], r"--layers 0: must be at least 1"),
    (["--steps", "0"], r"--steps 0: must be at least 1"),
    (["--warmup", "-1"], r"--warmup -1: must be at least 0"),
    (["--profile_steps", "0"], r"--profile_steps 0: must be at least 1"),
    (["--jagged", "--jagged_buckets", "3", "--jagged_bucket", "3"],
     r"--jagged_bucket 3: must be 0 to 2 \(--jagged_buckets 3\)"),
    (["--peak_flops", "-1"], r"--peak_flops -1.0: must be positive"),
    (["--launch_us", "-2"], r"--launch_us -2.0: must be at least 0"),
])
def test_bad_numbers_are_one_line_errors_before_any_work(argv, why, monkeypatch):
  monkeypatch.setattr(train_step, "run", lambda a: pytest.fail("ran with bad flags"))
  with pytest.raises(SystemExit) as e:
    train_step.main(["--config", "tiny", "--out_dir", "/nonexistent/never/made"] + argv)
  _assert_one_line(e, why)


@pytest.mark.parametrize("argv, why", [
    (["--mesh", "data=3"], r"--mesh data=3: mesh \(ici\): sizes .* multiply to 3 but there are 1 "
                           r"devices"),
    (["--mesh", "data"], r"--mesh data: "),
    (["--rules", "nope"], r"--rules nope: unknown sharding rules preset 'nope'"),
])
def test_mesh_and_rules_errors_name_their_flag_in_one_line(argv, why, tmp_path):
  with pytest.raises(SystemExit) as e:
    train_step.main(["--config", "tiny", "--devices", "1", "--out_dir", str(tmp_path)] + argv)
  _assert_one_line(e, why)


def test_an_unknown_backend_is_a_usage_error(capsys):
  with pytest.raises(SystemExit) as e:
    train_step.main(["--config", "tiny", "--backend", "nope"])
  assert e.value.code == 2 and "argument --backend: invalid choice: 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("argv, why", [
    (["--merge", "{tmp}/none", "{tmp}/merged.json"], r"--merge: no train_step_\*\.json in .*none"),
    (["--table", "{tmp}/none*.json"], r"--table: no file matches .*none\*\.json"),
])
def test_merge_or_table_of_nothing_is_a_one_line_error(argv, why, tmp_path):
  with pytest.raises(SystemExit) as e:
    train_step.main([a.format(tmp=tmp_path) for a in argv])
  _assert_one_line(e, why)
  assert not (tmp_path / "merged.json").exists()
