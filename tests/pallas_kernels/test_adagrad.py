"""pallas_kernels.adagrad (interpret mode on CPU) against its XLA twin and a float64 numpy
row-wise Adagrad; the optimizer's tables on the kernel against its XLA update."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _poison
from pallas_kernels import adagrad as A
from tests.pallas_kernels.deviceless import twin_jit

LR = 0.05
# three tables of one width sharing a gradient source (a small group's table-shaped gradient, each
# a range of its rows), a wide table alone, a width that is no power of two, a width under the
# smallest tile and rows across several programs with a ragged last one
GROUP = [(3, 32), (2, 32), (32, 32)]
ALONE = [(100, 128), (50, 24), (1030, 8), (1, 16)]


def _case(seed):
  rng = np.random.default_rng(seed)
  group_g = rng.normal(size=(sum(v for v, _ in GROUP), 32)).astype(np.float32)
  gs = [group_g] + [rng.normal(size=s).astype(np.float32) for s in ALONE]
  leaves, r0 = [], 0
  for v, _ in GROUP:
    leaves.append((0, r0))
    r0 += v
  leaves += [(1 + i, 0) for i in range(len(ALONE))]
  shapes = GROUP + ALONE
  ps = [rng.normal(size=s).astype(np.float32) for s in shapes]
  accs = [rng.uniform(0.0, 2.0, size=s[:1]).astype(np.float32) for s in shapes]
  sq = [i % 2 == 0 for i in range(len(shapes))]
  return gs, leaves, ps, accs, sq


def _numpy(gs, leaves, ps, accs, sq):
  new_p, new_a, total = [], [], 0.0
  for (k, r0), p, a, s in zip(leaves, ps, accs, sq, strict=True):
    g = np.asarray(gs[k][r0:r0 + p.shape[0]], np.float64)
    a = np.asarray(a, np.float64) + np.mean(g * g, axis=1)
    new_p.append(np.asarray(p, np.float64) - LR * g / (np.sqrt(a)[:, None] + A.EPS))
    new_a.append(a)
    total += float(np.sum(g * g)) if s else 0.0
  return new_p, new_a, total


def test_kernel_matches_the_twin_and_numpy():
  """Every table's new values and accumulator (f32, 1e-6) and the squares' sum over the tables
  ``sq`` names, from the kernel (NaN-filled outputs: a row it skips stays NaN) and the twin."""
  gs, leaves, ps, accs, sq = _case(0)
  args = ([jnp.asarray(g) for g in gs], [jnp.asarray(p) for p in ps],
          [jnp.asarray(a) for a in accs])
  with _poison.poison_outputs():
    got = jax.jit(lambda g, p, a: A.rowwise_adagrad_pallas(g, leaves, p, a, lr=LR, sq=sq,
                                                           interpret=True))(*args)
  twin = twin_jit(lambda g, p, a: A.rowwise_adagrad_xla(g, leaves, p, a, lr=LR, sq=sq),
                  jnp.float32)(*args)
  want_p, want_a, want_sq = _numpy(gs, leaves, ps, accs, sq)
  for res in (got, twin):
    for i, (wp, wa) in enumerate(zip(want_p, want_a, strict=True)):
      assert res[0][i].shape == ps[i].shape and res[0][i].dtype == jnp.float32
      np.testing.assert_allclose(np.asarray(res[0][i]), wp, rtol=1e-6, atol=1e-7)
      np.testing.assert_allclose(np.asarray(res[1][i]), wa, rtol=1e-6)
    np.testing.assert_allclose(float(res[2]), want_sq, rtol=1e-5)


def test_without_squares_there_is_no_partial_output():
  """``sq`` None: the sum is zero and the tables the same as with it."""
  gs, leaves, ps, accs, sq = _case(1)
  run = lambda s: A.rowwise_adagrad_pallas([jnp.asarray(g) for g in gs], leaves,
                                           [jnp.asarray(p) for p in ps],
                                           [jnp.asarray(a) for a in accs], lr=LR, sq=s,
                                           interpret=True)
  a, b = run(None), run(sq)
  assert float(a[2]) == 0.0 and float(b[2]) > 0.0
  for x, y in zip(jax.tree.leaves(a[:2]), jax.tree.leaves(b[:2]), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("bad", ["rows", "source", "width", "acc", "unread"])
def test_bad_layout_is_a_one_line_error(bad):
  g = [jnp.zeros((10, 32))]
  leaves, ps, accs = [(0, 0)], [jnp.zeros((10, 32))], [jnp.zeros((10,))]
  if bad == "rows":
    leaves = [(0, 5)]
  elif bad == "source":
    leaves = [(1, 0)]
  elif bad == "width":
    ps = [jnp.zeros((10, 16))]
  elif bad == "acc":
    accs = [jnp.zeros((9,))]
  else:
    g = g + [jnp.zeros((4, 32))]
  with pytest.raises(ValueError, match="rowwise_adagrad") as e:
    A.rowwise_adagrad_pallas(g, leaves, ps, accs, lr=LR, interpret=True)
  assert "\n" not in str(e.value)
