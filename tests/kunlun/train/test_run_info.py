"""train.py's run info: JSON with every model default filled in (no pickle); an older workdir's
config.pkl is unpickled only behind --trust_workdir."""

import json
import os
import pickle

import ml_collections
import pytest

from kunlun.configs import tiny
from kunlun.configs import types as model_config
from kunlun.train import run_info, startup


def _leaves(x, path=""):
  """(path, type, value) of every leaf of a ConfigDict / dict, an independent walk."""
  if isinstance(x, (dict, ml_collections.ConfigDict)):
    out = []
    for k in sorted(x.keys()):
      out += _leaves(x[k], f"{path}.{k}")
    return out
  return [(path, type(x), x)]


def test_saved_config_has_every_model_field(tmp_path):
  c = tiny.get_config()
  with c.model.unlocked():
    del c.model["score_clip"]                 # as in a config written before that field existed
    del c.model.mowe["cross_layer"]
  run_info.save_run_info(str(tmp_path), c, str(tmp_path))
  saved, data_dir = run_info.load_run_info(str(tmp_path))
  want = model_config.default_model()
  assert set(saved.model.keys()) == set(want.keys())
  assert saved.model.score_clip == want.score_clip
  assert saved.model.mowe.cross_layer == want.mowe.cross_layer
  assert saved.model.d_ns == c.model.d_ns and data_dir == str(tmp_path)
  assert "score_clip" not in c.model                      # the caller's config is not changed
  assert sorted(os.listdir(tmp_path)) == ["run_info.json"]   # no config.pkl any more


def test_run_info_round_trips_types_exactly(tmp_path):
  c = tiny.get_config()
  c.train.task_weights = (1.0, 0.5)
  c.data.extra = [1, (2, 3), {"a": None}]
  run_info.save_run_info(str(tmp_path), c, "/data")
  saved, _ = run_info.load_run_info(str(tmp_path))
  want = c.copy_and_resolve_references()
  with want.unlocked():
    want.model = model_config.with_defaults(want.model)
  got_leaves, want_leaves = _leaves(saved), _leaves(want)
  assert [p for p, *_ in got_leaves] == [p for p, *_ in want_leaves]
  for (p, tg, vg), (_, tw, vw) in zip(got_leaves, want_leaves, strict=True):
    assert tg is tw and vg == vw, p
  assert isinstance(saved.model.heads.top_mlp, tuple) and saved.train.task_weights == (1.0, 0.5)
  info = json.load(open(tmp_path / "run_info.json"))            # plain, readable JSON
  assert info["data_dir"] == "/data" and info["config"]["data"]["batch_size"] == 64


def test_unstorable_config_field_is_a_clear_error(tmp_path):
  c = tiny.get_config()
  c.train.fn = ml_collections.ConfigDict().__class__             # a class object
  with pytest.raises(startup.FatalError, match=r"config\.train\.fn = .* cannot be stored"):
    run_info.save_run_info(str(tmp_path), c, "/data")


class _Payload:
  """A pickle that runs code when loaded (makes a directory)."""

  def __init__(self, marker):
    self.marker = marker

  def __reduce__(self):
    return (os.mkdir, (self.marker,))


def test_old_config_pkl_needs_trust_workdir(tmp_path, capsys):
  old = tmp_path / "old"
  old.mkdir()
  marker = str(tmp_path / "code_ran")
  (old / "config.pkl").write_bytes(pickle.dumps(_Payload(marker)))
  (old / "data_dir.txt").write_text("/data/old")
  with pytest.raises(startup.FatalError, match="config.pkl .* --trust_workdir"):
    run_info.load_run_info(str(old))
  assert not os.path.exists(marker)                     # nothing from the workdir ran
  cfg = tiny.get_config()                               # --config given: data_dir, no unpickling
  assert run_info.run_config(str(old), cfg) == (cfg, "/data/old")
  assert not os.path.exists(marker)
  # an honest older workdir loads with the flag, with a warning
  (old / "config.pkl").write_bytes(pickle.dumps(cfg))
  loaded, data_dir = run_info.load_run_info(str(old), trust_pickle=True)
  assert loaded.model.d_ns == cfg.model.d_ns and data_dir == "/data/old"
  assert "warning: --trust_workdir: unpickling" in capsys.readouterr().err
  with pytest.raises(startup.FatalError, match="no run_info.json"):
    run_info.load_run_info(str(tmp_path / "empty"))


def test_run_stored_before_final_hsp_keeps_it_on(tmp_path):
  """A run stored before ``final_hsp`` existed was trained with the final HSP: loading its run
  info turns it on (its checkpoint has those parameters); a new run stores the field (off)."""
  c = tiny.get_config()
  with c.unlocked():
    c.model.final_hsp = False
  run_info.save_run_info(str(tmp_path), c, str(tmp_path))
  assert run_info.load_run_info(str(tmp_path))[0].model.final_hsp is False
  path = tmp_path / "run_info.json"
  info = json.loads(path.read_text())
  del info["config"]["model"]["final_hsp"]
  path.write_text(json.dumps(info))
  assert run_info.load_run_info(str(tmp_path))[0].model.final_hsp is True


def _schema_in(tmp_path, surfaces):
  import dataclasses

  from data.fake import tiny_schema
  return dataclasses.replace(tiny_schema(), surfaces=tuple(surfaces))


