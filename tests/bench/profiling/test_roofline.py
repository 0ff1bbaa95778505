"""bench.profiling.roofline byte counting, slice by slice, on small hand-written HLO programs
(expected bytes counted by hand in each test)."""

from bench.profiling import roofline

ADAM_HLO = """HloModule adam

%fused_leaf (p0: f32[1000], p1: f32[1000], p2: f32[]) -> bf16[2,100] {
  %p0 = f32[1000]{0} parameter(0)
  %p1 = f32[1000]{0} parameter(1)
  %p2 = f32[] parameter(2)
  %lr = f32[1000]{0} broadcast(%p2), dimensions={}
  %m = f32[1000]{0} multiply(%p1, %lr)
  %n = f32[1000]{0} subtract(%p0, %m)
  %c = bf16[1000]{0} convert(%n)
  %b = bf16[10,100]{1,0} bitcast(%c)
  ROOT %s = bf16[2,100]{1,0} slice(%b), slice={[2:4], [0:100]}
}

%fused_mixed (q0: f32[1000], q1: f32[1000]) -> (f32[300], f32[]) {
  %q0 = f32[1000]{0} parameter(0)
  %q1 = f32[1000]{0} parameter(1)
  %e = f32[1000]{0} exponential(%q0)
  %r = f32[10,100]{1,0} reshape(%e)
  %s = f32[3,100]{1,0} slice(%r), slice={[0:3], [0:100]}
  %sb = f32[300]{0} bitcast(%s)
  %z = f32[] constant(0)
  %red = f32[] reduce(%q1, %z), dimensions={0}, to_apply=%sum
  ROOT %t = (f32[300]{0}, f32[]) tuple(%sb, %red)
}

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %r = f32[] add(%a, %b)
}

%fused_two (r0: f32[1000]) -> (f32[100], f32[1000]) {
  %r0 = f32[1000]{0} parameter(0)
  %n = f32[1000]{0} negate(%r0)
  %s = f32[100]{0} slice(%n), slice={[0:100]}
  ROOT %t = (f32[100]{0}, f32[1000]{0}) tuple(%s, %n)
}

ENTRY %main (w: f32[1000], g: f32[1000], lr: f32[]) -> bf16[2,100] {
  %w = f32[1000]{0} parameter(0)
  %g = f32[1000]{0} parameter(1)
  %lr = f32[] parameter(2)
  %leaf = bf16[2,100]{1,0} fusion(%w, %g, %lr), kind=kLoop, calls=%fused_leaf, metadata={op_name="jit(f)/optimizer/leaf"}
  %mixed = (f32[300]{0}, f32[]) fusion(%w, %g), kind=kLoop, calls=%fused_mixed, metadata={op_name="jit(f)/optimizer/mixed"}
  %two = (f32[100]{0}, f32[1000]{0}) fusion(%w), kind=kLoop, calls=%fused_two, metadata={op_name="jit(f)/optimizer/two"}
  ROOT %o = bf16[2,100]{1,0} copy(%leaf)
}
"""


def _costs():
  return {c["name"]: c for c in roofline.op_costs(ADAM_HLO)}


def test_elementwise_chain_then_slice_is_charged_the_slice():
  """The flat AdamW update fused into a per-leaf slice consumer: w and g (f32[1000] each) are
  read only for the 200 elements the slice keeps (2 x 100 rows of the [10, 100] view, at
  4 bytes each: 800 B), the scalar lr whole (4 B, through a broadcast); out: bf16[2, 100]."""
  c = _costs()["leaf"]
  assert c["bytes_in"] == 800 + 800 + 4
  assert c["bytes_out"] == 400


def test_a_full_use_charges_the_whole_buffer():
  """exp -> reshape -> slice reads 300 of w's 1000 elements (1200 B); g feeds a reduce over
  all of it (4000 B)."""
  c = _costs()["mixed"]
  assert c["bytes_in"] == 1200 + 4000
  assert c["bytes_out"] == 1200 + 4


def test_a_chain_that_is_also_an_output_reads_everything():
  """negate(w) is both sliced and returned whole (a root tuple element): all of w is read."""
  c = _costs()["two"]
  assert c["bytes_in"] == 4000
  assert c["bytes_out"] == 400 + 4000


def test_attention_kernel_flops_count_the_band():
  """7 matmuls (2 forward, 5 backward) of 2 FLOPs per (query, key) pair and head dim; pairs
  counted by brute force over |i - j| <= w."""
  import numpy as np
  B, T, H, D, w = 2, 37, 3, 8, 5
  i = np.arange(T)
  pairs = int((abs(i[:, None] - i[None, :]) <= w).sum())
  assert roofline.attention_flops(B, T, T, H, D, window=w) == 14 * B * H * D * pairs
  assert roofline.attention_flops(B, T, T, H, D) == 14 * B * H * D * T * T
