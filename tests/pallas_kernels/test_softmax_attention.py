"""Softmax attention (full and banded |i - j| <= w): the Pallas kernel (interpret mode) and the
cuDNN LSE-merge backend (XLA stand-in for its two cuDNN calls) against the banded XLA reference
and a dense float64 numpy oracle, values and gradients. Tiny shapes: T is a multiple of neither
the window nor the 16-row tiles, and T > 3 * 16 so the reference takes its banded path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import _poison, api, cudnn_softmax, pallas_softmax, reference
from tests.pallas_kernels.np_ref import softmax_loop

B, T, H, D = 2, 53, 2, 8
TILES = dict(block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=16)


def _qkv(seed=0, tq=T, tk=None, bq=B, bk=None, h=H, hk=None, dtype=jnp.float32):
  ks = jax.random.split(jax.random.key(seed), 3)
  tk, bk, hk = tk or tq, bk or bq, hk or h
  return (jax.random.normal(ks[0], (bq, tq, h, D), dtype),
          jax.random.normal(ks[1], (bk, tk, hk, D), dtype),
          jax.random.normal(ks[2], (bk, tk, hk, D), dtype))


def _pallas(q, k, v, **kw):
  return pallas_softmax.softmax_attention_pallas(q, k, v, interpret=True, **TILES, **kw)


def _cudnn(q, k, v, **kw):
  return cudnn_softmax.softmax_attention_cudnn(q, k, v, interpret=True, **kw)


def _weights(tq):
  return jnp.cos(jnp.arange(tq * D, dtype=jnp.float32).reshape(tq, 1, D))


def _value_and_grads(fn, q, k, v, kw):
  """``fn``'s output and the gradients of ``sum(out * w)`` (one compile)."""
  w = _weights(q.shape[1])

  def both(q, k, v):
    out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, **kw), q, k, v)
    return out, vjp(jnp.broadcast_to(w, out.shape).astype(out.dtype))

  return jax.jit(both)(q, k, v)


def _check(fn, kw, q, k, v, atol=2e-5):
  """fn against the XLA reference and the numpy oracle: output and dq, dk, dv."""
  out, grads = _value_and_grads(fn, q, k, v, kw)
  ref, ref_grads = _value_and_grads(reference.softmax_attention_reference, q, k, v, kw)
  n_out = out.shape[0]
  do = np.broadcast_to(np.asarray(_weights(q.shape[1])), (n_out,) + q.shape[1:])
  o_np, *g_np = softmax_loop(q, k, v, do=do, **kw)
  np.testing.assert_allclose(ref, o_np, atol=atol, rtol=1e-5, err_msg="reference vs numpy")
  np.testing.assert_allclose(out, o_np, atol=atol, rtol=1e-5, err_msg="kernel vs numpy")
  np.testing.assert_allclose(out, ref, atol=atol, rtol=1e-5, err_msg="kernel vs reference")
  for name, g, r, n in zip("qkv", grads, ref_grads, g_np, strict=True):
    assert g.shape == r.shape == n.shape and np.isfinite(np.asarray(g)).all(), name
    np.testing.assert_allclose(r, n, atol=4 * atol, rtol=1e-4, err_msg=f"d{name} ref vs numpy")
    np.testing.assert_allclose(g, n, atol=4 * atol, rtol=1e-4, err_msg=f"d{name} vs numpy")
  return np.asarray(out)


