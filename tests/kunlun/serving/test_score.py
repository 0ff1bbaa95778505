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
  for ev in req["events"].values():   # request 0: an empty history (ragged with request 1)
    for v in ev.values():
      v[0] = 0
  ads = random_batch(schema, N, seq_lens(cfg), seed=2)
  batch = score.serving_batch(req["events"], ads, RI)
  shapes = nn.meta.unbox(jax.eval_shape(model.init, jax.random.key(0),
                                        score.expand(batch))["params"])
  rng = np.random.default_rng(0)     # random everywhere (zero-initialised tables included)
  params = jax.tree.map(lambda s: (0.3 * rng.normal(size=s.shape)).astype(s.dtype), shapes)
  return cfg, schema, model, batch, params


@pytest.mark.parametrize("comp_skip,time_buckets,packed", [(True, False, False),
                                                          (False, True, True)])
def test_shared_path_equals_separate_examples(comp_skip, time_buckets, packed):
  """The shared path scores N ads as N separate examples do; with ``packed`` the requests'
  events (request 0 empty, request 1 ragged) also go packed (``pack_requests``) and score the
  same as padded."""
  cfg, schema, model, batch, params = _setup(comp_skip, time_buckets)
  shared = score.make_scorer(model, jit=False)

  def naive(p, b):                   # N separate examples (events repeated) through __call__
    return model.apply({"params": p}, b)

  f = jax.jit(lambda p, b, e, pev: (shared(p, b)["logits"], naive(p, e))   # one program
              + ((shared(p, dict(b, events=pev))["logits"],) if packed else ()))
  pev = score.pack_requests(batch["events"], 64) if packed else None
  got, want, *got_packed = (np.asarray(x) for x in f(params, batch, score.expand(batch), pev))
  assert got.shape == (N, 2) and np.abs(want).max() > 0.1
  assert np.abs(want[1] - want[0]).max() > 1e-3        # the ads differ
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  for g in got_packed:
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(g, got, rtol=1e-5, atol=1e-5)
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
  got2, _, *got2_packed = (np.asarray(x) for x in f(params, b2, score.expand(b2), pev))
  np.testing.assert_allclose(got2[j], got2[i], rtol=1e-5, atol=1e-6)
  assert np.abs(got2[0] - got[0]).max() > 1e-4          # ad 0 moved to the other request
  for g in got2_packed:
    np.testing.assert_allclose(g, got2, rtol=1e-5, atol=1e-5)

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
  if packed:      # the request-level modules ran on the packed tokens: [1, C, d] and R rows
    inter = jax.eval_shape(captured, params, dict(batch, events=pev))
    assert rows("embed_click") == 1 and inter["embed_click"]["__call__"][0].shape[1] == 64
    assert {p: rows(p) for p in plan["request"] if "embed" not in p} == {
        p: R for p in plan["request"] if "embed" not in p}
    assert {p: rows(p) for p in plan["ad"]} == {p: N for p in plan["ad"]}
    # expand() of the packed batch is the padded one (the naive form, unpacked)
    jax.tree.map(np.testing.assert_array_equal, score.expand(dict(batch, events=pev),
                                                             seq_lens(cfg)), score.expand(batch))


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


def _ragged_requests(schema, cfg, lengths):
  """Request events with the given per-request lengths in every stream (0: an empty history)."""
  req = random_batch(schema, len(lengths), seq_lens(cfg), seed=3, min_len=max(lengths))
  for ev in req["events"].values():
    T = ev["item"].shape[1]
    ev["length"] = np.asarray(lengths, np.int32)
    valid = np.arange(T)[None, :] < ev["length"][:, None]
    for k, v in ev.items():
      if k != "length":
        v[~valid] = 0
  return req


def test_packed_request_batch_errors():
  """Bad packed request batches are one-line ValueErrors naming the problem."""
  cfg, schema = tiny.get_config(), tiny_schema()
  lens = seq_lens(cfg)
  req = _ragged_requests(schema, cfg, [5, 0, 20])
  ads = random_batch(schema, N, lens, seed=2)
  ri = np.array([0, 1, 2, 1, 0], np.int32)
  good = score.serving_batch(score.pack_requests(req["events"], 64), ads, ri)
  score.check_batch(schema, good, lens)

  def err(events, *words, kept=lens):
    with pytest.raises(ValueError) as e:
      score.check_batch(schema, dict(good, events=dict(good["events"], click=events)), kept)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg
  ev = good["events"]["click"]
  assert ev["offsets"].tolist() == [0, 5, 5, 25]
  err(dict(ev, offsets=np.array([0, 5, 3, 25], np.int32)), "offsets", "monotone")
  err(dict(ev, offsets=np.array([1, 5, 5, 25], np.int32)), "offsets", "start at 0")
  err(dict(ev, offsets=np.array([0, 5, 25], np.int32)), "offsets has 3 entries", "R + 1 = 4")
  err(dict(ev, length=np.array([5, 0, 19], np.int32)), "length", "request 2")
  seg = ev["seg"].copy()
  seg[4] = 1                                   # the last token of request 0 given to request 1
  err(dict(ev, seg=seg), "seg / pos")
  pos = ev["pos"].copy()
  pos[6] = 0
  err(dict(ev, pos=pos), "seg / pos")
  short = {k: (v if k in ("offsets", "length") else v[:48]) for k, v in ev.items()}
  err(short, "capacity 48", "multiple of 64")
  err(dict(ev, item=ev["item"][:32]), "token fields", "[64]")
  err(ev, "request 2 has 20 events", "kept length 16", kept={"click": 16})
  with pytest.raises(ValueError, match=r"65 events, over the packed capacity 64"):
    score.pack_requests(_ragged_requests(schema, cfg, [32, 32, 1])["events"], 64)
  with pytest.raises(ValueError, match="multiple of 64"):
    score.pack_requests(req["events"], {"click": 100})
