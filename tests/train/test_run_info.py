"""train.py's run info stores config.model with every default filled in."""

import pickle

from kunlun import config as model_config
from kunlun.configs import tiny
from kunlun.train import runtime


def test_saved_config_has_every_model_field(tmp_path):
  c = tiny.get_config()
  with c.model.unlocked():
    del c.model["score_clip"]                 # as in a config written before that field existed
    del c.model.mowe["cross_layer"]
  runtime.save_run_info(str(tmp_path), c, str(tmp_path))
  saved, data_dir = runtime.load_run_info(str(tmp_path))
  want = model_config.default_model()
  assert set(saved.model.keys()) == set(want.keys())
  assert saved.model.score_clip == want.score_clip
  assert saved.model.mowe.cross_layer == want.mowe.cross_layer
  assert saved.model.d_ns == c.model.d_ns and data_dir == str(tmp_path)
  assert "score_clip" not in c.model                      # the caller's config is not changed
  with open(tmp_path / "config.pkl", "rb") as f:
    assert pickle.load(f).model.towers.click.kept_len == c.model.towers.click.kept_len


def test_run_stored_before_final_hsp_keeps_it_on(tmp_path):
  """A run stored before ``final_hsp`` existed was trained with the final HSP: loading its run
  info turns it on (its checkpoint has those parameters); a new run stores the field."""
  c = tiny.get_config()
  runtime.save_run_info(str(tmp_path), c, str(tmp_path))
  assert runtime.load_run_info(str(tmp_path))[0].model.final_hsp is False
  with open(tmp_path / "config.pkl", "rb") as f:
    old = pickle.load(f)
  with old.model.unlocked():
    del old.model["final_hsp"]
  with open(tmp_path / "config.pkl", "wb") as f:
    pickle.dump(old, f)
  assert runtime.load_run_info(str(tmp_path))[0].model.final_hsp is True
