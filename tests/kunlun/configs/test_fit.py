"""Presets fit any dataset's schema (issue #14 friction 5): towers by stream name or by size
template, kept lengths clipped, surface weights following the schema's surfaces, and every
config / schema mismatch a one-line train.py error."""

import os
import subprocess
import sys

import pytest

from data.fake import tiny_schema
from data.schema import EventStream, Schema, SparseFeature, Task, surface_weights
from kunlun.configs import dev, large, mid, tiny, vm_dev, vm_tiny
from kunlun.configs import types as C
from kunlun.configs.fit import fit_surface_weights, fit_towers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _schema(streams=(("liked", 20), ("rated", 50), ("skipped", 8)), surfaces=("movielens",),
            tasks=("click",)):
  return Schema(sparse=(SparseFeature("user_id", 100),), dense=("user_count",),
                streams=tuple(EventStream(n, L, item_vocab=50, action_vocab=11)
                              for n, L in streams),
                surfaces=surfaces, tasks=tuple(Task(t) for t in tasks))


def test_synthetic_names_keep_the_preset_unchanged():
  c = tiny.get_config()
  before = c.model.to_dict()
  assert fit_towers(c, tiny_schema()) == []
  assert c.model.to_dict() == before
  # a saved run's config (every default filled in) is unchanged as well
  saved = c.copy_and_resolve_references()
  saved.model = C.with_defaults(saved.model)
  assert fit_towers(saved, tiny_schema()) == []


def test_templates_by_stream_index():
  c = tiny.get_config()
  want = {n: c.model.towers[n].to_dict() for n in ("click", "impression")}
  notes = fit_towers(c, _schema())
  t = c.model.towers
  assert set(t.keys()) == {"liked", "rated", "skipped"}
  for name, src, max_len in (("liked", "click", 20), ("rated", "impression", 50),
                             ("skipped", "impression", 8)):
    exp = dict(want[src])
    exp["kept_len"] = min(exp["kept_len"], max_len)
    exp["window"] = min(exp["window"], exp["kept_len"])
    assert t[name].to_dict() == exp, name
  assert "tower 'liked' (stream 0) takes the sizes of template 'click'" in notes
  assert "towers.liked.kept_len 32 -> 20 (stream max_len 20)" in notes
  assert c.model.tower_templates == "liked,rated,skipped"     # saved config stays consistent
  cfg = C.parse(c, _schema())
  assert [x.name for x in cfg.towers] == ["liked", "rated", "skipped"]
  assert cfg.surfaces == ("movielens",) and cfg.tasks == ("click",)
  assert fit_towers(c, _schema()) == []                         # idempotent (eval.py refits)


def test_matching_names_clip_and_block_attention():
  c = tiny.get_config()
  c.model.attention.kind = "block"                               # block_size 16
  fit_towers(c, _schema(streams=(("click", 40), ("impression", 10))))
  assert c.model.towers.click.kept_len == 32                     # fits: unchanged
  assert c.model.towers.impression.kept_len == 10                # < block: the whole stream
  c = tiny.get_config()
  c.model.attention.kind = "block"
  fit_towers(c, _schema(streams=(("click", 20),)))
  assert c.model.towers.click.kept_len == 16 and list(c.model.towers.keys()) == ["click"]
  c = tiny.get_config()
  c.model.seq_mode = "oneseq"                                    # oneseq kept 48
  fit_towers(c, _schema(streams=(("a", 10), ("b", 20))))
  assert c.model.oneseq.kept_len == 30 and c.model.oneseq.window <= 30
  C.parse(c, _schema(streams=(("a", 10), ("b", 20))))


@pytest.mark.parametrize("preset", [tiny, dev, mid, large, vm_tiny, vm_dev])
def test_every_preset_fits_a_foreign_schema(preset):
  c = preset.get_config()
  s = _schema(streams=(("a", 7), ("b", 300), ("c", 4000), ("d", 2)), surfaces=("x", "y"),
              tasks=("click", "like", "follow"))
  fit_towers(c, s)
  cfg = C.parse(c, s)
  assert [t.name for t in cfg.towers] == ["a", "b", "c", "d"]
  assert all(t.kept_len <= st.max_len for t, st in zip(cfg.towers, s.streams, strict=True))
  assert cfg.tasks == ("click", "like", "follow")


