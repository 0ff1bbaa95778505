"""WeightGen's kernels (``pallas_kernels.weightgen``): the twin against a float64 numpy computation
of the formulas, the Pallas kernels (interpret mode, NaN-poisoned outputs) against the twin in
values and gradients (float32: 1e-5 of the largest magnitude; bfloat16: 3e-2, the kernels compute
the GELU in float32 where XLA rounds each of its steps), with an all-zero example; the kernels
compiled deviceless for the H200 at mid's shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _poison, weightgen
from tests.pallas_kernels import deviceless
from tests.pallas_kernels.deviceless import close, twin_jit


def _inputs(B=3, N=16, m=32, d=32, e=16, W=64, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(B, N, d)).astype(np.float32) * rng.uniform(0.3, 2.0, size=(B, 1, 1))
  x[1] = 0.0                                                   # an all-zero example
  f = lambda *s, sc: (rng.normal(size=s) * sc).astype(np.float32)
  return (x, f(N, m, sc=N ** -0.5), f(d, e, sc=d ** -0.5), f(e, sc=0.3), f(e, W, sc=e ** -0.5),
          f(e, W, sc=e ** -0.5))


def _numpy(x, w_tok, a1, b1, a_k, a_v, eps=1e-6):
  x = x.astype(np.float64)
  xn = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
  pre = np.einsum("bnd,nm->bmd", xn, w_tok) @ a1 + b1
  h = 0.5 * pre * (1 + np.tanh(np.sqrt(2 / np.pi) * (pre + 0.044715 * pre ** 3)))
  return h @ a_k, h @ a_v


def test_twin_matches_numpy():
  args = _inputs()
  twin = twin_jit(lambda *a: weightgen.weightgen_xla(*a, dtype=jnp.float32), jnp.float32)
  for got, want in zip(twin(*map(jnp.asarray, args)), _numpy(*args), strict=True):
    close(got, want, 1e-5)


# the narrow kernels (every width one tile), then the wide ones (in chunks, prod's kind): 48
# tokens (padded to 64 by masked loads), 2 key chunks, 2 column chunks of d, e and W
SHAPES = {"narrow": dict(B=3, N=16, m=32, d=32, e=16, W=64),
          "wide": dict(B=2, N=48, m=128, d=256, e=256, W=256)}


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
@pytest.mark.parametrize("shape", ["narrow", "wide"])
def test_kernels_match_the_twin(dtype, tol, shape):
  sh = SHAPES[shape]
  args = tuple(map(jnp.asarray, _inputs(**sh, seed=int(dtype == jnp.float32))))
  args = (args[0].astype(dtype),) + args[1:]
  rng = np.random.default_rng(5)
  out = (sh["B"], sh["m"], sh["W"])
  ck, cv = (jnp.asarray(rng.normal(size=out), jnp.float32) for _ in range(2))

  def run(fn, jit):
    def loss(*a):
      k, v = fn(*a, dtype=dtype)
      return jnp.sum(k.astype(jnp.float32) * ck) + jnp.sum(v.astype(jnp.float32) * cv)
    return jit(lambda *a: (fn(*a, dtype=dtype), jax.grad(loss, argnums=tuple(range(6)))(*a)))(
        *args)

  with _poison.poison_outputs():
    (k, v), grads = run(lambda *a, **kw: weightgen.weightgen_pallas(*a, interpret=True, **kw),
                        jax.jit)
  (rk, rv), rgrads = run(weightgen.weightgen_xla, lambda f: twin_jit(f, dtype))
  assert k.dtype == dtype and k.shape == rk.shape == out
  close(k, rk, tol)
  close(v, rv, tol)
  for g, rg in zip(grads, rgrads, strict=True):
    assert g.shape == rg.shape and g.dtype == rg.dtype
    close(g, rg, tol)


def test_unsupported_widths_and_mismatched_weights_raise():
  assert weightgen.supported(32, 64, 128, 128, 256)                # mid's high-value towers
  assert weightgen.supported(48, 256, 256, 256, 512)               # prod's: the wide kernels
  assert not weightgen.supported(96, 256, 256, 256, 512)           # N past 64
  assert not weightgen.supported(48, 256, 512, 256, 512)           # d past 256
  x, w, a1, b1, ak, av = map(jnp.asarray, _inputs())
  with pytest.raises(ValueError, match="no kernel"):
    weightgen.weightgen_pallas(x, w[:, :24], a1, b1, ak, av, interpret=True)     # m 24
  with pytest.raises(ValueError, match="do not fit"):
    weightgen.weightgen_pallas(x, w, a1, b1, ak, av[:, :32], interpret=True)


# mid's WeightGen (kunlun/configs/mid.py): 32 non-sequence tokens of width 128 to 64 keys and
# values of the high-value towers' width 256
MID = dict(B=256, N=32, m=64, d=128, W=256)


def test_kernels_compile_for_h200_at_mid_shapes(tmp_path):
  """Both kernels compiled deviceless for the H200 by the venv ``scripts/setup.sh --gpu-compile``
  makes (``main`` runs there): they launch, within the H200's shared memory per block."""
  from pallas_kernels import tuning
  smem = deviceless.compiled_smem("tests.pallas_kernels.test_weightgen", tmp_path)
  assert sorted(smem) == ["weightgen_bwd", "weightgen_fwd"], smem
  assert max(smem.values()) <= tuning.SMEM_PER_BLOCK[90], smem


def main(dump_dir):
  """Compiles the kernels' value and gradients at ``MID`` for the H200 (deviceless); prints
  ``{kernel: shared memory bytes}``."""
  import json

  from bench.profiling import gpu_target
  gpu_target.set_flags(dump_dir, "h200")
  B, N, m, d, W = (MID[k] for k in ("B", "N", "m", "d", "W"))
  f32, sds = jnp.float32, jax.ShapeDtypeStruct

  def step(*a):
    loss = lambda *a: sum(jnp.sum(t.astype(f32)) for t in weightgen.weightgen_pallas(*a))
    return jax.value_and_grad(loss, argnums=tuple(range(6)))(*a)

  args = (sds((B, N, d), jnp.bfloat16), sds((N, m), f32), sds((d, d), f32), sds((d,), f32),
          sds((d, W), f32), sds((d, W), f32))
  gpu_target.compile_for(step, args, gpu_target.gpu_mesh("h200"))
  print(json.dumps(deviceless.kernel_smem(dump_dir, "weightgen_")))


if __name__ == "__main__":
  import sys
  main(sys.argv[1])
