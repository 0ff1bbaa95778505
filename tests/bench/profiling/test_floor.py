"""bench.profiling.roofline.group_floors: each scope group's compulsory bytes, on a hand-written
HLO program and a small compiled one (expected bytes counted by hand in each test)."""

import jax
import jax.numpy as jnp
import pytest

from bench.profiling import roofline

# f32[1000] a + b and -a, fused ops of the hand-written programs below
ADD_NEG = """%add2 (p0: f32[1000], p1: f32[1000]) -> f32[1000] {
  %p0 = f32[1000]{0} parameter(0)
  %p1 = f32[1000]{0} parameter(1)
  ROOT %s = f32[1000]{0} add(%p0, %p1)
}

%neg (q0: f32[1000]) -> f32[1000] {
  %q0 = f32[1000]{0} parameter(0)
  ROOT %n = f32[1000]{0} negate(%q0)
}
"""

FLOOR_HLO = """HloModule floors

""" + ADD_NEG + """
%two_out (r0: f32[1000]) -> (f32[1000], bf16[1000]) {
  %r0 = f32[1000]{0} parameter(0)
  %e = f32[1000]{0} exponential(%r0)
  %c = bf16[1000]{0} convert(%r0)
  ROOT %t = (f32[1000]{0}, bf16[1000]{0}) tuple(%e, %c)
}

%cvt (u0: bf16[1000]) -> f32[1000] {
  %u0 = bf16[1000]{0} parameter(0)
  ROOT %c = f32[1000]{0} convert(%u0)
}

%rows (t0: f32[100000]) -> f32[100] {
  %t0 = f32[100000]{0} parameter(0)
  ROOT %s = f32[100]{0} slice(%t0), slice={[0:100]}
}

ENTRY %main (x: f32[1000], w: f32[1000], table: f32[100000]) -> (f32[1000], f32[1000], f32[1000], f32[100]) {
  %x = f32[1000]{0} parameter(0)
  %w = f32[1000]{0} parameter(1)
  %table = f32[100000]{0} parameter(2)
  %a = f32[1000]{0} fusion(%x, %w), kind=kLoop, calls=%add2, metadata={op_name="jit(f)/jvp(M)/MoWE/a"}
  %b = f32[1000]{0} fusion(%a), kind=kLoop, calls=%neg, metadata={op_name="jit(f)/jvp(M)/MoWE/b"}
  %c = f32[1000]{0} fusion(%b, %x), kind=kLoop, calls=%add2, metadata={op_name="jit(f)/jvp(M)/HSP/c"}
  %e = (f32[1000]{0}, bf16[1000]{0}) fusion(%c), kind=kLoop, calls=%two_out, metadata={op_name="jit(f)/jvp(M)/HSP/e"}
  %e0 = f32[1000]{0} get-tuple-element(%e), index=0
  %e1 = bf16[1000]{0} get-tuple-element(%e), index=1
  %h = f32[1000]{0} fusion(%e1), kind=kLoop, calls=%cvt, metadata={op_name="jit(f)/jvp(M)/HSP/h"}
  %v = f32[10,100]{1,0} bitcast(%e0)
  %vb = f32[1000]{0} bitcast(%v)
  %d = f32[1000]{0} fusion(%c, %w), kind=kLoop, calls=%add2, metadata={op_name="jit(f)/transpose(jvp(M))/MoWE/d"}
  %f = f32[1000]{0} fusion(%vb, %h), kind=kLoop, calls=%add2, metadata={op_name="jit(f)/transpose(jvp(M))/MoWE/f"}
  %r = f32[100]{0} fusion(%table), kind=kLoop, calls=%rows, metadata={op_name="jit(f)/jvp(M)/EventEmbed/r"}
  %k = f32[1000]{0} fusion(%x, %c), kind=kLoop, calls=%add2, metadata={op_name="jit(f)/jvp(M)/HSP/k"}
  ROOT %out = (f32[1000]{0}, f32[1000]{0}, f32[1000]{0}, f32[100]{0}) tuple(%d, %f, %h, %r)
}
"""


