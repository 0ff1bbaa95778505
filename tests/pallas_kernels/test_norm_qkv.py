"""The fused attention input side (``pallas_kernels.norm_qkv``): the twin against a float64 numpy
computation of the formulas, the Pallas kernels (interpret mode, NaN-poisoned outputs) against
the twin in values and gradients (float32: 1e-5 of the largest magnitude; bfloat16: 2e-2), row
counts that are no multiple of the kernels' tiles, and zero rows (a packed block's tail)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kunlun.nn.time_encoding import rotary_inputs
from pallas_kernels import _poison, norm_qkv
from tests.pallas_kernels.deviceless import close
from tests.pallas_kernels.np_ref import _bf16

T_SCALE = 60.0


def _inputs(N=100, d=64, H=3, D=32, seed=0, zero_tail=7):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(N, d)).astype(np.float32) * rng.uniform(0.2, 3.0, size=(N, 1))
  x[N - zero_tail:] = 0.0                                  # a block's tail: zero rows
  w = (rng.normal(size=(d, 3, H, D)) / np.sqrt(d)).astype(np.float32)
  qs, ks = (rng.uniform(0.5, 1.5, size=(D,)).astype(np.float32) for _ in range(2))
  age = rng.uniform(-5.0, 1e6, size=(N,)).astype(np.float32)
  pos = rng.integers(0, 300, size=(N,)).astype(np.int32)
  return x, w, qs, ks, age, pos


def _angles(x, w, qs, ks, age, pos):
  """The kernels' arguments: the angle inputs from the model's ``rotary_inputs``."""
  return (x, w, qs, ks, *rotary_inputs(age, pos, w.shape[-1], T_SCALE))


def _numpy(x, w, qs, ks, age, pos, eps=1e-6, rnd=lambda a: a):
  """float64 numpy of the module docstring's formulas (``rnd``: the rounding to dtype)."""
  x, w = x.astype(np.float64), w.astype(np.float64)
  H, D = w.shape[2], w.shape[3]
  h = rnd(x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps))
  tau = np.log1p(np.maximum(age.astype(np.float64), 0.0) / T_SCALE)
  omega = 10000.0 ** (-np.arange(D // 2) * 2.0 / D)
  outs = []
  for p, s in ((0, qs), (1, ks), (2, None)):
    y = rnd(np.einsum("nd,dhc->nhc", h, rnd(w[:, p])))
    if s is None:
      outs.append(y)
      continue
    n = rnd(y / np.sqrt(np.mean(y * y, -1, keepdims=True) + eps) * s)
    o = np.empty_like(n)
    for j in range(H):
      t = tau if j < (H + 1) // 2 else pos.astype(np.float64)
      a = t[:, None] * omega[None]
      n1, n2 = n[:, j, :D // 2], n[:, j, D // 2:]
      o[:, j] = np.concatenate([n1 * np.cos(a) - n2 * np.sin(a), n2 * np.cos(a) + n1 * np.sin(a)],
                               -1)
    outs.append(rnd(o))
  return outs


def test_twin_matches_numpy_float32():
  args = _inputs()
  got = norm_qkv.norm_qkv_xla(*_angles(*map(jnp.asarray, args)), dtype=jnp.float32)
  for g, r in zip(got, _numpy(*args), strict=True):
    close(g, r, 2e-5)


def test_twin_matches_numpy_bfloat16_rounding():
  args = _inputs(seed=1)
  got = norm_qkv.norm_qkv_xla(*_angles(*map(jnp.asarray, args)), dtype=jnp.bfloat16)
  for g, r in zip(got, _numpy(*args, rnd=_bf16), strict=True):
    close(g, r, 1e-2)


def _loss(fn, x, w, qs, ks, age, pos, dtype, cot):
  def f(x, w, qs, ks):
    q, k, v = fn(*_angles(x, w, qs, ks, age, pos), dtype=dtype)
    return sum(jnp.sum(o.astype(jnp.float32) * c) for o, c in zip((q, k, v), cot, strict=True))
  return jax.value_and_grad(f, argnums=(0, 1, 2, 3))(x, w, qs, ks)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("N,H", [(100, 3), (64, 2), (33, 1)])
def test_kernels_match_the_twin(dtype, tol, N, H):
  x, w, qs, ks, age, pos = _inputs(N=N, H=H, seed=N + H, zero_tail=min(7, N // 4))
  x = jnp.asarray(x, dtype)
  rng = np.random.default_rng(5)
  cot = [jnp.asarray(rng.normal(size=(N, H, w.shape[-1])), jnp.float32) for _ in range(3)]
  cot[0] = cot[0].at[N - 3:].set(0.0)
  pal = lambda *a, **k: norm_qkv.norm_qkv_pallas(*a, interpret=True, **k)
  with _poison.poison_outputs():
    outs = norm_qkv.norm_qkv_pallas(*_angles(x, w, qs, ks, age, pos), dtype=dtype,
                                    interpret=True)
    (val, grads) = _loss(pal, x, w, qs, ks, age, pos, dtype, cot)
  ref = norm_qkv.norm_qkv_xla(*_angles(x, w, qs, ks, age, pos), dtype=dtype)
  for o, r in zip(outs, ref, strict=True):
    assert o.dtype == dtype and o.shape == r.shape
    close(o, r, tol)
  (rval, rgrads) = _loss(norm_qkv.norm_qkv_xla, x, w, qs, ks, age, pos, dtype, cot)
  close(val, rval, tol)
  for name, g, r in zip(("x", "w", "q_scale", "k_scale"), grads, rgrads, strict=True):
    assert g.dtype == r.dtype and g.shape == r.shape, name
    close(g, r, tol)


def test_zero_rows_stay_zero():
  x, w, qs, ks, age, pos = _inputs(N=40, zero_tail=40)
  outs = norm_qkv.norm_qkv_pallas(*_angles(x, w, qs, ks, age, pos), dtype=jnp.float32,
                                  interpret=True)
  for o in outs:
    assert not np.any(np.asarray(o))


def test_unsupported_widths_are_refused():
  """Widths the kernels cannot tile are refused in one line; ``supported`` (what the model asks
  before taking the kernels) also says no where the tiles would not fit the GPU's shared memory
  (the H200's without a GPU): d = 4096 with heads of 256 needs 1.1 MB at 16 rows."""
  assert norm_qkv.supported(256, 4, 64) and norm_qkv.supported(512, 4, 128)
  assert not norm_qkv.supported(4096, 16, 256)
  assert norm_qkv.supported(1024, 8, 128) == (norm_qkv._smem(16, 1024, 128, 2) <= 232448)
  x = jnp.zeros((8, 48))
  w = jnp.zeros((48, 3, 2, 24))
  assert not norm_qkv.supported(48, 2, 24)
  with pytest.raises(ValueError, match="powers of two"):
    norm_qkv.norm_qkv_pallas(x, w, jnp.ones(24), jnp.ones(24), jnp.zeros(8), jnp.zeros(8),
                             jnp.ones(12), interpret=True)


@pytest.mark.parametrize("split", [False, True], ids=["stacked", "per-projection"])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_plain_projections_match_the_twin_and_numpy(dtype, tol, split):
  """``norm_proj`` (HSP's keys and values: P = 2, nothing normalised or rotated), the weights
  stacked ``[d, 2, H, D]`` or as two ``[d, H, D]`` operands: the twin against numpy, the kernels
  against the twin in values and gradients (per operand), poisoned outputs."""
  x, w, *_ = _inputs(N=90, H=2, seed=7)
  w = w[:, 1:]                                                  # [d, 2, H, D]
  rnd = (lambda a: a) if dtype == jnp.float32 else _bf16
  ref_np = _numpy(x, np.concatenate([w, w[:, 1:]], 1), *_inputs(N=90, H=2)[2:], rnd=rnd)[2]
  w = (jnp.asarray(w[:, 0]), jnp.asarray(w[:, 1])) if split else jnp.asarray(w)
  twin = norm_qkv.norm_proj_xla(jnp.asarray(x), w, dtype=dtype)
  close(twin[1], ref_np, 2e-5 if dtype == jnp.float32 else 1e-2)
  rng = np.random.default_rng(2)
  cot = [jnp.asarray(rng.normal(size=(90, 2, twin[0].shape[-1])), jnp.float32) for _ in range(2)]

  def loss(fn, x, w):
    return sum(jnp.sum(o.astype(jnp.float32) * c) for o, c in zip(fn(x, w), cot, strict=True))

  pal = lambda x, w: norm_qkv.norm_proj_pallas(x, w, dtype=dtype, interpret=True)
  xla = lambda x, w: norm_qkv.norm_proj_xla(x, w, dtype=dtype)
  x = jnp.asarray(x, dtype)
  with _poison.poison_outputs():
    outs = pal(x, w)
    val, grads = jax.value_and_grad(lambda x, w: loss(pal, x, w), (0, 1))(x, w)
  rval, rgrads = jax.value_and_grad(lambda x, w: loss(xla, x, w), (0, 1))(x, w)
  for o, r in zip(outs, xla(x, w), strict=True):
    close(o, r, tol)
  close(val, rval, tol)
  assert jax.tree.structure(grads) == jax.tree.structure(rgrads)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(rgrads), strict=True):
    assert g.dtype == r.dtype and g.shape == r.shape
    close(g, r, tol)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_pass_through_adds_its_masked_cotangent(dtype, tol):
  """With ``valid``, ``x`` comes back as a fourth output and the backward kernel adds its
  cotangent, masked by ``valid``, to ``dx``: the gradients equal the twin's with ``valid * x``
  added to the loss, and the masked rows (holding values) get only the projections' part."""
  N, H = 50, 2
  x, w, qs, ks, age, pos = _inputs(N=N, H=H, seed=9, zero_tail=4)
  x = jnp.asarray(x, dtype)
  rng = np.random.default_rng(6)
  cot = [jnp.asarray(rng.normal(size=(N, H, w.shape[-1])), jnp.float32) for _ in range(3)]
  c_res = jnp.asarray(rng.normal(size=x.shape), jnp.float32)
  valid = jnp.asarray(np.arange(N) < N - 9, jnp.float32)       # 5 masked rows hold values

  def loss(x, w, qs, ks, pallas):
    args = _angles(x, w, qs, ks, age, pos)
    if pallas:
      *qkv, xr = norm_qkv.norm_qkv_pallas(*args, dtype=dtype, interpret=True, valid=valid)
      res = jnp.sum(xr.astype(jnp.float32) * c_res)
    else:
      qkv = norm_qkv.norm_qkv_xla(*args, dtype=dtype)
      res = jnp.sum(x.astype(jnp.float32) * valid[:, None] * c_res)
    return res + sum(jnp.sum(o.astype(jnp.float32) * c) for o, c in zip(qkv, cot, strict=True))

  with _poison.poison_outputs():
    got = jax.grad(loss, argnums=(0, 1, 2, 3))(x, w, qs, ks, True)
    xr = norm_qkv.norm_qkv_pallas(*_angles(x, w, qs, ks, age, pos), dtype=dtype, interpret=True,
                                  valid=valid)[3]
  assert xr.dtype == x.dtype and np.array_equal(np.asarray(xr), np.asarray(x))
  want = jax.grad(loss, argnums=(0, 1, 2, 3))(x, w, qs, ks, False)
  for name, g, r in zip(("x", "w", "q_scale", "k_scale"), got, want, strict=True):
    assert g.dtype == r.dtype and g.shape == r.shape, name
    close(g, r, tol)
