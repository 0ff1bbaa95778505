"""Pallas GDPA (interpret mode) against the XLA reference and a numpy loop; gradients against
jax.grad of the reference. Tiny shapes: T not a multiple of the 16-wide tiles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import _poison, activations, pallas_gdpa, reference
from tests.pallas_kernels.np_ref import NP_ACTS, gdpa_loop

B, TQ, TK, H, D = 2, 37, 29, 2, 8
TILES = dict(block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=16)


def _qkv(dtype=jnp.float32, seed=0, tq=TQ, tk=TK, bq=B, h=H, bk=B, hk=None):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  hk = hk or h
  return (jax.random.normal(kq, (bq, tq, h, D), dtype),
          jax.random.normal(kk, (bk, tk, hk, D), dtype),
          jax.random.normal(kv, (bk, tk, hk, D), dtype))


def _jit(fn, **kw):
  """``fn`` with keyword arguments bound, jitted (one compile instead of op-by-op dispatch)."""
  return jax.jit(lambda *args: fn(*args, **kw))


def _kernel(q, k, v, **kw):
  return pallas_gdpa.gdpa_pallas(q, k, v, interpret=True, **TILES, **kw)


def _check_forward(kw, q=None, k=None, v=None, atol=2e-5):
  if q is None:
    q, k, v = _qkv()
  out = _jit(_kernel, **kw)(q, k, v)
  ref = _jit(reference.gdpa_reference, **kw)(q, k, v)
  loop = gdpa_loop(q, k, v, **kw)
  assert out.shape == ref.shape == loop.shape
  np.testing.assert_allclose(out, ref, atol=atol, rtol=1e-5)
  np.testing.assert_allclose(ref, loop, atol=atol, rtol=1e-5)
  np.testing.assert_allclose(out, loop, atol=atol, rtol=1e-5)
  return out


def test_forward_every_activation_one_per_head():
  """H = 6 heads, head h uses activations.NAMES[h]: every activation in one kernel call."""
  q, k, v = _qkv(h=len(activations.NAMES))
  out = _check_forward(dict(activation=activations.NAMES, q_lengths=np.array([37, 20]),
                            kv_lengths=np.array([17, 29])), q, k, v)
  assert np.all(np.abs(np.asarray(out[0, :17])).max(axis=(0, 2)) > 0)  # no head trivially zero


def test_forward_single_activation():
  _check_forward(dict(activation="gelu", kv_lengths=np.array([29, 16])))


def test_forward_per_head_window_zero_length_scales():
  kw = dict(activation=("silu", "relu2"), window=5, scale=0.4, out_scale=0.25,
            q_lengths=np.array([0, 33]), kv_lengths=np.array([29, 0]))
  out = _check_forward(kw)
  assert np.all(np.asarray(out) == 0)  # each example has one zero-length side
  kw.update(q_lengths=np.array([30, 33]), kv_lengths=np.array([29, 11]))
  out = _check_forward(kw)
  assert np.all(np.asarray(out[0, 30:]) == 0) and np.abs(np.asarray(out[1, :5])).max() > 0


def test_forward_broadcast_q_and_dispatch():
  q, k, v = _qkv(bq=1)
  kw = dict(activation="gelu", broadcast_q=True, q_lengths=np.array([37, 8]), window=12)
  _check_forward(kw, q, k, v)
  out = pallas_kernels.gdpa(q, k, v, backend="pallas", interpret=True, **kw)
  np.testing.assert_allclose(out, gdpa_loop(q, k, v, **kw), atol=2e-5)


def test_forward_bf16_inputs():
  q, k, v = _qkv(jnp.bfloat16)
  kw = dict(activation="fast_gelu", kv_lengths=np.array([29, 13]))
  out = _kernel(q, k, v, **kw)
  assert out.dtype == jnp.bfloat16
  loop = gdpa_loop(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), **kw)
  # P is rounded to bf16 before P.V and the output is bf16: ~3 significant digits.
  np.testing.assert_allclose(np.asarray(out, np.float32), loop, atol=3e-2, rtol=2e-2)
  got = _grads(_kernel, q, k, v, kw)
  want = _grads(reference.gdpa_reference, *(x.astype(jnp.float32) for x in (q, k, v)), kw)
  for g, r in zip(got, want, strict=True):
    assert g.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(g, np.float32), r, atol=6e-2 * float(jnp.abs(r).max()))


GRAD_CASES = [  # (kwargs, heads); the first case covers every activation's derivative
    (dict(activation=activations.NAMES, q_lengths=np.array([37, 19]),
          kv_lengths=np.array([13, 29])), len(activations.NAMES)),
    (dict(activation="fast_gelu", window=6, out_scale=0.5, scale=0.3), H),
    (dict(activation=("relu", "silu"), q_lengths=np.array([0, 37]), kv_lengths=np.array([29, 0])),
     H),
]


def _grads(fn, q, k, v, kw):
  w = jnp.cos(jnp.arange(q.shape[1] * D, dtype=jnp.float32).reshape(q.shape[1], 1, D))
  return jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v, **kw).astype(jnp.float32) * w),
                          argnums=(0, 1, 2)))(q, k, v)


@pytest.mark.parametrize("kw,heads", GRAD_CASES, ids=range(len(GRAD_CASES)))
def test_gradients_match_reference(kw, heads):
  q, k, v = _qkv(seed=1, h=heads)
  got = _grads(_kernel, q, k, v, kw)
  want = _grads(reference.gdpa_reference, q, k, v, kw)
  for name, g, r in zip("qkv", got, want, strict=True):
    assert np.isfinite(np.asarray(g)).all(), name
    np.testing.assert_allclose(g, r, atol=5e-5, rtol=1e-4, err_msg=f"d{name}")


def test_gradients_broadcast_q():
  q, k, v = _qkv(bq=1, seed=2)
  kw = dict(activation="silu", broadcast_q=True, kv_lengths=np.array([29, 7]))
  got = _grads(_kernel, q, k, v, kw)
  want = _grads(reference.gdpa_reference, q, k, v, kw)
  assert got[0].shape == (1, TQ, H, D)
  for g, r in zip(got, want, strict=True):
    np.testing.assert_allclose(g, r, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("broadcast_q", [False, True])
def test_poisoned_outputs_are_fully_written(broadcast_q):
  """Every kernel output (forward, dq, dk/dv) starts NaN-filled: all elements must be written,
  including tiles skipped by lengths/window and the padding beyond T."""
  q, k, v = _qkv(bq=1 if broadcast_q else B)
  kw = dict(activation="silu", q_lengths=np.array([3, 0]), kv_lengths=np.array([29, 4]), window=3,
            broadcast_q=broadcast_q)
  with _poison.poison_outputs():
    out = _jit(_kernel, **kw)(q, k, v)
    got = _grads(_kernel, q, k, v, kw)
  assert np.isfinite(np.asarray(out)).all()
  np.testing.assert_allclose(out, gdpa_loop(q, k, v, **kw), atol=2e-5)
  want = _grads(reference.gdpa_reference, q, k, v, kw)
  for g, r in zip(got, want, strict=True):
    assert np.isfinite(np.asarray(g)).all()
    np.testing.assert_allclose(g, r, atol=5e-5, rtol=1e-4)


def test_nan_in_masked_positions_never_leaks():
  q, k, v = _qkv(seed=3)
  ql, kl = np.array([30, 11]), np.array([20, 29])
  clean = [x for x in (q, k, v)]
  qn = q.at[0, 30:].set(jnp.nan).at[1, 11:].set(jnp.inf)
  kn = k.at[0, 20:].set(jnp.nan)
  vn = v.at[0, 20:].set(jnp.nan)
  kw = dict(activation="fast_gelu", q_lengths=ql, kv_lengths=kl)
  out = _kernel(qn, kn, vn, **kw)
  assert np.isfinite(np.asarray(out)).all()
  np.testing.assert_allclose(out, gdpa_loop(*clean, **kw), atol=2e-5)
  got = _grads(_kernel, qn, kn, vn, kw)
  want = _grads(reference.gdpa_reference, *clean, kw)
  for g, r in zip(got, want, strict=True):
    assert np.isfinite(np.asarray(g)).all()
    np.testing.assert_allclose(g, r, atol=5e-5, rtol=1e-4)


def test_fp8_forward_close_to_fp32():
  """fp8 e4m3 (3 mantissa bits) per-tensor scaled q.k, bf16 P.V: relative L2 error < 8%."""
  q, k, v = _qkv(seed=4)
  kw = dict(activation="fast_gelu", window=10)
  out = pallas_kernels.gdpa(q, k, v, backend="pallas", interpret=True, fp8=True, **TILES, **kw)
  want = gdpa_loop(q, k, v, **kw)
  err = np.linalg.norm(np.asarray(out, np.float64) - want) / np.linalg.norm(want)
  assert err < 0.08, err
  # Independent emulation of the same quantisation in numpy-fed XLA: much closer.
  deq = [np.asarray((x / s).astype(jnp.float8_e4m3fn), np.float64) * s
         for x in (q, k, v) for s in [float(jnp.abs(x).max()) / 448.0]]
  emu = gdpa_loop(*deq, **kw)
  err_emu = np.linalg.norm(np.asarray(out, np.float64) - emu) / np.linalg.norm(emu)
  assert err_emu < 0.02, err_emu


def test_tile_span_covers_exactly_the_visible_tiles():
  """The loop bounds that skip tiles keep every tile with a visible pair (none is lost)."""
  tile, other, n_other = 4, 8, 5
  for start in range(0, 24, tile):
    for other_len in (0, 7, 17, 40):
      for window in (None, 0, 3, 9):
        lo, hi = (int(x) for x in pallas_gdpa._span(jnp.int32(start), tile, other, n_other,
                                                    jnp.int32(other_len), window))
        for t in range(n_other):
          visible = any(j < other_len and (window is None or abs(i - j) <= window)
                        for i in range(start, start + tile)
                        for j in range(t * other, (t + 1) * other))
          if visible:
            assert lo <= t < hi, (start, other_len, window, t, lo, hi)


def test_kernel_activation_forms_match_reference():
  """The closed-form values and derivatives the kernels use (activations.kernel_fn; the Triton
  source mirrors them) against the reference definitions, jax.grad and numpy."""
  x = jnp.linspace(-5.0, 5.0, 2001) + 1e-3           # avoid the kinks at exactly 0 and +-3
  for name in activations.NAMES:
    ref = activations.ACTIVATIONS[name]
    val, slope = activations.kernel_fn(name, with_slope=True)(x)
    np.testing.assert_allclose(val, ref(x), atol=2e-6, rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(val, NP_ACTS[name](np.asarray(x, np.float64)), atol=2e-6,
                               rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(slope, jax.vmap(jax.grad(ref))(x), atol=1e-5, rtol=1e-5,
                               err_msg=name)
    assert float(activations.kernel_fn(name)(jnp.zeros(()))) == 0.0, name   # act(0) = 0
  # gelu_taylor is the spec's polynomial: close to GELU only near 0 (hence the score clip).
  small = jnp.linspace(-1.0, 1.0, 201)
  np.testing.assert_allclose(activations.ACTIVATIONS["gelu_taylor"](small),
                             activations.ACTIVATIONS["gelu"](small), atol=2e-3)


# ---- request-level sharing (q_index / kv_index, spec d.6) and GQA ------------------------------

QI, KI = np.array([1, 0, 1]), np.array([0, 0, 1])          # 3 output rows; q and k/v have 2


def _per_ad(q, k, v, q_index, kv_index):
  """The dense per-ad operands (an explicit gather: what the kernels must never materialise)."""
  return (q if q_index is None else q[q_index]), *(x if kv_index is None else x[kv_index]
                                                   for x in (k, v))


@pytest.mark.parametrize("qi,ki", [(QI, KI), (None, KI)], ids=["both", "kv"])  # q: broadcast_q
def test_sharing_and_gqa_forward_and_gradients(qi, ki):
  """Output row b reads q[q_index[b]] and k/v[kv_index[b]] (lengths indexed like their operand),
  with GQA (4 q heads on 2 kv heads, per-head activations): forward against the numpy loop,
  gradients against jax.grad of the reference on explicitly gathered per-ad operands, i.e. the
  shared rows' gradients are sums over their ads."""
  n_out = 3
  q, k, v = _qkv(seed=11, h=4, hk=2, bq=2 if qi is not None else n_out,
                 bk=2 if ki is not None else n_out)
  ql = np.array([37, 21]) if qi is not None else np.array([37, 21, 30])
  kl = np.array([29, 12]) if ki is not None else np.array([29, 12, 5])
  kw = dict(activation=("fast_gelu", "silu", "gelu_taylor", "hardswish"), q_lengths=ql,
            kv_lengths=kl, window=20)
  out = _jit(_kernel, q_index=qi, kv_index=ki, **kw)(q, k, v)
  assert out.shape == (n_out, TQ, 4, D)
  np.testing.assert_allclose(out, gdpa_loop(q, k, v, q_index=qi, kv_index=ki, **kw), atol=2e-5,
                             rtol=1e-5)
  got = _grads(lambda q, k, v, **kw: _kernel(q, k, v, q_index=qi, kv_index=ki, **kw), q, k, v,
               kw)
  dense_kw = dict(kw, q_lengths=ql if qi is None else ql[qi],
                  kv_lengths=kl if ki is None else kl[ki])
  want = _grads(lambda q, k, v, **kw: reference.gdpa_reference(*_per_ad(q, k, v, qi, ki), **kw),
                q, k, v, dense_kw)
  for name, g, r in zip("qkv", got, want, strict=True):
    assert g.shape == r.shape
    np.testing.assert_allclose(g, r, atol=5e-5, rtol=1e-4, err_msg=f"d{name}")
  # The XLA reference with indices is the same computation.
  np.testing.assert_allclose(reference.gdpa_reference(q, k, v, q_index=qi, kv_index=ki, **kw),
                             out, atol=2e-5, rtol=1e-5)


