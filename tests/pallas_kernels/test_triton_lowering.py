"""The Pallas kernels lower to Triton IR for an sm_90 (H100/H200) target, checked on CPU.

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
