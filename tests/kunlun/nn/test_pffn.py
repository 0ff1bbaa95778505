"""GDPA-PFFN against an explicit per-example two-layer FFN built from the generated weights."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kunlun.nn.pffn import PFFN


def ln(x):
  mu = x.mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-6)


def rms(x):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6)


def fast_gelu(x):
  return 0.5 * x * (1.0 + np.tanh(0.7978845608 * (x + 0.044715 * x ** 3)))


def np_pffn(s, lengths, k, v, act, score_clip=None):
  """Per example b and head h: FFN with W1 = k[b,:,h].T / sqrt(dh), W2 = v[b,:,h].

  ``act``: a function, or a list with one per head; ``score_clip`` clamps u W1 first."""
  B, T, d = s.shape
  H, dh = k.shape[2], k.shape[3]
  out = np.zeros_like(s, dtype=np.float64)
  for b in range(B):
    u = ln(s[b].astype(np.float64))
    g = np.zeros_like(u)
    for h in range(H):
      w1 = k[b, :, h, :].T / np.sqrt(dh)          # [dh, n_kv]
      w2 = v[b, :, h, :]                           # [n_kv, dh]
      a = act[h] if isinstance(act, (list, tuple)) else act
      z = u[:, h * dh:(h + 1) * dh] @ w1
      if score_clip:
        z = np.clip(z, -score_clip, score_clip)
      g[:, h * dh:(h + 1) * dh] = a(z) @ w2
    y = rms(g + u) + s[b]
    y[lengths[b]:] = 0.0
    out[b] = y
  return out


def _inputs(B=3, T=10, d=16, H=4, n_kv=5, seed=0):
  rng = np.random.default_rng(seed)
  s = rng.normal(size=(B, T, d)).astype(np.float32)
  k, v = (rng.normal(size=(B, n_kv, H, d // H)).astype(np.float32) for _ in range(2))
  return s, np.array([T, 4, 0][:B], np.int32), k, v


@pytest.mark.parametrize("act,np_act", [("identity", lambda x: x), ("fast_gelu", fast_gelu)])
def test_pffn_matches_explicit_ffn(act, np_act):
  s, lengths, k, v = _inputs()
  m = PFFN(4, activation=act)
  var = jax.eval_shape(m.init, jax.random.key(0), s, lengths, k, v)
  assert not jax.tree.leaves(var)                  # affine-free: no parameters
  out = jax.jit(m.apply)({}, s, lengths, k, v)
  np.testing.assert_allclose(np.asarray(out), np_pffn(s, lengths, k, v, np_act),
                             rtol=1e-4, atol=1e-4)


def test_pffn_padding_invariance_and_gradients():
  s, lengths, k, v = _inputs()
  m = PFFN(4)
  apply = jax.jit(m.apply)
  out = apply({}, s, lengths, k, v)
  pad = np.random.default_rng(5).normal(size=(3, 6, 16)).astype(np.float32) * 100
  s_long = np.concatenate([s, pad], axis=1)
  s_long[1, 4:] = 1e3                                # garbage in padded slots
  out_long = np.asarray(apply({}, s_long, lengths, k, v))
  np.testing.assert_allclose(out_long[:, :10], np.asarray(out), rtol=1e-5, atol=1e-5)
  valid = np.arange(16)[None, :] < lengths[:, None]
  assert np.all(out_long[~valid] == 0)
  g = jax.jit(jax.grad(lambda s: jnp.sum(m.apply({}, s, lengths, k, v) ** 2)))(s_long)
  assert np.all(np.asarray(g)[~valid] == 0) and np.abs(np.asarray(g)[valid]).sum() > 0


def test_pffn_bf16_close_to_fp32():
  s, lengths, k, v = _inputs(B=2, T=32, d=64, H=2, n_kv=16, seed=3)
  f32 = np.asarray(jax.jit(PFFN(2).apply)({}, s, lengths, k, v))
  b16 = jax.jit(PFFN(2, dtype=jnp.bfloat16).apply)({}, s, lengths, k, v)
  assert b16.dtype == jnp.float32                    # residual stream keeps its dtype
  # stated tolerance: bf16 GEMM inputs, f32 accumulation and norms -> max abs error < 0.1
  # on unit-scale outputs, mean abs error < 0.02
  err = np.abs(np.asarray(b16) - f32)
  assert err.max() < 0.1 and err.mean() < 0.02, (err.max(), err.mean())


def test_pffn_errors():
  s, lengths, k, v = _inputs()
  with pytest.raises(ValueError, match="does not divide"):
    PFFN(3).apply({}, s, lengths, k, v)
  with pytest.raises(ValueError, match="k"):
    PFFN(2).apply({}, s, lengths, k, v)
  with pytest.raises(ValueError, match="unknown activation"):
    PFFN(4, activation="tanh").apply({}, s, lengths, k, v)


def test_pffn_named_scopes():
  s, lengths, k, v = _inputs()
  text = jax.jit(PFFN(4).apply).lower({}, s, lengths, k, v).as_text(debug_info=True)
  assert "PFFN" in text and "GDPA" in text


def test_pffn_norm_affine_option():
  s, lengths, k, v = _inputs()
  m = PFFN(4, activation="identity", norm_affine=True)
  p = jax.jit(m.init)(jax.random.key(0), s, lengths, k, v)
  p = jax.tree.map(np.asarray, nn.meta.unbox(p)["params"])
  assert sorted(p) == ["ln_bias", "ln_scale", "rms_scale"]
  rng = np.random.default_rng(4)
  p = jax.tree.map(lambda a: (a + 0.2 * rng.normal(size=a.shape)).astype(np.float32), p)
  out = np.asarray(jax.jit(m.apply)({"params": p}, s, lengths, k, v))
  dh = 4
  ref = np.zeros_like(out)
  for b in range(3):
    u = ln(s[b].astype(np.float64)) * p["ln_scale"] + p["ln_bias"]
    g = np.concatenate([u[:, h * dh:(h + 1) * dh] @ (k[b, :, h].T / 2.0) @ v[b, :, h]
                        for h in range(4)], 1)
    ref[b, :lengths[b]] = (rms(g + u) * p["rms_scale"] + s[b])[:lengths[b]]
  np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)


def test_pffn_per_head_activations_and_score_clip():
  """One activation per head (a tuple) and score_clip (spec h-13) against the explicit FFN; the
  first layer's pre-activations are ~N(0, 1), so a 0.5 clip changes the output."""
  s, lengths, k, v = _inputs()
  acts = ("relu", "silu", "identity", "fast_gelu")
  np_acts = [lambda x: np.maximum(x, 0), lambda x: x / (1 + np.exp(-x)), lambda x: x, fast_gelu]
  outs = {}
  for clip in (None, 0.5):
    outs[clip] = np.asarray(jax.jit(PFFN(4, activation=acts, score_clip=clip).apply)(
        {}, s, lengths, k, v))
    np.testing.assert_allclose(outs[clip], np_pffn(s, lengths, k, v, np_acts, clip),
                               rtol=1e-4, atol=1e-4)
  assert np.abs(outs[None] - outs[0.5]).max() > 0.05


