"""The packed (jagged) layout: pack / unpack and every op against the padded reference on unpacked
inputs and a float64 numpy loop over examples; gradients of the XLA twins against the padded
reference's; the Pallas kernels (interpret mode, poisoned outputs) against the XLA twins."""

import functools

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _poison, jagged, jagged_pallas, norm_qkv, reference
from tests.pallas_kernels.np_ref import NP_ACTS, block_loop, softmax_loop

B, T, H, D, N, NKV, S = 4, 64, 2, 8, 64, 5, 3
TILE = 16                          # XLA work-list and Pallas tiles (lengths / windows: +1)
LENGTHS = {
    "ragged": [17, 0, 33, 5],      # tile multiples plus one, an empty history
    "full": [0, 64, 0, 0],         # one example fills the whole capacity
    "overflow": [40, 30, 0, 20],   # 90 > 64: keeps 22, 22, 0, 20 (26 dropped)
    "empty": [0, 0, 0, 0],
}
KV_LENGTHS = np.array([5, 2, 0, 4])


@functools.cache
def _padded(seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  return tuple(jax.random.normal(k, (B, T, H, D), jnp.float32) for k in ks)


@functools.cache
def _packed(case, seed=0):
  """(tokens q, k, v [N, H, D], Jagged, dropped) of a lengths case."""
  pack = jax.jit(jagged.pack, static_argnums=2)
  outs = [pack(x, np.array(LENGTHS[case]), N) for x in _padded(seed)]
  return tuple(o[0] for o in outs), outs[0][1], outs[0][2]


@functools.cache
def _example_kv(seed=3):
  ks = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(ks[0], (B, NKV, H, D)), jax.random.normal(ks[1], (B, NKV, H, D)),
          jax.random.normal(ks[2], (S, H, D)))


# ----------------------------------------------------------------------------- pack / unpack


def _kept_oracle(lengths, capacity):
  """Plain Python: the largest cap c with sum(min(len, c)) <= N, leftover room one event each
  to the longest clipped histories (ties: lower index)."""
  c = max(lengths)
  while sum(min(n, c) for n in lengths) > capacity:
    c -= 1
  kept = [min(n, c) for n in lengths]
  for b in sorted(range(len(lengths)), key=lambda b: (-lengths[b], b)):
    if lengths[b] > c and sum(kept) < capacity:
      kept[b] += 1
  return kept


@pytest.mark.parametrize("case", list(LENGTHS))
def test_pack_unpack_against_a_loop(case):
  x = _padded()[0]
  lens = LENGTHS[case]
  tok, jag, dropped = jax.jit(jagged.pack, static_argnums=2)(x, np.array(lens), N)
  kept = _kept_oracle(lens, N)
  assert int(dropped) == sum(lens) - sum(kept)
  rows, seg, pos, offsets = [], [], [], [0]
  for b, (n, m) in enumerate(zip(lens, kept, strict=True)):
    rows += [np.asarray(x[b, t]) for t in range(n - m, n)]     # the m most recent events
    seg += [b] * m
    pos += list(range(m))
    offsets.append(offsets[-1] + m)
  pad = N - len(rows)
  want = np.stack(rows + [np.zeros((H, D), np.float32)] * pad)
  np.testing.assert_array_equal(tok, want)
  np.testing.assert_array_equal(jag.offsets, offsets)
  np.testing.assert_array_equal(jag.seg, seg + [B] * pad)
  np.testing.assert_array_equal(jag.pos, pos + [0] * pad)
  np.testing.assert_array_equal(jag.lengths, kept)
  back = np.asarray(jagged.unpack(tok, jag, T))
  for b, m in enumerate(kept):
    np.testing.assert_array_equal(back[b, :m], want[offsets[b]:offsets[b + 1]])
    assert not back[b, m:].any()


def test_overflow_case_drops_what_the_rule_says():
  _, jag, dropped = _packed("overflow")
  assert jag.lengths.tolist() == [22, 22, 0, 20] and int(dropped) == 26


def test_leftover_room_goes_to_the_longest():
  lens = [10, 9, 3, 10]             # capacity 27: cap 8 fills 8+8+3+8 = 27; 25 -> 2 left over
  kept, dropped = jagged.kept_lengths(np.array(lens), 25, 10)
  assert kept.tolist() == _kept_oracle(lens, 25) == [8, 7, 3, 7] and int(dropped) == 7


def test_bad_input_errors_are_one_line():
  (q, k, v), jag, _ = _packed("ragged")
  for fn in (lambda: jagged.pack(_padded()[0], np.array([1, 2]), N),
             lambda: jagged.jagged_softmax_attention(q, k, v[:10], jag),
             lambda: jagged.jagged_gdpa_cross(q, k[None], v[None], jag),
             lambda: jagged.jagged_gdpa_pool(q[:3, :1], k, v, jag),
             lambda: jagged_pallas.jagged_block_attention_pallas(q, k, v, jag, block_size=24)):
    with pytest.raises(ValueError) as e:
      fn()
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- numpy oracles


def _np_cross(q, k, v, offsets, kv_lengths, activation, scale, score_clip):
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  out = np.zeros_like(q)
  for b in range(B):
    kl = int(kv_lengths[b])
    for n in range(offsets[b], offsets[b + 1]):
      for h in range(H):
        s = np.clip(k[b, :kl, h] @ q[n, h] * scale, -score_clip, score_clip)
        out[n, h] = NP_ACTS[activation](s) @ v[b, :kl, h]
  return out


def _np_pool(q, k, v, offsets, activation, scale):
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  out = np.zeros((B,) + q.shape)
  for b in range(B):
    for h in range(H):
      kb, vb = k[offsets[b]:offsets[b + 1], h], v[offsets[b]:offsets[b + 1], h]
      if len(kb):                   # an empty history pools to 0
        out[b, :, h] = NP_ACTS[activation](q[:, h] @ kb.T * scale) @ vb
  return out


