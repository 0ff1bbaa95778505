"""16-bit parameter copies in the optimizer state (``kunlun.train.param_copies``,
``optim.FlatAdamWState.copies``): which leaves get one, and a step that reads them trains bit for
bit like the step that casts the float32 leaves itself (dense and sparse paths, microbatches, a
skipped step, a checkpoint restore)."""

import functools

import flax.linen as nn
import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from data.fake import random_batch, tiny_schema
from kunlun.nn.inputs import EventEmbed
from kunlun.train import checkpoint, opt_layout, optim, param_copies, step
from kunlun.train.sparse_update import make_sparse_update
from tests.kunlun.train.test_step import _cfg, _Inputs

BF16 = jnp.dtype(jnp.bfloat16)


def test_copy_dtypes_takes_leaves_cast_once_outside_custom_rules():
  """Cast once (also inside a ``jit`` or a remat): a copy in that dtype. Cast twice, also read in
  float32, never cast, or cast inside a custom-derivative rule: none."""
  @jax.custom_vjp
  def custom(x, w):
    return x @ w.astype(jnp.bfloat16)
  custom.defvjp(lambda x, w: (custom(x, w), (x, w)),
                lambda r, g: (g @ r[1].astype(g.dtype).T, (r[0].T @ g).astype(r[1].dtype)))

  def f(p, x):
    a = x @ p["once"].astype(jnp.bfloat16)
    a = jax.jit(lambda a, w: a @ w.astype(jnp.bfloat16))(a, p["in_jit"])
    a = jax.checkpoint(lambda a, w: a @ w.astype(jnp.bfloat16))(a, p["in_remat"])
    a = a @ p["twice"].astype(jnp.bfloat16) + a @ p["twice"].astype(jnp.bfloat16)
    a = custom(a, p["custom"]) * p["mixed"].astype(jnp.bfloat16)[0, 0]
    return jnp.sum(a.astype(jnp.float32) * p["mixed"][0, 0] + p["f32"][0, 0]
                   + (x @ p["half"].astype(jnp.float16)).astype(jnp.float32))

  names = ("custom", "f32", "half", "in_jit", "in_remat", "mixed", "once", "twice")
  p = {k: jax.ShapeDtypeStruct((4, 4), jnp.float32) for k in names}
  x = jax.ShapeDtypeStruct((2, 4), jnp.bfloat16)
  got = dict(zip(names, param_copies.copy_dtypes(f, p, x), strict=True))
  assert got == {"custom": None, "f32": None, "half": jnp.dtype(jnp.float16), "in_jit": BF16,
                 "in_remat": BF16, "mixed": None, "once": BF16, "twice": None}
  # the bench's count follows custom rules and counts both sites
  uses = dict(zip(names, param_copies.cast_uses(f, p, x), strict=True))
  assert uses["custom"] == (BF16, 1) and uses["twice"] == (BF16, 2)


def test_packed_event_mlp_weights_get_copies():
  """A packed stream's EventEmbed on the event-MLP kernels in bfloat16 casts its two weight
  matrices before the kernels (which round them to bfloat16 anyway): each gets a copy. The
  biases, added in float32 inside the kernels, and the tables do not."""
  sch = tiny_schema()
  ev = random_batch(sch, 4, {"click": 16}, seed=2)["events"]["click"]
  m = EventEmbed(sch.streams[0], 3, 16, axes=EventEmbed.PACKED_AXES, backend="pallas",
                 dtype=jnp.bfloat16)
  p = nn.meta.unbox(jax.eval_shape(m.init, jax.random.key(0), ev))
  assert "event_mlp_fwd" in str(jax.make_jaxpr(m.apply)(p, ev))
  got = {jax.tree_util.keystr(k): d for (k, _), d in zip(
      jax.tree_util.tree_leaves_with_path(p), param_copies.copy_dtypes(m.apply, p, ev),
      strict=True)}
  assert [k for k, d in got.items() if d is not None] == [
      "['params']['mlp_in']['kernel']", "['params']['mlp_out']['kernel']"]
  assert got["['params']['mlp_in']['kernel']"] == BF16


def _model():
  """The context input stage and a bfloat16 linear head over float32 params."""
  return _Inputs(dtype="bfloat16")


@functools.cache
def _batches(n=3, B=16):
  return tuple(random_batch(tiny_schema(), B, {"click": 8, "impression": 6}, seed=20 + i,
                            min_len=1) for i in range(n))


@functools.cache
def _init():
  """Host params and the copies' dtypes of ``_model()``."""
  model, b = _model(), _batches()[0]
  p = jax.tree.map(np.asarray, nn.meta.unbox(jax.jit(lambda k: model.init(k, b)["params"])(
      jax.random.key(0))))
  dts = param_copies.copy_dtypes(
      lambda p, b: model.apply({"params": p}, b, train=True, rngs={"dropout": jax.random.key(0)}),
      p, b)
  return p, dts


