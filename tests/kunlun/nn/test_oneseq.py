"""OneSeq: time-ordered merge against a python reference; the equal-FLOPs switch runs."""

import flax.linen as nn
import jax
import numpy as np

from data.fake import random_batch, tiny_schema
from kunlun.configs import tiny
from kunlun.configs.types import parse, seq_lens
from kunlun.models.build import build_model
from kunlun.models.flops import model_flops
from kunlun.nn.oneseq import equal_flops_config, merge_streams


def reference_merge(ages, lengths, kept):
  """Per example: list of (stream, position) of the kept events, oldest first."""
  out = []
  for b in range(ages[0].shape[0]):
    ev = [(-ages[e][b, t], e, t) for e in range(len(ages)) for t in range(lengths[e][b])]
    ev.sort()                                       # oldest first; ties by stream, position
    out.append([(e, t) for _, e, t in ev[-kept:]] if kept else [])
  return out


def test_merge_is_time_ordered_and_keeps_most_recent():
  rng = np.random.default_rng(0)
  B, Ts, kept = 5, (6, 9, 4), 10
  lengths = [rng.integers(0, T + 1, B).astype(np.int32) for T in Ts]
  lengths[0][0], lengths[1][0], lengths[2][0] = 0, 0, 0          # an example with no events
  ages = [np.where(np.arange(T)[None] < l[:, None],
                   np.sort(rng.integers(0, 50, (B, T)).astype(np.float32))[:, ::-1], 0.0)
          for T, l in zip(Ts, lengths, strict=True)]       # integer ages: ties happen
  # event payload encodes (stream, position) so the selection can be read back
  s = [np.stack([np.full((B, T), e, np.float32), np.tile(np.arange(T, dtype=np.float32), (B, 1)),
                 np.ones((B, T), np.float32)], -1) for e, T in enumerate(Ts)]
  s_m, len_m, age_m, src_m = jax.jit(merge_streams, static_argnums=3)(s, lengths, ages, kept)
  s_m, len_m, age_m, src_m = map(np.asarray, (s_m, len_m, age_m, src_m))
  ref = reference_merge(ages, lengths, kept)
  for b in range(B):
    n = len(ref[b])
    assert len_m[b] == n
    got = [(int(s_m[b, i, 0]), int(s_m[b, i, 1])) for i in range(n)]
    assert got == ref[b]
    assert [int(x) for x in src_m[b, :n]] == [e for e, _ in ref[b]]
    np.testing.assert_array_equal(age_m[b, :n], [ages[e][b, t] for e, t in ref[b]])
    assert np.all(np.diff(age_m[b, :n]) <= 0)                     # oldest first
    assert np.all(s_m[b, n:] == 0) and np.all(age_m[b, n:] == 0)


def test_equal_flops_switch_runs():
  cfg, schema = tiny.get_config(), tiny_schema()
  one, ratio = equal_flops_config(cfg, lambda c: model_flops(c, schema)["forward"])
  assert one.model.seq_mode == "oneseq"
  assert abs(ratio - 1) < 0.1, ratio
  f_towers = model_flops(cfg, schema)["forward"]
  f_one = model_flops(one, schema)["forward"]
  assert abs(f_one / f_towers - ratio) < 1e-9
  m = parse(one, schema)
  assert [t.name for t in m.seq_towers] == ["oneseq"]
  model = build_model(one, schema)
  batch = random_batch(schema, 4, seq_lens(one), seed=0, min_len=1)
  rep, v = jax.jit(lambda k, b: model.init_with_output(k, b, method="representations"))(
      jax.random.key(0, impl="unsafe_rbg"), batch)
  params = nn.meta.unbox(v)["params"]
  assert "oneseq_merge" in params and "embed_click" in params and "embed_impression" in params
  assert not any(k.startswith("click") for k in params["layer_0"])
  assert set(rep["summaries"]) == {"oneseq"}
  assert np.isfinite(np.asarray(rep["logits"])).all() and rep["logits"].shape == (4, 2)