def test_data_without_streams():
  c = tiny.get_config()
  s = _schema(streams=())
  assert fit_towers(c, s) == ["tower(s) ['click', 'impression'] dropped: the data has no such "
                              "stream"]
  assert C.seq_lens(c) == {} and C.parse(c, s).towers == ()


def test_template_errors():
  c = tiny.get_config()
  c.model.tower_templates = "click,nope"
  with pytest.raises(ValueError, match=r"tower_templates='click,nope': \['nope'\] are not towers"):
    fit_towers(c, _schema())
  c = tiny.get_config()
  c.model.towers = C.default_model().towers                      # empty
  with pytest.raises(ValueError, match="towers is empty"):
    fit_towers(c, _schema())


def test_surface_weights():
  s = _schema(surfaces=("home", "search", "live"))
  counts = {"home": 600, "search": 300, "live": 100}
  c = tiny.get_config()                                          # feed/stories/reels defaults
  w, notes = fit_surface_weights(c, s, counts)
  assert w == {"home": 600.0, "search": 300.0, "live": 100.0} and c.data.surface_weights == "auto"
  assert "using 'auto'" in notes[0]
  c = tiny.get_config()
  c.data.surface_weights = "home=1,search=0.5,feed=0"            # zero weights for unknown: fine
  w, notes = fit_surface_weights(c, s, counts)
  assert w == {"home": 1.0, "search": 0.5, "live": 0.0}
  assert notes == ["surface(s) ['live'] have weight 0 in data.surface_weights: not trained on"]
  c.data.surface_weights = "home=1,serach=2"
  with pytest.raises(ValueError, match=r"unknown surface\(s\) \['serach'\] with a non-zero weight"):
    fit_surface_weights(c, s, counts)
  assert surface_weights({"home": 2, "x": 0}, s.surfaces) == {"home": 2.0, "search": 0.0,
                                                              "live": 0.0}
  for bad in ("home=-1", "home=0", "home", "home=x"):
    with pytest.raises(ValueError, match="surface_weights"):
      surface_weights(bad, s.surfaces, counts)


@pytest.mark.parametrize("surfaces,counts", [
    (("movielens",), {"movielens": 700}),                        # one surface
    (("home", "search"), {"home": 700, "search": 0}),            # one surface with train records
])
def test_surface_weights_fallback_is_silent_on_one_surface(surfaces, counts):
  """Any weighting trains one surface the same: the 'auto' fallback changes nothing, no note."""
  c = tiny.get_config()                                          # feed/stories/reels defaults
  w, notes = fit_surface_weights(c, _schema(surfaces=surfaces), counts)
  assert notes == [] and c.data.surface_weights == "auto"
  assert w == {s: float(counts[s]) for s in surfaces}
  c.data.surface_weights = "home=1,search=0"                     # the user's own choice: noted
  w, notes = fit_surface_weights(c, _schema(surfaces=("home", "search", "live")),
                                 {"home": 700, "search": 0, "live": 5})
  assert notes == ["surface(s) ['live'] have weight 0 in data.surface_weights: not trained on"]


@pytest.fixture(scope="module")
def ml_dir(tmp_path_factory):
  from data.ingest.public import movielens
  from tests.data.ingest.test_public_movielens import RATINGS, T0
  base = tmp_path_factory.mktemp("ml")
  p = base / "u.data"
  p.write_text("".join(f"{u}\t{m}\t{r}\t{T0 + t}\n" for u, m, r, t in RATINGS * 3))
  d = str(base / "ds")
  with open(os.devnull, "w") as null:
    movielens.convert(str(p), d, split="time:0.5,0.25,0.25", out=null, err=null)
  return d


def _train(args):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
  return subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *args], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=300)


def test_mismatch_is_one_line_train_error(ml_dir, tmp_path):
  p = _train([f"--workdir={tmp_path / 'w'}", f"--data_dir={ml_dir}",
              "--config.data.surface_weights=movielens=1,feeds=0.5"])
  assert p.returncode == 2, p.stderr[-2000:]
  assert "Traceback" not in p.stderr
  assert p.stderr.strip().splitlines()[-1] == (
      "train.py: error: data.surface_weights: unknown surface(s) ['feeds'] with a non-zero "
      "weight; schema has ('movielens',) (set them to 0, or use 'auto')")