@pytest.fixture(scope="module")
def floors():
  return roofline.group_floors(FLOOR_HLO)


def test_a_group_reads_what_it_receives_once_per_phase(floors):
  """MoWE's forward reads x and w (4,000 B each; a is its own); its backward reads w again
  (another phase), c and e's first element (through two bitcasts) and h, all from HSP:
  6 x 4,000 B. HSP reads b (MoWE's) and x once although two of its ops read x."""
  assert floors["MoWE"]["read"] == 6 * 4000
  assert floors["HSP"]["read"] == 2 * 4000


def test_a_group_writes_what_it_hands_on(floors):
  """MoWE hands b to HSP and d, f to the step's outputs; HSP hands c and h to MoWE (h also an
  output) and e's f32 element to MoWE, but e's bf16 element only to its own h, and k to no one:
  3 x 4,000 B each."""
  assert floors["MoWE"]["written"] == 3 * 4000
  assert floors["HSP"]["written"] == 3 * 4000
  assert floors["MoWE"]["bytes"] == 9 * 4000
  assert (floors["MoWE"]["launches"], floors["HSP"]["launches"]) == (4, 4)


def test_a_partial_read_counts_the_rows_read(floors):
  """The embedding slice reads 100 of the table's 100,000 f32 rows and returns them."""
  assert floors["embeddings"] == {"bytes": 800.0, "read": 400.0, "written": 400.0,
                                  "launches": 1, "saved": 0.0}


def test_a_compiled_program():
  """x @ w in MoWE, then @ v in HSP (f32; a dot fuses nothing across the two): MoWE reads x and
  w and writes y; HSP reads y and v and writes z."""
  def f(x, w, v):
    with jax.named_scope("MoWE"):
      y = x @ w
    with jax.named_scope("HSP"):
      return y @ v
  args = (jnp.ones((64, 32)), jnp.ones((32, 16)), jnp.ones((16, 8)))
  text = jax.jit(f).lower(*args).compile().as_text()
  fl = roofline.group_floors(text)
  assert fl["MoWE"]["bytes"] == 4 * (64 * 32 + 32 * 16 + 64 * 16)
  assert fl["HSP"]["bytes"] == 4 * (64 * 16 + 16 * 8 + 64 * 8)