def _per_example(fn, q, k, v, offsets):
  """Runs a padded numpy loop on each example's tokens alone (``[1, len, H, D]``)."""
  out = np.zeros(q.shape)
  for b in range(B):
    lo, hi = offsets[b], offsets[b + 1]
    if hi > lo:
      out[lo:hi] = fn(*(np.asarray(a)[None, lo:hi] for a in (q, k, v)))[0]
  return out


# ----------------------------------------------------------------------------- ops


def _cross_op(tile):
  """(jagged, padded, numpy) PFFN GDPA at work-list ``tile`` (None: ``work_tile``)."""
  return (
      lambda q, k, v, jag, kk, vv, sd: jagged.jagged_gdpa_cross(
          q, kk, vv, jag, activation="silu", kv_lengths=KV_LENGTHS, score_clip=1.5, tile=tile,
          out_scale=0.75),
      lambda q, k, v, lens, kk, vv, sd: reference.gdpa_reference(
          q, kk, vv, activation="silu", q_lengths=lens, kv_lengths=KV_LENGTHS, score_clip=1.5,
          out_scale=0.75),
      lambda q, k, v, off, kk, vv, sd: 0.75 * _np_cross(q, kk, vv, off, KV_LENGTHS, "silu",
                                                        D ** -0.5, 1.5))


def _pool_op(tile):
  """(jagged, padded, numpy) HSP GDPA at work-list ``tile`` (None: ``work_tile``)."""
  return (
      lambda q, k, v, jag, kk, vv, sd: jagged.jagged_gdpa_pool(
          sd, k, v, jag, activation="gelu", out_scale=0.5, tile=tile),
      lambda q, k, v, lens, kk, vv, sd: reference.gdpa_reference(
          sd[None], k, v, activation="gelu", out_scale=0.5, kv_lengths=lens, broadcast_q=True),
      lambda q, k, v, off, kk, vv, sd: 0.5 * _np_pool(sd, k, v, off, "gelu", D ** -0.5))


OPS = {
    # name: (jagged fn (q, k, v, jag, kk, vv, seeds), padded fn on unpacked inputs, numpy)
    "cross": _cross_op(TILE),
    "pool": _pool_op(TILE),
    "cross_auto_tile": _cross_op(None),    # tile None: work_tile (8: 64 tokens, 4 examples)
    "pool_auto_tile": _pool_op(None),
    "block_softmax": (
        lambda q, k, v, jag, *_: jagged.jagged_block_attention(q, k, v, jag, block_size=TILE),
        lambda q, k, v, lens, *_: reference.block_attention_reference(
            q, k, v, block_size=TILE, lengths=lens),
        lambda q, k, v, off, *_: _per_example(lambda *a: block_loop(*a, TILE), q, k, v, off)),
    "block_gdpa": (
        lambda q, k, v, jag, *_: jagged.jagged_block_attention(
            q, k, v, jag, block_size=TILE, activation=("fast_gelu", "relu2"), score_clip=2.0),
        lambda q, k, v, lens, *_: reference.block_attention_reference(
            q, k, v, block_size=TILE, activation=("fast_gelu", "relu2"), lengths=lens,
            score_clip=2.0),
        lambda q, k, v, off, *_: _per_example(
            lambda *a: block_loop(*a, TILE, ("fast_gelu", "relu2"), score_clip=2.0), q, k, v,
            off)),
    "softmax_full": (
        lambda q, k, v, jag, *_: jagged.jagged_softmax_attention(q, k, v, jag),
        lambda q, k, v, lens, *_: reference.softmax_attention_reference(
            q, k, v, q_lengths=lens, kv_lengths=lens),
        lambda q, k, v, off, *_: _per_example(softmax_loop, q, k, v, off)),
    "softmax_w17": (
        lambda q, k, v, jag, *_: jagged.jagged_softmax_attention(q, k, v, jag, window=17,
                                                                 scale=0.3),
        lambda q, k, v, lens, *_: reference.softmax_attention_reference(
            q, k, v, window=17, scale=0.3, q_lengths=lens, kv_lengths=lens),
        lambda q, k, v, off, *_: _per_example(
            lambda *a: softmax_loop(*a, window=17, scale=0.3), q, k, v, off)),
    "softmax_w3": (
        lambda q, k, v, jag, *_: jagged.jagged_softmax_attention(q, k, v, jag, window=3),
        lambda q, k, v, lens, *_: reference.softmax_attention_reference(
            q, k, v, window=3, q_lengths=lens, kv_lengths=lens),
        lambda q, k, v, off, *_: _per_example(lambda *a: softmax_loop(*a, window=3), q, k, v,
                                              off)),
    "softmax_w8": (        # window = BAND_MIN: chunks of 8 queries against 24 keys
        lambda q, k, v, jag, *_: jagged.jagged_softmax_attention(q, k, v, jag, window=8),
        lambda q, k, v, lens, *_: reference.softmax_attention_reference(
            q, k, v, window=8, q_lengths=lens, kv_lengths=lens),
        lambda q, k, v, off, *_: _per_example(lambda *a: softmax_loop(*a, window=8), q, k, v,
                                              off)),
}


@functools.cache
def _jitted(name):
  """The op's jagged and padded functions, compiled once for every lengths case."""
  return jax.jit(OPS[name][0]), jax.jit(OPS[name][1])


def _to_padded_output(name, out, jag):
  return out if name.startswith("pool") else jagged.unpack(out, jag, T)


