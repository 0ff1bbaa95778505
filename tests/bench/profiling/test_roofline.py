"""bench.profiling.roofline byte counting, slice by slice, on small hand-written HLO programs
(expected bytes counted by hand in each test)."""

import pytest

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


def test_event_mlp_flops_take_the_input_whole_or_as_a_pair():
  """The event MLP's kernels, 2 N (4 K F + 3 F D) over its S x Ns rows, counted by hand; the
  model passes the item table's columns and the side tables' as a pair."""
  import jax
  import jax.numpy as jnp
  S, Ns, Ka, Kb, F, D = 2, 8, 16, 32, 64, 32
  sds = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16)
  w1, b1, w2 = sds(Ka + Kb, F), sds(F), sds(F, D)
  want = 2 * S * Ns * (4 * (Ka + Kb) * F + 3 * F * D)
  assert roofline.GEMM_OPS["fused_event_mlp"](sds(S, Ns, Ka + Kb), w1, b1, w2) == want
  assert roofline.GEMM_OPS["fused_event_mlp"]((sds(S, Ns, Ka), sds(S, Ns, Kb)), w1, b1, w2) == want


SCATTER_HLO = """HloModule scatters

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %r = f32[] add(%a, %b)
}

%fused_scatter (t: f32[1000,8], u: f32[16,8], i: s32[16]) -> f32[1000,8] {
  %t = f32[1000,8]{1,0} parameter(0)
  %i = s32[16]{0} parameter(2)
  %ib = s32[16,1]{1,0} bitcast(%i)
  %u = f32[16,8]{1,0} parameter(1)
  %c = f32[] constant(-0.1)
  %cb = f32[16,8]{1,0} broadcast(%c), dimensions={}
  %m = f32[16,8]{1,0} multiply(%u, %cb)
  %mb = f32[16,1,8]{2,1,0} bitcast(%m)
  ROOT %s = f32[1000,8]{1,0} scatter(%t, %ib, %mb), update_window_dims={1,2}, inserted_window_dims={}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%add
}

%fused_pair (t2: f32[1000,8], a2: bf16[1000], i2: s32[16,1], u2: f32[16,1,8], v2: bf16[16,1]) -> (f32[1000,8], bf16[1000]) {
  %t2 = f32[1000,8]{1,0} parameter(0)
  %a2 = bf16[1000]{0} parameter(1)
  %i2 = s32[16,1]{1,0} parameter(2)
  %u2 = f32[16,1,8]{2,1,0} parameter(3)
  %v2 = bf16[16,1]{1,0} parameter(4)
  %s2 = f32[1000,8]{1,0} scatter(%t2, %i2, %u2), update_window_dims={1,2}, inserted_window_dims={}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%add
  %d2 = bf16[1000]{0} dynamic-update-slice(%a2, %v2b, %z)
  %v2b = bf16[16]{0} bitcast(%v2)
  %z = s32[] constant(0)
  ROOT %t = (f32[1000,8]{1,0}, bf16[1000]{0}) tuple(%s2, %d2)
}

ENTRY %main (t: f32[1000,8], a: bf16[1000], i: s32[16], u: f32[16,8], ib: s32[16,1], ub: f32[16,1,8], v: bf16[16,1]) -> f32[1000,8] {
  %t = f32[1000,8]{1,0} parameter(0)
  %a = bf16[1000]{0} parameter(1)
  %i = s32[16]{0} parameter(2)
  %u = f32[16,8]{1,0} parameter(3)
  %ib = s32[16,1]{1,0} parameter(4)
  %ub = f32[16,1,8]{2,1,0} parameter(5)
  %v = bf16[16,1]{1,0} parameter(6)
  %one = f32[1000,8]{1,0} fusion(%t, %u, %i), kind=kInput, calls=%fused_scatter
  %pair = (f32[1000,8]{1,0}, bf16[1000]{0}) fusion(%one, %a, %ib, %ub, %v), kind=kInput, calls=%fused_pair
  %bare = f32[1000,8]{1,0} scatter(%t, %ib, %ub), update_window_dims={1,2}, inserted_window_dims={}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%add
  ROOT %o = f32[1000,8]{1,0} get-tuple-element(%pair), index=0
}
"""


