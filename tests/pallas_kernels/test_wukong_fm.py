"""A Wukong layer's kernels (``pallas_kernels.wukong_fm``), the token side and the output norm:
the twins against float64 numpy computations of the formulas (bfloat16: 2e-2, XLA:CPU may
accumulate a 16-bit dot in 16 bits), the Pallas kernels (interpret mode, NaN-poisoned outputs)
against the twins in values and gradients (float32: 1e-5 of the largest magnitude; bfloat16:
2e-2), with batches that are no multiple of a program's examples, token counts and map widths
that are no powers of two, and all-zero examples; the kernels compiled deviceless for the H200
at mid's shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _poison, wukong_fm
from tests.pallas_kernels import deviceless
from tests.pallas_kernels.deviceless import close, twin_jit
from tests.pallas_kernels.np_ref import _bf16


def _inputs(B=7, N=20, d=32, r=16, ms=(6, 40), seed=0, zero=(3,)):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(B, N, d)).astype(np.float32) * rng.uniform(0.3, 2.0, size=(B, 1, 1))
  x[list(zero)] = 0.0                                        # an all-zero example
  y = (rng.normal(size=(N, r)) / np.sqrt(N)).astype(np.float32)
  ws = tuple((rng.normal(size=(N, m)) / np.sqrt(N)).astype(np.float32) for m in ms)
  scale = rng.uniform(0.5, 1.5, size=(N * r,)).astype(np.float32)
  bias = (0.1 * rng.normal(size=(N * r,))).astype(np.float32)
  return x, y, ws, scale, bias


def _numpy(x, y, ws, scale, bias, eps=1e-6, rnd=lambda a: a):
  """float64 numpy of the module docstring's formulas (``rnd``: the rounding to dtype)."""
  x, y = rnd(x.astype(np.float64)), rnd(y.astype(np.float64))
  B = x.shape[0]
  xty = rnd(np.einsum("bnd,nr->bdr", x, y))
  fm = rnd(np.einsum("bnd,bdr->bnr", x, xty)).reshape(B, -1)
  c = fm - fm.mean(-1, keepdims=True)
  h = rnd(c / np.sqrt((c * c).mean(-1, keepdims=True) + eps) * scale + bias)
  return h, tuple(rnd(np.einsum("bnd,nm->bmd", x, rnd(w.astype(np.float64)))) for w in ws)


@pytest.mark.parametrize("dtype,tol,rnd", [(jnp.float32, 2e-5, lambda a: a),
                                           (jnp.bfloat16, 2e-2, _bf16)])
def test_twin_matches_numpy(dtype, tol, rnd):
  x, y, ws, sc, bi = _inputs(seed=1)
  h, mixes = wukong_fm.wukong_fm_xla(jnp.asarray(x), y, ws, sc, bi, dtype=dtype)
  rh, rmixes = _numpy(x, y, ws, sc, bi, rnd=rnd)
  close(h, rh, tol)
  for m, r in zip(mixes, rmixes, strict=True):
    close(m, r, tol)


def _loss(fn, dtype, cots):
  def f(x, y, ws, sc, bi):
    h, mixes = fn(x, y, ws, sc, bi, dtype=dtype)
    return (jnp.sum(h.astype(jnp.float32) * cots[0])
            + sum(jnp.sum(m.astype(jnp.float32) * c) for m, c in zip(mixes, cots[1], strict=True)))
  return jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4))


# the last two: examples wider than MAX_TILE (72 tokens, padded to 128, x 256), in two column
# chunks of 128, as prod's first Wukong layer (120 x 256)
@pytest.mark.parametrize("dtype,tol,B,N,ms,d", [
    (jnp.float32, 1e-5, 7, 20, (6, 40), 32), (jnp.float32, 1e-5, 4, 32, (16,), 32),
    (jnp.float32, 1e-5, 9, 72, (16, 32, 32), 32), (jnp.bfloat16, 2e-2, 7, 20, (6, 40), 32),
    (jnp.float32, 1e-5, 5, 72, (24, 48, 48), 256), (jnp.bfloat16, 2e-2, 5, 72, (24, 48), 256)])