SAVED_HLO = """HloModule saved

%mm (a0: bf16[64,32], a1: bf16[32,16]) -> bf16[64,16] {
  %a0 = bf16[64,32]{1,0} parameter(0)
  %a1 = bf16[32,16]{1,0} parameter(1)
  ROOT %d = bf16[64,16]{1,0} dot(%a0, %a1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%act (b0: bf16[64,16]) -> bf16[64,16] {
  %b0 = bf16[64,16]{1,0} parameter(0)
  ROOT %t = bf16[64,16]{1,0} tanh(%b0)
}

%mul (c0: bf16[64,16], c1: bf16[64,16]) -> bf16[64,16] {
  %c0 = bf16[64,16]{1,0} parameter(0)
  %c1 = bf16[64,16]{1,0} parameter(1)
  ROOT %m = bf16[64,16]{1,0} multiply(%c0, %c1)
}

ENTRY %main (x: bf16[64,32], w: bf16[32,16], g: bf16[64,16]) -> (bf16[64,16], bf16[64,16], bf16[64,16], bf16[64,16]) {
  %x = bf16[64,32]{1,0} parameter(0)
  %w = bf16[32,16]{1,0} parameter(1)
  %g = bf16[64,16]{1,0} parameter(2)
  %y = bf16[64,16]{1,0} fusion(%x, %w), kind=kCustom, calls=%mm, metadata={op_name="jit(f)/jvp(M)/MoWE/dot_general"}
  %t = bf16[64,16]{1,0} fusion(%y), kind=kLoop, calls=%act, metadata={op_name="jit(f)/jvp(M)/MoWE/tanh"}
  %p = bf16[64,16]{1,0} custom-call(%x, %w), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(f)/jvp(M)/MoWE/pallas_call"}
  %vy = bf16[1024]{0} bitcast(%y)
  %wy = bf16[64,16]{1,0} bitcast(%vy)
  %dy = bf16[64,16]{1,0} fusion(%g, %wy), kind=kLoop, calls=%mul, metadata={op_name="jit(f)/transpose(jvp(M))/MoWE/mul"}
  %dt = bf16[64,16]{1,0} fusion(%dy, %t), kind=kLoop, calls=%mul, metadata={op_name="jit(f)/transpose(jvp(M))/MoWE/mul"}
  %dp = bf16[64,16]{1,0} fusion(%dt, %p), kind=kLoop, calls=%mul, metadata={op_name="jit(f)/transpose(jvp(M))/MoWE/mul"}
  %dr = bf16[64,16]{1,0} fusion(%dt, %p), kind=kLoop, calls=%mul, metadata={op_name="jit(f)/transpose(jvp(M))/MoWE/mul"}
  %dq = bf16[64,16]{1,0} fusion(%dp, %p), kind=kLoop, calls=%mul, metadata={op_name="jit(f)/transpose(jvp(M))/HSP/mul"}
  %z = bf16[64,16]{1,0} fusion(%x, %w), kind=kCustom, calls=%mm, metadata={op_name="jit(f)/transpose(jvp(M))/MoWE/dot_general"}
  %dz = bf16[64,16]{1,0} fusion(%z, %g), kind=kLoop, calls=%mul, metadata={op_name="jit(f)/transpose(jvp(M))/MoWE/mul"}
  ROOT %out = (bf16[64,16]{1,0}, bf16[64,16]{1,0}, bf16[64,16]{1,0}, bf16[64,16]{1,0}) tuple(%dq, %t, %dr, %dz)
}
"""


def test_saved_counts_forward_products_the_backward_reads():
  """MoWE's forward GEMM y (read back through two bitcasts) and Pallas kernel p are read by
  MoWE's backward: each 64 x 16 bf16 (2,048 B), y written once and read once; p read once
  though it has two backward readers in MoWE, and not written again: MoWE hands it to HSP, so
  MoWE's floor has its write. 3 x 2,048 B. The elementwise t counts nothing, nor does the
  backward's own GEMM z, nor HSP's read of p (another group's value, in HSP's floor).
  ``add_floors`` gives the least ratio."""
  fl = roofline.group_floors(SAVED_HLO)
  assert fl["MoWE"]["written"] >= 2048                  # p, handed on to HSP
  assert fl["MoWE"]["saved"] == 3 * 2048
  assert fl["HSP"]["saved"] == 0.0
  rl = {"groups": {"MoWE": {"bytes": 9e4}, "HSP": {"bytes": 1e4}}, "flops": 0.0,
        "device": {"peak_flops": 1.0, "bandwidth": 1.0, "launch_s": 0.0},
        "xla": {"bytes": 1e5, "launches": 0}}
  roofline.add_floors(rl, fl)
  v = rl["groups"]["MoWE"]
  assert v["saved_bytes"] == 3 * 2048
  assert v["least_ratio"] == pytest.approx((fl["MoWE"]["bytes"] + 6144) / fl["MoWE"]["bytes"])


def test_saved_in_a_compiled_program():
  """The gradient of sum((x @ w)^2 @ v) (f32, one scope): the backward reads the forward GEMM's
  y [64, 16] (dz * 2y for the first GEMM's cotangent): 4,096 B written once and read once. y * y,
  elementwise, counts nothing."""
  def f(x, w, v):
    with jax.named_scope("L"), jax.named_scope("MoWE"):
      y = x @ w
      return jnp.sum((y * y) @ v)
  args = (jnp.ones((64, 32)), jnp.ones((32, 16)), jnp.ones((16, 8)))
  text = jax.jit(jax.grad(f, argnums=(1, 2))).lower(*args).compile().as_text()
  assert roofline.group_floors(text)["MoWE"]["saved"] == 2 * 64 * 16 * 4


