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


def _qkv(B=2, TQ=100, TK=70, H=4, D=64, dtype=jnp.float32, bq=None, bk=None, hk=None):
  ks = jax.random.split(jax.random.key(0), 3)
  return (jax.random.normal(ks[0], (bq or B, TQ, H, D), dtype),
          jax.random.normal(ks[1], (bk or B, TK, hk or H, D), dtype),
          jax.random.normal(ks[2], (bk or B, TK, hk or H, D), dtype))


CASES = [
    dict(activation="fast_gelu", q_lengths=np.array([100, 37]), kv_lengths=np.array([0, 70])),
    dict(activation=("silu", "relu", "gelu", "relu2"), window=9, out_scale=0.5),
    dict(activation="identity", broadcast_q=True, kv_lengths=np.array([64, 3])),
    dict(activation=("gelu", "silu", "gelu", "relu2"), scale=0.5, score_clip=1.5, window=30),
    dict(activation=("leaky_relu", "hardswish", "fast_silu", "gelu_taylor"), score_clip=1.0),
    dict(activation=("gelu_tanh", "fast_gelu_bf16", "fast_gelu", "silu")),
    # request-level sharing + GQA: 3 output rows over 2 q rows and 2 k/v rows, 4 q heads on 2
    dict(activation="fast_gelu", q_index=np.array([1, 0, 1]), kv_index=np.array([0, 0, 1]),
         q_lengths=np.array([100, 40]), kv_lengths=np.array([70, 11]), hk=2),
]


@pytest.mark.gpu
@pytest.mark.parametrize("kw", CASES, ids=range(len(CASES)))
def test_triton_forward_and_grads(kw):
  from pallas_kernels.triton_gdpa import gdpa_triton
  kw = dict(kw)
  hk = kw.pop("hk", None)
  q, k, v = _qkv(bq=1 if kw.get("broadcast_q") else None, hk=hk)
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


def test_triton_kernels_compile_for_sm90():
  """Triton -> cubin for sm_90 without launching (runs on CPU when triton is importable): every
  kernel, with a window, a clip, mixed per-head activations and GQA; no register spills at the
  default tiles of the benchmark shapes."""
  pytest.importorskip("triton")
  from pallas_kernels import sm90_report, tuning
  shape = dict(sm90_report.SHAPES["self"], Hkv=4)
  for kern in ("fwd", "dq", "dkv"):
    st = sm90_report.triton_kernel_stats(kern, tuning.DEFAULTS[kern], shape, window=100,
                                         clip=8.0, mixed=("gelu", "fast_gelu", "hardswish"))
    assert st["wgmma"] > 0 and st["cp_async"] > 0, (kern, st)   # tensor cores, pipelined loads
    st = sm90_report.triton_kernel_stats(kern, tuning.DEFAULTS[kern], sm90_report.SHAPES["self"])
    assert st["spill_st"] == 0, (kern, st)
