"""The jagged Pallas kernels lower to Triton IR for an sm_90 target, checked on CPU (the GPU info
stub of ``test_triton_lowering``); interpret mode does not exercise that lowering."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import jagged, jagged_pallas
from tests.pallas_kernels.test_triton_lowering import _n_triton_calls, sm90  # noqa: F401

B, N, H, D, NKV, S = 8, 1024, 4, 64, 64, 32
TOK = jax.ShapeDtypeStruct((N, H, D), jnp.bfloat16)
EX = jax.ShapeDtypeStruct((B, NKV, H, D), jnp.bfloat16)
SEEDS = jax.ShapeDtypeStruct((S, H, D), jnp.bfloat16)
LENS = jax.ShapeDtypeStruct((B,), jnp.int32)


def _with_jagged(fn):
  """``fn(*operands, jag)`` with the descriptor built from traced lengths."""
  return lambda lens, *ops: fn(*ops, jagged.from_lengths(lens, N))


@pytest.mark.parametrize("name,fn,ops", [
    ("cross", lambda q, k, v, j: jagged_pallas.jagged_gdpa_cross_pallas(
        q, k, v, j, activation=("gelu", "silu", "relu2", "fast_gelu"), score_clip=8.0,
        kv_lengths=jnp.full((B,), 40)), (TOK, EX, EX)),
    ("pool", lambda q, k, v, j: jagged_pallas.jagged_gdpa_pool_pallas(q, k, v, j), (SEEDS, TOK,
                                                                                    TOK)),
    ("block_softmax", lambda q, k, v, j: jagged_pallas.jagged_block_attention_pallas(q, k, v, j),
     (TOK, TOK, TOK)),
    ("block_gdpa", lambda q, k, v, j: jagged_pallas.jagged_block_attention_pallas(
        q, k, v, j, activation="silu", score_clip=4.0), (TOK, TOK, TOK)),
    ("softmax_band", lambda q, k, v, j: jagged_pallas.jagged_softmax_attention_pallas(
        q, k, v, j, window=64), (TOK, TOK, TOK)),
    ("softmax_full", lambda q, k, v, j: jagged_pallas.jagged_softmax_attention_pallas(q, k, v, j),
     (TOK, TOK, TOK)),
])
def test_jagged_kernels_lower(sm90, name, fn, ops):  # noqa: F811
  assert _n_triton_calls(_with_jagged(fn), LENS, *ops) == 1, name
  loss = jax.grad(lambda lens, *ops: jnp.sum(_with_jagged(fn)(lens, *ops).astype(jnp.float32)),
                  argnums=(1, 2, 3))
  assert _n_triton_calls(loss, LENS, *ops) == 2, name   # forward + one backward kernel