def test_sharing_bf16_and_index_errors():
  q, k, v = _qkv(jnp.bfloat16, seed=12, h=2, hk=1, bq=1, bk=2)
  qi, ki = np.array([0, 0, 0]), np.array([1, 0, 1])
  kw = dict(activation="fast_gelu", q_index=qi, kv_index=ki, kv_lengths=np.array([29, 9]))
  got = _grads(_kernel, q, k, v, kw)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  want = _grads(lambda q, k, v: reference.gdpa_reference(
      *_per_ad(q, k, v, qi, ki), activation="fast_gelu", kv_lengths=np.array([9, 29, 9])),
      *f32, {})
  for g, r in zip(got, want, strict=True):
    assert g.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(g, np.float32), r, atol=6e-2 * float(jnp.abs(r).max()))
  with pytest.raises(ValueError, match="same length"):
    _kernel(q, k, v, q_index=np.array([0]), kv_index=np.array([0, 1]))
  with pytest.raises(ValueError, match="multiple of the k/v heads"):
    _kernel(q, k[:, :, :1].repeat(3, axis=2), v[:, :, :1].repeat(3, axis=2),
            q_index=np.array([0, 0]))
  with pytest.raises(ValueError, match="kv_index"):
    _kernel(q, k, v, q_index=np.array([0, 0, 0]))