@pytest.mark.parametrize("lens,cap,dtype", [((9, 0, 16, 1), 32, jnp.float32),
                                            ((0, 32, 0), 32, jnp.float32),
                                            ((9, 0, 16, 1), 32, jnp.bfloat16)])
def test_packed_fused_tail_matches_the_xla_path(lens, cap, dtype):
  """A packed tower on the Pallas backend runs the tail ``RMSNorm(g + u) + s`` as
  ``pallas_kernels.norm_residual``'s kernels (interpret mode); output and gradients (tokens,
  keys, values) equal the XLA backend's (float32: 1e-5; bfloat16: 2e-2 of the largest magnitude)
  with ragged lengths, empty histories and one example filling the capacity; float32 outputs at
  the real tokens equal the numpy reference of the padded layout, the capacity's tail zero."""
  from data.jagged import pack_events
  from kunlun.nn import packed
  from pallas_kernels.jagged import Jagged
  from tests.kunlun.nn.backends import pallas_matches_xla
  B, T, d, H = len(lens), max(lens), 32, 2
  rng = np.random.default_rng(sum(lens))
  s = rng.normal(size=(B, T, d)).astype(np.float32)
  k, v = (rng.normal(size=(B, 4, H, d // H)).astype(np.float32) for _ in range(2))
  lengths = np.array(lens, np.int32)
  toks, offsets, seg, pos, _ = pack_events({"s": s}, lengths, cap)
  jag = Jagged(*(jnp.asarray(a) for a in (offsets, seg, pos)))
  x = jnp.asarray(toks["s"], dtype)
  mods = {b: PFFN(H, backend=b, dtype=dtype) for b in ("xla", "pallas")}
  assert packed.fuse_tail("pallas", d) and not packed.fuse_tail("xla", d)
  g = jnp.asarray(rng.normal(size=x.shape), jnp.float32)
  apply = lambda m, p, xkv: m.apply(p, packed.Packed(xkv[0], jag), None, xkv[1], xkv[2]).value
  got = pallas_matches_xla(mods, {}, (x, jnp.asarray(k), jnp.asarray(v)), apply, g, dtype)
  n = int(offsets[-1])
  assert not np.any(np.asarray(got, np.float32)[n:])
  if dtype == jnp.float32:
    real = np.arange(T)[None, :] < lengths[:, None]
    ref = np_pffn(s, lengths, k, v, fast_gelu)
    np.testing.assert_allclose(np.asarray(got)[:n], ref[real], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("lens,dtype", [((37, 0, 21, 1), jnp.float32), ((0, 64, 0), jnp.float32),
                                        ((37, 0, 21, 1), jnp.bfloat16)])
def test_hsp_passing_its_tokens_to_the_pffn_matches_the_xla_path(lens, dtype):
  """A layer's HSP then PFFN on one packed tower (width 64, two heads): on the Pallas backend
  HSP's fused pool passes the tokens through (``HSP(pass_tokens=True)``) and the PFFN reads them
  (``tokens=``), so the query norm's backward and the sum of the tokens' three cotangents run in
  the pool's backward kernel; the summaries, the PFFN's output and the gradients of HSP's
  parameters, the tokens, keys and values equal the XLA backend's chain, which passes nothing
  (float32 1e-5, bfloat16 2e-2 of the largest element), with ragged lengths, an empty history
  and one example filling the capacity 64."""
  from data.jagged import pack_events
  from kunlun.nn import packed
  from kunlun.nn.hsp import HSP
  from pallas_kernels.jagged import Jagged
  from tests.kunlun.nn.backends import _rel
  B, T, d, H = len(lens), max(lens), 64, 2
  rng = np.random.default_rng(sum(lens) + 3)
  s = rng.normal(size=(B, T, d)).astype(np.float32) * 2 + 0.5
  toks, offsets, seg, pos, _ = pack_events({"s": s}, np.array(lens, np.int32), 64)
  jag = Jagged(*(jnp.asarray(a) for a in (offsets, seg, pos)))
  x = jnp.asarray(toks["s"], dtype)
  k, v = (jnp.asarray(rng.normal(size=(B, 4, H, d // H)), dtype) for _ in range(2))
  hsp = {b: HSP(n_seed=16, n_sum=4, heads=H, rank=2, backend=b, t_max=T, dtype=dtype,
                pass_tokens=True) for b in ("xla", "pallas")}
  pffn = {b: PFFN(H, backend=b, dtype=dtype) for b in ("xla", "pallas")}
  params = jax.jit(hsp["xla"].init)(jax.random.key(0), packed.Packed(x, jag), None)

  def run(b):
    def chain(p, x, k, v):
      y, passed = hsp[b].apply(p, packed.Packed(x, jag), None)
      assert (passed is None) == (b == "xla")
      out = pffn[b].apply({}, packed.Packed(x, jag), None, k, v, tokens=passed).value
      return y.astype(jnp.float32), out.astype(jnp.float32)
    outs, vjp = jax.vjp(chain, params, x, k, v)
    return outs, vjp(jax.tree.map(jnp.cos, outs))

  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  want, got = jax.jit(lambda: run("xla"))(), jax.jit(lambda: run("pallas"))()
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want),
                          strict=True):
    assert _rel(a, b) <= tol, jax.tree_util.keystr(path)


def test_tokens_passed_through_only_where_the_kernels_normalise_the_query():
  """``PFFN(tokens=...)`` outside the packed path whose kernels normalise the query, and a PMA
  asked to pass tokens, are one-line errors."""
  from data.fake import tiny_schema
  from data.jagged import pack_events
  from kunlun.configs import tiny
  from kunlun.configs.types import validate
  from kunlun.nn import packed
  from kunlun.nn.pffn import query_in_kernels
  from kunlun.nn.towers import make_pooling
  from pallas_kernels.jagged import Jagged
  s, lengths, k, v = _inputs()
  toks, offsets, seg, pos, _ = pack_events({"s": np.asarray(s)}, np.asarray(lengths), 32)
  jag = Jagged(*(jnp.asarray(a) for a in (offsets, seg, pos)))
  x = jnp.asarray(toks["s"])
  assert not query_in_kernels("xla", 16, jnp.float32, jnp.float32)
  assert not query_in_kernels("pallas", 16, jnp.bfloat16, jnp.float32)
  cases = [(lambda: PFFN(4).apply({}, s, lengths, k, v, tokens=(s, s)), "packed tower only"),
           (lambda: PFFN(4).apply({}, packed.Packed(x, jag), None, k, v, tokens=(x, x)),
            "query_in_kernels")]
  c = tiny.get_config()
  c.model.pooling = "pma"
  cfg = validate(c, tiny_schema())
  cases.append((lambda: make_pooling(cfg, cfg.seq_towers[0], jnp.float32, "p", pass_tokens=True),
                "PMA passes no tokens"))
  for fn, msg in cases:
    with pytest.raises(ValueError, match=msg) as e:
      fn()
    assert "\n" not in str(e.value)
