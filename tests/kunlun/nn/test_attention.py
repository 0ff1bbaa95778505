"""SeqAttention against dense numpy references (masked softmax, per-block attention, GDPA)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kunlun.nn.attention import SeqAttention
from tests.kunlun.nn.backends import pallas_matches_xla


def rms(x):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6)


def silu(x):
  return x / (1.0 + np.exp(-x))


def np_rotary(x, age, t_scale=60.0):
  """Half-split RoPE: temporal angle on heads [0, ceil(H/2)), positional on the rest."""
  B, T, H, D = x.shape
  omega = 10000.0 ** (-2.0 * np.arange(D // 2) / D)
  out = np.empty_like(x)
  for h in range(H):
    pos = np.log1p(age / t_scale) if h < (H + 1) // 2 else np.broadcast_to(np.arange(T), (B, T))
    ang = pos[..., None] * omega
    x1, x2 = x[:, :, h, :D // 2], x[:, :, h, D // 2:]
    out[:, :, h] = np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang),
                                   x2 * np.cos(ang) + x1 * np.sin(ang)], -1)
  return out


NP_ACTS = {"silu": silu, "relu": lambda x: np.maximum(x, 0.0), "identity": lambda x: x,
           "relu2": lambda x: np.maximum(x, 0.0) ** 2}


def np_attention(p, s, lengths, age, kind, window=None, block=None, act="softmax", n=None,
                 score_clip=None):
  """Dense reference: explicit [T, T] masks per example, softmax or act(.)/n (``act`` a name or
  one name per head; ``score_clip`` clamps the GDPA scores first)."""
  s = s.astype(np.float64)
  B, T, d = s.shape
  w = p["qkv"]                                       # [d, 3, H, dh]
  H, dh = w.shape[2], w.shape[3]
  qkv = np.einsum("btd,dihc->btihc", rms(s), w)
  q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
  q, k = rms(q) * p["q_scale"], rms(k) * p["k_scale"]
  q, k = np_rotary(q, age), np_rotary(k, age)
  o = np.zeros_like(q)
  i = np.arange(T)
  for b in range(B):
    L = lengths[b]
    if kind == "full":
      m = np.ones((T, T), bool)
    elif kind == "swa":
      m = np.abs(i[:, None] - i[None, :]) <= window
    else:
      m = (i[:, None] // block) == (i[None, :] // block)
    m &= (i[None, :] < L)
    for h in range(H):
      sc = q[b, :, h] @ k[b, :, h].T / np.sqrt(dh)
      if act == "softmax":
        e = np.where(m, np.exp(sc - np.where(m, sc, -np.inf).max(-1, keepdims=True)), 0.0)
        pr = e / np.maximum(e.sum(-1, keepdims=True), 1e-30)
      else:
        a = NP_ACTS[act if isinstance(act, str) else act[h]]
        if score_clip:
          sc = np.clip(sc, -score_clip, score_clip)
        pr = np.where(m, a(sc), 0.0) / n
      o[b, :, h] = pr @ v[b, :, h]
  y = s + np.einsum("bthc,hcd->btd", o, p["out"])
  y[i[None, :] >= lengths[:, None]] = 0.0
  return y


def _setup(B=3, T=40, d=16, seed=0, lengths=(40, 23, 0)):
  rng = np.random.default_rng(seed)
  s = rng.normal(size=(B, T, d)).astype(np.float32)
  age = np.sort(rng.exponential(3600.0, (B, T)), 1)[:, ::-1].astype(np.float32)
  return s, np.array(lengths[:B], np.int32), age


def _init_perturbed(m, s, lengths, age, seed=1):
  """Init, then perturb the QK-norm scales so the test sees them."""
  v = nn.meta.unbox(jax.jit(m.init)(jax.random.key(seed), s, lengths, age))
  rng = np.random.default_rng(seed)
  p = jax.tree.map(np.asarray, v["params"])
  for n in ("q_scale", "k_scale"):
    p[n] = (1.0 + 0.3 * rng.normal(size=p[n].shape)).astype(np.float32)
  return {"params": p}


@pytest.mark.parametrize("kind,window,T", [("swa", 4, 60), ("swa", 20, 40), ("full", 0, 24),
                                           ("block", 0, 40)])
def test_softmax_attention_matches_dense(kind, window, T):
  s, lengths, age = _setup(T=T, lengths=(T, T - 17, 0))
  m = SeqAttention(4, kind, window=window, block_size=16)
  var = _init_perturbed(m, s, lengths, age)
  out = jax.jit(m.apply)(var, s, lengths, age)
  ref = np_attention(var["params"], s, lengths, age, kind, window, 16)
  np.testing.assert_allclose(np.asarray(out), ref, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("kind", ["swa", "full", "block"])
def test_gdpa_activation_attention(kind):
  s, lengths, age = _setup(T=32, lengths=(32, 9, 1))
  m = SeqAttention(2, kind, window=3, block_size=8, activation="silu")
  var = _init_perturbed(m, s, lengths, age)
  out = jax.jit(m.apply)(var, s, lengths, age)
  n = {"swa": 7, "full": 32, "block": 8}[kind]
  ref = np_attention(var["params"], s, lengths, age, kind, 3, 8, act="silu", n=n)
  np.testing.assert_allclose(np.asarray(out), ref, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("kind,act", [("swa", "softmax"), ("block", "softmax"), ("swa", "silu")])
def test_padding_invariance(kind, act):
  s, lengths, age = _setup(T=36, lengths=(36, 20, 5))
  m = SeqAttention(4, kind, window=5, block_size=16, activation=act, t_max=36)
  var = jax.jit(m.init)(jax.random.key(0), s, lengths, age)
  out = np.asarray(jax.jit(m.apply)(var, s, lengths, age))
  rng = np.random.default_rng(9)
  s_long = np.concatenate([s, 50 * rng.normal(size=(3, 20, 16)).astype(np.float32)], 1)
  s_long[2, 5:] = 7.0                                             # garbage in padded slots
  age_long = np.concatenate([age, rng.uniform(0, 1e6, (3, 20)).astype(np.float32)], 1)

  def loss(x):
    y = m.apply(var, x, lengths, age_long)
    return jnp.sum(jnp.sin(y)), y

  (_, out_long), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(s_long)
  out_long, g = np.asarray(out_long), np.asarray(g)
  valid = np.arange(56)[None, :] < lengths[:, None]
  np.testing.assert_allclose(out_long[:, :36][valid[:, :36]], out[valid[:, :36]],
                             rtol=1e-5, atol=1e-5)
  assert np.all(out_long[~valid] == 0)
  assert np.all(g[~valid] == 0) and np.abs(g[valid]).sum() > 0


def test_bf16_close_to_fp32(kind="swa"):
  s, lengths, age = _setup(B=2, T=64, d=64, lengths=(64, 30))
  f32 = SeqAttention(4, kind, window=8, block_size=16)
  var = jax.jit(f32.init)(jax.random.key(0), s, lengths, age)
  a = np.asarray(jax.jit(f32.apply)(var, s, lengths, age))
  b16 = SeqAttention(4, kind, window=8, block_size=16, dtype=jnp.bfloat16)
  b = np.asarray(jax.jit(b16.apply)(var, s, lengths, age))
  # stated tolerance: bf16 projections/scores inputs, f32 softmax and norms -> relative
  # error of the attention update below 3% (max) of the output scale, 1% on average
  err = np.abs(a - b)
  assert err.max() < 0.03 * np.abs(a).max() and err.mean() < 0.01 * np.abs(a).mean(), err.max()


def test_errors():
  s, lengths, age = _setup(T=8, lengths=(8, 4, 0))
  init = lambda m: jax.jit(m.init)(jax.random.key(0), s, lengths, age)
  with pytest.raises(ValueError, match="does not divide"):
    init(SeqAttention(3))
  with pytest.raises(ValueError, match="even head_dim"):
    init(SeqAttention(16))                                        # head_dim 1
  with pytest.raises(ValueError, match="kind"):
    init(SeqAttention(4, "local"))
  with pytest.raises(ValueError, match="activation"):
    init(SeqAttention(4, activation="tanh"))
  init(SeqAttention(16, rotary=False))                            # odd head_dim ok without RoPE


def test_per_head_gdpa_activations_and_score_clip():
  """A per-head activation tuple and score_clip (spec h-13) on the windowed GDPA path ("swa";
  "full" is the same call without window) and on block attention; scores after QK-norm are
  O(1), so a 0.5 clip is active. One parameter set serves every variant."""
  s, lengths, age = _setup(T=32, lengths=(32, 9, 1))
  acts = ("relu2", "silu", "identity", "relu")
  var = _init_perturbed(SeqAttention(4, activation=acts), s, lengths, age)
  for kind in ("swa", "block"):
    n = {"swa": 7, "block": 8}[kind]
    outs = {}
    for clip in (None, 0.5):
      m = SeqAttention(4, kind, window=3, block_size=8, activation=acts, score_clip=clip)
      outs[clip] = np.asarray(jax.jit(m.apply)(var, s, lengths, age))
      ref = np_attention(var["params"], s, lengths, age, kind, 3, 8, act=acts, n=n,
                         score_clip=clip)
      np.testing.assert_allclose(outs[clip], ref, rtol=2e-4, atol=2e-4, err_msg=kind)
    assert np.abs(outs[None] - outs[0.5]).max() > 1e-3, kind


@pytest.mark.parametrize("kind,window,T", [("swa", 5, 53), ("full", 0, 21)])
def test_softmax_kernel_backend_matches_xla(kind, window, T):
  """SeqAttention's softmax through the Pallas kernel (interpret mode) equals the banded XLA
  path, output and gradients (parameters and input), with ragged and empty examples."""
  s, lengths, age = _setup(T=T, lengths=(T, T - 17, 0))
  mods = {b: SeqAttention(4, kind, window=window, backend=b) for b in ("xla", "pallas")}
  var = _init_perturbed(mods["xla"], s, lengths, age)

  def run(m):
    loss = lambda v, x: jnp.sum(jnp.sin(m.apply(v, x, lengths, age)))
    return jax.jit(lambda v, x: (m.apply(v, x, lengths, age),
                                 jax.grad(loss, argnums=(0, 1))(v, x)))(var, s)

  (want, g_want), (got, g_got) = run(mods["xla"]), run(mods["pallas"])
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  flat = lambda g: jax.tree.leaves(g)
  for a, b in zip(flat(g_got), flat(g_want), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=2e-5)
  ref = np_attention(var["params"], s, lengths, age, kind, window)
  np.testing.assert_allclose(np.asarray(got), ref, rtol=2e-4, atol=2e-4)


def test_serving_request_rows_through_the_kernel():
  """The shared serving path (spec d.6): attention on a request-level sequence runs once per
  request (``rows.apply`` with ``PerRequest`` inputs); through the Pallas kernel it equals the
  XLA attention on the ad rows (request rows gathered by ``request_index``)."""
  from kunlun.nn import rows
  s, lengths, age = _setup(B=2, T=53, lengths=(53, 30))
  ri = np.array([1, 0, 1], np.int32)
  ker, ref = (SeqAttention(4, "swa", window=5, backend=b) for b in ("pallas", "xla"))
  var = _init_perturbed(ref, s, lengths, age)
  per = rows.PerRequest
  shared = jax.jit(lambda v: rows.apply(lambda *a: ker.apply(v, *a), ri, per(s), per(lengths),
                                        per(age)))(var)
  assert rows.is_shared(shared) and shared.value.shape == s.shape
  ads = jax.jit(lambda v: ref.apply(v, s[ri], lengths[ri], age[ri]))(var)
  np.testing.assert_allclose(np.asarray(rows.to_ads(shared, ri)), np.asarray(ads), rtol=1e-5,
                             atol=1e-5)


@pytest.mark.parametrize("lens,cap,dtype", [((37, 0, 21, 1), 64, jnp.float32),
                                            ((0, 64, 0), 64, jnp.float32),
                                            ((37, 0, 21, 1), 64, jnp.bfloat16)])
def test_packed_fused_input_matches_the_unfused_path(lens, cap, dtype):
  """A packed tower on the Pallas backend runs its input side as ``pallas_kernels.norm_qkv``'s
  kernels (interpret mode); output and gradients (parameters and tokens) equal the XLA
  backend's unfused path (float32: 1e-5; bfloat16: 2e-2 of the largest magnitude), with ragged
  lengths, empty histories and one example filling the capacity; float32 outputs at the real
  tokens equal the numpy reference of the padded layout."""
  from data.jagged import pack_events
  from kunlun.nn import packed
  from pallas_kernels.jagged import Jagged
  T = max(lens)
  s, lengths, age = _setup(B=len(lens), T=T, d=64, lengths=lens)
  toks, offsets, seg, pos, _ = pack_events({"s": s, "age": age}, lengths, cap)
  jag = Jagged(*(jnp.asarray(a) for a in (offsets, seg, pos)))
  x, a = jnp.asarray(toks["s"], dtype), jnp.asarray(toks["age"])
  mods = {b: SeqAttention(2, "swa", window=5, backend=b, dtype=dtype) for b in ("xla", "pallas")}
  var = _init_perturbed(mods["xla"], s, lengths, age)
  assert mods["pallas"]._fused_input(64) and not mods["xla"]._fused_input(64)
  g = jnp.asarray(np.random.default_rng(3).normal(size=x.shape), jnp.float32)
  got = pallas_matches_xla(mods, var, x, lambda m, v, x: m.apply(v, packed.Packed(x, jag), None,
                                                                  a).value, g, dtype)
  if dtype == jnp.float32:
    ref = np_attention(var["params"], s, lengths, age, "swa", 5)
    real = np.arange(T)[None, :] < np.asarray(lengths)[:, None]
    np.testing.assert_allclose(np.asarray(got)[:int(offsets[-1])], ref[real], rtol=2e-4,
                               atol=2e-4)