def test_add_floors_ratios():
  """Each group's ratio is its XLA bytes over its floor, and where known its Pallas kernels' and
  GEMMs' bytes alone over it; the bound at the floor is max(FLOPs / peak, floor / bandwidth) +
  launches."""
  rl = {"groups": {"MoWE": {"bytes": 10.0, "pallas_bytes": 4.0, "gemm_bytes": 2.0},
                   "HSP": {"bytes": 6.0}}, "flops": 1e3,
        "device": {"peak_flops": 1e6, "bandwidth": 1.0, "launch_s": 0.5},
        "xla": {"bytes": 16.0, "launches": 4}}
  roofline.add_floors(rl, {"MoWE": {"bytes": 4.0}, "HSP": {"bytes": 3.0}})
  assert rl["groups"]["MoWE"]["floor_ratio"] == 2.5 and rl["groups"]["HSP"]["floor_ratio"] == 2
  assert rl["groups"]["MoWE"]["kernel_gemm_ratio"] == 1.5        # (4 + 2) / 4
  assert "kernel_gemm_ratio" not in rl["groups"]["HSP"]
  assert rl["floor"] == {"bytes": 7.0, "ratio": 16 / 7, "bound_s": 7.0 + 2.0}


BARRIER_HLO = """HloModule barrier

%neg (q0: f32[1000]) -> f32[1000] {
  %q0 = f32[1000]{0} parameter(0)
  ROOT %n = f32[1000]{0} negate(%q0)
}

ENTRY %main (x: f32[1000]) -> (f32[1000], f32[1000]) {
  %x = f32[1000]{0} parameter(0)
  %a = f32[1000]{0} fusion(%x), kind=kLoop, calls=%neg, metadata={op_name="jit(f)/jvp(M)/MoWE/a"}
  %b = f32[1000]{0} fusion(%x), kind=kLoop, calls=%neg, metadata={op_name="jit(f)/jvp(M)/MoWE/b"}
  %t = (f32[1000]{0}, (f32[1000]{0}, f32[1000]{0})) tuple(%a, %u)
  %u = (f32[1000]{0}, f32[1000]{0}) tuple(%b, %a)
  %o = (f32[1000]{0}, (f32[1000]{0}, f32[1000]{0})) opt-barrier(%t)
  %g0 = f32[1000]{0} get-tuple-element(%o), index=0
  %g1 = (f32[1000]{0}, f32[1000]{0}) get-tuple-element(%o), index=1
  %g10 = f32[1000]{0} get-tuple-element(%g1), index=0
  %h = f32[1000]{0} fusion(%g0), kind=kLoop, calls=%neg, metadata={op_name="jit(f)/jvp(M)/HSP/h"}
  %m = f32[1000]{0} fusion(%g10), kind=kLoop, calls=%neg, metadata={op_name="jit(f)/jvp(M)/MoWE/m"}
  ROOT %out = (f32[1000]{0}, f32[1000]{0}) tuple(%h, %m)
}
"""


def test_a_value_handed_on_through_a_barrier_is_written():
  """MoWE's a reaches HSP's h through a tuple, an optimization barrier and get-tuple-element, as
  XLA routes values around remat; b goes the same way (nested one tuple deeper) to MoWE's own m
  only, and a's copy in the inner tuple is never taken out. MoWE writes a (handed on) and m (an
  output), not b: 2 x 4,000 B."""
  fl = roofline.group_floors(BARRIER_HLO)
  assert fl["MoWE"]["written"] == 2 * 4000
  assert fl["HSP"]["read"] == 4000 and fl["HSP"]["written"] == 4000


