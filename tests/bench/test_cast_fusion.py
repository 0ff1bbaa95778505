"""bench.cast_fusion's count of cast kernels, on a hand-written HLO program: a kernel whose body
is one float32 -> bfloat16 convert counts (times its executions); a GEMM fusion or a convert
fused with other work does not."""

from bench import cast_fusion

HLO = """HloModule casts

%cast (p0: f32[8,8]) -> bf16[8,8] {
  %p0 = f32[8,8]{1,0} parameter(0)
  ROOT %c = bf16[8,8]{1,0} convert(%p0)
}

%scaled (q0: f32[8,8]) -> bf16[8,8] {
  %q0 = f32[8,8]{1,0} parameter(0)
  %n = f32[8,8]{1,0} negate(%q0)
  ROOT %c = bf16[8,8]{1,0} convert(%n)
}

%gemm (a: bf16[8,8], b: bf16[8,8]) -> bf16[8,8] {
  %a = bf16[8,8]{1,0} parameter(0)
  %b = bf16[8,8]{1,0} parameter(1)
  ROOT %d = bf16[8,8]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (w: f32[8,8], v: f32[8,8], x: bf16[8,8]) -> bf16[8,8] {
  %w = f32[8,8]{1,0} parameter(0)
  %v = f32[8,8]{1,0} parameter(1)
  %x = bf16[8,8]{1,0} parameter(2)
  %wc = bf16[8,8]{1,0} fusion(%w), kind=kLoop, calls=%cast
  %vc = bf16[8,8]{1,0} fusion(%v), kind=kLoop, calls=%scaled
  %y = bf16[8,8]{1,0} fusion(%x, %wc), kind=kCustom, calls=%gemm
  ROOT %z = bf16[8,8]{1,0} fusion(%y, %vc), kind=kCustom, calls=%gemm
}
"""


def test_only_a_lone_convert_counts_as_a_cast():
  assert cast_fusion._casts(HLO) == 1