def test_kernels_match_the_twin(dtype, tol, B, N, ms, d):
  x, y, ws, sc, bi = _inputs(B=B, N=N, d=d, ms=ms, seed=B + N)
  x = jnp.asarray(x, dtype)
  rng = np.random.default_rng(4)
  cots = (jnp.asarray(rng.normal(size=(B, N * 16)), jnp.float32),
          tuple(jnp.asarray(rng.normal(size=(B, m, d)), jnp.float32) for m in ms))
  pal = lambda *a, **k: wukong_fm.wukong_fm_pallas(*a, interpret=True, **k)
  kernels = jax.jit(lambda *a: (pal(*a, dtype=dtype), _loss(pal, dtype, cots)(*a)))
  with _poison.poison_outputs():
    (h, mixes), (val, grads) = kernels(x, y, ws, sc, bi)
  # values: the float64 numpy computation (the XLA:CPU twin may accumulate its bfloat16 token
  # maps in 16 bits: 2-2.5% off at 60-72 tokens, where the kernels are within 0.3%)
  rh, rmixes = _numpy(np.asarray(x, np.float32), y, ws, sc, bi,
                      rnd=_bf16 if dtype == jnp.bfloat16 else lambda a: a)
  assert h.dtype == dtype and h.shape == rh.shape
  close(h, rh, tol)
  for m, r in zip(mixes, rmixes, strict=True):
    assert m.dtype == dtype and m.shape == r.shape
    close(m, r, tol)
  close(val, np.sum(rh * cots[0]) + sum(np.sum(r * c) for r, c in zip(rmixes, cots[1],
                                                                       strict=True)), tol)
  _, rgrads = twin_jit(_loss(wukong_fm.wukong_fm_xla, dtype, cots), dtype)(x, y, ws, sc, bi)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(rgrads), strict=True):
    assert g.dtype == r.dtype and g.shape == r.shape
    close(g, r, tol)


# the token side's backward with 16 and 8 examples per program (``bwd_examples``: B 1024 takes
# 8), the last program part empty (16 + 1, 8 + 8 + 1, 8 + 1); the last case in two column chunks
@pytest.mark.parametrize("min_programs,examples,B,N,ms,d", [
    (1, 16, 17, 20, (6, 40), 32), (2, 8, 17, 72, (16, 32, 32), 32), (1, 8, 9, 72, (24, 48), 256)])
def test_backward_with_more_examples_per_program(monkeypatch, min_programs, examples, B, N, ms,
                                                 d):
  monkeypatch.setattr(wukong_fm, "MIN_PROGRAMS", min_programs)
  assert wukong_fm.bwd_examples(B) == examples
  test_kernels_match_the_twin(jnp.float32, 1e-5, B, N, ms, d)


def test_under_vmap_with_shared_input():
  """The MoWE experts: ``vmap`` over the weights with ``x`` shared (not batched) gives each
  expert's values and gradients, ``x``'s summed over the experts."""
  x, y, ws, sc, bi = _inputs(B=5, N=12, ms=(8,), seed=3)
  E = 3
  rng = np.random.default_rng(6)
  stack = lambda a: jnp.asarray(np.stack([a * (1 + 0.1 * e) for e in range(E)]))
  ys, wss, scs, bis = stack(y), tuple(stack(w) for w in ws), stack(sc), stack(bi)
  cot = jnp.asarray(rng.normal(size=(E, 5, 8, 32)), jnp.float32)

  def loss(fn):
    def f(x, ys, wss, scs, bis):
      h, mixes = jax.vmap(lambda y, ws, s, b: fn(x, y, ws, s, b, dtype=jnp.float32))(
          ys, wss, scs, bis)
      return jnp.sum(jnp.sin(h)) + jnp.sum(mixes[0] * cot)
    return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4)))

  pal = lambda *a, **k: wukong_fm.wukong_fm_pallas(*a, interpret=True, **k)
  got = loss(pal)(jnp.asarray(x), ys, wss, scs, bis)
  want = loss(wukong_fm.wukong_fm_xla)(jnp.asarray(x), ys, wss, scs, bis)
  for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    close(g, r, 1e-5)


# one tile, and two column chunks (72 tokens x 256); experts vmapped with x batched per expert,
# as a stack's second layer
@pytest.mark.parametrize("dtype,tol,N,d", [(jnp.float32, 1e-5, 20, 32), (jnp.float32, 1e-5, 72, 256),
                                           (jnp.bfloat16, 2e-2, 20, 32)])
