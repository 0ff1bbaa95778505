"""Config validation: presets parse; impossible combinations raise errors naming field + values."""

import copy

import flax.linen as nn
import jax
import pytest

from data.fake import random_batch, tiny_schema
from data.synthetic import PRESETS, preset_schema
from kunlun.configs import dev, large, mid, prod, tiny
from kunlun.configs import types as C
from kunlun.models.build import build_model
from kunlun.models.flops import model_flops


@pytest.mark.parametrize("preset,data", [(tiny, "tiny"), (dev, "dev"), (mid, "mid"),
                                         (large, "mid")])
def test_presets_parse_against_synthetic_schemas(preset, data):
  c = preset.get_config()
  S = preset_schema(PRESETS[data])
  assert c.data.preset == data
  m = C.parse(c, S)
  assert m.streams == S.stream_names
  assert C.seq_lens(c) == {t.name: t.kept_len for t in m.towers}
  for t in m.towers:
    assert t.width % t.heads == 0 and t.window <= t.kept_len and t.depth <= m.num_layers


def test_tiny_matches_tiny_schema_names():
  m = C.parse(tiny.get_config(), tiny_schema())
  assert m.streams == ("click", "impression")
  assert m.surfaces == ("feed", "stories", "reels") and m.tasks == ("click", "conversion")
  assert C.seq_lens(tiny.get_config()) == {"click": 32, "impression": 32}


def _bad(mutate, *needles):
  c = tiny.get_config()
  mutate(c.model)
  with pytest.raises(ValueError) as e:
    C.parse(c, tiny_schema())
  for n in needles:
    assert n in str(e.value), (n, str(e.value))


def test_heads_not_dividing_width():
  _bad(lambda m: setattr(m.towers.click, "heads", 3), "towers.click.heads", "divisors of 32")


def test_window_larger_than_kept_len():
  _bad(lambda m: setattr(m.towers.impression, "window", 40), "towers.impression.window",
       "0..32")


def test_unknown_activation():
  _bad(lambda m: setattr(m.attention, "activation", "tanh"), "attention.activation",
       "softmax", "fast_gelu")
  _bad(lambda m: setattr(m, "pffn_activation", "softmax"), "pffn_activation", "relu2")


def test_unknown_and_missing_stream():
  def add(m):
    m.towers.organic = copy.deepcopy(m.towers.click)
  _bad(add, "towers", "organic", "'click', 'impression'")
  c = tiny.get_config()
  del c.model.towers["impression"]
  with pytest.raises(ValueError, match="no tower for stream.*impression"):
    C.parse(c, tiny_schema())


def test_other_impossible_combinations():
  _bad(lambda m: setattr(m, "arch", "dcn"), "arch", "interformer")
  _bad(lambda m: setattr(m, "seq_mode", "maskednet"), "seq_mode", "oneseq")
  _bad(lambda m: setattr(m.attention, "kind", "causal"), "attention.kind", "swa")
  _bad(lambda m: setattr(m.towers.click, "depth", 3), "towers.click.depth", "1..2")
  _bad(lambda m: setattr(m.towers.click, "kept_len", 65), "towers.click.kept_len", "1..64")
  _bad(lambda m: setattr(m.towers.click, "n_sum", 9), "towers.click.n_seed")
  _bad(lambda m: setattr(m, "d_ns", 0), "d_ns")
  _bad(lambda m: setattr(m.heads, "kind", "ple"), "heads.kind", "mmoe")
  _bad(lambda m: setattr(m, "dtype", "float16"), "dtype", "bfloat16")

  def odd_head_dim(m):
    m.towers.click.update(width=30, heads=2)
  _bad(odd_head_dim, "head_dim", "even")

  def block(m):
    m.attention.kind = "block"
    m.attention.block_size = 24
  _bad(block, "kept_len", "block_size")

  def oneseq_too_long(m):
    m.seq_mode = "oneseq"
    m.oneseq.kept_len = 65
  _bad(oneseq_too_long, "oneseq.kept_len", "1..64")


def test_unknown_fields():
  _bad(lambda m: setattr(m, "nlayers", 3), "nlayers", "num_layers")
  _bad(lambda m: setattr(m.towers.click, "widht", 3), "towers.click", "widht")
  with pytest.raises(ValueError, match="missing"):
    C.tower(width=8)


# ---- per-head activation lists -------------------------------------------------------------------

def _set(field, value):
  """Sets a (possibly dotted) activation field to a tuple/list despite ConfigDict's type lock."""
  def f(m):
    *path, last = field.split(".")
    for p in path:
      m = m[p]
    with m.ignore_type():
      setattr(m, last, value)
  return f


def _parsed(mutate):
  c = tiny.get_config()
  mutate(c.model)
  return C.parse(c, tiny_schema())


@pytest.mark.parametrize("field", ["pffn_activation", "hsp_activation", "attention.activation"])
def test_per_head_activation_tuple_list_and_string(field):
  get = lambda m: m.attention.activation if field.startswith("attention") else getattr(m, field)
  for value in (("relu", "silu"), ["relu", "silu"], "relu, silu"):
    m = _parsed(_set(field, value))
    assert get(m) == ("relu", "silu") and isinstance(get(m), tuple)
    hash(m)                                       # frozen and hashable with the tuple inside
  assert get(_parsed(_set(field, "gelu"))) == "gelu"


