"""Input stage: sparse pooling and hashing, dense tokens, LCE, event embeddings, context tokens."""

import flax.linen as nn
import jax
import numpy as np
import pytest

from data.fake import random_batch, tiny_schema
from data.schema import SparseFeature
from kunlun.nn import inputs
from kunlun.nn.inputs import LCE, ContextEncoder, DenseTokens, EventEmbed, SparseEmbed


def _np(v):
  return jax.tree.map(np.asarray, nn.meta.unbox(v)["params"])


def test_sparse_pooling_ignores_empty_slots_and_wraps_ids():
  feats = (SparseFeature("a", 7), SparseFeature("tags", 10, max_len=4, hashed=True))
  sparse = {"a": np.array([[3], [6], [0]], np.int32),
            "tags": np.array([[1, 5, -1, -1], [-1, -1, -1, -1], [12, 2, 9, 23]], np.int32)}
  m = SparseEmbed(feats, 4)
  v = jax.jit(m.init)(jax.random.key(0), sparse)
  p = _np(v)
  y = np.asarray(jax.jit(m.apply)(v, sparse))
  assert y.shape == (3, 2, 4)
  ta, tt = p["embedding_a"], p["embedding_tags"]
  np.testing.assert_allclose(y[:, 0], ta[[3, 6, 0]], rtol=1e-6)
  np.testing.assert_allclose(y[0, 1], (tt[1] + tt[5]) / 2, rtol=1e-6)        # mean over valid
  np.testing.assert_array_equal(y[1, 1], 0.0)                                 # all empty
  np.testing.assert_allclose(y[2, 1], (tt[2] + tt[2] + tt[9] + tt[3]) / 4, rtol=1e-5)  # % vocab
  assert v["params"]["embedding_tags"].names == ("table_rows", "table_dim")
  with pytest.raises(ValueError, match="tags"):
    m.apply(v, {"a": sparse["a"]})


def test_lookup_is_the_single_row_gather(monkeypatch):
  """Every table look-up goes through ``sharding.embedding.lookup_flat``, batched per group:
  EventEmbed's five tables of one width (item, action, surface, field, time) in one call."""
  calls = []
  se = inputs.sharded_embedding
  orig = se.lookup_flat
  monkeypatch.setattr(se, "lookup_flat",
                      lambda t, i, **kw: calls.append([x.shape for x in t]) or orig(t, i, **kw))
  sch = tiny_schema()
  b = random_batch(sch, 2, {"click": 8})
  m = EventEmbed(sch.streams[0], 3, 8)
  jax.jit(m.init)(jax.random.key(0), b["events"]["click"])
  assert calls == [[(500, 8), (3, 8), (3, 8), (20, 8), (32, 8)]]


def test_dense_tokens_per_example_and_formula():
  x = np.array([[0.0, 3.0, -2.0], [1e6, -0.5, 7.0]], np.float32)
  m = DenseTokens(2, 4)
  v = jax.jit(m.init)(jax.random.key(0), x)
  p = _np(v)
  rng = np.random.default_rng(0)
  p["scale"] = rng.normal(size=3).astype(np.float32)
  p["bias"] = rng.normal(size=3).astype(np.float32)
  apply = jax.jit(m.apply)
  y = np.asarray(apply({"params": p}, x))
  z = np.sign(x) * np.log1p(np.abs(x)) * p["scale"] + p["bias"]
  ref = (z @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"]).reshape(2, 2, 4)
  np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
  y0 = np.asarray(apply({"params": p}, x[:1]))                # no dependence on other examples
  np.testing.assert_allclose(y0[0], y[0], rtol=1e-5, atol=1e-6)


def test_lce_token_mix():
  x = np.random.default_rng(0).normal(size=(2, 5, 3)).astype(np.float32)
  m = LCE(2)
  v = jax.jit(m.init)(jax.random.key(0), x)
  np.testing.assert_allclose(np.asarray(jax.jit(m.apply)(v, x)),
                             np.einsum("bnd,nm->bmd", x, _np(v)["w"]), rtol=1e-5, atol=1e-6)


def test_event_embed_padding_zero_and_invariant():
  sch = tiny_schema()
  st = sch.streams[0]
  b = random_batch(sch, 3, {"click": 16}, seed=1)
  ev = dict(b["events"]["click"])
  ev["length"] = np.array([16, 7, 0], np.int32)
  m = EventEmbed(st, 3, 8, num_time_buckets=20)
  v = jax.jit(m.init)(jax.random.key(0), ev)
  y = np.asarray(jax.jit(m.apply)(v, ev))
  valid = np.arange(16)[None, :] < ev["length"][:, None]
  assert y.shape == (3, 16, 8) and np.all(y[~valid] == 0)
  assert np.abs(y[valid]).sum() > 0
  rng = np.random.default_rng(2)
  long = {k: np.concatenate([a, rng.integers(0, 3, (3, 8)).astype(a.dtype)], 1)
          for k, a in ev.items() if k != "length"}
  long["length"] = ev["length"]
  y_long = np.asarray(jax.jit(m.apply)(v, long))
  np.testing.assert_allclose(y_long[:, :16], y, rtol=1e-6)
  assert np.all(y_long[:, 16:] == 0)
  # the age bucket matters: events differing only in age embed differently
  ev2 = dict(ev, age=ev["age"] * 1000 + 5.0)
  assert np.abs(np.asarray(jax.jit(m.apply)(v, ev2))[valid] - y[valid]).max() > 1e-4
  with pytest.raises(ValueError, match="category"):
    m.apply(v, {k: a for k, a in ev.items() if k != "category"})


def test_context_encoder_surface_embedding():
  sch = tiny_schema()
  b = random_batch(sch, 3)
  m = ContextEncoder(sch.sparse, num_dense_tokens=2, num_tokens=5, dim=8, num_surfaces=3)
  v = jax.jit(m.init)(jax.random.key(0), b["sparse"], b["dense"], b["surface"])
  apply = jax.jit(m.apply)
  x = np.asarray(apply(v, b["sparse"], b["dense"], b["surface"]))
  assert x.shape == (3, 5, 8)
  surf = (b["surface"] + 1) % 3
  x2 = np.asarray(apply(v, b["sparse"], b["dense"], surf))
  tab = _np(v)["embedding_surface"]
  np.testing.assert_allclose(x2 - x, np.broadcast_to((tab[surf] - tab[b["surface"]])[:, None],
                                                     x.shape), rtol=1e-4, atol=1e-5)