def test_inplace_scatter_is_charged_its_rows_not_the_table():
  """A scatter into a parameter of its fusion (the donated table, updated in place) reads the
  indices (16 x 4 B) and updates (16 x 8 x 4 B) and reads + writes the 16 x 8 f32 elements it
  touches (2 x 512 B), not the 32 kB table; a top-level scatter alike."""
  c = {x["name"]: x for x in roofline.op_costs(SCATTER_HLO)}
  assert c["one"]["bytes_in"] == 64 + 512 + 512
  assert c["one"]["bytes_out"] == 512
  assert c["bare"]["bytes_in"] == 64 + 512 + 512
  assert c["bare"]["bytes_out"] == 512


def test_inplace_updates_in_a_tuple_root_are_charged_what_they_touch():
  """A multi-output fusion: a scatter (as above) and a dynamic-update-slice of 16 bf16 into a
  bf16[1000] accumulator; the accumulator is not read, the update slice is written (32 B)."""
  c = {x["name"]: x for x in roofline.op_costs(SCATTER_HLO)}["pair"]
  assert c["bytes_in"] == (64 + 512 + 512) + 32
  assert c["bytes_out"] == 512 + 32


def _jit_text(fn, *shapes, donate=(0,)):
  import jax
  return jax.jit(fn, donate_argnums=donate).lower(*shapes).compile().as_text()


def test_a_compiled_scatter_add_into_a_donated_table_is_charged_its_rows():
  """XLA:CPU's program of ``table.at[ids].add(-0.1 * g)`` and ``acc.at[ids].add(sum(g^2))``:
  the scatters together charge indices + updates + 2 x the touched rows (by hand below); the
  tables (10^4 rows) do not appear."""
  import jax
  import jax.numpy as jnp
  R, D, N = 10000, 8, 16

  def f(table, acc, ids, g):
    return table.at[ids].add(-0.1 * g), acc.at[ids].add(jnp.sum(g * g, -1))

  text = _jit_text(f, jax.ShapeDtypeStruct((R, D), jnp.float32),
                   jax.ShapeDtypeStruct((R,), jnp.float32), jax.ShapeDtypeStruct((N,), jnp.int32),
                   jax.ShapeDtypeStruct((N, D), jnp.float32), donate=(0, 1))
  sc = [c for c in roofline.op_costs(text) if "scatter" in c["op_name"]]
  assert len(sc) == 2
  table_rows, acc_rows = N * D * 4, N * 4
  # each scatter: indices (as s32[16, 1]) + updates + its rows read and written
  expect = (N * 4 + 3 * table_rows) + (N * 4 + 3 * acc_rows)
  assert sum(c["bytes_in"] + c["bytes_out"] for c in sc) == expect