def test_bad_arguments_raise():
  q, k, v = _qkv()
  with pytest.raises(ValueError, match="activation"):
    _kernel(q, k, v, activation="tanh")
  with pytest.raises(ValueError, match="broadcast_q"):
    _kernel(q, k, v, broadcast_q=True)
  with pytest.raises(ValueError, match="lengths"):
    _kernel(q, k, v, q_lengths=np.array([1, 2, 3]))


def test_backend_dispatch_errors():
  q, k, v = _qkv()
  with pytest.raises(ValueError, match="unknown gdpa backend"):
    pallas_kernels.gdpa(q, k, v, backend="cuda")
  with pytest.raises(ValueError, match="no interpret mode"):
    pallas_kernels.gdpa(q, k, v, backend="triton", interpret=True)
  # On CPU "auto" is the XLA reference.
  np.testing.assert_array_equal(pallas_kernels.gdpa(q, k, v, backend="auto"),
                                reference.gdpa_reference(q, k, v))


# ---- score_clip (spec h-13): s = scale q.k clamped to [-c, c] before the activation -----------

CLIP = 1.5
CLIP_KW = dict(activation=("gelu", "silu"), scale=1.0, score_clip=CLIP, window=20,
               q_lengths=np.array([37, 25]), kv_lengths=np.array([29, 18]))