@pytest.mark.parametrize("case", ["ragged", "full", "overflow", "empty"])
@pytest.mark.parametrize("name", list(OPS))
def test_op_against_padded_reference_and_numpy(name, case):
  (fn, padded), oracle = _jitted(name), OPS[name][2]
  (q, k, v), jag, _ = _packed(case)
  kk, vv, sd = _example_kv()
  out = fn(q, k, v, jag, kk, vv, sd)
  qp, kp, vp = (jagged.unpack(x, jag, T) for x in (q, k, v))
  want = padded(qp, kp, vp, jag.lengths, kk, vv, sd)
  np.testing.assert_allclose(_to_padded_output(name, out, jag), want, atol=2e-6, rtol=1e-5)
  offsets = np.asarray(jag.offsets)
  np.testing.assert_allclose(out, oracle(q, k, v, offsets, kk, vv, sd), atol=2e-6, rtol=1e-5)
  if not name.startswith("pool"):
    assert not np.asarray(out)[offsets[-1]:].any()       # padding tokens give 0


@pytest.mark.parametrize("capacity, batch, tile", [
    (1408, 64, 8),      # tiny click: 22 tokens an example -> 11 -> 8
    (7168, 64, 32),     # dev click: 112 -> 56 -> 32
    (19520, 64, 64),    # dev impression: 305 -> 152, capped at 64
    (64, 4, 8), (64, 8, 8), (10, 4, 8)])   # below the floor
def test_work_tile_is_a_power_of_two_near_half_the_mean_capacity(capacity, batch, tile):
  jag = jagged.from_lengths(np.zeros(batch, np.int32), capacity)
  assert jagged.work_tile(jag) == tile


@pytest.mark.parametrize("name", list(OPS))
def test_gradients_match_the_padded_reference(name):
  fn, padded, _ = OPS[name]
  (q, k, v), jag, _ = _packed("ragged", seed=1)
  kk, vv, sd = _example_kv(seed=4)
  out_shape = jax.eval_shape(fn, q, k, v, jag, kk, vv, sd).shape
  w = jax.random.normal(jax.random.key(9), out_shape)
  w = jnp.where(jag.valid[:, None, None], w, 0.0) if not name.startswith("pool") else w
  wp = _to_padded_output(name, w, jag)
  args = (q, k, v, kk, vv, sd)
  g_jag = jax.jit(jax.grad(lambda q, k, v, kk, vv, sd: jnp.sum(fn(q, k, v, jag, kk, vv, sd) * w),
                   argnums=tuple(range(6))))(*args)
  unpack = lambda x: jagged.unpack(x, jag, T)
  g_pad = jax.jit(jax.grad(lambda q, k, v, kk, vv, sd: jnp.sum(
      padded(unpack(q), unpack(k), unpack(v), jag.lengths, kk, vv, sd) * wp),
      argnums=tuple(range(6))))(*args)
  for what, g, r in zip(["q", "k", "v", "k_ex", "v_ex", "seeds"], g_jag, g_pad, strict=True):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6, err_msg=f"d{what}")


@pytest.mark.parametrize("name", ["cross", "pool", "softmax_w17", "softmax_w3", "softmax_w8"])
def test_gradients_on_every_lengths_case(name):
  """The twins' gradients (the GDPA pair core's and the banded softmax's custom VJPs)
  against autodiff of the dense masked padded reference on every lengths case: tile multiples +
  1 with an empty history, one example filling the capacity, overflow, every history empty. The
  descriptor is traced (one compile per op)."""
  fn, padded, _ = OPS[name]
  kk, vv, sd = _example_kv(seed=4)
  pool = name.startswith("pool")

  def grads(jag, w, *args):
    unpack = lambda x: jagged.unpack(x, jag, T)
    w = w if pool else jnp.where(jag.valid[:, None, None], w, 0.0)
    wp = w if pool else unpack(w)
    g_jag = jax.grad(lambda *a: jnp.sum(fn(*a[:3], jag, *a[3:]) * w), argnums=range(6))(*args)
    g_pad = jax.grad(lambda q, k, v, *a: jnp.sum(
        padded(unpack(q), unpack(k), unpack(v), jag.lengths, *a) * wp), argnums=range(6))(*args)
    return g_jag, g_pad

  grads = jax.jit(grads)
  for case in LENGTHS:
    (q, k, v), jag, _ = _packed(case, seed=2)
    w = jax.random.normal(jax.random.key(7), jax.eval_shape(fn, q, k, v, jag, kk, vv, sd).shape)
    g_jag, g_pad = grads(jag, w, q, k, v, kk, vv, sd)
    for what, g, r in zip(["q", "k", "v", "k_ex", "v_ex", "seeds"], g_jag, g_pad, strict=True):
      np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6, err_msg=f"{case} d{what}")


@pytest.mark.parametrize("name", ["cross", "pool", "softmax_w17"])
def test_bfloat16_operands_against_numpy(name):
  """bfloat16 operands (the mixed-precision path: the twins' matmuls take them as they are,
  accumulate in float32, round p to bfloat16 before p.v) against the float64 loop on the same
  rounded inputs, within bfloat16's resolution."""
  fn, _, oracle = OPS[name]
  (q, k, v), jag, _ = _packed("ragged")
  bf = lambda x: x.astype(jnp.bfloat16)
  args = [bf(x) for x in (q, k, v, *_example_kv())]
  out = jax.jit(fn)(*args[:3], jag, *args[3:])
  assert out.dtype == jnp.bfloat16
  want = oracle(*(np.asarray(x, np.float64) for x in args[:3]), np.asarray(jag.offsets),
                *(np.asarray(x, np.float64) for x in args[3:]))
  np.testing.assert_allclose(np.asarray(out, np.float64), want, rtol=2e-2, atol=2e-2)