def test_block_attention_calls_are_recorded_with_their_formula():
  """A differentiated block attention call (T 40 in blocks of 16: 3 blocks, the last padded) is
  recorded with 7 matmuls of 2 FLOPs per (query, key) pair and head dim, pairs counted by brute
  force over the padded blocks; its forward's 2 matmuls are the XLA twin's analytic score count
  (``kunlun.models.flops.attention_scope`` as executed: 4 x pairs x H * D per example)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  import pallas_kernels
  from kunlun.models import flops
  B, T, H, D, bs = 2, 40, 3, 8, 16
  q = jnp.ones((B, T, H, D), jnp.float32)
  with roofline.record_kernels(fence=False) as calls:
    jax.grad(lambda q: pallas_kernels.block_attention(q, q, q, block_size=bs,
                                                      backend="xla").sum())(q)
  (c,) = [x for x in calls if x["kind"] == "block"]
  i = np.arange(48)
  pairs = int((i[:, None] // bs == i[None, :] // bs).sum())
  assert c["flops"] == 14 * B * H * D * pairs
  rows, keys = flops.attention_scope(T, "block", 0, bs, executed=True)
  assert c["flops"] == 3.5 * B * 4 * rows * keys * (H * D)


def test_a_call_traced_twice_is_recorded_once():
  """A GDPA call traced by ``jax.eval_shape`` and then in a remat'd function under
  ``jax.grad`` (whose name stack has no ``jvp(``) is one call site: recorded once."""
  import jax
  import jax.numpy as jnp

  import pallas_kernels
  q = jnp.ones((2, 8, 2, 4), jnp.float32)
  f = lambda q: pallas_kernels.gdpa(q, q, q, activation="silu", backend="xla").sum()
  with roofline.record_kernels(fence=False) as calls:
    jax.eval_shape(f, q)
    jax.grad(jax.checkpoint(f))(q)
  assert [c["kind"] for c in calls] == ["gdpa"]
  assert calls[0]["flops"] == roofline.attention_flops(2, 8, 8, 2, 4)


def test_a_scatter_with_more_updates_than_rows_is_charged_the_table_at_most():
  """4096 updates of 8 f32 into a [1000, 8] zero-initialised gradient buffer (a parameter of
  the fusion): the updates and indices are read whole (131072 + 16384 B); the rows read and
  written are at most the 32 kB buffer each."""
  hlo = SCATTER_HLO.replace("u: f32[16,8], i: s32[16]", "u: f32[4096,8], i: s32[4096]")
  for a, b in (("s32[16]", "s32[4096]"), ("s32[16,1]", "s32[4096,1]"),
               ("f32[16,8]", "f32[4096,8]"), ("f32[16,1,8]", "f32[4096,1,8]")):
    hlo = hlo.replace(a, b)
  c = {x["name"]: x for x in roofline.op_costs(hlo)}["one"]
  assert c["bytes_in"] == 16384 + 131072 + 32000
  assert c["bytes_out"] == 32000


def test_a_remat_trace_reused_from_the_cache_is_still_recorded():
  """``eval_shape`` of a checkpointed function, then its gradient: the gradient's trace reuses
  the cached jaxpr and calls nothing, the call is recorded once (from the first trace); two
  call sites under different scopes are two calls."""
  import jax
  import jax.numpy as jnp

  import pallas_kernels
  q = jnp.ones((2, 8, 2, 4), jnp.float32)

  def f(q):
    with jax.named_scope("one"):
      a = pallas_kernels.gdpa(q, q, q, activation="silu", backend="xla")
    with jax.named_scope("two"):
      b = pallas_kernels.gdpa(q, q, q, activation="silu", backend="xla")
    return (a + b).sum()

  g = jax.checkpoint(f)
  with roofline.record_kernels(fence=False) as calls:
    jax.eval_shape(g, q)
    jax.jit(jax.grad(g)).lower(q)
  assert sorted(c["scope"] for c in calls) == ["one", "two"]


@pytest.mark.parametrize("N,d", [(20, 32), (72, 256)])
def test_wukong_token_side_calls_are_recorded_per_expert(N, d):
  """MoWE on the Wukong token-side kernels (interpret mode): each layer's call is recorded with
  its experts' FLOPs (the vmap's copies): the matmul FLOPs of the twin's value and gradient,
  counted from its jaxpr's dot_generals, plus the backward's recomputed ``X^T y`` and ``F``, and
  ``X^T y`` once more where an example runs in column chunks (72 tokens of 256: the backward's
  second pass over the chunks)."""
  import math

  import jax
  import jax.extend.core as jex
  import jax.numpy as jnp

  from kunlun.nn.mowe import MoWE
  from pallas_kernels import wukong_fm

  def dot_flops(jaxpr):
    n = 0
    for e in jaxpr.eqns:
      if e.primitive.name == "dot_general":
        (lc, _), _ = e.params["dimension_numbers"]
        k = math.prod(e.invars[0].aval.shape[i] for i in lc)
        n += 2 * math.prod(e.outvars[0].aval.shape) * k
      for sub in jex.jaxprs_in_params(e.params):
        n += dot_flops(sub)
    return n

  B, E, r, n_out = 5, 2, 16, 6
  m = MoWE(E, 2, n_out, r, 32, cross_layer=True, backend="pallas")
  x = jnp.zeros((B, N, d))
  p = m.init(jax.random.key(0), x)
  with roofline.record_kernels(fence=False) as calls:      # traced only: calls record shapes
    jax.eval_shape(jax.grad(lambda p, x: jnp.sum(m.apply(p, x))), p, x)
  got = sorted(c["flops"] for c in calls if "_token_side" in c["scope"])

  def twin(n_in, ms):
    def f(x, y, ws, s, b):
      h, mixes = wukong_fm.wukong_fm_xla(x, y, ws, s, b, dtype=jnp.float32)
      return jnp.sum(h) + sum(jnp.sum(v) for v in mixes)
    args = (jnp.zeros((B, n_in, d)), jnp.zeros((n_in, r)), tuple(jnp.zeros((n_in, k)) for k in ms),
            jnp.zeros(n_in * r), jnp.zeros(n_in * r))
    jaxpr = jax.make_jaxpr(jax.value_and_grad(f, argnums=(0, 1, 2)))(*args).jaxpr
    recomputed = 6 if (n_in, d) == (72, 256) else 4
    return E * (dot_flops(jaxpr) + recomputed * B * n_in * d * r)

  # layer 0: LCB 3, residual 6 and the first cross-layer map 6; layer 1 (N = n_out): LCB only
  assert got == sorted([twin(N, (3, 6, 6)), twin(n_out, (3,))])


def test_seed_kron_calls_are_recorded_with_the_twins_gemm_flops():
  """HSP's seed side on ``pallas_kernels.seed_kron`` (interpret mode): the call is recorded with
  the matmul FLOPs of the twin's value and gradient, counted from its jaxpr's dot_generals, and
  the second product's weight-gradient kernel with its own."""
  import math

  import jax
  import jax.numpy as jnp

  from kunlun.nn.hsp import SumKronLinear
  from pallas_kernels import seed_kron

  B, S, n_out, rank, d = 3, 32, 8, 2, 64
  m = SumKronLinear(n_out, rank, backend="pallas")
  a, e = jnp.zeros((B, S, d)), jnp.zeros((S, d))
  p = m.init(jax.random.key(0), a, e)
  with roofline.record_kernels(fence=False) as calls:
    jax.eval_shape(jax.grad(lambda p, a: jnp.sum(m.apply(p, a, e))), p, a)
  got = [c["flops"] for c in calls if "SumKronLinear" in c["scope"]]
  f = lambda a, e, z: jnp.sum(seed_kron.seed_kron_xla(a, e, z, eps=1e-6, dtype=jnp.float32))
  jaxpr = jax.make_jaxpr(jax.value_and_grad(f, argnums=(0, 1, 2)))(
      a, e, jnp.zeros((rank, S, n_out))).jaxpr
  want = 0
  for eq in jaxpr.eqns:
    if eq.primitive.name == "dot_general":
      (lc, _), _ = eq.params["dimension_numbers"]
      want += 2 * math.prod(eq.outvars[0].aval.shape) * math.prod(
          eq.invars[0].aval.shape[i] for i in lc)
  # and the second product's weight gradient (pallas_kernels.wgrad through packed.dense_kernel):
  # 2 (B n_out) (rank d) d
  assert sorted(got) == sorted([want, 2 * B * n_out * rank * d * d]), got
  assert want == 6 * B * S * n_out * rank * d