def _run(copies: bool, sparse: bool, microbatches: int = 1, bad: int = -1, backend="xla"):
  """Params, optimizer state and stats after a step per test batch (batch ``bad`` poisoned);
  ``backend="pallas"``: the optimizer on ``pallas_kernels.adamw`` (interpret mode on CPU)."""
  p_host, dts = _init()
  tx = optim.make_optimizer(_cfg(), 10, copies=dts if copies else None, backend=backend)
  su = make_sparse_update(_cfg(), 10, backend=backend) if sparse else None
  f = step.make_train_step(_model(), tx, sparse_update=su, microbatches=microbatches)
  p = jax.device_put(p_host)
  o = jax.jit(tx.init)(p)
  stats = []
  for i, b in enumerate(_batches()):
    if i == bad:
      b = dict(b, dense=np.full_like(b["dense"], np.nan))
    p, o, s = f(p, o, b, jax.random.key(1), i)
    stats.append(jax.device_get(s))
  return p, o, stats


def _equal(a, b):
  a, b = jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)
  assert len(a) == len(b)
  for (k, x), y in zip(a, b, strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(k))


def _check_copies(p, o):
  """Each copy is its param cast now; the bfloat16 head's kernel and bias have one, the tables
  and the context stage's float32 leaves none."""
  copies = optim.state_copies(o)
  named = {jax.tree_util.keystr(k): c for (k, _), c in
           zip(jax.tree_util.tree_leaves_with_path(p), copies, strict=True)}
  assert [k for k in named if named[k] is not None] == ["['Dense_0']['bias']",
                                                       "['Dense_0']['kernel']"]
  for x, c in zip(jax.tree.leaves(p), copies, strict=True):
    if c is not None:
      assert c.dtype == BF16
      np.testing.assert_array_equal(np.asarray(c), np.asarray(x.astype(jnp.bfloat16)))


def test_dense_step_with_copies_trains_bit_for_bit_like_the_casting_step():
  """Three steps, the second skipped (non-finite input): params, moments and statistics equal the
  step without copies bit for bit; the copies follow the params."""
  p_c, o_c, s_c = _run(True, sparse=False, bad=1)
  p_n, o_n, s_n = _run(False, sparse=False, bad=1)
  assert [bool(s["ok"]) for s in s_c] == [True, False, True]
  _equal(p_c, p_n)
  d_c, d_n = (o.inner_states["dense"].inner_state for o in (o_c, o_n))
  _equal((d_c.count, d_c.mu, d_c.nu, o_c.inner_states["emb"]),
         (d_n.count, d_n.mu, d_n.nu, o_n.inner_states["emb"]))
  _equal(s_c, s_n)
  _check_copies(p_c, o_c)


def test_sparse_step_and_microbatches_with_copies_train_bit_for_bit():
  """The sparse embedding update, with 2 microbatches: the same, bit for bit."""
  p_c, o_c, s_c = _run(True, sparse=True, microbatches=2)
  p_n, o_n, s_n = _run(False, sparse=True, microbatches=2)
  _equal(p_c, p_n)
  _equal(s_c, s_n)
  _check_copies(p_c, o_c)


def test_restore_casts_the_copies_again(tmp_path):
  """Checkpoints store no copies; a restore into a state with copies casts them from the
  restored params, and the next step equals the uninterrupted one bit for bit."""
  p_host, dts = _init()
  tx = optim.make_optimizer(_cfg(), 10, copies=dts)
  f = step.make_train_step(_model(), tx)
  b0, b1, _ = _batches()
  p = jax.device_put(p_host)
  p, o, _ = f(p, jax.jit(tx.init)(p), b0, jax.random.key(1), 0)
  abstract = checkpoint.abstract_like(p), checkpoint.abstract_like(o)
  ck = checkpoint.Checkpointer(str(tmp_path / "ck"))
  it = lambda: iter(grain.MapDataset.range(4).to_iter_dataset())
  ck.save(1, p, o, jax.random.key(1), it())
  ck.wait()
  _, p2, o2, _ = ck.restore(*abstract, it())
  ck.close()
  _check_copies(p2, o2)
  want = f(p, o, b1, jax.random.key(1), 1)[:2]
  got = f(p2, o2, b1, jax.random.key(1), 1)[:2]
  _equal(got, want)


@pytest.mark.parametrize("sparse", [False, True])
def test_steps_on_the_optimizer_kernels_equal_the_xla_optimizer(sparse):
  """The optimizer on its kernels (``backend="pallas"``), handed the copies' bfloat16 gradients
  as they are: three steps, the second skipped, equal the XLA optimizer's (f32 1e-6: the same
  operations, fused apart; the global norm is a reassociated sum), copies included."""
  p_k, o_k, s_k = _run(True, sparse=sparse, bad=1, backend="pallas")
  groups = optim.make_optimizer(_cfg(), 10, backend="pallas").layout(p_k)[0].groups
  assert any(g.align > 1 for g in groups)
  p_x, o_x, s_x = _run(True, sparse=sparse, bad=1)
  assert [bool(s["ok"]) for s in s_k] == [True, False, True]
  close = lambda a, b: [np.testing.assert_allclose(np.asarray(x, np.float32),
                                                   np.asarray(y, np.float32), rtol=1e-6,
                                                   atol=1e-7)
                        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)]
  close(p_k, p_x)
  close(opt_layout.to_per_leaf(o_k, p_k), opt_layout.to_per_leaf(o_x, p_x))
  close([s["loss"] for s in s_k], [s["loss"] for s in s_x])
  _check_copies(p_k, o_k)
