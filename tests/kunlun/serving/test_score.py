"""Shared serving path (spec d.6): N ads of R requests through the shared path equal N separate
examples through the normal model; request-level modules really run on request rows."""

import flax.linen as nn
import jax
import numpy as np
import pytest

from data.fake import random_batch, tiny_schema
from kunlun.configs import tiny
from kunlun.configs.types import seq_lens
from kunlun.models.build import build_model
from kunlun.models.flops import event_embed_flops, model_flops, pooling_flops
from kunlun.serving import score

R, N = 2, 5
RI = np.array([1, 0, 1, 1, 0], np.int32)


def _setup(comp_skip, time_buckets):
  cfg = tiny.get_config()
  cfg.model.comp_skip = comp_skip
  cfg.model.time_buckets.enabled = time_buckets
  cfg.model.time_buckets.kinds = "age,log_age,gap,position"
  schema = tiny_schema()
  model = build_model(cfg, schema)
  req = random_batch(schema, R, seq_lens(cfg), seed=1, min_len=1)
  ads = random_batch(schema, N, seq_lens(cfg), seed=2)
  batch = score.serving_batch(req["events"], ads, RI)
  shapes = nn.meta.unbox(jax.eval_shape(model.init, jax.random.key(0),
                                        score.expand(batch))["params"])
  rng = np.random.default_rng(0)     # random everywhere (zero-initialised tables included)
  params = jax.tree.map(lambda s: (0.3 * rng.normal(size=s.shape)).astype(s.dtype), shapes)
  return cfg, schema, model, batch, params


@pytest.mark.parametrize("comp_skip,time_buckets", [(True, False), (False, True)])
def test_shared_path_equals_separate_examples(comp_skip, time_buckets):
  cfg, schema, model, batch, params = _setup(comp_skip, time_buckets)
  shared = score.make_scorer(model, jit=False)

  def naive(p, b):                   # N separate examples (events repeated) through __call__
    return model.apply({"params": p}, b)

  f = jax.jit(lambda p, b, e: (shared(p, b)["logits"], naive(p, e)))
  got, want = f(params, batch, score.expand(batch))
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == (N, 2) and np.abs(want).max() > 0.1
  assert np.abs(want[1] - want[0]).max() > 1e-3        # the ads differ
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  # two ads of the same request with the same context score the same; request matters
  i, j = 2, 3                       # both of request 1; ad 0 moves from request 1 to 0
  b2 = jax.tree.map(lambda x: x, batch)
  for k in ("dense", "surface"):
    b2[k] = np.asarray(b2[k]).copy()
    b2[k][j] = b2[k][i]
  b2["sparse"] = {n: v.copy() for n, v in batch["sparse"].items()}
  for v in b2["sparse"].values():
    v[j] = v[i]
  b2["request_index"] = RI.copy()
  b2["request_index"][0] = 1 - RI[0]
  got2, _ = f(params, b2, score.expand(b2))
  got2 = np.asarray(got2)
  np.testing.assert_allclose(got2[j], got2[i], rtol=1e-5, atol=1e-6)
  assert np.abs(got2[0] - got[0]).max() > 1e-4          # ad 0 moved to the other request

  # the sharing plan is what runs: request-level module outputs have R rows, the others N
  def captured(p, b):
    return model.apply({"params": p}, {k: b[k] for k in score.AD_KEYS + ("events",)},
                       method="representations", request_index=b["request_index"],
                       capture_intermediates=True, mutable=["intermediates"])[1]["intermediates"]
  inter = jax.eval_shape(captured, params, batch)
  plan = score.sharing_plan(model.cfg)

  def rows(path):
    node = inter
    for k in path.split("/"):
      node = node[k]
    out = node["__call__"][0]
    return jax.tree.leaves(out)[0].shape[0]
  assert {p: rows(p) for p in plan["request"]} == {p: R for p in plan["request"]}
  assert {p: rows(p) for p in plan["ad"]} == {p: N for p in plan["ad"]}
  assert "layer_0/click_hsp" in plan["request"] and "embed_click" in plan["request"]
  assert not any("attention" in p for p in plan["request"])   # every SWA follows a PFFN


