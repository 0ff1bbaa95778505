"""jax-triton GDPA backend. The numerics tests need a CUDA GPU and jax-triton (marked gpu);
the CPU test only checks that nothing imports jax_triton eagerly."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import reference


def test_triton_backend_is_imported_lazily():
  code = ("import sys, pallas_kernels, pallas_kernels.triton_gdpa, pallas_kernels.pallas_gdpa; "
          "assert 'jax_triton' not in sys.modules and 'triton' not in sys.modules, 'eager import'")
  subprocess.run([sys.executable, "-c", code], check=True, env={"JAX_PLATFORMS": "cpu"})


def _qkv(B=2, TQ=100, TK=70, H=4, D=64, dtype=jnp.float32, bq=None):
  ks = jax.random.split(jax.random.key(0), 3)
  return (jax.random.normal(ks[0], (bq or B, TQ, H, D), dtype),
          jax.random.normal(ks[1], (B, TK, H, D), dtype),
          jax.random.normal(ks[2], (B, TK, H, D), dtype))


CASES = [
    dict(activation="fast_gelu", q_lengths=np.array([100, 37]), kv_lengths=np.array([0, 70])),
    dict(activation=("silu", "relu", "gelu", "relu2"), window=9, out_scale=0.5),
    dict(activation="identity", broadcast_q=True, kv_lengths=np.array([64, 3])),
    dict(activation=("gelu", "silu", "gelu", "relu2"), scale=0.5, score_clip=1.5, window=30),
]


@pytest.mark.gpu
@pytest.mark.parametrize("kw", CASES, ids=range(len(CASES)))
def test_triton_forward_and_grads(kw):
  from pallas_kernels.triton_gdpa import gdpa_triton
  q, k, v = _qkv(bq=1 if kw.get("broadcast_q") else None)
  np.testing.assert_allclose(gdpa_triton(q, k, v, **kw), reference.gdpa_reference(q, k, v, **kw),
                             atol=1e-4, rtol=1e-4)
  loss = lambda fn: (lambda q, k, v: jnp.sum(fn(q, k, v, **kw) ** 2))
  got = jax.grad(loss(gdpa_triton), (0, 1, 2))(q, k, v)
  want = jax.grad(loss(reference.gdpa_reference), (0, 1, 2))(q, k, v)
  for g, r in zip(got, want, strict=True):
    np.testing.assert_allclose(g, r, atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
def test_triton_bf16():
  from pallas_kernels.triton_gdpa import gdpa_triton
  q, k, v = _qkv(dtype=jnp.bfloat16, D=128)
  out = gdpa_triton(q, k, v, kv_lengths=np.array([70, 20]))
  ref = reference.gdpa_reference(q, k, v, kv_lengths=np.array([70, 20]))
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                             atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
def test_triton_kernels_compile_for_sm90():
  """Triton -> cubin for sm_90 without launching (this also passes on a CPU host with triton
  installed: it was run that way with triton 3.6.0 when the kernels were written)."""
  import triton
  from triton.backends.compiler import GPUTarget
  from triton.compiler import ASTSource

  from pallas_kernels import triton_gdpa

  _, fwd, dq, dkv = triton_gdpa.kernels()
  ptr = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "QL": "*i32", "KL": "*i32", "O": "*bf16",
         "DO": "*bf16", "DQ": "*bf16", "DK": "*bf16", "DV": "*bf16"}
  codes = triton_gdpa.ACT_CODES
  for act, clip in ((codes["gelu"], 0.0), (codes["fast_gelu"], 8.0)):
    consts = dict(TQ=1024, TK=128, H=4, D=128, BQ=64, BK=64, ACT=act, WINDOW=-1, QB=0,
                  SCALE=0.088, OUT_SCALE=1.0, CLIP=clip, PREC="tf32")
    for fn in (fwd, dq, dkv):
      sig = {n: ptr.get(n, "constexpr") for n in fn.arg_names}
      triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                     options=dict(num_warps=4, num_stages=2))