def test_the_command_lists_a_groups_ops_with_their_bytes(tmp_path, capsys):
  """``python -m bench.profiling.roofline FILE --group MoWE``: the group table (MoWE's floor 9 x
  4,000 B against its 4 ops' bytes) and MoWE's ops, largest first, each with its bytes in and
  out counted by hand: a, d, f read two f32[1000] and write one (12,000 B), b reads one (8,000
  B)."""
  path = tmp_path / "step.hlo"
  path.write_text(FLOOR_HLO)
  assert roofline.main([str(path), "--group", "MoWE", "--top", "3"]) == 0
  out = capsys.readouterr().out.splitlines()
  mowe = next(line.split() for line in out if line.startswith("MoWE "))
  assert mowe[1:5] == ["0.00", "0.00", f"{44000 / 36000:.2f}x", "4"]   # GB, floor GB, ratio
  head = out.index("MoWE: 4 launched ops, 0.000 GB; the 3 largest (MB in / out per launch, "
                   "launches per step)")
  rows = [line.split() for line in out[head + 1:]]
  assert len(rows) == 3 and all(r[2] == "xla" for r in rows)
  assert [(r[0], r[3], r[4]) for r in rows] == [("0.0", "0.0", "0.0")] * 3   # MB, rounded
  assert {r[6] for r in rows} == {"a", "d", "f"} and rows[0][5] == "x1"
  ops = roofline.group_ops(roofline.op_costs(FLOOR_HLO), "MoWE")
  assert [(o["name"], o["bytes_in"], o["bytes_out"], o["bytes"]) for o in ops] == [
      ("a", 8000, 4000, 12000), ("d", 8000, 4000, 12000), ("f", 8000, 4000, 12000),
      ("b", 4000, 4000, 8000)]


@pytest.mark.parametrize("args,message", [
    (["missing.hlo"], "cannot read"),
    (["empty.hlo"], "has no launched ops"),
    (["step.hlo", "--group", "Nope"], "no scope group 'Nope'; the program's: HSP, MoWE"),
])
def test_the_command_fails_in_one_line(tmp_path, capsys, args, message):
  (tmp_path / "step.hlo").write_text(FLOOR_HLO)
  (tmp_path / "empty.hlo").write_text("not an HLO module\n")
  assert roofline.main([str(tmp_path / args[0]), *args[1:]]) == 2
  err = capsys.readouterr().err.strip()
  assert message in err and "\n" not in err and "Traceback" not in err