SUM_SLICE_HLO = """HloModule sum_slice

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %r = f32[] add(%a, %b)
}

%fused_split (p0: bf16[2,10,8]) -> (bf16[2,8], bf16[3,8]) {
  %p0 = bf16[2,10,8]{2,1,0} parameter(0)
  %c = f32[2,10,8]{2,1,0} convert(%p0)
  %z = f32[] constant(0)
  %r = f32[10,8]{1,0} reduce(%c, %z), dimensions={0}, to_apply=%add
  %h = bf16[10,8]{1,0} convert(%r)
  %s1 = bf16[2,8]{1,0} slice(%h), slice={[2:4], [0:8]}
  %s2 = bf16[3,8]{1,0} slice(%h), slice={[7:10], [0:8]}
  ROOT %t = (bf16[2,8]{1,0}, bf16[3,8]{1,0}) tuple(%s1, %s2)
}

%fused_whole (q0: bf16[2,10,8]) -> bf16[10,8] {
  %q0 = bf16[2,10,8]{2,1,0} parameter(0)
  %c = f32[2,10,8]{2,1,0} convert(%q0)
  %z = f32[] constant(0)
  %r = f32[10,8]{1,0} reduce(%c, %z), dimensions={0}, to_apply=%add
  ROOT %h = bf16[10,8]{1,0} convert(%r)
}

ENTRY %main (x: bf16[2,10,8]) -> bf16[10,8] {
  %x = bf16[2,10,8]{2,1,0} parameter(0)
  %split = (bf16[2,8]{1,0}, bf16[3,8]{1,0}) fusion(%x), kind=kLoop, calls=%fused_split, metadata={op_name="jit(f)/split"}
  ROOT %whole = bf16[10,8]{1,0} fusion(%x), kind=kLoop, calls=%fused_whole, metadata={op_name="jit(f)/whole"}
}
"""