def test_bfloat16_band_gradients_against_the_float32_reference():
  """The banded twin's own VJP on bfloat16 operands (probabilities and the key-side gradients
  rounded to bfloat16 before their three copies are summed) against float32 autodiff of the
  dense masked padded reference on the same rounded inputs, within bfloat16's resolution."""
  fn, padded, _ = OPS["softmax_w17"]
  (q, k, v), jag, _ = _packed("ragged", seed=1)
  q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
  w = jnp.where(jag.valid[:, None, None], jax.random.normal(jax.random.key(9), q.shape), 0.0)
  unpack = lambda x: jagged.unpack(x, jag, T)
  g_bf = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v, jag).astype(jnp.float32) * w),
                          argnums=(0, 1, 2)))(q, k, v)
  g_ref = jax.jit(jax.grad(lambda q, k, v: jnp.sum(
      padded(unpack(q), unpack(k), unpack(v), jag.lengths) * unpack(w)), argnums=(0, 1, 2)))(
          *(x.astype(jnp.float32) for x in (q, k, v)))
  for what, g, r in zip("qkv", g_bf, g_ref, strict=True):
    assert g.dtype == jnp.bfloat16
    g, r = np.asarray(g, np.float32), np.asarray(r)
    np.testing.assert_allclose(g, r, atol=3e-2 * np.abs(r).max(), err_msg=f"d{what}")


# ----------------------------------------------------------------------------- Pallas


PALLAS = {   # unequal tiles where a backward swaps the roles of the two tiles
    "cross": (lambda q, k, v, jag, kk, vv, sd: jagged_pallas.jagged_gdpa_cross_pallas(
        q, kk, vv, jag, activation="silu", kv_lengths=KV_LENGTHS, score_clip=1.5, out_scale=0.75,
        interpret=True, block_q=TILE)),
    "pool": (lambda q, k, v, jag, kk, vv, sd: jagged_pallas.jagged_gdpa_pool_pallas(
        sd, k, v, jag, activation="gelu", out_scale=0.5, interpret=True, block_k=2 * TILE)),
    "block_softmax": (lambda q, k, v, jag, *_: jagged_pallas.jagged_block_attention_pallas(
        q, k, v, jag, block_size=TILE, interpret=True)),
    "block_gdpa": (lambda q, k, v, jag, *_: jagged_pallas.jagged_block_attention_pallas(
        q, k, v, jag, block_size=TILE, activation=("fast_gelu", "relu2"), score_clip=2.0,
        interpret=True)),
    "softmax_full": (lambda q, k, v, jag, *_: jagged_pallas.jagged_softmax_attention_pallas(
        q, k, v, jag, interpret=True, block_q=2 * TILE, block_k=TILE)),
    "softmax_w17": (lambda q, k, v, jag, *_: jagged_pallas.jagged_softmax_attention_pallas(
        q, k, v, jag, window=17, scale=0.3, interpret=True, block_q=TILE, block_k=2 * TILE)),
}


@pytest.mark.parametrize("name", list(PALLAS))
def test_pallas_against_the_xla_twin(name):
  """Outputs and the gradients of sum(sin(out)) with respect to every operand. Poisoned outputs:
  an element a kernel (forward or backward) does not write stays NaN. One compile serves every
  lengths case (the descriptor is traced)."""
  def vjp_of(fn):
    def run(jag, *ops):
      out, vjp = jax.vjp(lambda *ops: fn(*ops[:3], jag, *ops[3:]), *ops)
      return out, vjp(jnp.cos(out))
    return jax.jit(run)

  twin = vjp_of(OPS[name][0])
  with _poison.poison_outputs():
    run = vjp_of(PALLAS[name])
    for case in LENGTHS:
      (q, k, v), jag, _ = _packed(case)
      ops = (q, k, v, *_example_kv())
      (out, grads), (want, want_grads) = run(jag, *ops), twin(jag, *ops)
      np.testing.assert_allclose(out, want, atol=2e-6, rtol=1e-5, err_msg=case)
      for what, g, r in zip(["q", "k", "v", "k_ex", "v_ex", "seeds"], grads, want_grads,
                            strict=True):
        # another summation order: dseeds sums over every token of the batch
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5, err_msg=f"{case} d{what}")


def _cross_through_twin(q, kk, vv, jag, **kw):
  """The pass-through's twin: ``(jagged_gdpa_cross(q, ...), q)``, differentiated by autodiff
  (q's two cotangents summed by XLA)."""
  return jagged.jagged_gdpa_cross(q, kk, vv, jag, **kw), q


def _through_vjp(fn, jag, ops, **kw):
  """Outputs and the vjp of ``fn(q, kk, vv, jag) -> (o, q)`` at cotangents ``cos(o)`` and
  ``cos(2 q) + 0.5`` (non-zero on the rows past ``offsets[B]``, where dq is the pass-through's
  alone)."""
  outs, vjp = jax.vjp(lambda *a: fn(*a, jag, **kw), *ops)
  return outs, vjp((jnp.cos(outs[0]), jnp.cos(2 * outs[1]) + 0.5))


