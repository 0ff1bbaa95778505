"""SumKronLinear vs the explicit Kronecker form; HSP and PMA vs numpy; padding invariance."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kunlun.nn.hsp import HSP, PMA, SumKronLinear
from tests.kunlun.nn.backends import pallas_matches_xla


def rms(x):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6)


def fast_gelu(x):
  return 0.5 * x * (1.0 + np.tanh(0.7978845608 * (x + 0.044715 * x ** 3)))


def _params(v):
  return jax.tree.map(np.asarray, nn.meta.unbox(v)["params"])


@pytest.mark.parametrize("out_dim", [None, 3])
def test_sumkron_matches_kronecker_form(out_dim):
  B, n_in, d, n_out, r = 2, 6, 5, 4, 3
  h = np.random.default_rng(0).normal(size=(B, n_in, d)).astype(np.float32)
  m = SumKronLinear(n_out, r, out_dim)
  v = jax.jit(m.init)(jax.random.key(0), h)
  p = _params(v)
  z, w = p["Z"].astype(np.float64), p["W"].astype(np.float64)
  do = out_dim or d
  y = np.asarray(jax.jit(m.apply)(v, h))
  for b in range(B):
    big = sum(np.kron(z[i].T, w[i].T) for i in range(r))        # [n_out*do, n_in*d]
    ref = (big @ h[b].reshape(-1)).reshape(n_out, do)              # row-major vec
    np.testing.assert_allclose(y[b], ref, rtol=1e-4, atol=1e-5)
  assert v["params"]["Z"].names == (None, None, "seeds")


def np_hsp(p, s, lengths, t_max, acts=None, score_clip=None):
  """HSP in numpy; ``acts``: one activation function per head (default fast_gelu)."""
  B, T, d = s.shape
  e = p["seeds"]
  q = np.einsum("nd,dhc->nhc", rms(e), p["query"])
  k = np.einsum("btd,dhc->bthc", rms(s), p["key"])
  v = np.einsum("btd,dhc->bthc", rms(s), p["value"])
  H, dh = q.shape[1:]
  o = np.zeros((B, e.shape[0], H, dh))
  for b in range(B):
    for h in range(H):
      sc = q[:, h] @ k[b, :lengths[b], h].T / np.sqrt(dh)
      if score_clip:
        sc = np.clip(sc, -score_clip, score_clip)
      a = (acts[h] if acts else fast_gelu)(sc)
      o[b, :, h] = a @ v[b, :lengths[b], h] / t_max
  hs = rms(e + np.einsum("bnhc,hcd->bnd", o, p["out"]))
  z, w = p["kron"]["Z"], p["kron"]["W"]
  return sum(np.einsum("nm,bnd,de->bme", z[i], hs, w[i]) for i in range(z.shape[0]))


def _seq(B=3, T=12, d=8, seed=0):
  rng = np.random.default_rng(seed)
  return rng.normal(size=(B, T, d)).astype(np.float32), np.array([T, 5, 0][:B], np.int32)


def test_hsp_matches_numpy():
  s, lengths = _seq()
  m = HSP(n_seed=6, n_sum=3, heads=2, rank=2)
  v = jax.jit(m.init)(jax.random.key(0), s, lengths)
  y = np.asarray(jax.jit(m.apply)(v, s, lengths))
  assert y.shape == (3, 3, 8)
  np.testing.assert_allclose(y, np_hsp(_params(v), s, lengths, 12), rtol=1e-4, atol=1e-5)


def test_hsp_padding_invariance_and_gradients():
  s, lengths = _seq()
  m = HSP(n_seed=6, n_sum=3, heads=2, rank=2, out_dim=4, t_max=12)
  v = jax.jit(m.init)(jax.random.key(0), s, lengths)
  y = np.asarray(jax.jit(m.apply)(v, s, lengths))
  s_long = np.concatenate([s, 30 * np.ones((3, 8, 8), np.float32)], 1)
  s_long[1, 5:] = -40.0

  def loss(x):
    out = m.apply(v, x, lengths)
    return jnp.sum(out ** 2), out

  (_, y_long), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(s_long)
  np.testing.assert_allclose(np.asarray(y_long), y, rtol=1e-5, atol=1e-5)
  valid = np.arange(20)[None, :] < lengths[:, None]
  g = np.asarray(g)
  assert np.all(g[~valid] == 0) and np.abs(g[valid]).sum() > 0


@pytest.mark.parametrize("out_dim", [None, 5])
def test_pma_matches_numpy(out_dim):
  """Also the ``out_dim`` path (HSP->PMA ablation): the RMS-normalised pooled tokens times the
  ``final`` projection."""
  s, lengths = _seq()
  m = PMA(n_sum=3, heads=2, out_dim=out_dim)
  v = jax.jit(m.init)(jax.random.key(0), s, lengths)
  p = _params(v)
  y = np.asarray(jax.jit(m.apply)(v, s, lengths))
  e = p["queries"]
  q = np.einsum("nd,dhc->nhc", rms(e), p["query"])
  k = np.einsum("btd,dhc->bthc", rms(s), p["key"])
  vv = np.einsum("btd,dhc->bthc", rms(s), p["value"])
  o = np.zeros((3, 3, 2, 4))
  for b in range(3):
    for h in range(2):
      sc = q[:, h] @ k[b, :lengths[b], h].T / 2.0
      if lengths[b]:
        pr = np.exp(sc - sc.max(-1, keepdims=True))
        o[b, :, h] = (pr / pr.sum(-1, keepdims=True)) @ vv[b, :lengths[b], h]
  ref = e + np.einsum("bnhc,hcd->bnd", o, p["out"])
  if out_dim:
    assert y.shape == (3, 3, out_dim)
    ref = rms(ref) @ p["final"]
  np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5)


def test_errors():
  s, lengths = _seq()
  with pytest.raises(ValueError, match="does not divide"):
    HSP(6, 3, heads=3).init(jax.random.key(0), s, lengths)
  with pytest.raises(ValueError, match="unknown activation"):
    HSP(6, 3, heads=2, activation="soft").init(jax.random.key(0), s, lengths)
  with pytest.raises(ValueError, match="rank"):
    SumKronLinear(3, 0).init(jax.random.key(0), s)


def test_hsp_per_head_activations_and_score_clip():
  s, lengths = _seq(d=16, seed=2)
  acts = (lambda x: np.maximum(x, 0) ** 2, lambda x: x)
  m = HSP(n_seed=6, n_sum=3, heads=2, rank=2, activation=("relu2", "identity"), score_clip=0.5)
  v = jax.jit(m.init)(jax.random.key(1), s, lengths)
  p = _params(v)
  p["query"] = p["query"] * 30.0        # seeds start tiny (std 0.02): make the scores O(1)
  y = np.asarray(jax.jit(m.apply)({"params": p}, s, lengths))
  np.testing.assert_allclose(y, np_hsp(p, s, lengths, 12, acts, 0.5), rtol=1e-4, atol=1e-5)
  unclipped = np_hsp(p, s, lengths, 12, acts)
  assert np.abs(y - unclipped).max() > 1e-3


@pytest.mark.parametrize("lens,dtype", [((37, 0, 21, 1), jnp.float32), ((0, 64, 0), jnp.float32),
                                        ((37, 0, 21, 1), jnp.bfloat16)])
def test_packed_fused_keys_values_match_the_unfused_path(lens, dtype):
  """A packed tower's HSP on the Pallas backend computes its keys and values inside the pool's
  kernels (``pallas_kernels.jagged_pallas.jagged_gdpa_pool_proj_pallas``, interpret mode; no
  ``norm_proj`` kernel in the forward): summaries and gradients (parameters and tokens) equal the
  XLA backend's (float32: 1e-5; bfloat16: 2e-2 of the largest magnitude), with ragged lengths,
  empty histories and one example filling the capacity 64; float32 summaries equal the numpy
  HSP of the padded layout."""
  from data.jagged import pack_events
  from kunlun.nn import packed
  from pallas_kernels.jagged import Jagged
  T = max(lens)
  s = np.random.default_rng(4).normal(size=(len(lens), T, 64)).astype(np.float32)
  lengths = np.array(lens, np.int32)
  toks, offsets, seg, pos, _ = pack_events({"s": s}, lengths, 64)
  jag = Jagged(*(jnp.asarray(a) for a in (offsets, seg, pos)))
  x = jnp.asarray(toks["s"], dtype)
  mods = {b: HSP(n_seed=16, n_sum=4, heads=2, rank=2, backend=b, t_max=T, dtype=dtype)
          for b in ("xla", "pallas")}
  v = jax.jit(mods["xla"].init)(jax.random.key(0), packed.Packed(x, jag), None)
  fwd = str(jax.make_jaxpr(lambda v, x: mods["pallas"].apply(v, packed.Packed(x, jag), None))(
      v, x))
  assert "jagged_gdpa_pool" in fwd and "norm_proj" not in fwd
  g = jnp.asarray(np.random.default_rng(5).normal(size=(len(lens), 4, 64)), jnp.float32)
  got = pallas_matches_xla(mods, v, x, lambda m, v, x: m.apply(v, packed.Packed(x, jag), None),
                           g, dtype)
  if dtype == jnp.float32:
    np.testing.assert_allclose(np.asarray(got), np_hsp(_params(v), s, lengths, T), rtol=1e-4,
                               atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_seed_side_kernel_matches_the_xla_path(dtype):
  """HSP's seed side on the Pallas backend, the seeds' queries as ``pallas_kernels.seed_query``
  and ``rms_norm(e + o W_o)`` then ``SumKronLinear``'s first product as
  ``pallas_kernels.seed_kron`` (interpret mode; 32 seeds, 8 summaries of rank 2, width 64), on a
  packed tower with ragged and empty histories: summaries and gradients (parameters and tokens)
  equal the XLA backend's (float32: 1e-5; bfloat16: 2e-2)."""
  from data.jagged import pack_events
  from kunlun.nn import packed
  from pallas_kernels import seed_kron
  from pallas_kernels.jagged import Jagged
  lens = (37, 0, 21, 1, 64)
  s = np.random.default_rng(6).normal(size=(len(lens), 64, 64)).astype(np.float32)
  toks, offsets, seg, pos, _ = pack_events({"s": s}, np.array(lens, np.int32), 64)
  jag = Jagged(*(jnp.asarray(a) for a in (offsets, seg, pos)))
  x = jnp.asarray(toks["s"], dtype)
  mods = {b: HSP(n_seed=32, n_sum=8, heads=2, rank=2, backend=b, t_max=64, dtype=dtype)
          for b in ("xla", "pallas")}
  assert seed_kron.supported(32, 2, 8, 64)
  apply = lambda m, v, x: m.apply(v, packed.Packed(x, jag), None)
  v = jax.jit(mods["xla"].init)(jax.random.key(1), packed.Packed(x, jag), None)
  fwd = str(jax.make_jaxpr(lambda v, x: apply(mods["pallas"], v, x))(v, x))
  assert "seed_kron" in fwd and "seed_query_fwd" in fwd
  g = jnp.asarray(np.random.default_rng(7).normal(size=(len(lens), 8, 64)), jnp.float32)
  pallas_matches_xla(mods, v, x, apply, g, dtype)