def test_per_head_activation_errors():
  # tiny: click and impression towers both have 2 heads
  _bad(_set("pffn_activation", ("relu", "silu", "gelu")), "pffn_activation", "3 per-head",
       "'click': 2", "'impression': 2")
  _bad(_set("hsp_activation", ("relu", "tanh")), "hsp_activation", "['tanh']", "relu2")
  _bad(_set("attention.activation", ("softmax", "relu")), "attention.activation",
       "['softmax']", "softmax only as a single name")
  _bad(_set("pffn_activation", ()), "pffn_activation", "non-empty")

  def uneven(m):                                  # only the tower whose heads differ is named
    m.towers.click.heads = 4
    _set("hsp_activation", ("relu", "silu"))(m)
  c = tiny.get_config()
  uneven(c.model)
  with pytest.raises(ValueError, match=r"tower\(s\) \{'click': 4\}"):
    C.parse(c, tiny_schema())

  def oneseq(m):                                  # OneSeq: only the merged tower counts
    m.seq_mode = "oneseq"
    m.oneseq.heads = 4
    _set("pffn_activation", ("relu", "silu", "gelu", "identity"))(m)
  assert _parsed(oneseq).pffn_activation == ("relu", "silu", "gelu", "identity")


def test_score_clip_field():
  assert _parsed(lambda m: None).score_clip == 8.0          # spec h-13 default
  assert _parsed(lambda m: setattr(m, "score_clip", 0.0)).score_clip == 0.0
  _bad(lambda m: setattr(m, "score_clip", -1.0), "score_clip", ">= 0")


def _module_settings(config):
  """(class, activation, score_clip) of every PFFN / HSP / SeqAttention the built model calls,
  recorded by intercepting module calls while tracing ``init`` (no compilation)."""
  seen = set()

  def record(next_fun, args, kwargs, context):
    mod = context.module
    if type(mod).__name__ in ("PFFN", "HSP", "SeqAttention") and context.method_name == "__call__":
      seen.add((type(mod).__name__, mod.activation, mod.score_clip))
    return next_fun(*args, **kwargs)

  schema = tiny_schema()
  model = build_model(config, schema)
  batch = random_batch(schema, 2, C.seq_lens(config), seed=0, min_len=1)
  with nn.intercept_methods(record):
    jax.eval_shape(lambda b: model.init(jax.random.key(0), b, False), batch)
  return seen


def test_activation_tuples_and_score_clip_reach_the_modules():
  c = tiny.get_config()
  for f, v in (("pffn_activation", ("relu", "silu")), ("hsp_activation", ["relu2", "gelu"]),
               ("attention.activation", "identity,relu")):
    _set(f, v)(c.model)
  c.model.score_clip = 4.0
  assert _module_settings(c) == {("PFFN", ("relu", "silu"), 4.0),
                                 ("HSP", ("relu2", "gelu"), 4.0),
                                 ("SeqAttention", ("identity", "relu"), 4.0)}
  assert _module_settings(tiny.get_config()) == {("PFFN", "fast_gelu", 8.0),   # default (h-13)
                                                 ("HSP", "fast_gelu", 8.0),
                                                 ("SeqAttention", "softmax", 8.0)}
  off = tiny.get_config()
  off.model.score_clip = 0.0
  assert {s[2] for s in _module_settings(off)} == {None}


def test_flops_with_per_head_activations():
  """Per-head activations change only the PFFN's elementwise count: the mean per-head cost."""
  from kunlun.models.flops import GDPA_ACT
  c = tiny.get_config()
  _set("pffn_activation", ("relu", "silu"))(c.model)
  got, base = model_flops(c, tiny_schema()), model_flops(tiny.get_config(), tiny_schema())
  assert {k: v for k, v in got["per_module"].items() if k != "pffn"} == \
      {k: v for k, v in base["per_module"].items() if k != "pffn"}
  m = C.parse(c, tiny_schema())
  scores = sum(t.kept_len * t.n_kv * t.heads for t in m.towers for l in range(m.num_layers)
               if l < t.depth and l % 2 == 0)
  per_score = (GDPA_ACT["relu"] + GDPA_ACT["silu"]) / 2 - GDPA_ACT["fast_gelu"]
  assert abs(got["per_module"]["pffn"] - base["per_module"]["pffn"] - per_score * scores) < 1e-6


def test_prod_preset_parses_and_builds():
  """The production-shaped preset: towers d 512 / H 4 / d_h 128 with n_kv 256 over ~1-2k events,
  batch 1024; it parses against its synthetic schema and its model initialises abstractly (tiny
  batch, eval_shape: no arrays), with the dense-parameter count its memory estimate uses."""
  c = prod.get_config()
  S = preset_schema(PRESETS["prod"])
  m = C.parse(c, S)
  assert c.data.batch_size == 1024 and c.train.sparse_embedding_update
  click = m.tower("click")
  assert (click.width, click.heads, click.width // click.heads, click.n_kv) == (512, 4, 128, 256)
  assert C.seq_lens(c) == {"click": 1024, "impression": 1024, "conversion": 256}
  model = build_model(c, S)
  b = random_batch(S, 2, C.seq_lens(c), seed=0, min_len=1)
  v = jax.eval_shape(lambda k: model.init(k, b, train=False), jax.random.key(0))
  leaves = jax.tree_util.tree_leaves_with_path(nn.meta.unbox(v["params"]))
  dense = sum(x.size for k, x in leaves if "embedding" not in jax.tree_util.keystr(k))
  assert 200e6 < dense < 230e6                       # the estimate's "214M dense params"