def test_resume_checks_model_schema_and_data_against_the_recorded_run(tmp_path):
  """run_info.check_resume: model change refused (unless allowed), surfaces in another order
  refused (heads are indexed by surface), changed train data stated in one line."""
  wd = str(tmp_path)
  c = tiny.get_config()
  schema = _schema_in(tmp_path, ("feed", "stories", "reels"))
  run_info.save_run_info(wd, c, wd, schema, {"feed": 10, "stories": 5, "reels": 5})
  info = json.load(open(tmp_path / "run_info.json"))
  assert info["schema"] == {"surfaces": ["feed", "stories", "reels"],
                            "tasks": list(schema.task_names)}
  lines = []
  log = lambda *a, **k: lines.append(" ".join(map(str, a)))
  run_info.check_resume(wd, tiny.get_config(), schema, info["data"], False, log)
  assert lines == []                                       # same run: nothing to say
  changed = tiny.get_config()
  changed.model.score_clip = 0.0
  with pytest.raises(startup.FatalError, match=r"config.model.score_clip: .* -> 0.0") as e:
    run_info.check_resume(wd, changed, schema, info["data"], False, log)
  assert "\n" not in str(e.value) and "--allow_config_change" in str(e.value)
  run_info.check_resume(wd, changed, schema, info["data"], True, log)    # allowed: stated
  assert len(lines) == 1 and "score_clip" in lines[0]
  swapped = _schema_in(tmp_path, ("feed", "reels", "stories"))
  with pytest.raises(startup.FatalError, match="surfaces") as e:
    run_info.check_resume(wd, tiny.get_config(), swapped, info["data"], False, log)
  assert "\n" not in str(e.value)
  lines.clear()
  run_info.check_resume(wd, tiny.get_config(), schema, {"feed": 12, "stories": 5, "reels": 5},
                       False, log)
  assert len(lines) == 1 and "train data changed" in lines[0] and "\n" not in lines[0]


def test_resume_with_the_same_surfaces_and_other_tasks_is_refused(tmp_path):
  """Issue 39, 13: only surfaces were ever changed in the resume tests. The same surfaces with
  the tasks in another order, or a task renamed, are refused in one line naming both task lists
  (the heads are indexed by task); with --allow_config_change the resume goes on."""
  import dataclasses
  wd = str(tmp_path)
  schema = _schema_in(tmp_path, ("feed", "stories", "reels"))
  run_info.save_run_info(wd, tiny.get_config(), wd, schema)
  click, conversion = schema.tasks
  other = {"swapped": (conversion, click),
           "renamed": (click, dataclasses.replace(conversion, name="purchase"))}
  for tasks in other.values():
    changed = dataclasses.replace(schema, tasks=tasks)
    assert changed.surfaces == schema.surfaces
    want = [t.name for t in tasks]
    with pytest.raises(startup.FatalError) as e:
      run_info.check_resume(wd, tiny.get_config(), changed, None, False, print)
    msg = str(e.value)
    assert "\n" not in msg and f"tasks {want}" in msg and "tasks ['click', 'conversion']" in msg
    run_info.check_resume(wd, tiny.get_config(), changed, None, True, print)


def test_eval_and_export_match_surfaces_and_tasks_by_name(tmp_path):
  """The data lists the run's surfaces and tasks in another order: the schema comes back in the
  trained order and each batch is re-indexed so every row keeps its surface and task names
  (checked by name against the original batch); other names are refused in one line."""
  import dataclasses

  import numpy as np

  from data.fake import random_batch, tiny_schema
  trained = tiny_schema()
  tasks = trained.tasks[::-1] if len(trained.tasks) > 1 else trained.tasks
  data = dataclasses.replace(trained, surfaces=trained.surfaces[::-1], tasks=tasks)
  run_info.save_run_info(str(tmp_path), tiny.get_config(), str(tmp_path), trained)
  info = run_info.saved_run_info(str(tmp_path))
  got, remap = run_info.schema_as_trained(info, data, "eval")
  assert got.surfaces == trained.surfaces and got.task_names == trained.task_names
  b = random_batch(data, 16, {s.name: s.max_len for s in data.streams}, seed=3, min_len=1)
  r = remap(b)
  names = lambda sch, idx: [sch.surfaces[i] for i in np.asarray(idx).ravel()]
  assert names(got, r["surface"]) == names(data, b["surface"])
  for st in data.streams:
    ev, ev2 = b["events"][st.name], r["events"][st.name]
    for i in range(16):
      n = int(ev["length"][i])
      assert names(got, ev2["surface"][i, :n]) == names(data, ev["surface"][i, :n])
      assert (np.asarray(ev2["surface"][i, n:]) == np.asarray(ev["surface"][i, n:])).all()
  for k, name in enumerate(got.task_names):
    j = list(data.task_names).index(name)
    np.testing.assert_array_equal(r["labels"][:, k], np.asarray(b["labels"])[:, j])
    np.testing.assert_array_equal(r["label_mask"][:, k], np.asarray(b["label_mask"])[:, j])
  same, none = run_info.schema_as_trained(info, trained, "eval")
  assert same is trained and none is None
  other = dataclasses.replace(trained, surfaces=("feed", "stories", "shorts"))
  with pytest.raises(startup.FatalError, match="shorts") as e:
    run_info.schema_as_trained(info, other, "--data_dir=x")
  assert "\n" not in str(e.value)