def test_batched_mixes_equal_the_unbatched(monkeypatch):
  """The GPU's forms of the token-axis mixes (``kunlun.nn.fused.batched_mixes``: SumKronLinear's
  seed contraction, Wukong's X^T Y, LCB, residual and cross-layer maps) give the CPU forms'
  values and gradients (float32, 1e-5 relative, of the largest element for gradients): HSP and
  a cross-layer MoWE."""
  from kunlun.nn import fused, hsp, wukong
  from kunlun.nn.mowe import MoWE
  s, lengths = _seq(T=12, d=8)
  x = np.random.default_rng(2).normal(size=(3, 10, 8)).astype(np.float32)
  cases = [(HSP(n_seed=6, n_sum=3, heads=2, rank=2), (s, lengths)),
           (MoWE(2, 2, 6, 3, 16, cross_layer=True), (x,))]
  def run(m, args):
    v = jax.jit(m.init)(jax.random.key(0), *args)
    loss = lambda v, a: jnp.sum(jnp.sin(m.apply(v, a, *args[1:])))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(v, args[0])

  for m, args in cases:
    out = {}
    for batched in (False, True):
      for mod in (fused, hsp, wukong):
        monkeypatch.setattr(mod, "batched_mixes", lambda b=batched: b, raising=False)
      out[batched] = run(m, args)
    (a, ga), (b, gb) = out[False], out[True]
    np.testing.assert_allclose(float(a), float(b), rtol=1e-5)
    for u, w in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
      w = np.asarray(w)        # summed in another order: 1e-5 of the array's largest element
      np.testing.assert_allclose(np.asarray(u), w, rtol=1e-5, atol=1e-5 * np.abs(w).max())