def test_pallas_cross_pass_through_adds_its_cotangent_to_dq():
  """``jagged_gdpa_cross_pallas(through=True)`` (PFFN's query is also its residual): returns
  ``(o, q)``, and its backward kernel writes dq plus the pass-through's cotangent, also on the
  rows past ``offsets[B]``; against the twin, every lengths case, poisoned outputs."""
  kw = dict(activation="silu", kv_lengths=KV_LENGTHS, score_clip=1.5, out_scale=0.75)
  assert jagged_pallas.cross_through_fits(_packed("full")[0][0], _example_kv()[0], **kw)
  twin = jax.jit(lambda jag, *ops: _through_vjp(_cross_through_twin, jag, ops, **kw))
  with _poison.poison_outputs():
    run = jax.jit(lambda jag, *ops: _through_vjp(
        jagged_pallas.jagged_gdpa_cross_pallas, jag, ops, interpret=True, block_q=TILE,
        through=True, **kw))
    for case in LENGTHS:
      (q, _, _), jag, _ = _packed(case)
      ops = (q, *_example_kv()[:2])
      (outs, grads), (want, want_grads) = run(jag, *ops), twin(jag, *ops)
      np.testing.assert_allclose(outs[0], want[0], atol=2e-6, rtol=1e-5, err_msg=case)
      np.testing.assert_array_equal(outs[1], q, err_msg=case)
      for what, g, r in zip(["q", "k", "v"], grads, want_grads, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5, err_msg=f"{case} d{what}")


def _np_layer_norm(x, eps):
  """float64: each token's row normalised over all its heads (no scale, no bias)."""
  x = np.asarray(x, np.float64).reshape(x.shape[0], -1)
  y = (x - x.mean(1, keepdims=True)) / np.sqrt(x.var(1, keepdims=True) + eps)
  return y.reshape(-1, H, D)


def test_cross_twin_normalises_its_queries_like_numpy():
  """``q_norm``: the twin's output is the float64 loop's on numpy's LayerNorm of the rows
  (values on every token; a row's heads share one statistic)."""
  (q, _, _), jag, _ = _packed("ragged")
  kk, vv, _ = _example_kv()
  q = q * 3.0 + 1.5                                   # a mean and a scale the norm must remove
  got = jagged.jagged_gdpa_cross(q, kk, vv, jag, activation="silu", kv_lengths=KV_LENGTHS,
                                 score_clip=1.5, q_norm=1e-6)
  off = np.asarray(jag.offsets)
  want = _np_cross(_np_layer_norm(q, 1e-6), kk, vv, off, KV_LENGTHS, "silu", D ** -0.5, 1.5)
  np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)


def _ln_vjp(fn, jag, ops, **kw):
  """Outputs and the vjp at cotangent ``cos(o)`` of ``fn(q, kk, vv, jag, q_norm=1e-6)``."""
  out, vjp = jax.vjp(lambda *a: fn(*a, jag, q_norm=1e-6, **kw), *ops)
  return out, vjp(jnp.cos(out.astype(jnp.float32)).astype(out.dtype))


@pytest.mark.parametrize("ln_split", [False, True])
def test_pallas_cross_normalises_its_queries_inside(ln_split):
  """``jagged_gdpa_cross_pallas(q_norm=eps)`` (PFFN's LayerNorm inside the kernels: the query
  never written): values and the gradients of x (through the norm), k and v equal the twin's,
  every lengths case, poisoned outputs; and ``through`` with it is refused in one line. With
  ``ln_split`` the norm's statistics are held in both (``reference.layer_norm_held``: x's
  cotangent is ``r du``, from the kernels), and ``ln_split`` without ``q_norm`` is refused in one
  line by both."""
  kw = dict(activation="silu", kv_lengths=KV_LENGTHS, score_clip=1.5, out_scale=0.75,
            ln_split=ln_split)
  twin = jax.jit(lambda jag, *ops: _ln_vjp(jagged.jagged_gdpa_cross, jag, ops, **kw))
  with _poison.poison_outputs():
    run = jax.jit(lambda jag, *ops: _ln_vjp(jagged_pallas.jagged_gdpa_cross_pallas, jag, ops,
                                            interpret=True, block_q=TILE, **kw))
    for case in LENGTHS:
      (q, _, _), jag, _ = _packed(case)
      ops = (q * 2.0 - 0.5, *_example_kv()[:2])
      (out, grads), (want, want_grads) = run(jag, *ops), twin(jag, *ops)
      np.testing.assert_allclose(out, want, atol=2e-6, rtol=1e-5, err_msg=case)
      for what, g, r in zip(["x", "k", "v"], grads, want_grads, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5, err_msg=f"{case} d{what}")
  (q, _, _), jag, _ = _packed("ragged")
  refused = ([(jagged.jagged_gdpa_cross, "ln_split needs q_norm", dict(ln_split=True)),
              (jagged_pallas.jagged_gdpa_cross_pallas, "ln_split needs q_norm",
               dict(ln_split=True))] if ln_split else
             [(jagged_pallas.jagged_gdpa_cross_pallas, "do not combine",
               dict(interpret=True, through=True, q_norm=1e-6))])
  for fn, msg, bad in refused:
    with pytest.raises(ValueError, match=msg) as e:
      fn(q, *_example_kv()[:2], jag, **bad)
    assert "\n" not in str(e.value)