CASES = {   # name -> (kwargs, operand shapes); lengths ragged, one example fully padded
    "band_w5": (dict(window=5, q_lengths=np.array([53, 29]), kv_lengths=np.array([53, 29])), {}),
    "band_w20_empty_rows": (dict(window=20, q_lengths=np.array([0, 53]),
                                 kv_lengths=np.array([53, 0])), dict(tq=70)),
    "full_ragged": (dict(q_lengths=np.array([37, 11]), kv_lengths=np.array([20, 37])),
                    dict(tq=37)),
    "band_halo_offset": (dict(window=4, q_offset=4, kv_start=np.array([4, 0]),
                              q_lengths=np.array([20, 9]), kv_lengths=np.array([28, 17])),
                         dict(tq=20, tk=28)),
    # a tile multiple plus one: a q tile's last row reaches exactly the first key of the tile
    # after the band's last full one (the last key tile must be visited)
    "band_w17_tile_plus_one": (dict(window=17, q_lengths=np.array([53, 40]),
                                    kv_lengths=np.array([53, 40])), {}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_pallas_matches_reference_and_numpy(name):
  kw, shapes = CASES[name]
  out = _check(_pallas, kw, *_qkv(seed=1, **shapes))
  if name == "band_w20_empty_rows":   # example 0: no valid query; example 1: no valid key
    assert np.all(out == 0)
  if name == "band_w5":
    assert np.all(out[1, 29:] == 0) and np.abs(out[1, :29]).min(axis=(1, 2)).max() > 0


def test_pallas_request_sharing_and_gqa():
  """Output row b reads q[q_index[b]] and k, v[kv_index[b]] (lengths indexed like their operand);
  4 q heads on 2 kv heads. Gradients of the shared rows are sums over their output rows."""
  q, k, v = _qkv(seed=2, bq=2, bk=2, h=4, hk=2)
  kw = dict(window=6, q_index=np.array([1, 0, 1]), kv_index=np.array([0, 0, 1]),
            q_lengths=np.array([53, 30]), kv_lengths=np.array([41, 53]))
  out = _check(_pallas, kw, q, k, v)
  assert out.shape == (3, T, 4, D)


def test_pallas_outputs_fully_written_and_padding_nan_never_leaks():
  """NaN-filled kernel outputs (forward, dq, dk/dv, lse, delta) must all be overwritten; NaN
  stored in padding rows of q, k, v must not reach any valid output or gradient."""
  q, k, v = _qkv(seed=3)
  kw = dict(window=3, q_lengths=np.array([3, 0]), kv_lengths=np.array([50, 4]))
  bad = lambda x, n: x.at[0, n:].set(jnp.nan)
  qn, kn, vn = bad(q, 3), bad(k, 50), bad(v, 50)
  with _poison.poison_outputs():
    out, grads = _value_and_grads(_pallas, qn, kn, vn, kw)
  ref, ref_grads = _value_and_grads(reference.softmax_attention_reference, q, k, v, kw)
  np.testing.assert_allclose(out, ref, atol=2e-5)
  for g, r in zip(grads, ref_grads, strict=True):
    np.testing.assert_allclose(g, r, atol=5e-5)


def test_pallas_bf16_close_to_fp32():
  q, k, v = _qkv(seed=4, dtype=jnp.bfloat16)
  kw = dict(window=7, q_lengths=np.array([53, 22]), kv_lengths=np.array([53, 22]))
  out, grads = _value_and_grads(_pallas, q, k, v, kw)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  ref, ref_grads = _value_and_grads(reference.softmax_attention_reference, *f32, kw)
  assert out.dtype == jnp.bfloat16
  # P and dS rounded to bf16 before their matmuls, bf16 outputs: ~2-3 significant digits
  np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=2e-2)
  for g, r in zip(grads, ref_grads, strict=True):
    assert g.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(g, np.float32), r, atol=3e-2 * float(jnp.abs(r).max()))


def test_key_tiles_visited_are_the_band():
  """The forward walks only key tiles touching the band: with T = 4096, w = 64 and 64-row tiles
  a q tile visits 3 key tiles, not 64 (and 0 beyond the lengths)."""
  span = lambda start, kv_hi, q_off=0: tuple(int(x) for x in pallas_softmax._key_span(
      jnp.int32(start), 64, 64, 64, jnp.int32(0), jnp.int32(kv_hi), 64, q_off))
  assert span(0, 4096) == (0, 2)
  assert span(1024, 4096) == (15, 18)
  assert span(4032, 4096) == (62, 64)
  assert span(1024, 1000) == (15, 16)                     # keys 960..999 are in the band
  assert span(1024, 900) == (15, 15)
  lo, hi = pallas_softmax._query_span(jnp.int32(1024), 64, 64, 64, jnp.int32(4096), 64, 0)
  assert (int(lo), int(hi)) == (15, 18)


@pytest.mark.parametrize("window", [0, 1, 5, None])
def test_cudnn_lse_merge_matches_reference_and_numpy(window):
  """The two causal left-window halves (the right one on the reversed sequence), merged by
  their log-sum-exp with the diagonal counted once, and the custom VJP that runs each half's
  backward with the merged o and lse: exact against the reference and numpy. Full attention
  (window None) is one call with the padding lengths."""
  q, k, v = _qkv(seed=5, tq=40)
  kw = dict(window=window, q_lengths=np.array([40, 17]), kv_lengths=np.array([33, 17]))
  _check(_cudnn, kw, q, k, v)


def test_cudnn_lse_merge_request_sharing_gqa_and_empty_rows():
  q, k, v = _qkv(seed=6, tq=24, bq=2, bk=2, h=4, hk=2)
  kw = dict(window=3, q_index=np.array([1, 0, 1]), kv_index=np.array([0, 1, 1]),
            q_lengths=np.array([0, 24]), kv_lengths=np.array([13, 0]))
  out = _check(_cudnn, kw, q, k, v)
  assert np.all(out[1:] == 0)     # row 1 reads a q row without queries, row 2 a k row without keys
  assert np.all(out[0, 13 + 3:] == 0) and np.abs(out[0, :13 + 3]).min(axis=(1, 2)).max() > 0