def test_score_clip_forward_and_gradients():
  """Scores well beyond the clip (scale 1: s ~ N(0, D)): forward against the reference and the
  numpy loop, gradients against jax.grad of the reference (jnp.clip)."""
  q, k, v = _qkv(seed=5)
  s = np.einsum("bqhd,bkhd->bhqk", np.asarray(q), np.asarray(k))
  assert 0.3 < np.mean(np.abs(s) > CLIP) < 0.9
  out = _check_forward(CLIP_KW, q, k, v)
  unclipped = gdpa_loop(q, k, v, **{**CLIP_KW, "score_clip": None})
  assert np.abs(np.asarray(out) - unclipped).max() > 0.1   # the clip is active
  got = _grads(_kernel, q, k, v, CLIP_KW)
  want = _grads(reference.gdpa_reference, q, k, v, CLIP_KW)
  free = _grads(reference.gdpa_reference, q, k, v, {**CLIP_KW, "score_clip": None})
  for name, g, r, f in zip("qkv", got, want, free, strict=True):
    assert np.isfinite(np.asarray(g)).all(), name
    np.testing.assert_allclose(g, r, atol=5e-5, rtol=1e-4, err_msg=f"d{name}")
    assert np.abs(np.asarray(r) - np.asarray(f)).max() > 0.1, name