def test_flops_split_and_batch_checks():
  cfg, schema = tiny.get_config(), tiny_schema()
  split = score.flops_split(cfg, schema)
  m = build_model(cfg, schema).cfg
  per = model_flops(cfg, schema)["per_module"]
  want_req = (sum(event_embed_flops(schema.stream(t.name), t.kept_len, t.width) for t in m.towers)
              + sum(pooling_flops(m, t) for t in m.towers))    # layer-0 HSP of every tower
  assert split["request"] == pytest.approx(want_req)
  assert split["request"] == pytest.approx(per["event_embed"] + sum(pooling_flops(m, t)
                                                                    for t in m.towers))
  assert split["total"] == pytest.approx(split["request"] + split["ad"]) and split["ad"] > 0

  req = random_batch(schema, R, seq_lens(cfg), seed=1)
  ads = random_batch(schema, N, seq_lens(cfg), seed=2)
  b = score.serving_batch(req["events"], ads, RI)
  score.check_batch(schema, b)
  e = score.expand(b)
  np.testing.assert_array_equal(e["events"]["click"]["item"], req["events"]["click"]["item"][RI])
  bad = dict(b, request_index=np.array([0, 1, 2, 0, 0], np.int32))
  with pytest.raises(ValueError, match=r"request_index must lie in \[0, 2\)"):
    score.check_batch(schema, bad)
  with pytest.raises(ValueError, match="dense has 4 rows"):
    score.check_batch(schema, dict(b, dense=b["dense"][:4]))
  with pytest.raises(ValueError, match="lacks"):
    score.check_batch(schema, {k: v for k, v in b.items() if k != "events"})


def test_negative_request_index_is_rejected():
  """An ad pointing at request -1 would be scored against another request's events (a gather
  wraps around): check_batch refuses it, as it refuses one past the last request."""
  cfg, schema = tiny.get_config(), tiny_schema()
  req = random_batch(schema, R, seq_lens(cfg), seed=1)
  ads = random_batch(schema, N, seq_lens(cfg), seed=2)
  b = score.serving_batch(req["events"], ads, RI)
  score.check_batch(schema, b)
  for bad in ([0, -1, 1, 1, 0], [-3, 0, 0, 0, 0]):
    with pytest.raises(ValueError, match=r"request_index must lie in \[0, 2\)"):
      score.check_batch(schema, dict(b, request_index=np.array(bad, np.int32)))


def test_naive_path_and_models_that_cannot_share():
  """``shared=False`` scores N separate examples: equal to the model on ``expand(batch)`` and to
  the shared path. A model adding inputs through ``extra_inputs`` (LoopFM) is not shared (the
  shared path does not feed those inputs): its scorer takes the naive path and matches the
  model's own output."""
  from kunlun.transfer import loopfm
  cfg, schema, model, batch, params = _setup(True, False)
  naive = score.make_scorer(model, shared=False)(params, batch)["logits"]
  shared = score.make_scorer(model)(params, batch)["logits"]
  want = jax.jit(model.apply)({"params": params}, score.expand(batch))   # 4x less CPU than eager
  np.testing.assert_allclose(np.asarray(naive), np.asarray(want), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(shared), np.asarray(want), rtol=1e-5, atol=1e-5)
  fm = loopfm.build_loopfm(cfg, schema, use_ctx=False, use_events=False)
  assert score.supports_sharing(model) and not score.supports_sharing(fm)
  got = score.make_scorer(fm)(params, batch)                   # same parameter tree as Kunlun
  np.testing.assert_allclose(np.asarray(got["logits"]),
                             np.asarray(jax.jit(fm.apply)({"params": params}, score.expand(batch))),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(got["prob"]), 1 / (1 + np.exp(-np.asarray(want))),
                             rtol=1e-5, atol=1e-6)