def test_pass_through_adds_its_cotangent_to_dx(dtype, tol, N, d):
  """``through=True`` returns ``x`` itself third, and the backward kernel adds that output's
  cotangent to ``dx``: the gradients equal the twin's with the same term on ``x`` in the loss,
  and the values are those without ``through``."""
  B, E, ms = 5, 2, (8,)
  x, y, ws, sc, bi = _inputs(B=B, N=N, d=d, ms=ms, seed=11)
  rng = np.random.default_rng(8)
  xs = jnp.asarray(np.stack([x, -0.5 * x]), dtype)                 # [E, B, N, d]
  stack = lambda a: jnp.asarray(np.stack([a * (1 + 0.1 * e) for e in range(E)]))
  ys, wss, scs, bis = stack(y), tuple(stack(w) for w in ws), stack(sc), stack(bi)
  c_h, c_m = (jnp.asarray(rng.normal(size=s), jnp.float32)
              for s in ((E, B, N * 16), (E, B, ms[0], d)))
  c_x = jnp.asarray(rng.normal(size=(E, B, N, d)), jnp.float32)

  def loss(fn, through):
    def f(xs, ys, wss, scs, bis):
      out = jax.vmap(lambda *a: fn(*a, dtype=dtype, **through))(xs, ys, wss, scs, bis)
      x_out = out[2] if through else xs                  # the twin: the same term on x itself
      return (jnp.sum(out[0].astype(jnp.float32) * c_h)
              + jnp.sum(out[1][0].astype(jnp.float32) * c_m)
              + jnp.sum(x_out.astype(jnp.float32) * c_x))
    return jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4))

  pal = lambda *a, **k: wukong_fm.wukong_fm_pallas(*a, interpret=True, **k)
  vmapped = lambda **kw: jax.jit(jax.vmap(lambda *a: pal(*a, dtype=dtype, **kw)))
  with _poison.poison_outputs():
    out = vmapped(through=True)(xs, ys, wss, scs, bis)
    val, grads = jax.jit(loss(pal, {"through": True}))(xs, ys, wss, scs, bis)
  plain = vmapped()(xs, ys, wss, scs, bis)
  assert len(out) == 3 and out[2] is not None
  np.testing.assert_array_equal(np.asarray(out[2]), np.asarray(xs))
  for a, b in zip(jax.tree.leaves(out[:2]), jax.tree.leaves(plain), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  rval, rgrads = twin_jit(loss(wukong_fm.wukong_fm_xla, {}), dtype)(xs, ys, wss, scs, bis)
  close(val, rval, tol)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(rgrads), strict=True):
    assert g.dtype == r.dtype and g.shape == r.shape
    close(g, r, tol)


def test_unsupported_widths_are_refused():
  """What the kernels cannot tile is refused in one line; ``supported`` (what the model asks
  before taking the kernels) says no for it."""
  assert wukong_fm.supported(72, 128, 16, (16, 32, 32))
  assert wukong_fm.supported(128, 128, 32, (16,))
  assert wukong_fm.supported(120, 256, 32, (24, 48, 48))          # in column chunks
  assert not wukong_fm.supported(129, 128, 16, (16,))            # 256 x 128 tile
  assert not wukong_fm.supported(120, 2048, 16, (16,))           # wider than MAX_WIDE_D
  assert not wukong_fm.supported(72, 128, 8, (16,))              # rank below 16
  assert not wukong_fm.supported(72, 96, 16, (16,))              # width no power of two
  assert not wukong_fm.supported(72, 128, 16, ())                # nothing to map
  assert not wukong_fm.supported(72, 128, 16, (200,))
  x, y, ws, sc, bi = _inputs(r=8)
  with pytest.raises(ValueError, match="no kernel for"):
    wukong_fm.wukong_fm_pallas(jnp.asarray(x), y, ws, sc, bi, interpret=True)



def _numpy_out(parts, res, scale, bias, bias0=None, others=(), weights=None, eps=1e-6):
  ps = [p.astype(np.float64) for p in parts]
  if bias0 is not None:
    ps[0] = ps[0] + bias0.astype(np.float64)
  t = np.concatenate(ps, 1) + res.astype(np.float64)
  c = t - t.mean(-1, keepdims=True)
  z = c / np.sqrt((c * c).mean(-1, keepdims=True) + eps) * scale + bias
  if weights is None:
    return z
  mixed = sum(w * o.astype(np.float64) for w, o in zip(weights[:-1], others, strict=True))
  return z + mixed + weights[-1] * z


