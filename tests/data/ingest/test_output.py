"""data.ingest's output paths (issue 39): ``--write_schema`` is checked like ``--out`` before
any work: not an input (a log, the ``--schema`` file), not inside ``--out``, not something other
than a regular file. Each refusal is one line and leaves every file as it was."""

import os

import pytest

from data import ingest

RENAME = "request_ts=time,user_id=uid,ad_id=ad,label.click=click"
LOG = "time,uid,ad,click\n" + "".join(f"{1_700_000_000 + 60 * i},{i % 3},{i % 4},{i % 2}\n"
                                      for i in range(12))


@pytest.fixture()
def files(tmp_path):
  (tmp_path / "log.csv").write_text(LOG)
  (tmp_path / "spec.json").write_text('{"columns": {"request_ts": "time"}}')
  (tmp_path / "target.json").write_text("kept")
  (tmp_path / "link.json").symlink_to(tmp_path / "target.json")
  (tmp_path / "ds").mkdir()
  return tmp_path


def _contents(d):
  return {os.path.relpath(os.path.join(r, f), d): open(os.path.join(r, f), "rb").read()
          if not os.path.islink(os.path.join(r, f)) else os.readlink(os.path.join(r, f))
          for r, _, fs in os.walk(d) for f in fs}


@pytest.mark.parametrize("write_schema,words", [
    ("log.csv", ["--write_schema=", "log.csv is the input", "--input"]),
    ("spec.json", ["--write_schema=", "spec.json is the input", "--schema"]),
    ("ds/spec.json", ["--write_schema=", "lies inside --out="]),
    ("link.json", ["--write_schema=", "link.json: is a symbolic link"]),
    ("ds", ["--write_schema=", "ds: is a directory"]),
])
def test_write_schema_is_checked_before_any_work(files, capsys, write_schema, words):
  before = _contents(files)
  code = ingest.main(["--input", str(files / "log.csv"), "--out", str(files / "ds"),
                      "--schema", str(files / "spec.json"), "--rename", RENAME,
                      "--write_schema", str(files / write_schema)])
  err = capsys.readouterr().err
  assert code == 2 and "Traceback" not in err, err
  lines = err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("data.ingest: error: "), err
  for w in words:
    assert w in lines[0], lines[0]
  assert _contents(files) == before


def test_write_schema_to_a_new_file_still_works(files, capsys):
  spec = files / "new" / "spec.json"
  os.makedirs(spec.parent)
  code = ingest.main(["--input", str(files / "log.csv"), "--out", str(files / "out"),
                      "--rename", RENAME, "--ids_as_features", "--write_schema", str(spec)])
  assert code == 0, capsys.readouterr().err
  assert '"request_ts": "time"' in spec.read_text() and not (files / "out").exists()
