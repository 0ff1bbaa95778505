import json

import pytest

from data import synthetic
from data.fake import tiny_schema
from data.schema import Schema, check_seq_lens


@pytest.mark.parametrize("preset", sorted(synthetic.PRESETS))
def test_schema_json_roundtrip(tmp_path, preset):
  s = synthetic.preset_schema(synthetic.PRESETS[preset])
  s.save(str(tmp_path))
  assert Schema.load(str(tmp_path)) == s


def test_tiny_preset_matches_fake_schema():
  assert synthetic.preset_schema(synthetic.PRESETS["tiny"]) == tiny_schema()


def test_malformed_schema_json(tmp_path):
  (tmp_path / "schema.json").write_text('{"sparse": []}')
  with pytest.raises(ValueError, match="malformed schema"):
    Schema.load(str(tmp_path))


def test_check_seq_lens():
  s = tiny_schema()
  assert check_seq_lens(s, {"click": 32}) == {"click": 32, "impression": 128}
  with pytest.raises(ValueError, match="unknown event stream.*'likes'"):
    check_seq_lens(s, {"likes": 8})
  with pytest.raises(ValueError, match=r"seq_lens\['click'\] = 65 must be in \[1, 64\]"):
    check_seq_lens(s, {"click": 65})
  with pytest.raises(ValueError, match="impression"):
    check_seq_lens(s, {"impression": 0})


@pytest.mark.parametrize("value", ["feed=inf,stories=1", "feed=nan,stories=1",
                                   {"feed": float("inf"), "stories": 1.0}, "feed=-inf,stories=1"])
def test_surface_weights_refuse_non_finite(value):
  from data.schema import surface_weights
  with pytest.raises(ValueError, match="finite") as e:
    surface_weights(value, ("feed", "stories"))
  assert "\n" not in str(e.value)


def _edited(tmp_path, edit):
  d = tiny_schema().to_dict()
  edit(d)
  (tmp_path / "schema.json").write_text(json.dumps(d))
  return str(tmp_path)


# (where in schema.json, the largest value accepted): hand-written, 2**27 rows and 2**16 events
SIZES = [(("sparse", 0, "vocab_size"), 134_217_728), (("sparse", 3, "max_len"), 65_536),
         (("streams", 0, "item_vocab"), 134_217_728), (("streams", 1, "action_vocab"), 134_217_728),
         (("streams", 0, "max_len"), 65_536),
         (("streams", 0, "extra_fields", 0, "vocab_size"), 134_217_728)]


def _set_at(d, path, value):
  for k in path[:-1]:
    d = d[k]
  d[path[-1]] = value


@pytest.mark.parametrize("path,top", SIZES)
def test_schema_sizes_are_bounded_on_load(tmp_path, path, top):
  assert Schema.load(_edited(tmp_path, lambda d: _set_at(d, path, top)))
  for bad in (top + 1, 2**31 - 1, 10**10, 0, 1.5, "64", True):
    with pytest.raises(ValueError, match=path[-1]) as e:
      Schema.load(_edited(tmp_path, lambda d, v=bad: _set_at(d, path, v)))
    assert "\n" not in str(e.value) and (not isinstance(bad, int) or str(top) in str(e.value))


def test_schema_without_a_context_feature_is_refused(tmp_path):
  def bare(d):
    d["sparse"], d["dense"] = [], []
  with pytest.raises(ValueError, match="no sparse or dense feature"):
    Schema.load(_edited(tmp_path, bare))
  assert Schema.load(_edited(tmp_path, lambda d: d.update(sparse=[])))
  assert Schema.load(_edited(tmp_path, lambda d: d.update(dense=[])))
