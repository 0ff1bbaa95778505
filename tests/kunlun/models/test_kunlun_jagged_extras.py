"""Packed (jagged) towers with PMA pooling, LoopFM inputs and OneSeq equal the padded model on the
same batch (ragged lengths, empty histories) and parameters; PMA's jagged softmax pool against a
float64 numpy loop and the padded reference's gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from data.fake import tiny_schema
from data.jagged import pack_blocks, pack_events
from kunlun.configs import vm_tiny
from kunlun.models.build import build_model
from kunlun.nn import oneseq
from kunlun.nn.packed import Packed
from kunlun.transfer import loopfm
from kunlun.transfer.experiment import FMFeatures
from kunlun.transfer.join import EmbeddingLog, event_times
from pallas_kernels import jagged, reference
from pallas_kernels.jagged import Jagged
from tests.kunlun.models.test_kunlun_jagged import loss_and_grad, make, packed_batch
from tests.kunlun.nn.test_oneseq import reference_merge
from tests.kunlun.transfer.test_loopfm import D_FM, _random_params

LENS = np.array([5, 0, 17, 1, 9])            # one empty history; 32 tokens at capacity 40
T, H, D, S = 17, 2, 4, 3


def _np_softmax_pool(q, k, v, offsets):
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  out = np.zeros((len(offsets) - 1,) + q.shape)
  for b in range(len(offsets) - 1):
    for h in range(H):
      kb, vb = k[offsets[b]:offsets[b + 1], h], v[offsets[b]:offsets[b + 1], h]
      if len(kb):                             # an empty history pools to 0
        z = q[:, h] @ kb.T * D ** -0.5
        p = np.exp(z - z.max(-1, keepdims=True))
        out[b, :, h] = (p / p.sum(-1, keepdims=True)) @ vb
  return out


def test_jagged_softmax_pool_against_numpy_and_padded_gradients():
  """Values against numpy; gradients (q and the tokens' k, v) against the padded masked softmax
  attention's at the same slots."""
  rng = np.random.default_rng(0)
  q = 3 * rng.standard_normal((S, H, D)).astype(np.float32)   # scores of a few units
  k, v = rng.standard_normal((2, len(LENS), T, H, D)).astype(np.float32)
  g = rng.standard_normal((len(LENS), S, H, D)).astype(np.float32)
  toks, offsets, seg, pos, _ = pack_events({"k": k, "v": v}, LENS, 40)
  jag = Jagged(*(jnp.asarray(a) for a in (offsets, seg, pos)))
  mask = np.broadcast_to((np.arange(T)[None, :] < LENS[:, None])[:, None], (len(LENS), S, T))

  def run(q, kt, vt, k, v):
    packed = lambda q, k, v: jnp.sum(jagged.jagged_softmax_pool(q, k, v, jag, tile=8) * g)
    padded = lambda q, k, v: jnp.sum(reference.masked_softmax_attention(
        jnp.broadcast_to(q, (len(LENS),) + q.shape), k, v, mask) * g)
    return (jagged.jagged_softmax_pool(q, kt, vt, jag, tile=8),
            jax.grad(packed, (0, 1, 2))(q, kt, vt), jax.grad(padded, (0, 1, 2))(q, k, v))

  out, (gq, gk, gv), (rq, rk, rv) = jax.jit(run)(q, toks["k"], toks["v"], k, v)
  np.testing.assert_allclose(out, _np_softmax_pool(q, toks["k"], toks["v"], offsets), rtol=1e-5,
                             atol=1e-6)
  assert not np.asarray(out[1]).any()                       # the empty history
  n = offsets[-1]
  np.testing.assert_allclose(gq, rq, rtol=1e-5, atol=1e-6)
  for got, ref in ((gk, rk), (gv, rv)):
    np.testing.assert_allclose(np.asarray(got)[:n], np.asarray(ref)[seg[:n], pos[:n]], rtol=1e-5,
                               atol=1e-6)
    assert not np.asarray(got)[n:].any()
  with pytest.raises(ValueError, match=r"^jagged_softmax_pool: q must be \[S, 2, 4\], got"):
    jagged.jagged_softmax_pool(q[:, :1], toks["k"], toks["v"], jag)


def _config(**fields):
  """The vm_tiny config (one layer: the cheapest programs) with ``config.model`` fields set; time
  buckets on (the packed poolings and the merged tower read the tokens' ages); OneSeq keeps 12 of
  the streams' 16 slots (the merge truncates)."""
  cfg = vm_tiny.get_config()
  cfg.model.time_buckets.enabled = True
  cfg.model.oneseq.kept_len = 12
  cfg.model.update(fields)
  return cfg


def _assert_packed_equals_padded(model, batch, jb, seed=0):
  """Logits of the packed batch ``jb`` equal the padded ``batch``'s (random parameters)."""
  params = _random_params(model, batch, seed)
  apply = jax.jit(model.apply)
  np.testing.assert_allclose(apply({"params": params}, jb), apply({"params": params}, batch),
                             rtol=1e-5, atol=1e-5)


def test_pma_and_loopfm_packed_equals_padded():
  """PMA pooling and LoopFM's inputs (context token; per-event FM rows packed like their stream's
  tokens, as ``pack_events`` packs them with the events) on packed towers: the padded model's
  logits (one program pair for both: the suite's time budget), the batch packed in two blocks;
  a padded ``[B, T, d_fm]`` for a packed stream is a one-line error."""
  _, batch = make(preset=vm_tiny)
  rng = np.random.default_rng(2)
  B = len(batch["surface"])
  batch["fm_ctx"] = rng.normal(size=(B, D_FM)).astype(np.float32)
  batch["fm_ctx_present"] = rng.uniform(size=B) < 0.7
  batch["fm_events"], batch["fm_events_present"] = {}, {}
  for s, ev in batch["events"].items():
    batch["fm_events"][s] = rng.normal(size=ev["item"].shape + (D_FM,)).astype(np.float32)
    batch["fm_events_present"][s] = rng.uniform(size=ev["item"].shape) < 0.6
  jb = packed_batch(batch, shards=2)           # two blocks (a batch split over two devices)
  jb["fm_events"], jb["fm_events_present"] = {}, {}
  for s, ev in batch["events"].items():
    rows = {"fm": batch["fm_events"][s], "present": batch["fm_events_present"][s]}
    toks = pack_blocks(rows, ev["length"], jb["events"][s]["seg"].shape[0], 2)[0]
    jb["fm_events"][s], jb["fm_events_present"][s] = toks["fm"], toks["present"]
  model = loopfm.build_loopfm(_config(pooling="pma"), tiny_schema(), use_ctx=True,
                              use_events=True)
  _assert_packed_equals_padded(model, batch, jb)
  bad = dict(jb, fm_events=dict(jb["fm_events"], click=batch["fm_events"]["click"]))
  with pytest.raises(ValueError, match=r"^LoopFM: stream 'click' is packed .*got \(12, 8, 6\)"):
    jax.eval_shape(lambda b: model.init(jax.random.key(0), b), bad)


def test_oneseq_packed_equals_padded():
  """OneSeq with packed streams in two blocks (merged in-graph, packed again at
  ``merged_capacity`` in two blocks; one block: ``test_oneseq_merge_of_a_packed_and_a_padded_stream``):
  the padded model's logits, loss and gradients. Gradients: rtol 1e-5 plus 1e-5 of each leaf's largest
  entry (random parameters: summation order alone moved the towers-mode packed model's
  gradients by up to 4.7e-6 of a leaf's largest entry, the tiny config)."""
  _, batch = make(preset=vm_tiny)
  model = build_model(_config(seq_mode="oneseq"), tiny_schema())
  params = _random_params(model, batch, 1)
  (loss_p, logits_p), grads_p = loss_and_grad(model, params, batch)
  (loss_j, logits_j), grads_j = loss_and_grad(model, params, packed_batch(batch, shards=2))
  np.testing.assert_allclose(logits_j, logits_p, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(loss_j, loss_p, rtol=1e-5)
  flat_p = dict(jax.tree_util.tree_flatten_with_path(grads_p)[0])
  for k, g in jax.tree_util.tree_flatten_with_path(grads_j)[0]:
    ref = np.asarray(flat_p[k])
    np.testing.assert_allclose(g, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max(),
                               err_msg=jax.tree_util.keystr(k))


def test_join_on_a_packed_stream_equals_packing_the_padded_join():
  """``EmbeddingLog.join_events`` on a packed stream (two blocks) gives the padded join's rows packed like the
  tokens (``pack_events``); padding tokens are missing; ``FMFeatures``' present rate is the same
  on both layouts."""
  _, batch = make(preset=vm_tiny)
  ev = batch["events"]["click"]
  rng = np.random.default_rng(3)
  b, t = np.nonzero(np.arange(ev["item"].shape[1])[None] < ev["length"][:, None])
  ts = event_times(batch["request_ts"], ev["age"])[b, t] + rng.integers(-5, 3, len(b))  # some later
  log = EmbeddingLog(batch["user_id"][b], ev["item"][b, t], ts,
                     rng.normal(size=(len(b), D_FM)).astype(np.float32))
  emb, present, age = log.join_events(batch, "click")
  jb = packed_batch(batch, shards=2)
  got = log.join_events(jb, "click")
  want = pack_blocks({"emb": emb, "present": present, "age": age}, ev["length"],
                     jb["events"]["click"]["seg"].shape[0], 2)[0]
  assert 0 < present.sum() < len(b)
  for g, k in zip(got, ("emb", "present", "age"), strict=True):
    np.testing.assert_array_equal(g, want[k], err_msg=k)
  for b in (batch, jb):                      # the transfer experiment's join statistics
    features = FMFeatures(log, None, join_key="user_item")
    features.loopfm(b, ["click"])
    assert features.present_rates()["events"] == present.sum() / ev["length"].sum()


def test_oneseq_merge_of_a_packed_and_a_padded_stream():
  """``stream_rows`` -> ``merge_streams`` -> ``pack_merged`` (a packed stream beside a padded one, as
  ``data.jagged_capacity`` may pack some streams only) against the python merge of
  ``tests/kunlun/nn/test_oneseq.py``; ``merged_capacity`` is min(tokens, B kept_len) rounded up."""
  rng = np.random.default_rng(4)
  Ts, kept = (6, 4), 5
  lengths = [np.array([3, 0, 6, 1, 2], np.int32), np.array([4, 0, 1, 0, 3], np.int32)]
  ages = [np.where(np.arange(T)[None] < n[:, None],
                   np.sort(rng.integers(0, 30, (5, T)).astype(np.float32))[:, ::-1], 0.0)
          for T, n in zip(Ts, lengths, strict=True)]
  s = [np.stack([np.full((5, T), e, np.float32), np.tile(np.arange(T, dtype=np.float32), (5, 1))],
                -1) for e, T in enumerate(Ts)]                    # payload: (stream, position)
  toks, offsets, seg, pos, _ = pack_events({"s": s[0], "age": ages[0]}, lengths[0], 64)
  first = Packed(jnp.asarray(toks["s"]), Jagged(*(jnp.asarray(a) for a in (offsets, seg, pos))))
  assert oneseq.merged_capacity([first, s[1]], 5, kept, multiple=1) == 5 * kept
  assert oneseq.merged_capacity([first, s[1]], 5, 100, multiple=1) == 64 + 5 * Ts[1]
  assert oneseq.merged_capacity([first, s[1]], 5, kept) == 64

  @jax.jit
  def merged(first, age0, second, age1):
    rows = [oneseq.stream_rows(first, age0, Ts[0]), oneseq.stream_rows(second, age1, None)]
    m = oneseq.merge_streams([r[0] for r in rows], lengths, [r[1] for r in rows], kept)
    tower, n, age = oneseq.pack_merged(*m[:3], 64)
    return jagged.unpack(tower.value, tower.jag, kept), n, jagged.unpack(age, tower.jag, kept)

  got, n, age = (np.asarray(x) for x in merged(first, toks["age"], s[1], ages[1]))
  for b, ref in enumerate(reference_merge(ages, lengths, kept)):
    assert n[b] == len(ref) and [tuple(map(int, x)) for x in got[b, :n[b]]] == ref
    np.testing.assert_array_equal(age[b, :n[b]], [ages[e][b, t] for e, t in ref])
    assert not got[b, n[b]:].any() and not age[b, n[b]:].any()