@pytest.mark.parametrize("dtype,tol,B,ns,with_b0,J", [
    (jnp.float32, 1e-5, 11, (5, 3), False, -1), (jnp.float32, 1e-5, 16, (16, 16), False, -1),
    (jnp.float32, 1e-5, 3, (7,), False, -1), (jnp.bfloat16, 2e-2, 11, (5, 3), False, -1),
    (jnp.float32, 1e-5, 11, (5, 3), True, -1), (jnp.bfloat16, 2e-2, 9, (16, 16), True, 1),
    (jnp.float32, 1e-5, 10, (5, 3), True, 1), (jnp.float32, 1e-5, 7, (6,), False, 2),
    (jnp.float32, 1e-5, 5, (4, 4), False, 0)])
def test_out_norm_kernels_match_the_twin_and_numpy(dtype, tol, B, ns, with_b0, J):
  """``wukong_out``: the twin against numpy (float64), the kernels (interpret mode, poisoned
  outputs) against the twin in values and the gradients of every input: the parts, the
  residual, the scale, the bias, the first part's bias ``bias0`` and, with ``J >= 0``, the
  cross-layer mix's ``J`` other inputs and ``J + 1`` logits (the kernels compute the weights'
  softmax themselves); part sizes and batches that are no multiple of the tiles, an all-zero
  example."""
  rng = np.random.default_rng(B)
  d = 32
  parts = [rng.normal(size=(B, n, d)).astype(np.float32) for n in ns]
  res = rng.normal(size=(B, sum(ns), d)).astype(np.float32)
  for p in parts:
    p[1] = 0.0
  res[1] = 0.0
  sc = rng.uniform(0.5, 1.5, size=d).astype(np.float32)
  bi = (0.1 * rng.normal(size=d)).astype(np.float32)
  b0 = rng.normal(size=(ns[0], d)).astype(np.float32) if with_b0 else None
  others = [rng.normal(size=res.shape).astype(np.float32) for _ in range(max(J, 0))]
  lgt = rng.normal(size=J + 1).astype(np.float32) if J >= 0 else None
  twin = wukong_fm.wukong_out_xla([jnp.asarray(p) for p in parts], jnp.asarray(res), sc, bi,
                                  bias0=b0, others=others, logits=lgt, dtype=jnp.float32)
  wts = None if lgt is None else np.exp(lgt - lgt.max()) / np.exp(lgt - lgt.max()).sum()
  close(twin, _numpy_out(parts, res, sc, bi, b0, others, wts), 2e-5)
  parts = tuple(jnp.asarray(p, dtype) for p in parts)
  res = jnp.asarray(res, dtype)
  cot = jnp.asarray(rng.normal(size=(B, sum(ns), d)), jnp.float32)
  args = (parts, res, sc, bi, None if b0 is None else jnp.asarray(b0),
          tuple(jnp.asarray(o, dtype) for o in others), None if lgt is None else jnp.asarray(lgt))

  def run(fn, jit):
    g = lambda p, r, s, b, b0, o, c: fn(p, r, s, b, bias0=b0, others=o, logits=c, dtype=dtype)
    f = lambda *a: jnp.sum(g(*a).astype(jnp.float32) * cot)
    return jit(lambda *a: (g(*a), jax.grad(f, argnums=tuple(range(len(args))))(*a)))(*args)

  with _poison.poison_outputs():
    got, g_got = run(lambda *a, **k: wukong_fm.wukong_out_pallas(*a, interpret=True, **k),
                     jax.jit)
  want, g_want = run(wukong_fm.wukong_out_xla, lambda f: twin_jit(f, dtype))
  assert got.dtype == dtype
  close(got, want, tol)
  assert jax.tree.structure(g_got) == jax.tree.structure(g_want)
  for u, w in zip(jax.tree.leaves(g_got), jax.tree.leaves(g_want), strict=True):
    assert u.dtype == w.dtype and u.shape == w.shape
    close(u, w, tol)
  if with_b0:                        # bias0's gradient: the first part's rows of dt, summed
    assert g_got[4].shape == (ns[0], d)
  if J >= 0:
    assert g_got[6].shape == (J + 1,) and len(g_got[5]) == J


def test_out_norm_refuses_what_it_cannot_tile():
  assert wukong_fm.out_supported(128, (16, 16)) and not wukong_fm.out_supported(96, (16, 16))
  assert not wukong_fm.out_supported(128, (200,)) and not wukong_fm.out_supported(128, ())
  with pytest.raises(ValueError, match="wukong_out"):
    wukong_fm.wukong_out_pallas((jnp.zeros((2, 3, 32)),), jnp.zeros((2, 4, 32)), jnp.ones(32),
                                jnp.zeros(32), interpret=True)