# prod's head size (d_h 128) with more keys and seeds than one kernel can hold in shared memory
# at once: the GDPA kernels split them (tuning.fit_smem). bfloat16 (prod): the cross forward and
# dq kernels read an example's keys in 2 chunks of 128; float32: every GDPA kernel splits them
# into chunks of 64 rows (inner loops: cross fwd / dq, pool dk/dv; a third grid axis: cross
# dk/dv, pool fwd / dq).
PROD_LENGTHS, PROD_N, PROD_D, PROD_NKV, PROD_S = np.array([40, 0, 70, 9]), 128, 128, 200, 100
PROD_TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}   # of the largest element


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_pallas_gdpa_at_prod_head_dim_against_the_xla_twin(dtype):
  """Cross (ragged kv lengths) and pool GDPA kernels, outputs and gradients, poisoned outputs."""
  ks = jax.random.split(jax.random.key(5), 6)
  jag = jagged.from_lengths(PROD_LENGTHS, PROD_N)
  tok = lambda k: jax.random.normal(k, (PROD_N, 1, PROD_D), dtype)
  ex = lambda k: jax.random.normal(k, (B, PROD_NKV, 1, PROD_D), dtype)
  ops = (tok(ks[0]), ex(ks[1]), ex(ks[2]), jax.random.normal(ks[3], (PROD_S, 1, PROD_D), dtype),
         tok(ks[4]), tok(ks[5]))
  kvl = np.array([200, 17, 0, 129])
  cross = dict(activation="silu", kv_lengths=kvl, score_clip=4.0)

  def run(gdpa_cross, gdpa_pool, **kw):
    def f(q, kk, vv, sd, k, v):
      return (gdpa_cross(q, kk, vv, jag, **cross, **kw).astype(jnp.float32),
              gdpa_pool(sd, k, v, jag, activation="gelu", **kw).astype(jnp.float32))
    outs, vjp = jax.vjp(f, *ops)
    return outs, vjp(tuple(jnp.cos(o) for o in outs))

  want = jax.jit(lambda: run(jagged.jagged_gdpa_cross, jagged.jagged_gdpa_pool))()
  with _poison.poison_outputs():
    got = jax.jit(lambda: run(jagged_pallas.jagged_gdpa_cross_pallas,
                              jagged_pallas.jagged_gdpa_pool_pallas, interpret=True))()
  names = ["cross", "pool", "dq", "dk_ex", "dv_ex", "dseeds", "dk", "dv"]
  for what, g, r in zip(names, jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
    np.testing.assert_allclose(g, r, atol=PROD_TOL[dtype] * np.abs(r).max(), err_msg=what)
  # the pass-through (PFFN's residual): float32 on the split keys' dq kernel; bfloat16's one
  # backward kernel would drop from 2 pipeline stages to 1 reading it, so XLA adds it after the
  # kernels (the test above: the one kernel reading it), and the PFFN does not ask for it
  q, kk, vv = ops[:3]
  assert jagged_pallas.cross_through_fits(q, kk, **cross) == (dtype == jnp.float32)
  want = jax.jit(lambda: _through_vjp(_cross_through_twin, jag, (q, kk, vv), **cross))()
  with _poison.poison_outputs():
    got = jax.jit(lambda: _through_vjp(jagged_pallas.jagged_gdpa_cross_pallas, jag, (q, kk, vv),
                                       interpret=True, through=True, **cross))()
  for what, g, r in zip(["cross", "q", "dq", "dk_ex", "dv_ex"], jax.tree.leaves(got),
                        jax.tree.leaves(want), strict=True):
    g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
    np.testing.assert_allclose(g, r, atol=PROD_TOL[dtype] * np.abs(r).max(), err_msg=what)
  # the query normalised inside the kernels (q_norm: PFFN's LayerNorm), on both backward plans,
  # also with the norm's statistics held (ln_split: the kernels write r du)
  for split in (False, True):
    want = jax.jit(lambda split=split: _ln_vjp(jagged.jagged_gdpa_cross, jag, (q, kk, vv),
                                               ln_split=split, **cross))()
    with _poison.poison_outputs():
      got = jax.jit(lambda split=split: _ln_vjp(jagged_pallas.jagged_gdpa_cross_pallas, jag,
                                                (q, kk, vv), interpret=True, ln_split=split,
                                                **cross))()
    for what, g, r in zip(["cross_ln", "dx", "dk_ex", "dv_ex"], jax.tree.leaves(got),
                          jax.tree.leaves(want), strict=True):
      g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
      np.testing.assert_allclose(g, r, atol=PROD_TOL[dtype] * np.abs(r).max(),
                                 err_msg=f"{what} ln_split={split}")


@pytest.mark.parametrize("programs", [jagged_pallas.POOL_DQ_PROGRAMS, 2],
                         ids=["4-per-program", "8-per-program"])
def test_pallas_pool_seed_gradient_over_a_partial_group_of_examples(programs, monkeypatch):
  """The pool's seed-gradient kernel sums ``_dq_examples`` examples per program (4, or 8 where
  the grid keeps ``POOL_DQ_PROGRAMS`` programs: here made 2): with a batch that is no multiple
  of it (the last group partial) and an empty history, every gradient equals the XLA twin's
  (float32, poisoned outputs)."""
  monkeypatch.setattr(jagged_pallas, "POOL_DQ_PROGRAMS", programs)
  Bx = 10                                   # groups of 4: 4 + 4 + 2; of 8: 8 + 2
  assert jagged_pallas._dq_examples(Bx, H) == (4 if programs > 2 else 8)
  lengths = np.array([5, 0, 9, 1, 7, 3, 2, 4, 6, 1], np.int32)
  rng = np.random.default_rng(11)
  x = [jnp.asarray(rng.normal(size=(Bx, 9, H, D)), jnp.float32) for _ in range(2)]
  pack = jax.jit(jagged.pack, static_argnums=2)
  (k, jag, _), (v, _, _) = (pack(a, lengths, 32) for a in x)
  seeds = jnp.asarray(rng.normal(size=(S, H, D)), jnp.float32)

  def grads(fn):
    f = lambda sd, k, v: jnp.sum(jnp.sin(fn(sd, k, v, jag, activation="gelu", out_scale=0.5)))
    return jax.jit(jax.grad(f, argnums=(0, 1, 2)))(seeds, k, v)

  with _poison.poison_outputs():
    got = grads(functools.partial(jagged_pallas.jagged_gdpa_pool_pallas, interpret=True))
  for what, g, r in zip(("seeds", "k", "v"), got, grads(jagged.jagged_gdpa_pool), strict=True):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5, err_msg=f"d{what}")


