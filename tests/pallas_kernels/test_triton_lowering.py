"""The Pallas kernels lower to Triton IR for an sm_90 (H100/H200) target, checked on CPU (and the
cuDNN softmax-attention backend's graph lowers for CUDA).

Interpret mode does not exercise the Triton lowering, which supports fewer primitives (e.g. no
``lax.erf``, no bool->int adds). Lowering for ``cuda`` needs the GPU's compute capability, so the
test stubs jax's GPU-info query (a private hook of the pinned jax 0.11.2). This stops at Triton IR:
Triton's own compilation to PTX still only happens on a GPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.triton import gpu_info
from jax._src.pallas.triton import pallas_call_registration as registration

from pallas_kernels import activations, pallas_block, pallas_gdpa


@pytest.fixture
def sm90(monkeypatch):
  monkeypatch.setattr(registration.gpu_info_lib, "get_gpu_info", lambda: gpu_info.GpuInfo(
      gpu_version=None, arch_name="sm_90", compute_capability=90))


def _n_triton_calls(f, *shapes):
  text = jax.jit(f).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
  return text.count("__gpu$xla.gpu.triton")


def _loss(fn, **kw):
  return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v, **kw).astype(jnp.float32)), (0, 1, 2))


BF16 = jax.ShapeDtypeStruct((2, 100, 4, 64), jnp.bfloat16)


@pytest.mark.parametrize("kw", [
    dict(activation=activations.NAMES[:4], window=8, q_lengths=jnp.array([3, 100])),
    dict(activation="gelu", broadcast_q=True),
    dict(activation="relu2", kv_lengths=jnp.array([0, 7])),
    dict(activation=("gelu", "silu", "gelu", "relu"), score_clip=8.0, window=8),
], ids=["per_head_window", "broadcast_q", "relu2", "score_clip"])
def test_gdpa_forward_and_backward_lower(sm90, kw):
  q = jax.ShapeDtypeStruct((1, 100, 4, 64), jnp.bfloat16) if kw.get("broadcast_q") else BF16
  assert _n_triton_calls(_loss(pallas_gdpa.gdpa_pallas, **kw), q, BF16, BF16) == 3  # fwd dq dkv


def test_gdpa_fp8_and_f32_lower(sm90):
  for clip in (None, 8.0):
    assert _n_triton_calls(lambda q, k, v, c=clip: pallas_gdpa.gdpa_pallas(q, k, v, fp8=True,
                                                                         score_clip=c),
                           BF16, BF16, BF16) == 1
  f32 = jax.ShapeDtypeStruct(BF16.shape, jnp.float32)
  assert _n_triton_calls(_loss(pallas_gdpa.gdpa_pallas, activation="silu"), f32, f32, f32) == 3


def test_block_attention_lowers(sm90):
  x = jax.ShapeDtypeStruct((2, 128, 4, 64), jnp.bfloat16)
  rot = jax.ShapeDtypeStruct((2, 128, 4, 32), jnp.float32)
  f = jax.grad(lambda q, k, v, c, s: jnp.sum(pallas_block.block_attention_pallas(
      q, k, v, block_size=64, rotary=(c, s), lengths=jnp.array([3, 100])).astype(jnp.float32)),
      (0, 1, 2))
  assert _n_triton_calls(f, x, x, x, rot, rot) == 2
  for clip in (None, 8.0):
    g = _loss(pallas_block.block_attention_pallas, block_size=64, score_clip=clip,
              activation=("silu", "gelu", "relu", "identity"))
    assert _n_triton_calls(g, x, x, x) == 2


def test_kernel_gelu_matches_exact():
  """The in-kernel erf approximation (A&S 7.1.26) and the GELU slope against lax.erf/jax.grad."""
  x = jnp.linspace(-6.0, 6.0, 2001)
  # A&S bound 1.5e-7 plus float32 rounding.
  np.testing.assert_allclose(activations._erf_kernel(x), jax.lax.erf(x), atol=5e-7)
  val, slope = activations._gelu_kernel(x, with_slope=True)
  exact = activations.ACTIVATIONS["gelu"]
  np.testing.assert_allclose(val, exact(x), atol=1e-6)
  np.testing.assert_allclose(slope, jax.vmap(jax.grad(exact))(x), atol=1e-6)


@pytest.mark.parametrize("kw", [
    dict(window=64, q_lengths=jnp.array([3, 100]), kv_lengths=jnp.array([100, 40])),
    dict(q_lengths=jnp.array([0, 100]), kv_lengths=jnp.array([100, 0])),
    dict(window=8, q_index=jnp.array([1, 0, 1]), kv_index=jnp.array([0, 0, 1]),
         kv_start=jnp.array([2, 0]), q_offset=8),
], ids=["band", "full", "shared_halo"])
def test_softmax_attention_forward_and_backward_lower(sm90, kw):
  from pallas_kernels import pallas_softmax
  assert _n_triton_calls(_loss(pallas_softmax.softmax_attention_pallas, **kw),
                         BF16, BF16, BF16) == 3                           # fwd, dq, dk/dv
  f32 = jax.ShapeDtypeStruct(BF16.shape, jnp.float32)
  assert _n_triton_calls(_loss(pallas_softmax.softmax_attention_pallas, **kw), f32, f32,
                         f32) == 3


@pytest.fixture
def cudnn_sm90(monkeypatch):
  """jax's cuDNN attention checks the installed cuDNN and the device before lowering: stub
  them (private hooks of the pinned jax 0.11.2) to lower the cuDNN graph on CPU."""
  from jax._src.cudnn import fused_attention_stablehlo as fa
  monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91000)
  monkeypatch.setattr(fa, "check_compute_capability", lambda c: True)
  monkeypatch.setattr(fa, "is_cuda_compute_capability_equal", lambda c: False)


@pytest.mark.parametrize("window", [64, None])
def test_cudnn_softmax_attention_lowers_for_cuda(cudnn_sm90, window):
  """The cuDNN backend's graph (forward with fp32 statistics, the backward primitive bound with
  the merged o / lse) builds and lowers for CUDA: 2 forward and 2 backward cuDNN calls for the
  band, 1 + 1 for full attention. Numerics need a GPU (test_pallas_gpu.py)."""
  from pallas_kernels import cudnn_softmax
  x = jax.ShapeDtypeStruct((2, 256, 4, 64), jnp.bfloat16)
  n = jax.ShapeDtypeStruct((2,), jnp.int32)
  if window is None:
    fn = lambda q, k, v, n: cudnn_softmax._full(q, k, v, n, n, 0.125, False)
  else:
    cfg = cudnn_softmax._Cfg(window, 0.125, False)
    fn = lambda q, k, v, n: cudnn_softmax._band(cfg, q, k, v, n, n)
  f = jax.grad(lambda q, k, v, n: jnp.sum(fn(q, k, v, n).astype(jnp.float32)), (0, 1, 2))
  text = jax.jit(f).trace(x, x, x, n).lower(lowering_platforms=("cuda",)).as_text()
  calls = 2 if window is not None else 1
  assert text.count("@__cudnn$fmhaSoftmaxBackward(") == calls
  assert text.count("@__cudnn$fmhaSoftmax(") == calls