def test_a_sum_then_slices_reads_the_summed_rows_of_the_slices():
  """A loop fusion sums x bf16[2, 10, 8] over its leading axis (the experts' cotangents) and
  slices rows 2:4 and 7:10 of the sum: the emitter computes only the 5 sliced rows, each from
  2 x 8 elements of x (5 x 16 x 2 B = 160 B of x's 320), and writes 5 x 8 x 2 B = 80 B. The
  same sum returned whole reads all of x."""
  c = {x["name"]: x for x in roofline.op_costs(SUM_SLICE_HLO)}
  assert c["split"]["bytes_in"] == 160 and c["split"]["bytes_out"] == 80
  assert c["whole"]["bytes_in"] == 320 and c["whole"]["bytes_out"] == 160


GEMM_OPERAND_HLO = """HloModule gemm_operand

%fused_dot (p0: bf16[64,32], p1: bf16[32,16]) -> bf16[64,16] {
  %p0 = bf16[64,32]{1,0} parameter(0)
  %p1 = bf16[32,16]{1,0} parameter(1)
  ROOT %d = bf16[64,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: bf16[64,32], w: bf16[32,16]) -> (bf16[64,16], bf16[64,16]) {
  %x = bf16[64,32]{1,0} parameter(0)
  %w = bf16[32,16]{1,0} parameter(1)
  %gemm_fusion_dot.1 = bf16[64,16]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_dot, metadata={op_name="jit(f)/dot_general"}
  %pallas_call.2 = bf16[64,16]{1,0} custom-call(%gemm_fusion_dot.1), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(f)/k/pallas_call"}
  %cublas = (bf16[64,16]{1,0}, s8[0]{0}) custom-call(%x, %w), custom_call_target="__cublas$gemm", metadata={op_name="jit(f)/c"}
  %c0 = bf16[64,16]{1,0} get-tuple-element(%cublas), index=0
  ROOT %t = (bf16[64,16]{1,0}, bf16[64,16]{1,0}) tuple(%pallas_call.2, %c0)
}
"""


def test_a_kernel_reading_a_gemm_output_is_not_a_gemm():
  """The GEMM fusion and the cuBLAS call are GEMMs; the Pallas call that reads the GEMM's output
  (an operand named gemm_fusion_dot.1) is not."""
  c = {x["name"]: x for x in roofline.op_costs(GEMM_OPERAND_HLO)}
  assert c["gemm_fusion_dot.1"]["gemm"] and c["cublas"]["gemm"]
  assert c["pallas_call.2"]["pallas"] and not c["pallas_call.2"]["gemm"]