def _pallas_calls(jaxpr):
  """``[(kernel name, number of outputs, operand shapes)]`` of a jaxpr's pallas_calls, nested
  jaxprs included."""
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      name = getattr(eqn.params["name"], "name", eqn.params["name"])
      out.append((name, len(eqn.outvars), [tuple(v.aval.shape) for v in eqn.invars]))
    for sub in jex.jaxprs_in_params(eqn.params):
      out += _pallas_calls(sub)
  return out


@pytest.mark.parametrize("seeds,whole", [(S, True), (100, False)])
def test_pool_projecting_its_keys_stores_them_only_for_split_seeds(seeds, whole):
  """Where the pool's backward keeps its seeds whole (one kernel) it projects each tile's k, v
  again from x: the forward kernel writes only the pooled output and the backward kernel reads
  x [N, d], no [N, H, D] k or v. With the seeds split (100 of them, float32, head size 128) the
  forward stores k, v and the split kernels read them."""
  d, heads = 256, 2
  D = d // heads
  f32 = jnp.float32
  q, x = jnp.zeros((seeds, heads, D), f32), jnp.zeros((N, d), f32)
  w = (jnp.zeros((d, heads, D), f32),) * 2
  jag = jagged.Jagged(jnp.array([0, 30, 30, 40, 50], jnp.int32), jnp.zeros((N,), jnp.int32),
                      jnp.zeros((N,), jnp.int32))
  assert jagged_pallas.pool_proj_recomputes(q, x, w) == whole
  f = lambda q, x, w: jnp.sum(jagged_pallas.jagged_gdpa_pool_proj_pallas(q, x, w, jag,
                                                                          interpret=True))
  calls = _pallas_calls(jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2)))(q, x, w).jaxpr)
  fwd = [c for c in calls if c[0] == "jagged_gdpa_pool"]
  pool_bwd = [c for c in calls if c[0].startswith("jagged_gdpa_pool_")]
  assert len(fwd) == 1 and fwd[0][1] == (1 if whole else 3), calls
  reads_x = [(N, d) in c[2] for c in pool_bwd]
  assert pool_bwd and all(reads_x) if whole else not any(reads_x), calls


@pytest.mark.parametrize("d,heads,seeds,again", [
    (256, 4, 64, True),      # mid's high-value towers: 4 d HD / ((4 HD - d) 2) = 171 FLOP/byte
    (128, 2, 32, True),      # mid's impression tower: 85
    (256, 2, 32, True),      # prod's impression tower: 171
    (512, 4, 128, False)])   # prod's high-value towers: 341, over the H200's ridge (206)
def test_pool_projects_again_only_under_the_ridge(d, heads, seeds, again):
  """The presets' HSP pools (bfloat16): projecting k, v again in the backward where it costs
  fewer FLOPs per byte saved than the target's ridge, storing them where it costs more."""
  bf = jnp.bfloat16
  D = d // heads
  q, x = jax.ShapeDtypeStruct((seeds, heads, D), bf), jax.ShapeDtypeStruct((4096, d), bf)
  w = (jax.ShapeDtypeStruct((d, heads, D), bf),) * 2
  assert jagged_pallas.pool_proj_recomputes(q, x, w) == again


# HSP's keys and values projected inside the pool's forward kernel: (d, heads, seeds, dtype); the
# last case (float32, head size 128, 100 seeds) splits the backward's seeds, whose split kernels
# read the k, v the forward stored
PROJ_CASES = [(64, 2, S, jnp.float32), (64, 2, S, jnp.bfloat16), (256, 2, 20, jnp.float32),
              (256, 2, 100, jnp.float32)]


def _token_rows(x, case, dtype):
  """``(tokens [N, d] in dtype, Jagged)``: the padded rows ``x [B, T, d]`` packed at a lengths
  case."""
  xs, jag, _ = jax.jit(jagged.pack, static_argnums=2)(
      jnp.asarray(x, jnp.float32)[:, :, None], np.array(LENGTHS[case]), N)
  return xs[:, 0].astype(dtype), jag


