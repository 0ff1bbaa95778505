"""pallas_kernels.adamw (interpret mode on CPU) against its XLA twin and a float64 numpy AdamW;
the optimizer on its kernels against the XLA optimizer, and its state through a checkpoint."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from kunlun.train import opt_layout, optim
from pallas_kernels import _poison
from pallas_kernels import adamw as A
from tests.pallas_kernels.deviceless import twin_jit

# sizes below, at and across the block; one leaf exactly two blocks
SHAPES = [(3,), (40, 33), (2, 5, 7), (A.BLOCK,), (1500,), (2 * A.BLOCK // 4, 4), (300, 9)]
HYPER = A.Hyper(b1=0.9, b2=0.999, wd=0.1, clip=1.0)


def _leaves(seed):
  rng = np.random.default_rng(seed)
  gs = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
  ps = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
  mus = [(0.1 * rng.normal(size=s)).astype(np.float32) for s in SHAPES]
  nus = [(0.1 * rng.uniform(size=s)).astype(np.float32) for s in SHAPES]
  return gs, ps, mus, nus


def _numpy(g, p, mu, nu, norm, bc1, bc2, lr, trigger):
  g, p, mu, nu = (np.asarray(x, np.float64) for x in (g, p, mu, nu))
  g = g if trigger else g / norm * HYPER.clip
  mu = (1 - HYPER.b1) * g + HYPER.b1 * mu
  nu = (1 - HYPER.b2) * g * g + HYPER.b2 * nu
  u = (mu / bc1) / (np.sqrt(nu / bc2) + A.EPS)
  if p.ndim >= 2:
    u = u + HYPER.wd * p
  return p - lr * u, mu, nu


@pytest.mark.parametrize("trigger", [1.0, 0.0])
def test_kernel_matches_the_twin_and_numpy(trigger):
  """Every leaf's new value (f32 1e-6), its bfloat16 copy where asked, and the moments in the
  aligned buffer (zero between the leaves); clipped (trigger 0) and not."""
  gs, ps, mus, nus = _leaves(0)
  sc = np.asarray([3.0, 0.1, 0.002, 0.01, trigger], np.float32)
  cds = [jnp.bfloat16 if i % 2 else None for i in range(len(SHAPES))]
  pack = jax.jit(A.pack)
  args = ([jnp.asarray(x) for x in gs], [jnp.asarray(x) for x in ps],
          pack([jnp.asarray(x) for x in mus]), pack([jnp.asarray(x) for x in nus]),
          jnp.asarray(sc))
  kernel = lambda: jax.jit(lambda *a: A.adamw_pallas(*a, hyper=HYPER, copy_dtypes=cds,
                                                       interpret=True))
  with _poison.poison_outputs():              # an element the kernel does not write stays NaN
    got = kernel()(*args)
  twin = twin_jit(lambda *a: A.adamw_xla(*a, hyper=HYPER, copy_dtypes=cds), jnp.float32)(*args)
  offs, L = A.offsets([g.size for g in gs])
  want_mu, want_nu = np.zeros(L), np.zeros(L)
  for i, (g, p, mu, nu) in enumerate(zip(gs, ps, mus, nus, strict=True)):
    wp, wm, wn = _numpy(g, p, mu, nu, *sc)
    for res in (got, twin):
      np.testing.assert_allclose(np.asarray(res[0][i]), wp, rtol=1e-6, atol=1e-7)
      assert res[0][i].shape == p.shape and res[0][i].dtype == jnp.float32
      if cds[i] is None:
        assert res[1][i] is None
      else:
        assert res[1][i].dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(res[1][i]),
                                      np.asarray(res[0][i].astype(jnp.bfloat16)))
    want_mu[offs[i]:offs[i] + g.size], want_nu[offs[i]:offs[i] + g.size] = wm.ravel(), wn.ravel()
  for res in (got, twin):
    np.testing.assert_allclose(np.asarray(res[2]), want_mu, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(res[3]), want_nu, rtol=1e-6, atol=1e-12)
  # bfloat16 gradients (a 16-bit copy's, as the train step hands them over) are widened exactly
  g16 = [g.astype(jnp.bfloat16) for g in args[0]]
  plain = kernel()                            # traced here: not poisoned (the switch is read
  a = plain(g16, *args[1:])                   # when a kernel is traced)
  b = plain([g.astype(jnp.float32) for g in g16], *args[1:])
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  with _poison.poison_outputs():
    sq = jax.jit(lambda gs: A.sq_norm_pallas(gs, interpret=True))(args[0])
  want = sum(np.sum(np.asarray(g, np.float64) ** 2) for g in gs)
  sq_xla = twin_jit(A.sq_norm_xla, jnp.float32)(args[0])
  np.testing.assert_allclose([float(sq), float(sq_xla)], [want, want], rtol=1e-6)


def test_bad_shapes_are_one_line_errors():
  gs, ps, mus, _ = _leaves(1)
  gs, ps = [jnp.asarray(x) for x in gs], [jnp.asarray(x) for x in ps]
  mu = A.pack([jnp.asarray(x) for x in mus])
  sc = jnp.zeros(5)
  with pytest.raises(ValueError, match=r"moments must be f32\[\d+\]"):
    A.adamw_pallas(gs, ps, mu[:-1], mu, sc, hyper=HYPER, interpret=True)
  with pytest.raises(ValueError, match="every value needs its gradient"):
    A.adamw_pallas(gs, ps[:-1], mu, mu, sc, hyper=HYPER, interpret=True)
  with pytest.raises(ValueError, match="no leaves"):
    A.sq_norm_pallas([], interpret=True)


def _cfg():
  return ml_collections.ConfigDict(dict(lr=1e-2, warmup_steps=1, schedule="constant",
                                        weight_decay=0.1, b1=0.9, b2=0.999, clip_norm=2.0,
                                        emb_lr=0.05))


def _params(n, seed=0):
  """``n`` blocks of a kernel, a bias and a scale (3 n dense leaves) and one table."""
  rng = np.random.default_rng(seed)
  a = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  p = {f"b{i:03d}": {"kernel": a(7, 3 + i % 5), "bias": a(3 + i % 5), "scale": a()}
       for i in range(n)}
  p["SparseEmbed_0"] = {"ad_embedding": a(16, 4)}
  return p


def test_the_optimizer_on_its_kernels_equals_the_xla_one(monkeypatch):
  """``backend="pallas"`` (kernels in interpret mode on CPU; 18 dense leaves in groups of at
  most 8 here) and ``"auto"`` on a CPU (XLA's update on the kernels' layout): three steps, clipped and not, with bfloat16 copies of the kernels' leaves, equal
  the XLA optimizer's params, moments, copies and accumulators (f32 1e-6; the global norm is a
  reassociated sum); its state goes through the stored per-leaf layout and back unchanged."""
  monkeypatch.setattr(optim, "KERNEL_MEMBERS", 8)
  params = _params(6)
  labels = jax.tree.leaves(optim.param_labels(params))
  copies = [jnp.bfloat16 if x.ndim == 2 and lab == "dense" else None
            for x, lab in zip(jax.tree.leaves(params), labels, strict=True)]
  txs = {b: optim.make_optimizer(_cfg(), 100, copies=copies, backend=b)
         for b in ("xla", "pallas", "auto")}        # auto on a CPU: XLA's update, kernel layout
  layout, _ = txs["pallas"].layout(params)
  assert [len(g.members) for g in layout.groups] == [8, 8, 2]
  assert all(g.align == A.BLOCK and g.size == len(g.members) * A.BLOCK for g in layout.groups)
  assert all(m.offset % A.BLOCK == 0 for g in layout.groups for m in g.members)
  states = {b: jax.jit(tx.init)(params) for b, tx in txs.items()}
  steps = {b: jax.jit(lambda g, s, p, tx=tx: tx.step(tx.prepare(g, p), g, s, p))
           for b, tx in txs.items()}                # traced once each, not once a step
  ps = dict.fromkeys(txs, params)
  rng = np.random.default_rng(3)
  for t in range(3):
    grads = jax.tree.map(lambda x, t=t: jnp.asarray(rng.normal(size=x.shape) * (0.02 + 2 * t),
                                                    jnp.float32), params)
    for b in txs:
      ps[b], states[b] = steps[b](grads, states[b], ps[b])
  assert not txs["auto"].kernels() and txs["pallas"].kernels()
  for b in ("pallas", "auto"):
    for a, c in zip(jax.tree.leaves(ps[b]), jax.tree.leaves(ps["xla"]), strict=True):
      np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-6, atol=1e-7)
  per_leaf = {b: opt_layout.to_per_leaf(s, ps[b]) for b, s in states.items()}
  for a, c in zip(jax.tree.leaves(per_leaf["pallas"]), jax.tree.leaves(per_leaf["xla"]),
                  strict=True):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(c, np.float32),
                               rtol=1e-5, atol=1e-7)   # the first moment: float32 cancellation
  copied = [c for c in optim.state_copies(states["pallas"]) if c is not None]
  assert len(copied) == 6 and all(c.dtype == jnp.bfloat16 for c in copied)
  back = opt_layout.from_per_leaf(per_leaf["pallas"], ps["pallas"], states["pallas"])
  for a, c in zip(jax.tree.leaves(back), jax.tree.leaves(states["pallas"]), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
  # the optax protocol: params + updates is the step
  g = jax.tree.map(jnp.ones_like, params)
  upd, _ = jax.jit(txs["pallas"].update)(g, states["pallas"], ps["pallas"])
  new, _ = steps["pallas"](g, states["pallas"], ps["pallas"])
  applied = jax.jit(optax.apply_updates)(ps["pallas"], upd)
  for a, c in zip(jax.tree.leaves(applied), jax.tree.leaves(new), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-6, atol=1e-7)