SPLIT_K_HLO = """HloModule split_k

%dot.7.reduce_sub_computation (s0: f32[], s1: f32[]) -> f32[] {
  %s0 = f32[] parameter(0)
  %s1 = f32[] parameter(1)
  ROOT %s2 = f32[] add(%s0, %s1)
}

%add (t0: f32[], t1: f32[]) -> f32[] {
  %t0 = f32[] parameter(0)
  %t1 = f32[] parameter(1)
  ROOT %t2 = f32[] add(%t0, %t1)
}

%gemm_split (p0: bf16[4,32,16], p1: bf16[4,32,8]) -> f32[4,16,8] {
  %p0 = bf16[4,32,16]{2,1,0} parameter(0)
  %p1 = bf16[4,32,8]{2,1,0} parameter(1)
  ROOT %d0 = f32[4,16,8]{2,1,0} dot(%p0, %p1), lhs_batch_dims={0}, lhs_contracting_dims={1}, rhs_batch_dims={0}, rhs_contracting_dims={1}
}

%fused_top (q0: f32[4,16,8]) -> bf16[8,8] {
  %q0 = f32[4,16,8]{2,1,0} parameter(0)
  %z0 = f32[] constant(0)
  %r0 = f32[16,8]{1,0} reduce(%q0, %z0), dimensions={0}, to_apply=%dot.7.reduce_sub_computation
  %h0 = bf16[16,8]{1,0} convert(%r0)
  ROOT %top_rows = bf16[8,8]{1,0} slice(%h0), slice={[0:8], [0:8]}
}

%fused_bottom (q1: f32[4,16,8]) -> bf16[8,8] {
  %q1 = f32[4,16,8]{2,1,0} parameter(0)
  %z1 = f32[] constant(0)
  %r1 = f32[16,8]{1,0} reduce(%q1, %z1), dimensions={0}, to_apply=%dot.7.reduce_sub_computation
  %h1 = f32[8,8]{1,0} slice(%r1), slice={[8:16], [0:8]}
  ROOT %bottom_rows = bf16[8,8]{1,0} convert(%h1)
}

%gemm_plain (p2: bf16[16,32], p3: bf16[32,8]) -> f32[16,8] {
  %p2 = bf16[16,32]{1,0} parameter(0)
  %p3 = bf16[32,8]{1,0} parameter(1)
  ROOT %d1 = f32[16,8]{1,0} dot(%p2, %p3), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_sum (q2: f32[16,8]) -> f32[8] {
  %q2 = f32[16,8]{1,0} parameter(0)
  %z2 = f32[] constant(0)
  ROOT %r2 = f32[8]{0} reduce(%q2, %z2), dimensions={0}, to_apply=%add
}

ENTRY %main (a: bf16[4,32,16], b: bf16[4,32,8], x: bf16[16,32], w: bf16[32,8]) -> (bf16[8,8], bf16[8,8], f32[8]) {
  %a = bf16[4,32,16]{2,1,0} parameter(0)
  %b = bf16[4,32,8]{2,1,0} parameter(1)
  %x = bf16[16,32]{1,0} parameter(2)
  %w = bf16[32,8]{1,0} parameter(3)
  %gemm_fusion_dot.7 = f32[4,16,8]{2,1,0} fusion(%a, %b), kind=kCustom, calls=%gemm_split, metadata={op_name="jit(f)/transpose(jvp(Kunlun))/Kunlun/layer_0/KunlunLayer_0/click_proj/transpose"}
  %top = bf16[8,8]{1,0} fusion(%gemm_fusion_dot.7), kind=kLoop, calls=%fused_top, metadata={op_name="jit(f)/transpose(jvp(Kunlun))/Kunlun/layer_0/KunlunLayer_0/click_proj/transpose"}
  %bottom = bf16[8,8]{1,0} fusion(%gemm_fusion_dot.7), kind=kLoop, calls=%fused_bottom, metadata={op_name="jit(f)/transpose(jvp(Kunlun))/Kunlun/layer_0/KunlunLayer_0/click_proj/transpose"}
  %gemm_fusion_dot.9 = f32[16,8]{1,0} fusion(%x, %w), kind=kCustom, calls=%gemm_plain, metadata={op_name="jit(f)/Kunlun/heads/Heads/dense/dot_general"}
  %sum = f32[8]{0} fusion(%gemm_fusion_dot.9), kind=kInput, calls=%fused_sum, metadata={op_name="jit(f)/Kunlun/heads/Heads/reduce_sum"}
  ROOT %t = (bf16[8,8]{1,0}, bf16[8,8]{1,0}, f32[8]{0}) tuple(%top, %bottom, %sum)
}
"""