# A LayerNorm backward in PFFN's scope fused under HSP's cotangent add (XLA names the fusion after
# its root), an elementwise fusion with one op of each group (a tie), and a GEMM fusion whose
# epilogue comes from HSP, each fused computation with its ops' metadata as XLA writes it.
MIXED_HLO = """HloModule mixed

%ln_bwd (p0: f32[1000], p1: f32[1000], p2: f32[1000]) -> f32[1000] {
  %p0 = f32[1000]{0} parameter(0)
  %p1 = f32[1000]{0} parameter(1)
  %p2 = f32[1000]{0} parameter(2)
  %m = f32[1000]{0} multiply(%p0, %p1), metadata={op_name="jit(f)/transpose(jvp(M))/L/PFFN/_norm/mul"}
  %c = f32[1000]{0} convert(%m), metadata={op_name="jit(f)/transpose(jvp(M))/L/HSP/convert"}
  %r = f32[1000]{0} reshape(%c), metadata={op_name="jit(f)/transpose(jvp(M))/L/HSP/reshape"}
  %z = f32[] constant(0), metadata={op_name="jit(f)/transpose(jvp(M))/L/HSP/zero"}
  %zb = f32[1000]{0} broadcast(%z), dimensions={}, metadata={op_name="jit(f)/transpose(jvp(M))/L/HSP/zeros"}
  %s = f32[1000]{0} subtract(%r, %p1), metadata={op_name="jit(f)/transpose(jvp(M))/L/PFFN/_norm/sub"}
  %n = f32[1000]{0} multiply(%s, %zb), metadata={op_name="jit(f)/jvp(M)/L/PFFN/_norm/mul"}
  ROOT %a = f32[1000]{0} add(%n, %p2), metadata={op_name="jit(f)/transpose(jvp(M))/L/HSP/add_any"}
}

%tie (q0: f32[1000], q1: f32[1000]) -> f32[1000] {
  %q0 = f32[1000]{0} parameter(0)
  %q1 = f32[1000]{0} parameter(1)
  %m = f32[1000]{0} multiply(%q0, %q1), metadata={op_name="jit(f)/jvp(M)/L/PFFN/mul"}
  ROOT %a = f32[1000]{0} add(%m, %q1), metadata={op_name="jit(f)/jvp(M)/L/HSP/add"}
}

%gemm (r0: f32[10,100], r1: f32[100,100]) -> f32[10,100] {
  %r0 = f32[10,100]{1,0} parameter(0)
  %r1 = f32[100,100]{1,0} parameter(1)
  %d = f32[10,100]{1,0} dot(%r0, %r1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/jvp(M)/L/PFFN/dot_general"}
  %e1 = f32[10,100]{1,0} exponential(%d), metadata={op_name="jit(f)/jvp(M)/L/PFFN/exp"}
  ROOT %e2 = f32[10,100]{1,0} negate(%e1), metadata={op_name="jit(f)/jvp(M)/L/HSP/neg"}
}

ENTRY %main (x: f32[1000], g: f32[1000], h: f32[1000], y: f32[10,100], w: f32[100,100]) -> (f32[1000], f32[1000], f32[10,100]) {
  %x = f32[1000]{0} parameter(0)
  %g = f32[1000]{0} parameter(1)
  %h = f32[1000]{0} parameter(2)
  %y = f32[10,100]{1,0} parameter(3)
  %w = f32[100,100]{1,0} parameter(4)
  %bwd = f32[1000]{0} fusion(%x, %g, %h), kind=kLoop, calls=%ln_bwd, metadata={op_name="jit(f)/transpose(jvp(M))/L/HSP/add_any"}
  %even = f32[1000]{0} fusion(%x, %g), kind=kLoop, calls=%tie, metadata={op_name="jit(f)/jvp(M)/L/HSP/add"}
  %mm = f32[10,100]{1,0} fusion(%y, %w), kind=kCustom, calls=%gemm, metadata={op_name="jit(f)/jvp(M)/L/HSP/neg"}
  ROOT %out = (f32[1000]{0}, f32[1000]{0}, f32[10,100]{1,0}) tuple(%bwd, %even, %mm)
}
"""


def test_a_fusion_is_named_after_most_of_its_ops_on_request():
  """By default a fusion is its root's (HSP's add). With ``attribute="majority"`` the LayerNorm
  backward goes to PFFN (3 PFFN ops against HSP's add and convert; its constant,
  broadcast and reshape do not count), named after PFFN's last op of the root's phase (backward); the tie stays with its root; the
  GEMM fusion keeps its root's name (2 of its 3 ops PFFN's). The floors follow: HSP no longer reads x, g, h nor writes the fused result (4 x 4,000 B)."""
  by = lambda attribute: {c["name"]: c["op_name"] for c in roofline.op_costs(MIXED_HLO, attribute)}
  root, major = by("root"), by("majority")
  assert root["bwd"].endswith("HSP/add_any")
  assert major["bwd"] == "jit(f)/transpose(jvp(M))/L/PFFN/_norm/sub"
  assert major["even"] == root["even"] == "jit(f)/jvp(M)/L/HSP/add"
  assert major["mm"] == root["mm"] == "jit(f)/jvp(M)/L/HSP/neg"
  before = roofline.group_floors(MIXED_HLO)
  after = roofline.group_floors(MIXED_HLO, attribute="majority")
  assert "PFFN" not in before and after["PFFN"] == {"bytes": 4 * 4000.0, "read": 3 * 4000.0,
                                                     "written": 4000.0, "launches": 1,
                                                     "saved": 0.0}
  assert before["HSP"]["bytes"] - after["HSP"]["bytes"] == 4 * 4000
  with pytest.raises(ValueError, match="attribute='most'"):
    roofline.op_costs(MIXED_HLO, "most")


