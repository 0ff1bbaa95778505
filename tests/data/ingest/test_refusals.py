"""Hostile inputs to data.ingest, round 5 (issue 39, part B): label delays stated per task (an
unknown label refused until stated, the delays printed, recorded in ingest.json and read back
for train.py), bounded durations and history lengths, datasets without a context feature, and
explicit split files that partly overlap. Each refusal is one line (status 2)."""

import json
import os

import pyarrow as pa
import pytest

from data import ingest, records
from data.ingest.infer import Spec, duration, label_delays
from tests.data.ingest.test_hostile import RENAME, _csv, _main, _one_line

DAY = 86_400


# ---- label delays ------------------------------------------------------------------------------

def test_label_delays_are_known_by_exact_name_or_stated():
  h = {"streams": {"imp": "all"}}
  assert label_delays(h, ["click", "conversion"]) == {"click": 0, "conversion": DAY}
  for task in ("cvr", "conv", "purchase", "like", "Click", "conversion_7d"):
    with pytest.raises(ValueError, match=f"'{task}'.*--label_delay {task}="):
      label_delays(h, ["click", task])
  stated = {**h, "label_delay": {"cvr": "2h", "like": "immediate", "click": "1m"}}
  assert label_delays(stated, ["click", "cvr", "like"]) == {"click": 60, "cvr": 7200, "like": 0}


def test_durations_are_bounded():
  assert duration("immediate", "x") == 0
  assert duration("365d", "x") == 365 * DAY
  assert duration(365 * DAY, "x") == 365 * DAY
  for bad in ("366d", 365 * DAY + 1, "99999999999999999999d", "9" * 5000, -1, True, 1.5):
    with pytest.raises(ValueError, match="365d"):
      duration(bad, "--label_delay conversion")


def test_unknown_label_is_refused_then_stated_printed_and_recorded(tmp_path, capsys):
  src = _csv(tmp_path / "log.csv")
  rename = RENAME.replace("label.click=click", "label.cvr=click")
  base = ["--input", src, "--rename", rename, "--yes", "--history", "imp=all,cv=label.cvr",
          "--split", "none"]
  out = tmp_path / "ds"
  code, _, err = _main(base + ["--out", str(out)], capsys)
  _one_line(code, err, "'cvr'", "--label_delay cvr=")
  assert not out.exists()
  code, _, err = _main(base + ["--out", str(out), "--label_delay",
                               "conversion=99999999999999999999d"], capsys)
  _one_line(code, err, "--label_delay conversion", "365d")
  code, o, err = _main(base + ["--out", str(out), "--label_delay", "cvr=1d"], capsys)
  assert code == 0, err
  assert "label delays: cvr 1d (stated)" in o
  rep = json.load(open(out / "ingest.json"))
  assert rep["label_delays"] == {"cvr": DAY}
  assert rep["spec"]["history"]["label_delay"] == {"cvr": "1d"}
  assert records.label_delay_note(str(out)) == "data: label delays (ingest.json): cvr 1d"


def test_label_delay_note_without_built_histories(tmp_path, capsys, tiny_dir):
  src = _csv(tmp_path / "log.csv")
  out = tmp_path / "flat"
  code, _, err = _main(["--input", src, "--rename", RENAME, "--yes", "--split", "none",
                        "--out", str(out)], capsys)
  assert code == 0, err
  assert json.load(open(out / "ingest.json"))["label_delays"] is None
  assert "no built histories" in records.label_delay_note(str(out))
  assert "synthetic" in records.label_delay_note(tiny_dir)
  assert "no ingest.json" in records.label_delay_note(str(tmp_path))


# ---- bounds ------------------------------------------------------------------------------------

def test_history_len_is_bounded_before_work(tmp_path, capsys):
  with pytest.raises(ValueError, match="max_len=65537"):
    Spec.from_dict({"history": {"streams": {"imp": "all"}, "max_len": 65537}})
  assert Spec.from_dict({"history": {"streams": {"imp": "all"}, "max_len": 65536}})
  code, _, err = _main(["--input", str(tmp_path / "absent.csv"), "--out", str(tmp_path / "o"),
                        "--rename", RENAME, "--history", "imp=all", "--history_len",
                        "10000000000"], capsys)
  _one_line(code, err, "max_len=10000000000")


def test_records_per_chunk_is_bounded(tmp_path, capsys):
  src = _csv(tmp_path / "log.csv")
  code, _, err = _main(["--input", src, "--out", str(tmp_path / "o"), "--rename", RENAME,
                        "--yes", "--records_per_chunk", "10000000000"], capsys)
  _one_line(code, err, "--records_per_chunk=10000000000")


def test_no_context_feature_is_refused(tmp_path, capsys):
  src = _csv(tmp_path / "log.csv")
  bare = RENAME.replace(",dense.bid=bid", "")
  args = ["--input", src, "--rename", bare, "--yes", "--split", "none"]
  code, _, err = _main(args + ["--out", str(tmp_path / "o")], capsys)
  _one_line(code, err, "no sparse or dense feature", "--ids_as_features")
  assert not (tmp_path / "o").exists()
  code, _, err = _main(args + ["--out", str(tmp_path / "o"), "--ids_as_features"], capsys)
  assert code == 0, err


# ---- explicit split files ----------------------------------------------------------------------

def _split_run(tmp_path, name, train_ts, eval_ts):
  t = lambda ts: pa.table({"time": ts, "uid": [i % 3 for i in range(len(ts))],
                           "ad": [7] * len(ts), "click": [i % 2 for i in range(len(ts))]})
  spec = Spec.from_dict({"columns": {"request_ts": "time", "user_id": "uid", "ad_id": "ad",
                                     "label.click": "click"}, "ids_as_features": True})
  ingest.run({"train": [ingest.Source(table=t(train_ts), name="train.csv")],
              "eval": [ingest.Source(table=t(eval_ts), name="eval.csv")]},
             str(tmp_path / name), spec, yes=True, engine="memory",
             out=open(os.devnull, "w"), err=open(os.devnull, "w"))


def test_split_files_that_partly_overlap_are_refused(tmp_path):
  t0 = 1_700_000_000
  train = [t0, t0 + 100, t0 + 200, t0 + 300]
  with pytest.raises(ValueError, match="--train and --eval overlap in time"):
    _split_run(tmp_path, "part", train, [t0 + 250, t0 + 400, t0 + 500])   # eval starts inside
  with pytest.raises(ValueError, match="--train and --eval overlap in time"):
    _split_run(tmp_path, "inside", train, [t0 + 150, t0 + 160])            # eval within train
  _split_run(tmp_path, "touch", train, [t0 + 300, t0 + 400])              # train's last second
  assert os.path.exists(tmp_path / "touch" / "manifest.json")
  assert not os.path.exists(tmp_path / "part") and not os.path.exists(tmp_path / "inside")