def _assert_leaves_close(names, got, want, tol, case):
  """Each leaf of ``got`` finite and within ``tol`` of the largest element of ``want``'s."""
  for what, g, r in zip(names, jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
    assert np.all(np.isfinite(g)), f"{case} {what}"
    np.testing.assert_allclose(g, r, atol=tol * max(np.abs(r).max(), 1e-6),
                               err_msg=f"{case} {what}")


@pytest.mark.parametrize("d,heads,seeds,dtype", PROJ_CASES)
def test_pallas_pool_projecting_its_keys_against_the_unfused_twin(d, heads, seeds, dtype):
  """``jagged_gdpa_pool_proj_pallas(q, x, (w_k, w_v))`` against the twin of the unfused chain,
  ``jagged_gdpa_pool(q, *norm_proj_xla(x, w))``: outputs and the gradients of every operand
  (float32 1e-5, bfloat16 2e-2 of the largest element), with ragged lengths, an empty history
  and one example filling the capacity (``LENGTHS``), poisoned outputs; ``x`` wider than
  ``PROJ_COLS`` runs its column chunks."""
  D = d // heads
  rng = np.random.default_rng(d + seeds)
  w = tuple(jnp.asarray(rng.normal(size=(d, heads, D)) / np.sqrt(d), dtype) for _ in range(2))
  q = jnp.asarray(rng.normal(size=(seeds, heads, D)), dtype)
  kw = dict(activation="gelu", out_scale=0.5)

  def twin(q, x, w, jag):
    return jagged.jagged_gdpa_pool(q, *norm_qkv.norm_proj_xla(x, w, dtype=dtype), jag, **kw)

  def fused(q, x, w, jag):
    return jagged_pallas.jagged_gdpa_pool_proj_pallas(q, x, w, jag, interpret=True, **kw)

  def vjp_of(fn):
    def run(jag, q, x, w):
      out, vjp = jax.vjp(lambda q, x, w: fn(q, x, w, jag).astype(jnp.float32), q, x, w)
      return out, vjp(jnp.cos(out))
    return jax.jit(run)

  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  with _poison.poison_outputs():
    run = vjp_of(fused)
    for case in ("ragged", "empty", "full"):
      xs, jag = _token_rows(rng.normal(size=(B, T, d)), case, dtype)
      (out, grads), (want, wgrads) = run(jag, q, xs, w), vjp_of(twin)(jag, q, xs, w)
      _assert_leaves_close(["out", "q", "x", "w_k", "w_v"], (out, grads), (want, wgrads), tol,
                           case)


def test_ln_through_and_held_statistics_compose_to_the_layer_norm():
  """``reference.ln_through`` returns x exactly, and its VJP is numpy's ``g - mean(g) - y mean(g
  y)`` (float64, ``y`` the rows' LayerNorm); ``layer_norm_held`` after it has ``layer_norm``'s
  values and, by autodiff of the plain norm, its VJP."""
  rng = np.random.default_rng(7)
  x = jnp.asarray(rng.normal(size=(9, 32)) * 3 + 1, jnp.float32)
  g = jnp.asarray(rng.normal(size=(9, 32)), jnp.float32)
  y, vjp = jax.vjp(lambda x: reference.ln_through(x, 1e-6), x)
  np.testing.assert_array_equal(y, x)
  xn = np.asarray(x, np.float64)
  yn = (xn - xn.mean(1, keepdims=True)) / np.sqrt(xn.var(1, keepdims=True) + 1e-6)
  gn = np.asarray(g, np.float64)
  want = gn - gn.mean(1, keepdims=True) - yn * (gn * yn).mean(1, keepdims=True)
  np.testing.assert_allclose(vjp(g)[0], want, atol=1e-5)
  held = lambda x: reference.layer_norm_held(reference.ln_through(x, 1e-6), 1e-6)
  plain = lambda x: reference.layer_norm(x, 1e-6)
  np.testing.assert_allclose(held(x), plain(x), atol=1e-6)
  np.testing.assert_allclose(jax.vjp(held, x)[1](g)[0], jax.vjp(plain, x)[1](g)[0], rtol=1e-5,
                             atol=1e-5)


def _tower_readers(x, q, w, kk, vv, jag, pallas, dtype):
  """HSP's pool, the PFFN's GDPA on the LayerNorm of the same tokens and a third reader
  (``sin``, the tail's stand-in) of ``x [N, d]``: the Pallas kernels with the pool passing x
  through to the other two (``through``, ``ln_split``), or the twins of the plain chain."""
  kw = dict(activation="gelu", out_scale=0.5)
  cross = dict(activation="silu", kv_lengths=KV_LENGTHS, score_clip=1.5)
  shape = (x.shape[0],) + kk.shape[2:]
  if pallas:
    o, xl, xi = jagged_pallas.jagged_gdpa_pool_proj_pallas(q, x, w, jag, interpret=True,
                                                           through=1e-6, **kw)
    g = jagged_pallas.jagged_gdpa_cross_pallas(xl.reshape(shape), kk, vv, jag, interpret=True,
                                               block_q=TILE, q_norm=1e-6, ln_split=True, **cross)
  else:
    o = jagged.jagged_gdpa_pool(q, *norm_qkv.norm_proj_xla(x, w, dtype=dtype), jag, **kw)
    g = jagged.jagged_gdpa_cross(x.reshape(shape), kk, vv, jag, q_norm=1e-6, **cross)
    xi = x
  return o.astype(jnp.float32), g.astype(jnp.float32), jnp.sin(xi.astype(jnp.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pool_passing_tokens_to_the_pffn_equals_the_plain_chain(dtype):
  """A layer's three readers of a tower's tokens with the pool's pass-throughs
  (``jagged_gdpa_pool_proj_pallas(through=eps)`` into ``jagged_gdpa_cross_pallas(q_norm=eps,
  ln_split=True)`` and an elementwise reader): outputs and the gradients of x (whose three
  cotangents and the LayerNorm's backward the projections' backward kernel adds), the seeds,
  the weights and the keys and values equal the plain chain's twins, autodiff of the LayerNorm
  (float32 1e-5, bfloat16 2e-2 of the largest element), with ragged lengths, an empty history,
  one example filling the capacity, poisoned outputs."""
  d, heads = 64, 2
  D = d // heads
  rng = np.random.default_rng(11)
  w = tuple(jnp.asarray(rng.normal(size=(d, heads, D)) / np.sqrt(d), dtype) for _ in range(2))
  q = jnp.asarray(rng.normal(size=(S, heads, D)), dtype)
  kk, vv = (jnp.asarray(rng.normal(size=(B, NKV, heads, D)) * 0.5, dtype) for _ in range(2))

  def vjp_of(pallas):
    def run(jag, *ops):
      out, vjp = jax.vjp(lambda x, q, w, kk, vv: _tower_readers(x, q, w, kk, vv, jag, pallas,
                                                                  dtype), *ops)
      return out, vjp(jax.tree.map(jnp.cos, out))
    return jax.jit(run)

  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  with _poison.poison_outputs():
    run = vjp_of(True)
    for case in ("ragged", "empty", "full"):
      xs, jag = _token_rows(rng.normal(size=(B, T, d)) * 2 + 0.5, case, dtype)
      ops = (xs, q, w, kk, vv)
      (out, grads), (want, wgrads) = run(jag, *ops), vjp_of(False)(jag, *ops)
      _assert_leaves_close(["pool", "gdpa", "third", "x", "q", "w_k", "w_v", "k", "v"],
                           (out, grads), (want, wgrads), tol, case)