def test_the_command_takes_the_attribution(tmp_path, capsys):
  path = tmp_path / "step.hlo"
  path.write_text(MIXED_HLO)
  assert roofline.main([str(path), "--attribute", "majority"]) == 0
  groups = {line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]}
  assert {"PFFN", "HSP"} <= groups
  assert roofline.main([str(path)]) == 0
  groups = {line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]}
  assert "PFFN" not in groups


TOTALS_HLO = """HloModule totals

""" + ADD_NEG + """
ENTRY %main (x: f32[1000], w: f32[1000]) -> (f32[1000], f32[1000]) {
  %x = f32[1000]{0} parameter(0)
  %w = f32[1000]{0} parameter(1)
  %a0 = f32[1000]{0} fusion(%x, %w), kind=kLoop, calls=%add2, metadata={op_name="jit(f)/jvp(M)/MoWE/layer_0/mul"}
  %a1 = f32[1000]{0} fusion(%a0), kind=kLoop, calls=%neg, metadata={op_name="jit(f)/jvp(M)/MoWE/layer_1/mul"}
  %b = f32[1000]{0} fusion(%a1, %w), kind=kLoop, calls=%add2, metadata={op_name="jit(f)/transpose(jvp(M))/MoWE/layer_1/mul"}
  %h = f32[1000]{0} fusion(%b), kind=kLoop, calls=%neg, metadata={op_name="jit(f)/jvp(M)/HSP/h"}
  ROOT %out = (f32[1000]{0}, f32[1000]{0}) tuple(%b, %h)
}
"""


def test_op_totals_sum_a_groups_launches_by_phase_and_op_with_layers_folded():
  """MoWE's two forward launches, one per layer, are one row: a0 reads x and w and writes one
  f32[1000], a1 reads a0 and writes one (in 12,000 B, out 8,000 B); the backward's b, the same
  op in another phase, is a row of its own (in 8,000 B, out 4,000 B); HSP's h is not MoWE's."""
  rows = roofline.op_totals(roofline.group_ops(roofline.op_costs(TOTALS_HLO), "MoWE"))
  assert rows == [
      {"phase": "fwd", "kind": "xla", "op": "layer_N/mul", "launches": 2, "bytes_in": 12000.0,
       "bytes_out": 8000.0, "bytes": 20000.0},
      {"phase": "bwd", "kind": "xla", "op": "layer_N/mul", "launches": 1, "bytes_in": 8000.0,
       "bytes_out": 4000.0, "bytes": 12000.0}]


def test_the_command_lists_a_groups_ops_summed_by_op(tmp_path, capsys):
  """``--by-op``: MoWE's 3 launches as its 2 rows of ``op_totals``, largest first, in MB."""
  path = tmp_path / "step.hlo"
  path.write_text(TOTALS_HLO)
  assert roofline.main([str(path), "--group", "MoWE", "--by-op"]) == 0
  out = capsys.readouterr().out.splitlines()
  head = out.index("MoWE: 3 launched ops as 2 kinds of op, 0.000 GB; the 2 largest (MB in / out "
                   "per step, launches per step)")
  assert [line.split() for line in out[head + 1:]] == [
      ["0.0", "MB", "fwd", "xla", "0.0", "0.0", "x2", "layer_N/mul"],
      ["0.0", "MB", "bwd", "xla", "0.0", "0.0", "x1", "layer_N/mul"]]