def test_naive_lse_merge_through_jax_nn_has_wrong_gradients():
  """Why the cuDNN backend has its own VJP: merging two ``return_residual=True`` calls of
  ``jax.nn.dot_product_attention`` gives the right forward but wrong gradients, because the
  log-sum-exp output carries no gradient (XLA: stop_gradient; cuDNN: its cotangent is dropped)."""
  q, k, v = _qkv(seed=7, tq=20, bq=1)
  w = 3

  def naive(q, k, v):
    dpa = lambda q, k, v, win: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, local_window_size=(win, 0), return_residual=True,
        implementation="xla")
    o_l, lse_l = dpa(q, k, v, w)
    r = lambda x: x[:, ::-1]       # full length: reverse the sequence, shift q by one
    o_r, lse_r = dpa(r(q)[:, 1:], r(k)[:, :-1], r(v)[:, :-1], w - 1)
    o_r, lse_r = r(o_r), r(lse_r)
    o_r = jnp.pad(o_r, ((0, 0), (0, 1), (0, 0), (0, 0)))
    lse_r = jnp.pad(lse_r, ((0, 0), (0, 1), (0, 0)), constant_values=-jnp.inf)
    lse = jnp.logaddexp(lse_l, lse_r)
    return (jnp.exp(lse_l - lse)[..., None] * o_l + jnp.exp(lse_r - lse)[..., None] * o_r)

  kw = dict(window=w)
  ref, ref_grads = _value_and_grads(reference.softmax_attention_reference, q, k, v, kw)
  out, grads = _value_and_grads(lambda q, k, v, window: naive(q, k, v), q, k, v, kw)
  np.testing.assert_allclose(out, ref, atol=2e-5)                        # forward is right
  assert np.abs(np.asarray(grads[0]) - np.asarray(ref_grads[0])).max() > 1e-2   # dq is not
  _, ours = _value_and_grads(_cudnn, q, k, v, kw)
  np.testing.assert_allclose(ours[0], ref_grads[0], atol=1e-4)


def test_dispatch_and_errors():
  q, k, v = _qkv(seed=8, tq=20)
  kw = dict(window=4, q_lengths=np.array([20, 7]), kv_lengths=np.array([20, 7]))
  ref = reference.softmax_attention_reference(q, k, v, **kw)
  np.testing.assert_array_equal(pallas_kernels.softmax_attention(q, k, v, backend="auto", **kw),
                                ref)                                    # CPU: auto is xla
  for backend in ("pallas", "triton"):                                   # triton runs pallas
    np.testing.assert_allclose(pallas_kernels.softmax_attention(q, k, v, backend=backend, **kw),
                               ref, atol=2e-5)
  np.testing.assert_allclose(
      pallas_kernels.softmax_attention(q, k, v, backend="cudnn", interpret=True, **kw), ref,
      atol=2e-5)
  with pytest.raises(ValueError, match="needs a GPU"):
    pallas_kernels.softmax_attention(q, k, v, backend="cudnn", **kw)
  with pytest.raises(ValueError, match="kv_start"):
    _cudnn(q, k, v, kv_start=np.array([0, 1]), **kw)
  with pytest.raises(ValueError, match="unknown softmax_attention backend"):
    pallas_kernels.softmax_attention(q, k, v, backend="cuda")
  with pytest.raises(ValueError, match="window must be >= 0"):
    _pallas(q, k, v, window=-1)
  with pytest.raises(ValueError, match="q_offset"):
    _pallas(q, k, v, q_offset=-2)
  with pytest.raises(ValueError, match="kv_start must have shape"):
    _pallas(q, k, v, kv_start=np.array([0, 1, 2]))
  assert api.shape_class("softmax_attention", 512, 512, window=64) == "swa"
  assert api.shape_class("softmax_attention", 512, 512) == "full"


@pytest.mark.parametrize("window", [1, 5, 17])
def test_cudnn_lse_merge_full_length_key_value_gradients(window):
  """Every example at the full sequence length (kv_len == T: the reversed right half's index
  maps wrap round the whole sequence, no padding row absorbs them): output, dq and the key /
  value gradients of the merged halves and their custom VJP against the numpy oracle."""
  q, k, v = _qkv(seed=9, tq=40)
  kw = dict(window=window, q_lengths=np.array([40, 40]), kv_lengths=np.array([40, 40]))
  _check(_cudnn, kw, q, k, v)
