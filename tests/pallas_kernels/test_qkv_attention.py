"""The packed softmax attention with its input side (``pallas_kernels.qkv_attention``): the twin
against float64 numpy (the input side's formulas, then a softmax per example within the
window), the kernels (interpret mode, NaN-poisoned outputs; the backward one kernel) against the
twin in values and gradients (float32: 1e-5 of the largest magnitude; bfloat16: 2e-2) and
against the two ops they fuse, ragged lengths with empty histories, one example filling the
buffer, the residual's pass-through, one-line errors, and the deviceless H200 compile (shared
memory, registers, no spills at mid's widths)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kunlun.nn.time_encoding import rotary_inputs
from pallas_kernels import _poison, jagged, jagged_pallas, norm_qkv, qkv_attention, tuning
from tests.pallas_kernels.deviceless import close, compiled_smem, kernel_smem
from tests.pallas_kernels.test_norm_qkv import T_SCALE
from tests.pallas_kernels.test_norm_qkv import _numpy as _np_qkv

CASES = {                      # lengths, capacity N (no multiple of the kernel's 16 rows)
    "ragged": ([7, 0, 13, 3, 20], 50),
    "one_fills": ([37], 37),
    "empty": ([0, 0], 21),
}


def _inputs(lengths, N, d=64, H=2, D=32, seed=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  jag = jagged.from_lengths(np.array(lengths), N)
  x = rng.normal(size=(N, d)).astype(np.float32) * rng.uniform(0.2, 3.0, size=(N, 1))
  x[int(sum(lengths)):] = 0.0                              # the buffer's tail: zero rows
  w = (rng.normal(size=(d, 3, H, D)) / np.sqrt(d)).astype(np.float32)
  qs, ks = (rng.uniform(0.5, 1.5, size=(D,)).astype(np.float32) for _ in range(2))
  age = rng.uniform(-5.0, 1e6, size=(N,)).astype(np.float32)
  return x.astype(jnp.dtype(dtype)), w, qs, ks, age, jag


def _args(x, w, qs, ks, age, jag):
  """The ops' arguments: the angles from the model's ``rotary_inputs`` by the tokens' pos."""
  tau, pos, omega = rotary_inputs(jnp.asarray(age), jag.pos, w.shape[-1], T_SCALE)
  return (jnp.asarray(x), jnp.asarray(w), jnp.asarray(qs), jnp.asarray(ks), tau, pos, omega, jag)


def _numpy(x, w, qs, ks, age, jag, window):
  """float64: ``tests.pallas_kernels.test_norm_qkv``'s q, k, v, then per example a softmax over
  its own tokens within ``window`` positions."""
  pos = np.asarray(jag.pos)
  q, k, v = _np_qkv(np.asarray(x, np.float32), w, qs, ks, age, pos)
  out = np.zeros_like(q)
  off = np.asarray(jag.offsets)
  for a, b in zip(off[:-1], off[1:], strict=True):
    for h in range(q.shape[1]):
      s = q[a:b, h] @ k[a:b, h].T / np.sqrt(q.shape[-1])
      if window is not None:
        s = np.where(np.abs(pos[a:b, None] - pos[None, a:b]) <= window, s, -np.inf)
      p = np.exp(s - s.max(1, keepdims=True)) if b > a else s
      out[a:b, h] = (p / p.sum(1, keepdims=True)) @ v[a:b, h] if b > a else 0.0
  return out


@pytest.mark.parametrize("window", [None, 4])
def test_twin_matches_numpy(window):
  raw = _inputs(*CASES["ragged"])
  got = jax.jit(lambda *a: qkv_attention.qkv_attention_xla(*a, window=window,
                                                           dtype=jnp.float32))(*_args(*raw))
  close(got, _numpy(*raw, window), 2e-5)


def _loss(fn, args, cot, valid=None, **kw):
  x, w, qs, ks, tau, pos, omega, jag = args

  def f(x, w, qs, ks):
    out = fn(x, w, qs, ks, tau, pos, omega, jag, valid=valid, **kw)
    o, xr = (out, None) if valid is None else out
    return (jnp.sum(o.astype(jnp.float32) * cot[0])
            + (0.0 if xr is None else jnp.sum(xr.astype(jnp.float32) * cot[1])))
  return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3)))(x, w, qs, ks)


def _cotangents(N, H=2, D=32, d=64, seed=5):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.normal(size=(N, H, D)), jnp.float32),
          jnp.asarray(rng.normal(size=(N, d)), jnp.float32))


def _pallas(*a, **k):
  return qkv_attention.qkv_attention_pallas(*a, interpret=True, **k)


F32, BF16 = (jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)


@pytest.mark.parametrize("dtype,tol,case,window,through", [
    (*F32, "ragged", None, False), (*F32, "ragged", 5, True), (*F32, "one_fills", 8, False),
    (*F32, "empty", None, True), (*BF16, "ragged", None, False), (*BF16, "ragged", 5, True),
    (*BF16, "one_fills", 8, False)])      # bfloat16 with no real token: zeros, as float32's
def test_kernels_match_the_twin(dtype, tol, case, window, through):
  raw = _inputs(*CASES[case], dtype=dtype, seed=len(case))
  args = _args(*raw)
  jag = args[-1]
  cot = _cotangents(jag.capacity)
  valid = jag.valid.astype(jnp.float32) if through else None
  with _poison.poison_outputs():
    val, grads = _loss(_pallas, args, cot, valid, window=window, dtype=dtype)
  rval, rgrads = _loss(qkv_attention.qkv_attention_xla, args, cot, valid, window=window,
                       dtype=dtype)
  close(val, rval, tol)
  for name, g, r in zip(("x", "w", "q_scale", "k_scale"), grads, rgrads, strict=True):
    assert g.dtype == r.dtype and g.shape == r.shape, name
    if np.any(np.asarray(r)):
      close(g, r, tol)
    else:                                   # no real token: every gradient is zero
      assert not np.any(np.asarray(g)), name