def test_score_clip_gradient_zero_outside_range():
  """Identity activation and every score above the clip c: o_i = c * out_scale * sum_j v_j does
  not depend on q or k (zero dq, dk); dv_j = c * sum_i w_i (w: the loss weights of _grads).
  Checks the reference's semantics; the kernels match the reference in the test above."""
  q, k, v = _qkv(seed=7)
  q, k = jnp.abs(q) + 0.1, jnp.abs(k) + 0.1         # every q.k >= D * 0.01, scaled by 100
  kw = dict(activation="identity", scale=100.0, score_clip=0.5)
  dq, dk, dv = _grads(reference.gdpa_reference, q, k, v, kw)
  np.testing.assert_array_equal(dq, 0.0)
  np.testing.assert_array_equal(dk, 0.0)
  w = np.cos(np.arange(TQ * D, dtype=np.float64).reshape(TQ, 1, D))
  want_dv = np.broadcast_to(0.5 * w.sum(0), (B, TK, H, D))
  np.testing.assert_allclose(dv, want_dv, atol=1e-4, rtol=1e-5)


def test_score_clip_off_is_the_same_computation():
  """score_clip None / 0 trace to exactly the jaxpr of a call without it (forward and backward,
  pallas and xla), so results are bitwise unchanged."""
  q, k, v = _qkv(seed=8)
  kw = dict(activation="gelu", kv_lengths=np.array([29, 16]))
  for fn in (_kernel, reference.gdpa_reference):
    loss = lambda q, k, v, fn=fn, **extra: jnp.sum(fn(q, k, v, **kw, **extra) ** 2)
    base = str(jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(q, k, v))
    for off in (None, 0, 0.0):
      got = jax.make_jaxpr(jax.grad(lambda *a, off=off, loss=loss: loss(*a, score_clip=off),
                                    (0, 1, 2)))
      assert str(got(q, k, v)) == base, (fn, off)
  with_clip = jax.make_jaxpr(lambda *a: _kernel(*a, score_clip=2.0, **kw))(q, k, v)
  assert str(with_clip) != str(jax.make_jaxpr(lambda *a: _kernel(*a, **kw))(q, k, v))


def test_score_clip_fp8_dispatch_and_errors():
  q, k, v = _qkv(seed=9)
  kw = dict(activation="relu2", scale=1.0, score_clip=CLIP, kv_lengths=np.array([29, 9]))
  want = gdpa_loop(q, k, v, **kw)
  out = pallas_kernels.gdpa(q, k, v, backend="xla", **kw)
  np.testing.assert_allclose(out, want, atol=2e-5, rtol=1e-5)
  out = pallas_kernels.gdpa(q, k, v, backend="pallas", interpret=True, fp8=True, **TILES, **kw)
  err = np.linalg.norm(np.asarray(out, np.float64) - want) / np.linalg.norm(want)
  assert err < 0.08, err
  for backend in ("xla", "pallas"):
    with pytest.raises(ValueError, match="score_clip"):
      pallas_kernels.gdpa(q, k, v, backend=backend, score_clip=-1.0)
