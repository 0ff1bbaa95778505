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