def test_the_same_as_the_two_kernels_it_fuses():
  """bfloat16: the values are the two kernels' (the same forward kernels), the gradients theirs
  to the rounding of a 16-bit value here and there (D summed in two halves)."""
  dtype = jnp.bfloat16
  raw = _inputs(*CASES["ragged"], dtype=dtype, seed=3)
  args = _args(*raw)
  cot = _cotangents(args[-1].capacity)

  def two(x, w, qs, ks, tau, pos, omega, jag, valid=None, window=None, dtype=dtype):
    q, k, v = norm_qkv.norm_qkv_pallas(x, w, qs, ks, tau, pos, omega, dtype=dtype,
                                       interpret=True)
    return jagged_pallas.jagged_softmax_attention_pallas(q, k, v, jag, window=window,
                                                         interpret=True)
  val, grads = _loss(_pallas, args, cot, window=6, dtype=dtype)
  rval, rgrads = _loss(two, args, cot, window=6, dtype=dtype)
  assert float(val) == float(rval)
  for g, r in zip(grads, rgrads, strict=True):
    close(g, r, 4e-3)


def test_bad_arguments_are_one_line_errors():
  args = _args(*_inputs(*CASES["ragged"]))
  for kw, msg in ((dict(window=-1), "window must be >= 0"),
                  (dict(valid=jnp.ones((3,))), r"valid \(3,\) must be \[N\]")):
    with pytest.raises(ValueError, match=msg) as e:
      _pallas(*args, **kw)
    assert "\n" not in str(e.value)
  x, w = args[0], args[1]
  with pytest.raises(ValueError, match="powers of two >= 16; got d=48") as e:
    _pallas(x[:, :48], w[:48], *args[2:])
  assert "\n" not in str(e.value)
  wide = _args(*_inputs([20, 9], 32, d=512, H=4, D=128))       # supported by norm_qkv alone
  with pytest.raises(ValueError, match="no kernel tiles width 512 in 4 heads of 128") as e:
    _pallas(*wide)
  assert "\n" not in str(e.value)
  with pytest.raises(ValueError, match="jagged tokens must be") as e:
    _pallas(x[:10], w, *args[2:])
  assert "\n" not in str(e.value)


# ---- the deviceless H200 compile (the GPU-compile venv) ------------------------------------

SHAPES = {"mid": (8192, 64, 256, 4, 64), "mid_d128": (8192, 64, 128, 2, 64)}  # N, B, d, H, window


def main(dump_dir):
  """Compiles the op's value and gradients at ``SHAPES`` for the H200 (deviceless); prints
  ``{shape: {kernel: shared memory bytes}}`` (ptxas's report goes to stderr)."""
  from bench.profiling import gpu_target
  gpu_target.set_flags(dump_dir, "h200")
  f32, bf16, i32 = jnp.float32, jnp.bfloat16, jnp.int32
  sds = jax.ShapeDtypeStruct
  seen, out = set(), {}
  for name, (N, B, d, H, window) in SHAPES.items():
    D = d // H

    def step(x, w, qs, ks, tau, pos, omega, offsets, seg, jpos, B=B, window=window):
      jag = jagged.Jagged(offsets, seg, jpos)

      def loss(x, w, qs, ks):
        o, xr = qkv_attention.qkv_attention_pallas(x, w, qs, ks, tau, pos, omega, jag,
                                                   window=window, dtype=bf16,
                                                   valid=(seg < B).astype(f32))
        return jnp.sum(o.astype(f32)) + jnp.sum(xr.astype(f32))
      return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(x, w, qs, ks)

    args = (sds((N, d), bf16), sds((d, 3, H, D), f32), sds((D,), f32), sds((D,), f32),
            sds((N,), f32), sds((N,), f32), sds((D // 2,), f32), sds((B + 1,), i32),
            sds((N,), i32), sds((N,), i32))
    gpu_target.compile_for(step, args, gpu_target.gpu_mesh("h200"))
    out[name] = kernel_smem(dump_dir, "qkv_", seen)
  print(json.dumps(out))


def test_compiles_for_h200_without_spills(tmp_path):
  """mid's widths compile with the backward as one kernel (and the scales' sum) within the
  H200's shared memory, and ptxas spills no register. prod's widths are not taken (they spilled:
  ``qkv_attention.MAX_WIDTH``, ``MAX_HEAD_DIM``)."""
  assert qkv_attention.supported(256, 4, 64) and qkv_attention.supported(128, 2, 64)
  assert not qkv_attention.supported(512, 4, 128) and not qkv_attention.supported(256, 2, 128)
  smem, report = compiled_smem("tests.pallas_kernels.test_qkv_attention", tmp_path, ptxas=True)
  for name in SHAPES:
    assert set(smem[name]) == {"qkv_attention_bwd", "qkv_attention_scale_sums"}, smem[name]
    assert all(0 < b <= tuning.smem_limit() for b in smem[name].values()), smem[name]
  bwd = [r for r in report if r["kernel"] == "qkv_attention_bwd"]
  assert len(bwd) == len(SHAPES)
  for name, r in zip(SHAPES, bwd, strict=True):          # compiled in SHAPES' order
    assert not r["spills"], (name, r)


if __name__ == "__main__":
  import sys
  main(sys.argv[1])
