"""kunlun.nn.fused (hand-written VJPs of the sequence modules' elementwise blocks) against autodiff
of the plain formulas, and SeqAttention's float32 output and gradients against autodiff of the
plain (pre-issue-19) composition of the same operations."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kunlun.nn import fused
from kunlun.nn.attention import SeqAttention
from kunlun.nn.time_encoding import rotary_time
from pallas_kernels.reference import apply_rotary, softmax_attention_reference

F32 = jnp.float32


def _plain_rms(x, eps=1e-6):
  x = x.astype(F32)
  return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), -1, keepdims=True) + eps)


def _data(B=2, T=12, H=2, D=8, seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(B, T, H, D)), F32)
  w = jnp.asarray(rng.normal(size=(B, T, H, D)), F32)
  age = jnp.asarray(rng.exponential(3600.0, (B, T)), F32)
  return x, w, age


def test_rotary_values_and_gradient():
  x, w, age = _data()
  plain = lambda x: apply_rotary(x, rotary_time(age, 2, 8, 60.0))
  np.testing.assert_allclose(np.asarray(fused.rotary(x, age)), np.asarray(plain(x)),
                             rtol=1e-6, atol=1e-6)
  g = jax.grad(lambda x: jnp.sum(fused.rotary(x, age) * w))(x)
  g_ref = jax.grad(lambda x: jnp.sum(plain(x) * w))(x)
  np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-6, atol=1e-6)
  xb = x.astype(jnp.bfloat16)                           # 16-bit in, 16-bit out and cotangent
  assert fused.rotary(xb, age).dtype == jnp.bfloat16
  assert jax.grad(lambda x: jnp.sum(fused.rotary(x, age).astype(F32)))(xb).dtype == jnp.bfloat16


def test_rotary_with_given_positions():
  """Packed tokens rotate their positional heads by their own ``pos`` (not 0..T-1): values and
  gradient against autodiff of ``apply_rotary(rotary_time(..., positions))``."""
  x, w, age = _data(H=3)
  pos = jnp.asarray(np.random.default_rng(1).integers(0, 40, age.shape), jnp.int32)
  plain = lambda x: apply_rotary(x, rotary_time(age, 3, 8, 60.0, pos))
  np.testing.assert_allclose(np.asarray(fused.rotary(x, age, positions=pos)),
                             np.asarray(plain(x)), rtol=1e-6, atol=1e-6)
  assert not np.allclose(np.asarray(fused.rotary(x, age)), np.asarray(plain(x)), atol=1e-3)
  g = jax.grad(lambda x: jnp.sum(fused.rotary(x, age, positions=pos) * w))(x)
  g_ref = jax.grad(lambda x: jnp.sum(plain(x) * w))(x)
  np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("with_emb", [False, True])
def test_qk_norm_rotary_equals_the_plain_composition(with_emb):
  x, w, age = _data(seed=1)
  rng = np.random.default_rng(2)
  sc = jnp.asarray(1 + 0.3 * rng.normal(size=8), F32)
  emb = jnp.asarray(rng.normal(size=x.shape), F32) if with_emb else None

  def plain(x, sc, emb):
    y = _plain_rms(x) * sc
    y = y if emb is None else y + emb
    return apply_rotary(y, rotary_time(age, 2, 8, 60.0))

  got = lambda x, sc, emb: fused.qk_norm_rotary(x, sc, age, dtype=F32, emb=emb)
  np.testing.assert_allclose(np.asarray(got(x, sc, emb)), np.asarray(plain(x, sc, emb)),
                             rtol=1e-6, atol=1e-6)
  n = 3 if with_emb else 2
  g = jax.grad(lambda *a: jnp.sum(got(*a) * w), argnums=tuple(range(n)))(x, sc, emb)
  g_ref = jax.grad(lambda *a: jnp.sum(plain(*a) * w), argnums=tuple(range(n)))(x, sc, emb)
  for a, b in zip(g, g_ref, strict=True):                # row sums reassociated: rtol 1e-5
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_masked_residual_values_and_gradients():
  """``y`` zero at the padding rows (as an attention projection): the same gradients as the
  plain ``where(valid, s + y, 0)``; ``s`` gets none at the padding rows."""
  rng = np.random.default_rng(3)
  s = jnp.asarray(rng.normal(size=(3, 7, 4)), F32)
  z = jnp.asarray(rng.normal(size=(3, 7, 4)), F32)
  w = jnp.asarray(rng.normal(size=(3, 7, 4)), F32)
  lengths = jnp.array([7, 3, 0])
  valid = (jnp.arange(7)[None] < lengths[:, None])[..., None]
  proj = lambda z: jnp.where(valid, jnp.tanh(z), 0.0)     # zero at the padding rows
  plain = lambda s, z: jnp.where(valid, s + proj(z), 0.0)
  got = lambda s, z: fused.masked_residual(s, proj(z), lengths)
  np.testing.assert_array_equal(np.asarray(got(s, z)), np.asarray(plain(s, z)))
  g = jax.grad(lambda s, z: jnp.sum(got(s, z) * w), argnums=(0, 1))(s, z)
  g_ref = jax.grad(lambda s, z: jnp.sum(plain(s, z) * w), argnums=(0, 1))(s, z)
  for a, b in zip(g, g_ref, strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert np.all(np.asarray(g[0])[~np.asarray(valid[..., 0])] == 0)


def _plain_seq_attention(p, s, lengths, age, window):
  """SeqAttention (softmax, swa) as plain autodiff-able jnp, as it was before issue 19."""
  B, T, d = s.shape
  H, dh = p["qkv"].shape[2:]
  qkv = jnp.einsum("btd,dihc->btihc", _plain_rms(s), p["qkv"])
  q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
  q, k = _plain_rms(q) * p["q_scale"], _plain_rms(k) * p["k_scale"]
  rot = rotary_time(age, H, dh, 60.0)
  q, k = apply_rotary(q, rot), apply_rotary(k, rot)
  o = softmax_attention_reference(q, k, v, window=window, q_lengths=lengths, kv_lengths=lengths)
  y = s + jnp.einsum("bthc,hcd->btd", o, p["out"])
  return jnp.where((jnp.arange(T)[None] < lengths[:, None])[..., None], y, 0.0)


def test_seq_attention_float32_output_and_gradients_equal_the_plain_composition():
  rng = np.random.default_rng(4)
  B, T, d = 3, 60, 16
  s = jnp.asarray(rng.normal(size=(B, T, d)), F32)
  age = jnp.asarray(np.sort(rng.exponential(3600.0, (B, T)), 1)[:, ::-1], F32)
  lengths = jnp.array([60, 41, 0], jnp.int32)
  m = SeqAttention(4, "swa", window=5)
  p = nn.meta.unbox(jax.jit(m.init)(jax.random.key(0), s, lengths, age))["params"]
  p = dict(p, q_scale=jnp.asarray(1 + 0.3 * rng.normal(size=4), F32),
           k_scale=jnp.asarray(1 + 0.3 * rng.normal(size=4), F32))
  w = jnp.asarray(rng.normal(size=(B, T, d)), F32)
  got = lambda p, s: m.apply({"params": p}, s, lengths, age)
  plain = lambda p, s: _plain_seq_attention(p, s, lengths, age, 5)
  np.testing.assert_allclose(np.asarray(jax.jit(got)(p, s)), np.asarray(jax.jit(plain)(p, s)),
                             rtol=1e-5, atol=1e-5)
  g = jax.jit(jax.grad(lambda p, s: jnp.sum(got(p, s) * w), argnums=(0, 1)))(p, s)
  g_ref = jax.jit(jax.grad(lambda p, s: jnp.sum(plain(p, s) * w), argnums=(0, 1)))(p, s)
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_norm_residual_values_and_gradients():
  rng = np.random.default_rng(5)
  g, u, s, w = (jnp.asarray(rng.normal(size=(3, 7, 8)), F32) for _ in range(4))
  lengths = jnp.array([7, 2, 0])
  valid = (jnp.arange(7)[None] < lengths[:, None])[..., None]
  plain = lambda g, u, s: jnp.where(valid, _plain_rms(g + u) + s, 0.0)
  got = lambda g, u, s: fused.norm_residual(g, u, s, lengths)
  np.testing.assert_allclose(np.asarray(got(g, u, s)), np.asarray(plain(g, u, s)), rtol=1e-6,
                             atol=1e-6)
  gr = jax.grad(lambda *a: jnp.sum(got(*a) * w), argnums=(0, 1, 2))(g, u, s)
  gr_ref = jax.grad(lambda *a: jnp.sum(plain(*a) * w), argnums=(0, 1, 2))(g, u, s)
  for a, b in zip(gr, gr_ref, strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_pffn_float32_gradients_equal_the_plain_composition():
  """PFFN (float32) against autodiff of ``where(valid, RMSNorm(GDPA(LN(s)) + LN(s)) + s, 0)``."""
  from kunlun.nn.pffn import PFFN
  from pallas_kernels.reference import gdpa_reference
  rng = np.random.default_rng(6)
  B, T, d, H, n = 3, 10, 16, 4, 5
  s, w = (jnp.asarray(rng.normal(size=(B, T, d)), F32) for _ in range(2))
  k, v = (jnp.asarray(rng.normal(size=(B, n, H, d // H)), F32) for _ in range(2))
  lengths = jnp.array([10, 4, 0], jnp.int32)
  valid = (jnp.arange(T)[None] < lengths[:, None])[..., None]

  def plain(s, k, v):
    x = s - jnp.mean(s, -1, keepdims=True)
    u = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
    g = gdpa_reference(u.reshape(B, T, H, d // H), k, v, activation="fast_gelu",
                       q_lengths=lengths).reshape(B, T, d)
    return jnp.where(valid, _plain_rms(g + u) + s, 0.0)

  got = lambda s, k, v: PFFN(H).apply({}, s, lengths, k, v)
  np.testing.assert_allclose(np.asarray(jax.jit(got)(s, k, v)), np.asarray(jax.jit(plain)(s, k, v)),
                             rtol=1e-5, atol=1e-5)
  gr = jax.jit(jax.grad(lambda *a: jnp.sum(got(*a) * w), argnums=(0, 1, 2)))(s, k, v)
  gr_ref = jax.jit(jax.grad(lambda *a: jnp.sum(plain(*a) * w), argnums=(0, 1, 2)))(s, k, v)
  for a, b in zip(gr, gr_ref, strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_add_rms_norm_values_and_gradients(dtype):
  """``add_rms_norm(a, e)`` against autodiff of ``rms_norm(a + e)`` (``e`` broadcast over the
  batch): values and both gradients (float32: 1e-6; bfloat16 inputs: the same formula at their
  rounded values)."""
  rng = np.random.default_rng(4)
  a = jnp.asarray(rng.normal(size=(3, 5, 16)) * 2.0, dtype)
  e = jnp.asarray(rng.normal(size=(5, 16)), F32)
  w = jnp.asarray(rng.normal(size=(3, 5, 16)), F32)
  plain = lambda a, e: _plain_rms(a.astype(F32) + e).astype(dtype)
  got = fused.add_rms_norm(a, e, dtype)
  assert got.dtype == dtype
  tol = 1e-6 if dtype == jnp.float32 else 1e-2
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(plain(a, e), np.float32),
                             rtol=tol, atol=tol)
  loss = lambda f: (lambda a, e: jnp.sum(f(a, e).astype(F32) * w))
  g = jax.grad(loss(lambda a, e: fused.add_rms_norm(a, e, dtype)), (0, 1))(a, e)
  r = jax.grad(loss(plain), (0, 1))(a, e)
  for u, v in zip(g, r, strict=True):
    assert u.dtype == v.dtype and u.shape == v.shape
    np.testing.assert_allclose(np.asarray(u, np.float32), np.asarray(v, np.float32),
                               rtol=tol, atol=tol * float(np.abs(np.asarray(v, np.float32)).max()))


@pytest.mark.parametrize("batched", [True, False])
def test_token_mix_equals_the_unbatched_einsum(batched, monkeypatch):
  """``token_mix(x, w)`` (batched: a matmul batched over examples with ``w`` broadcast, the GPU
  form; else the einsum, XLA:CPU's) equals ``einsum("bnd,nm->bmd")`` in float64 numpy and in
  its gradients, float32 to 1e-6."""
  monkeypatch.setattr(fused, "batched_mixes", lambda: batched)
  rng = np.random.default_rng(6)
  x = jnp.asarray(rng.normal(size=(4, 7, 5)), F32)
  w = jnp.asarray(rng.normal(size=(7, 3)), F32)
  g = jnp.asarray(rng.normal(size=(4, 3, 5)), F32)
  ref = np.einsum("bnd,nm->bmd", np.asarray(x, np.float64), np.asarray(w, np.float64))
  np.testing.assert_allclose(np.asarray(fused.token_mix(x, w)), ref, rtol=1e-6, atol=1e-6)
  got = jax.grad(lambda x, w: jnp.sum(fused.token_mix(x, w) * g), (0, 1))(x, w)
  want = jax.grad(lambda x, w: jnp.sum(jnp.einsum("bnd,nm->bmd", x, w) * g), (0, 1))(x, w)
  for u, v in zip(got, want, strict=True):
    np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-6, atol=1e-6)
