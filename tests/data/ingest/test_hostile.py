"""Hostile inputs to data.ingest (issue 29): names from the data that are paths, values
formatted into SQL, unbounded workers, label leaks through built histories, overlapping split
files, --overwrite of what is not a dataset, --out symlinks, per-batch id hashing, workers that
outlive their parent. Each case ends in one line (``data.ingest: error: ...``, status 2) or
works, and writes nothing outside --out."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data import ingest, verify
from data.ingest.infer import Spec
from data.schema import Schema

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
RENAME = "request_ts=time,user_id=uid,ad_id=ad,label.click=click,surface=tab,dense.bid=bid"


def _csv(path, n=20, t0=1_700_000_000, tab=None, step=60):
  rng = np.random.default_rng(0)
  tabs = tab if tab is not None else ["feed"] * n
  rows = ["time,uid,ad,tab,click,bid"] + [
      f"{t0 + i * step},{i % 4},{10 + i % 3},{tabs[i]},{int(rng.random() < 0.5)},{i / 10}"
      for i in range(n)]
  path.write_text("\n".join(rows) + "\n")
  return str(path)


def _main(argv, capsys):
  code = ingest.main(argv)
  cap = capsys.readouterr()
  return code, cap.out, cap.err


def _one_line(code, err, *words):
  assert code == 2, err
  last = err.strip().splitlines()[-1]
  assert last.startswith("data.ingest: error: "), last
  assert "Traceback" not in err
  for w in words:
    assert w in last, last
  return last


# ---- 1. names from the data --------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["/../../../../outside/PWNED", "../..", "a/b", ".."])
def test_surface_that_is_a_path_is_refused(tmp_path, capsys, bad):
  work = tmp_path / "w"
  work.mkdir()
  src = _csv(work / "log.csv", tab=["feed"] * 10 + [bad] * 10)
  out = work / "a" / "b" / "ds"
  code, _, err = _main(["--input", src, "--out", str(out), "--rename", RENAME, "--yes",
                        "--split", "none"], capsys)
  _one_line(code, err, repr(bad))
  assert sorted(os.listdir(tmp_path)) == ["w"]
  assert not out.exists() and not (tmp_path / "outside").exists()


def test_schema_json_cannot_carry_a_path(tmp_path):
  d = {"sparse": [], "dense": [], "streams": [], "surfaces": ["feed", "../../x"],
       "tasks": [{"name": "click"}]}
  (tmp_path / "schema.json").write_text(json.dumps(d))
  with pytest.raises(ValueError, match="'../../x'"):
    Schema.load(str(tmp_path))
  for kind, bad in (("tasks", [{"name": "a/b"}]), ("dense", ["x/../y"]),
                    ("sparse", [{"name": "..", "vocab_size": 3}])):
    with pytest.raises(ValueError, match="not a safe name"):
      Schema.from_dict({**d, "surfaces": ["feed"], kind: bad})
  with pytest.raises(ValueError, match="not a safe name"):
    Schema.from_dict({**d, "surfaces": ["feed"], "streams": [
        {"name": "c/d", "max_len": 2, "item_vocab": 3, "action_vocab": 2}]})


def test_manifest_records_relative_paths(tmp_path, capsys):
  src = _csv(tmp_path / "log.csv", tab=["feed", "réels"] * 10)
  out = tmp_path / "ds"
  code, _, err = _main(["--input", src, "--out", str(out), "--rename", RENAME, "--yes"], capsys)
  assert code == 0, err
  m = json.load(open(out / "manifest.json"))
  files = [e["file"] for s in m["splits"].values() for es in s.values() for e in es]
  assert files and all(not os.path.isabs(f) and ".." not in f.split(os.sep) for f in files)


# ---- 2, 3. SQL settings ------------------------------------------------------------------------

def test_memory_limit_and_workers_are_checked(tmp_path, capsys, monkeypatch):
  monkeypatch.chdir(tmp_path)
  src = _csv(tmp_path / "log.csv")
  base = ["--input", src, "--rename", RENAME, "--yes"]
  code, _, err = _main(base + ["--out", "o1", "--memory_limit", "lots"], capsys)
  _one_line(code, err, "--memory_limit")
  inj = "1GB'; COPY (SELECT 'pwned') TO 'inj.csv'; SET threads='1"
  code, _, err = _main(base + ["--out", "o2", "--memory_limit", inj], capsys)
  _one_line(code, err, "--memory_limit")
  code, _, err = _main(base + ["--out", "o3", "--workers", "100000"], capsys)
  _one_line(code, err, "--workers")
  assert sorted(os.listdir(tmp_path)) == ["log.csv"]


def test_engine_settings_never_formatted_into_sql(tmp_path, monkeypatch):
  from data.ingest.sql import connect
  monkeypatch.chdir(tmp_path)
  with pytest.raises(ValueError, match="memory_limit"):
    connect(str(tmp_path), 1, "1GB'; COPY (SELECT 1) TO 'x.csv'; SET threads='1")
  assert not (tmp_path / "x.csv").exists()
  d = tmp_path / "it's"
  con = connect(str(d), 2, "512MB")
  assert con.execute("SELECT current_setting('temp_directory')").fetchone()[0].endswith(
      os.path.join("it's", "duckdb_tmp"))
  con.close()


@pytest.mark.parametrize("name", ["it's", "x';COPY (SELECT 'pwned') TO 'inj.csv';SELECT '"])
def test_out_with_an_apostrophe_works(tmp_path, capsys, monkeypatch, name):
  monkeypatch.chdir(tmp_path)
  src = _csv(tmp_path / "log.csv")
  code, _, err = _main(["--input", src, "--out", name, "--rename", RENAME, "--yes",
                        "--history", "impression=all"], capsys)
  assert code == 0, err
  assert (tmp_path / name / "manifest.json").exists()
  assert not (tmp_path / "inj.csv").exists()


# ---- 4. label delays ---------------------------------------------------------------------------

def _delay_log():
  """User 0: a converted click at t, then requests 10 s, 2 min and 2 days later."""
  t0 = 1_700_000_000
  return pa.table({"time": [t0, t0 + 10, t0 + 120, t0 + 2 * 86400],
                   "uid": [0, 0, 0, 0], "ad": [5, 6, 7, 8], "click": [1, 0, 0, 0],
                   "conv": [1, 0, 0, 0]})


def _delay_run(tmp_path, name, engine, delay=None):
  spec = {"columns": {"request_ts": "time", "user_id": "uid", "ad_id": "ad",
                      "label.click": "click", "label.conversion": "conv"},
          "history": {"streams": {"imp": "all", "conv": "label.conversion"}, "max_len": 4,
                      "stats": True, **({"label_delay": delay} if delay is not None else {})}}
  out = str(tmp_path / name)
  ingest.run({None: [ingest.Source(table=_delay_log(), name="t")]}, out, Spec.from_dict(spec),
             split="none", yes=True, engine=engine, out=open(os.devnull, "w"),
             err=open(os.devnull, "w"))
  recs = sorted((r for _, _, r in verify.read_split(out, "train")),
                key=lambda r: int(r["request_ts"]))
  return recs


@pytest.mark.parametrize("engine", ["memory", "duckdb"])
def test_conversions_are_delayed_by_default(tmp_path, engine):
  recs = _delay_run(tmp_path, "d", engine)
  # schema dense: user_count, user_click_rate, user_conversion_rate, ad_count, ...
  r10, r120, r2d = recs[1], recs[2], recs[3]
  for r, rate in ((r10, 2 / 3), (r120, 2 / 4)):
    assert r["events/imp"][:, 1].tolist()[0] == 1          # the click bit only
    assert len(r["events/conv"]) == 0                       # not known yet
    assert r["dense"][1] == pytest.approx(rate)            # click seen
    assert r["dense"][2] == pytest.approx(0.5)             # conversion prior
  assert r2d["events/imp"][0, 1] == 3 and len(r2d["events/conv"]) == 1
  assert r2d["dense"][2] == pytest.approx(2 / 5)
  recs = _delay_run(tmp_path, "d2", engine, {"click": "1m", "conversion": "0s"})
  assert recs[1]["events/imp"][0, 1] == 2 and len(recs[1]["events/conv"]) == 1
  assert recs[1]["dense"][1] == pytest.approx(0.5)        # the click not seen yet: the prior
  assert recs[2]["events/imp"][0, 1] == 3                 # 2 minutes on: both seen


def test_label_delay_flag_is_checked(tmp_path, capsys):
  src = _csv(tmp_path / "log.csv")
  base = ["--input", src, "--rename", RENAME, "--yes", "--history", "imp=all"]
  code, _, err = _main(base + ["--out", str(tmp_path / "o"), "--label_delay", "click=soon"],
                       capsys)
  _one_line(code, err, "--label_delay")
  code, _, err = _main(base + ["--out", str(tmp_path / "o"), "--label_delay", "nope=1d"],
                       capsys)
  _one_line(code, err, "nope")
  code, _, err = _main(base + ["--out", str(tmp_path / "o"), "--label_delay", "click=5m"],
                       capsys)
  assert code == 0, err


# ---- 5. explicit split files -------------------------------------------------------------------

def test_overlapping_split_files(tmp_path, capsys):
  early = _csv(tmp_path / "early.csv", t0=1_700_000_000)
  late = _csv(tmp_path / "late.csv", t0=1_700_100_000)
  base = ["--rename", RENAME, "--yes"]
  code, _, err = _main(["--train", late, "--eval", early, "--out", str(tmp_path / "o")] + base,
                       capsys)
  _one_line(code, err, "overlap", "--allow_overlap")
  code, _, err = _main(["--train", early, "--eval", early, "--out", str(tmp_path / "o")] + base,
                       capsys)
  _one_line(code, err, "early.csv")
  code, _, err = _main(["--train", late, "--eval", early, "--out", str(tmp_path / "o"),
                        "--allow_overlap"] + base, capsys)
  assert code == 0 and "warning" in err and "overlap" in err, err
  code, _, err = _main(["--train", early, "--eval", late, "--out", str(tmp_path / "o2")] + base,
                       capsys)
  assert code == 0, err


# ---- 6, 9, 16. --out and --overwrite -----------------------------------------------------------

def test_overwrite_refuses_a_foreign_manifest(tmp_path, capsys):
  src = _csv(tmp_path / "log.csv")
  app = tmp_path / "webapp"
  app.mkdir()
  (app / "manifest.json").write_text('{"name": "my app", "icons": []}')
  (app / "index.html").write_text("<html/>")
  code, _, err = _main(["--input", src, "--out", str(app), "--rename", RENAME, "--yes",
                        "--overwrite"], capsys)
  _one_line(code, err, "not a kunlun dataset")
  assert sorted(os.listdir(app)) == ["index.html", "manifest.json"]


def test_overwrite_removes_only_what_the_manifest_lists(tmp_path, capsys):
  src = _csv(tmp_path / "log.csv")
  out = tmp_path / "ds"
  args = ["--input", src, "--out", str(out), "--rename", RENAME, "--yes"]
  assert _main(args, capsys)[0] == 0
  (out / "notes.txt").write_text("mine")
  code, _, err = _main(args + ["--overwrite"], capsys)
  _one_line(code, err, "notes.txt")
  assert (out / "notes.txt").exists() and (out / "manifest.json").exists()


def test_out_symlink_with_overwrite(tmp_path, capsys):
  src = _csv(tmp_path / "log.csv")
  target = tmp_path / "real"
  link = tmp_path / "link"
  args = ["--input", src, "--out", str(target), "--rename", RENAME, "--yes"]
  assert _main(args, capsys)[0] == 0
  link.symlink_to(target)
  code, _, err = _main(["--input", src, "--out", str(link), "--rename", RENAME, "--yes",
                        "--overwrite"], capsys)
  assert code == 0, err
  assert link.is_symlink() and os.path.realpath(link) == str(target)
  assert (target / "manifest.json").exists()
  assert sorted(os.listdir(tmp_path)) == ["link", "log.csv", "real"]


def test_out_symlink_to_an_empty_directory(tmp_path, capsys):
  src = _csv(tmp_path / "log.csv")
  target = tmp_path / "empty"
  target.mkdir()
  link = tmp_path / "link"
  link.symlink_to(target)
  code, _, err = _main(["--input", src, "--out", str(link), "--rename", RENAME, "--yes"], capsys)
  assert code == 0, err
  assert link.is_symlink() and (target / "manifest.json").exists()


def test_split_with_no_train_rows_is_refused(tmp_path, capsys):
  src = _csv(tmp_path / "log.csv", t0=1_700_000_000)
  code, _, err = _main(["--input", src, "--out", str(tmp_path / "o"), "--rename", RENAME,
                        "--yes", "--split", "ts:1600000000,1800000000"], capsys)
  _one_line(code, err, "--split=ts:1600000000,1800000000", "train")
  assert not (tmp_path / "o").exists()


# ---- 8. one id decision per column -------------------------------------------------------------

@pytest.mark.parametrize("engine", ["memory", "duckdb"])
def test_one_hashing_decision_per_id_column(tmp_path, engine):
  uid = [1, 2, 3, 1, 2, 3, 2 ** 40, 1]
  t = pa.table({"time": 1_700_000_000 + np.arange(8) * 60, "uid": uid, "ad": [7] * 8,
                "click": [0, 1] * 4})
  a, b = t.slice(0, 4), t.slice(4)
  pq.write_table(a, str(tmp_path / "a.parquet"))
  pq.write_table(b, str(tmp_path / "b.parquet"))
  spec = Spec.from_dict({"columns": {"request_ts": "time", "user_id": "uid", "ad_id": "ad",
                                     "label.click": "click"}, "ids_as_features": True})
  for name, srcs in (("one", [ingest.Source(table=t, name="t", batch_rows=4)]),
                     ("two", [ingest.Source(str(tmp_path / "a.parquet")),
                              ingest.Source(str(tmp_path / "b.parquet"))])):
    out = str(tmp_path / f"{name}-{engine}")
    ingest.run({None: srcs}, out, spec, split="none", yes=True, engine=engine,
               out=open(os.devnull, "w"), err=open(os.devnull, "w"))
    recs = [r for _, _, r in verify.read_split(out, "train")]
    by_ts = {int(r["request_ts"]): int(r["user_id"]) for r in recs}
    users = [by_ts[1_700_000_000 + 60 * i] for i in range(8)]
    assert len(set(users)) == 4, users
    assert users[0] == users[3] == users[7] and users[1] == users[4]


# ---- 14. workers die with their parent ---------------------------------------------------------

_PARENT = """
import concurrent.futures, multiprocessing, os, sys, time
from data.ingest import engine
if __name__ == "__main__":
  with concurrent.futures.ProcessPoolExecutor(
      2, mp_context=multiprocessing.get_context("spawn"), initializer=engine._worker_init) as p:
    pids = [p.submit(os.getpid).result() for _ in range(4)]
    print(" ".join(map(str, set(pids))), flush=True)
    time.sleep(60)
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_workers_die_with_their_parent(tmp_path, sig):
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  proc = subprocess.Popen([sys.executable, "-c", _PARENT], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, text=True)
  try:
    pids = [int(x) for x in proc.stdout.readline().split()]
    assert pids
    proc.send_signal(sig)
    proc.wait(timeout=20)
    deadline = time.time() + 15
    alive = pids
    while alive and time.time() < deadline:
      alive = [p for p in alive if _alive(p)]
      time.sleep(0.1)
    assert not alive, f"workers {alive} outlived their parent"
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()


def _alive(pid):
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().split(")")[-1].split()[0] != "Z"
  except FileNotFoundError:
    return False
