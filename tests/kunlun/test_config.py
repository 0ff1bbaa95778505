"""Config validation: presets parse; impossible combinations raise errors naming field + values."""

import copy

import pytest

from data.fake import tiny_schema
from data.synthetic import PRESETS, preset_schema
from kunlun import config as C
from kunlun.configs import dev, large, mid, tiny


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