def test_split_k_charges_the_partials_round_trip_to_the_gemms_group():
  """A weight-gradient GEMM split in 4 along its contraction writes float32 partials [4, 16, 8]
  (2,048 B); two fusions reduce them with XLA's split-K reduction, each keeping 8 of the 16 rows
  (converted before or after the slice; 4 x 8 x 8 x 4 B = 1,024 B read each): 4,096 B in two extra launches, in the projection's group
  (``other``). A plain GEMM whose output an ordinary reduce sums (the heads) is not split-K."""
  sk = roofline.split_k(SPLIT_K_HLO)
  assert sk == {"other": {"gemms": 1, "launches": 2, "bytes": 4096.0}}


BATCHED_SPLIT_K_HLO = """HloModule batched_split_k

%dot.3.reduce_sub_computation (s0: f32[], s1: f32[]) -> f32[] {
  %s0 = f32[] parameter(0)
  %s1 = f32[] parameter(1)
  ROOT %s2 = f32[] add(%s0, %s1)
}

%gemm_split (p0: bf16[2,16,4,8], p1: bf16[2,32,4,8]) -> f32[2,4,16,32] {
  %p0 = bf16[2,16,4,8]{3,2,1,0} parameter(0)
  %p1 = bf16[2,32,4,8]{3,2,1,0} parameter(1)
  ROOT %d0 = f32[2,4,16,32]{3,2,1,0} dot(%p0, %p1), lhs_batch_dims={0,2}, lhs_contracting_dims={3}, rhs_batch_dims={0,2}, rhs_contracting_dims={3}
}

%fused_add (g: bf16[2,16,32], q0: f32[2,4,16,32]) -> bf16[2,16,32] {
  %q0 = f32[2,4,16,32]{3,2,1,0} parameter(1)
  %z0 = f32[] constant(0)
  %r0 = f32[2,16,32]{2,1,0} reduce(%q0, %z0), dimensions={1}, to_apply=%dot.3.reduce_sub_computation
  %h0 = bf16[2,16,32]{2,1,0} convert(%r0)
  %g = bf16[2,16,32]{2,1,0} parameter(0)
  ROOT %m0 = bf16[2,16,32]{2,1,0} multiply(%h0, %g)
}

ENTRY %main (a: bf16[2,16,4,8], b: bf16[2,32,4,8], g: bf16[2,16,32]) -> bf16[2,16,32] {
  %a = bf16[2,16,4,8]{3,2,1,0} parameter(0)
  %b = bf16[2,32,4,8]{3,2,1,0} parameter(1)
  %g = bf16[2,16,32]{2,1,0} parameter(2)
  %gemm_fusion_dot.3 = f32[2,4,16,32]{3,2,1,0} fusion(%a, %b), kind=kCustom, calls=%gemm_split, metadata={op_name="jit(f)/transpose(jvp(Kunlun))/Kunlun/layer_0/KunlunLayer_0/mowe/MoWE/vmap(experts)/layer_0/WukongLayer/dot_general"}
  ROOT %dh = bf16[2,16,32]{2,1,0} fusion(%g, %gemm_fusion_dot.3), kind=kLoop, calls=%fused_add, metadata={op_name="jit(f)/transpose(jvp(Kunlun))/Kunlun/layer_0/KunlunLayer_0/mowe/MoWE/vmap(experts)/layer_0/WukongLayer/transpose(jvp())/add_any"}
}
"""


def test_split_k_counts_a_batched_gemm_whose_split_follows_its_batch_dimension():
  """Under the experts' ``vmap`` a GEMM has a batch dimension, and XLA's split-K puts the split
  after it: f32 partials [2, 4, 16, 32] (16,384 B), summed over dimension 1 in a fusion that also
  applies an elementwise epilogue. Written and read back: 32,768 B in one reducing launch, in
  the GEMM's group (MoWE)."""
  sk = roofline.split_k(BATCHED_SPLIT_K_HLO)
  assert sk == {"MoWE": {"gemms": 1, "launches": 1, "bytes": 32768.0}}