# mid's MoWE (kunlun/configs/mid.py): 72 tokens in (n_ns 32 + the towers' 16 + 16 + 8 summaries)
# of width 128, rank 16; layer 0 maps to the LCB's 16, the residual's 32 and the first
# cross-layer map's 32 tokens. prod's (d_ns 256: 120 tokens, rank 32, maps to 24, 48 and 48
# tokens) exceeds MAX_TILE: its kernels run in column chunks.
MID = dict(B=1024, N=72, d=128, r=16, ms=(16, 32, 32))
PROD = dict(B=256, N=120, d=256, r=32, ms=(24, 48, 48))


def test_mid_and_prod_take_the_kernels():
  for c in (MID, PROD):
    assert wukong_fm.supported(c["N"], c["d"], c["r"], c["ms"])
  assert wukong_fm.supported(32, 128, 16, (16,))                 # mid's layer 1
  assert wukong_fm.supported(48, 256, 32, (24,))                 # prod's layer 1


def test_kernels_compile_for_h200_at_mid_and_prod_shapes(tmp_path):
  """The token-side and output-norm kernels, forward and backward, under the MoWE experts' vmap,
  compiled deviceless for the H200 by the venv ``scripts/setup.sh --gpu-compile`` makes
  (``main`` runs there), at mid's and prod's first layer (prod's token side in column chunks):
  all four launch, and the two that sum and cut the backward kernels' partials, within the
  H200's shared memory per block."""
  from pallas_kernels import tuning
  smem = deviceless.compiled_smem("tests.pallas_kernels.test_wukong_fm", tmp_path)
  assert sorted(smem) == ["mid", "prod"]
  for shape, kernels in smem.items():
    assert sorted(kernels) == ["wukong_fm_bwd", "wukong_fm_fwd", "wukong_fm_sums",
                               "wukong_out_bwd", "wukong_out_fwd", "wukong_out_sums"], (
                                   shape, kernels)
    assert max(kernels.values()) <= tuning.SMEM_PER_BLOCK[90], (shape, kernels)


def main(dump_dir):
  """Compiles the kernels' value and gradients at ``MID`` and ``PROD`` for the H200
  (deviceless, two experts vmapped over the weights, ``x`` shared); prints ``{shape: {kernel:
  shared memory bytes}}``."""
  import json

  from bench.profiling import gpu_target
  gpu_target.set_flags(dump_dir, "h200")
  E, f32 = 2, jnp.float32
  sds = jax.ShapeDtypeStruct

  def step(x, y, ws, sc, bi, b0):
    d = x.shape[-1]

    def loss(x, y, ws, sc, bi, b0):
      h, mixes = jax.vmap(lambda *a: wukong_fm.wukong_fm_pallas(x, *a))(y, ws, sc, bi)
      out = jax.vmap(lambda p, r, s, b, b0, o, w: wukong_fm.wukong_out_pallas(
          p, r, s, b, bias0=b0, others=(o,), logits=w))(    # parts of 16 + 16, the FM's bias,
          (mixes[0][:, :, :16], mixes[0][:, :, :16]), mixes[1][:, :, :32],   # the cross-layer
          sc[:, :d], bi[:, :d], b0, mixes[2][:, :, :32], bi[:, :2])           # mix
      return jnp.sum(h.astype(f32)) + sum(jnp.sum(m.astype(f32)) for m in mixes + (out,))
    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5))(x, y, ws, sc, bi, b0)

  seen, out = set(), {}
  for shape, c in (("mid", MID), ("prod", PROD)):
    B, N, d, r, ms = (c[k] for k in ("B", "N", "d", "r", "ms"))
    args = (sds((B, N, d), jnp.bfloat16), sds((E, N, r), f32),
            tuple(sds((E, N, m), f32) for m in ms), sds((E, N * r), f32), sds((E, N * r), f32),
            sds((E, 16, d), f32))
    gpu_target.compile_for(step, args, gpu_target.gpu_mesh("h200"))
    out[shape] = deviceless.kernel_smem(dump_dir, "wukong_", seen)
  print(json.dumps(out))


if __name__ == "__main__":
  import sys
  main(sys.argv[1])
