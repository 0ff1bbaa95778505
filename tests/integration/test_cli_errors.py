"""Bad invocations of every command line program fail fast with one error line, never a
traceback: train.py, eval.py, ``python -m data.synthetic``, ``data.ingest``, ``data.verify``,
the FM export, ``kunlun.serving.export`` and ``bench/experiments/real_data.py``. Every case is a subprocess
that stops before any compilation (most before importing jax); two run at a time. Bad settings
(issue 20) stop before any data is read: train.py is given a real dataset and would train (and
time out here) if a check were lost; so are a workdir held by another train.py, output paths
that are directories, read-only or full, and a run_info.json with a bad config."""

import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest

from tests import fs_faults, subproc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# imported once by the interpreter the cases are forked from (tests/subproc.Programs)
PRELOAD = (*subproc.TRAIN_MODULES, "kunlun.serving.score")
HOLD = ("import sys, time\n"
        "from kunlun.utils.lock import WorkdirLock\n"
        "WorkdirLock(sys.argv[1]).acquire()\n"
        "print('held', flush=True)\n"
        "time.sleep(3600)\n")


def _checkpointed(wd, data):
  """A workdir with run_info.json (tiny config) and one committed checkpoint of a stand-in tree:
  enough for the checks that come before a restore."""
  import grain
  import jax.numpy as jnp

  from kunlun.configs import tiny
  from kunlun.train import checkpoint, run_info
  run_info.save_run_info(wd, tiny.get_config(), data)
  ck = checkpoint.Checkpointer(os.path.join(wd, "checkpoints"))
  it = iter(grain.MapDataset.range(8).to_iter_dataset().batch(2))
  ck.save(2, {"w": jnp.ones(4)}, {"m": jnp.zeros(4)}, __import__("jax").random.key(0), it)
  ck.close()


def _edit_run_info(src, dst, edit):
  shutil.copytree(src, dst)
  path = os.path.join(dst, "run_info.json")
  info = json.load(open(path))
  edit(info)
  json.dump(info, open(path, "w"))


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
  from data import synthetic
  from kunlun.configs import tiny
  from kunlun.train import run_info
  base = tmp_path_factory.mktemp("cli")
  data = str(base / "data")
  synthetic.generate(data, "tiny", num_examples=200, seed=0)
  cut = str(base / "cut")                                 # a train shard cut short
  import shutil
  shutil.copytree(data, cut)
  shard = os.path.join(cut, "train", "feed-00000-of-00001.arrayrecord")
  with open(shard, "r+b") as f:
    f.truncate(os.path.getsize(shard) // 2)
  fresh = str(base / "fresh")                             # run info, no checkpoints
  run_info.save_run_info(fresh, tiny.get_config(), data)
  old = base / "old"                                      # an older workdir: config.pkl only
  (old / "checkpoints" / "2").mkdir(parents=True)
  (old / "checkpoints" / "2" / "commit_success.txt").write_text("ok")
  (old / "config.pkl").write_bytes(pickle.dumps(tiny.get_config()))
  afile = base / "afile"
  afile.write_text("x")
  os.mkfifo(base / "fifo")                                # an output path that is no file
  f = {}                                                  # small input files for data.ingest
  f["log"] = "ts,user,item,clicked\n100,1,5,1\n200,2,6,0\n300,1,7,1\n400,3,5,0\n"
  f["badlabel"] = "ts,user,item,clicked\n100,1,5,1\n200,2,6,maybe\n"
  f["spec"] = json.dumps({"columns": {"request_ts": "time", "user_id": "user", "ad_id": "item",
                                      "label.click": "clicked"}})     # 'time': not in the log
  f["badjson"] = '{"columns": {"request_ts": "ts",'
  f["badtype"] = json.dumps({"schema": {"tasks": "click"}})
  f["parquet"] = "not parquet"
  f["inter"] = "user_id:token\titem_id:token\trating:float\ttimestamp:float\n1\tx\tfive\t8\n"
  names = {"log": "log.csv", "badlabel": "badlabel.csv", "spec": "spec.json",
           "badjson": "bad.json", "badtype": "badtype.json", "parquet": "log.parquet",
           "inter": "bad.inter"}
  for k, text in f.items():
    (base / names[k]).write_text(text)
  (base / "dupcol.csv").write_text("ts,user,item,clicked,user\n100,1,5,1,3\n200,2,6,0,4\n")
  (base / "bigid.csv").write_text("ts,user,item,clicked\n100,9223372036854775808,5,1\n"
                                  "200,2,6,0\n")
  holder = base / "holder"                                # a dataset holding its own input
  holder.mkdir()
  (holder / "manifest.json").write_text("{}")
  (holder / "log.csv").write_text(f["log"])
  badschema = base / "badschema"                          # a dataset whose schema.json is cut
  badschema.mkdir()
  (badschema / "schema.json").write_text('{"sparse": [')
  ck = str(base / "ck")                                   # run info + a committed checkpoint
  _checkpointed(ck, data)
  _edit_run_info(ck, str(base / "info_null"), lambda i: i.update(config=None))
  _edit_run_info(ck, str(base / "info_nomodel"), lambda i: i["config"].pop("model"))
  _edit_run_info(ck, str(base / "info_huge"),
                 lambda i: i["config"]["data"].update(batch_size=10**12))
  _edit_run_info(ck, str(base / "info_str"), lambda i: i["config"]["data"].update(batch_size="64"))
  locked = base / "locked"                                # held by another train.py
  locked.mkdir()
  locker = subprocess.Popen([sys.executable, "-c", HOLD, str(locked)], cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.PIPE,
                            text=True)
  assert locker.stdout.readline().strip() == "held"
  yield {"data": data, "cut": cut, "shard": shard, "fresh": fresh, "old": str(old),
         "file": str(afile), "fifo": str(base / "fifo"), "wd": str(base / "wd"),
         "missing": str(base / "missing"),
         "out": str(base / "ingest_out"), "badschema": str(badschema), "ck": ck,
         "dupcol": str(base / "dupcol.csv"), "bigid": str(base / "bigid.csv"),
         "holder": str(holder), "held": str(holder / "log.csv"),
         "locked": str(locked), "holder_pid": str(locker.pid),
         **{k: str(base / k) for k in ("info_null", "info_nomodel", "info_huge", "info_str")},
         **{k: str(base / v) for k, v in names.items()}}
  locker.kill()
  locker.wait(timeout=30)


# (program, args, a substring the error line must contain); {name} -> paths[name]
CASES = [
    ("train.py", ["--bogus=1"], "Unknown command line flag 'bogus'"),
    ("train.py", [], "--workdir"),
    ("train.py", ["--workdir={wd}", "--steps=abc"], "--steps=abc"),
    ("train.py", ["--workdir={wd}", "--config={missing}/c.py"], "cannot load the config file"),
    ("train.py", ["--workdir={wd}", "--config.train.nope=1"], "--config.train.nope=1: no such"),
    ("train.py", ["--workdir={wd}", "--config.train.lr=fast"], "--config.train.lr=fast"),
    ("train.py", ["--workdir={wd}", "steps=5"], "unexpected argument(s) ['steps=5']"),
    ("train.py", ["--workdir={wd}", "--data_dir={missing}"], "no such directory"),
    ("train.py", ["--workdir={wd}", "--config.train.microbatches=3"],
     "config.train.microbatches = 3: allowed a divisor of config.data.batch_size = 64"),
    # settings checked before any data is read (issue 20)
    ("train.py", ["--workdir={wd}", "--data_dir={data}", "--config.train.keep_checkpoints=0"],
     "config.train.keep_checkpoints = 0: allowed an integer >= 1"),
    ("train.py", ["--workdir={wd}", "--data_dir={data}", "--steps=-1"],
     "--steps=-1: allowed an integer in [0, 2147483647]"),
    ("train.py", ["--workdir={wd}", "--data_dir={data}", "--config.train.checkpoint_every=0"],
     "config.train.checkpoint_every = 0: allowed an integer >= 1"),
    ("train.py", ["--workdir={wd}", "--data_dir={data}", "--config.train.log_every=0"],
     "config.train.log_every = 0: allowed an integer >= 1"),
    ("train.py", ["--workdir={wd}", "--data_dir={data}", "--config.data.batch_size=0"],
     "config.data.batch_size = 0: allowed an integer in [1, 1048576]"),
    ("train.py", ["--workdir={wd}", "--data_dir={data}", "--config.data.batch_size=-64"],
     "config.data.batch_size = -64: allowed an integer in [1, 1048576]"),
    ("train.py", ["--workdir={wd}", "--config.train.max_bad_steps=-1"],
     "config.train.max_bad_steps = -1"),
    ("train.py", ["--workdir={file}"], "--workdir={file}: exists and is not a directory"),
    ("train.py", ["--workdir={file}/sub"], "--workdir={file}/sub: cannot create it"),
    ("train.py", ["--workdir={locked}", "--data_dir={data}"],
     "--workdir={locked} is in use: train.py (pid {holder_pid} on host"),
    ("train.py", ["--workdir={wd}", "--data_dir={cut}"], "{shard}: "),
    ("train.py", ["--workdir={wd}", "--data_dir={data}",
                  "--config.data.surface_weights=feed=1,search=1"], "unknown surface(s) ['search']"),
    # issue 39 (9, 10): refused before work, in one line
    ("train.py", ["--workdir={wd}", "--data_dir={data}", "--config.seed=1180591620717411303424"],
     "config.seed = 1180591620717411303424: allowed an integer in [0, 4294967295]"),
    ("train.py", ["--workdir={wd}", "--data_dir={data}",
                  "--config.data.jagged_capacity=click=64,click=1024"], "'click' given twice"),
    ("train.py", ["--workdir={wd}", "--data_dir={data}", "--config.data.jagged_buckets=3"],
     "data.jagged_buckets = 3 needs data.jagged_capacity=auto"),
    ("train.py", ["--workdir={wd}", "--data_dir={data}", "--config.data.jagged_capacity=auto",
                  "--config.model.arch=dlrm"], "packed towers run only with config.model.arch"),
    ("train.py", ["--workdir={wd}", "--data_dir={data}", "--config.data.jagged_capacity=auto",
                  "--config.model.arch=interformer"], "got 'interformer'"),
    ("train.py", ["--workdir={wd}", "--data_dir={data}", "--config.data.jagged_capacity=views=64"],
     "data.jagged_capacity: unknown stream(s) ['views']"),
    ("eval.py", ["--workdir={missing}"], "no checkpoint"),
    ("eval.py", ["--workdir={old}"], "--trust_workdir"),
    ("eval.py", ["--workdir={old}", "--step=two"], "--step=two"),
    ("eval.py", ["--workdir={ck}", "--batch_size=0"], "--batch_size=0: allowed an integer >= 1"),
    ("eval.py", ["--workdir={ck}", "--step=-2"], "--step=-2: allowed an integer >= 0"),
    ("eval.py", ["--workdir={ck}", "--out={ck}/checkpoints"],
     "--out={ck}/checkpoints: is a directory"),
    ("eval.py", ["--workdir={ck}", "--predictions={ck}"], "--predictions={ck}: is a directory"),
    ("eval.py", ["--workdir={ck}", "--out={file}/m.json"], "--out={file}/m.json: cannot create"),
    # issue 39: every output path is checked before any work (docs/outputs.md)
    ("eval.py", ["--workdir={ck}", "--out={wd}/m.json", "--predictions={wd}/m.json"],
     "--out={wd}/m.json and --predictions={wd}/m.json are the same path"),
    ("eval.py", ["--workdir={ck}", "--out={ck}/run_info.json"],
     "run_info.json belongs to the train.py workdir {ck}"),
    ("eval.py", ["--workdir={ck}", "--predictions={ck}/checkpoints/2/p.parquet"],
     "checkpoints belongs to the train.py workdir {ck}"),
    ("eval.py", ["--workdir={ck}", "--out={data}/metrics.json"], "lies inside the input {data}"),
    ("eval.py", ["--workdir={ck}", "--out={fifo}"], "--out={fifo}: is a FIFO (named pipe)"),
    ("eval.py", ["--workdir={ck}", "--split=train"],
     "--split=train is the split this model was trained on ({data}"),
    ("-m kunlun.serving.export", ["--workdir={ck}", "--out={ck}/best"],
     "best belongs to the train.py workdir {ck}"),
    ("-m kunlun.transfer.export", ["--workdir={ck}", "--out={data}"], "is the input {data}"),
    ("train.py", ["--workdir={data}/run", "--data_dir={data}", "--steps=1"],
     "--workdir={data}/run lies inside the input {data} (--data_dir)"),
    ("eval.py", ["--workdir={info_null}"], "unreadable run info (ValueError: config is None"),
    ("eval.py", ["--workdir={info_huge}"],
     "config.data.batch_size = 1000000000000: allowed an integer in [1, 1048576]"),
    ("eval.py", ["--workdir={info_str}"], "config.data.batch_size = '64': allowed an integer"),
    ("-m data.synthetic", ["--out={file}/sub", "--num_examples=50"], "Not a directory"),
    ("-m data.synthetic", ["--out={wd}", "--num_examples=-5"], "num_examples must be > 0"),
    ("-m data.synthetic", ["--out={wd}", "--preset=huge"], "invalid choice: 'huge'"),
    ("-m data.verify", ["{missing}"], "no such directory"),
    ("-m data.verify", ["{file}"], "not a directory"),
    ("-m data.verify", ["{fresh}"], "no schema.json"),
    ("-m data.verify", ["{badschema}"], "schema.json: not valid JSON"),
    ("-m data.verify", ["{data}", "--split=nope"], "unknown split(s) ['nope']"),
    ("-m data.verify", ["{data}", "--update_manifest"], "--update_manifest needs --deep"),
    ("-m data.verify", ["{data}", "--json={missing}/r.json"], "--json={missing}/r.json"),
    ("-m data.verify", ["{data}", "--json={data}/manifest.json"],
     "--json={data}/manifest.json lies inside the input {data} (DIR)"),
    ("-m data.verify", ["{data}", "--json={fifo}"], "--json={fifo}: is a FIFO (named pipe)"),
    ("-m data.ingest", ["--input={log}"], "required: --out"),
    ("-m data.ingest", ["--input={log}", "--out={out}", "--bogus"], "unrecognized arguments"),
    ("-m data.ingest", ["--input={missing}/a.csv", "--out={out}"], "{missing}/a.csv: no such"),
    ("-m data.ingest", ["--input={data}", "--out={out}"], "{data}: a directory"),
    ("-m data.ingest", ["--input={parquet}", "--out={out}"], "{parquet}: unreadable"),
    ("-m data.ingest", ["--input={log}", "--train={log}", "--out={out}"], "not both"),
    ("-m data.ingest", ["--input={log}", "--out={data}"], "exists and is not empty"),
    ("-m data.ingest", ["--input={log}", "--out={out}", "--records_per_shard=many"],
     "invalid int value: 'many'"),
    ("-m data.ingest", ["--input={log}", "--out={out}", "--records_per_shard=0"], "must be >= 1"),
    ("-m data.ingest", ["--input={log}", "--out={out}", "--split=time:0.5,0.6"],
     "--split=time:0.5,0.6"),
    ("-m data.ingest", ["--input={log}", "--out={out}", "--rename=time"], "--rename=time"),
    ("-m data.ingest", ["--input={log}", "--out={out}", "--schema={badjson}"],
     "{badjson}: cannot parse"),
    ("-m data.ingest", ["--input={log}", "--out={out}", "--schema={badtype}"],
     "schema.tasks must be a list"),
    ("-m data.ingest", ["--input={log}", "--out={out}", "--schema={spec}", "--yes"],
     "{log}: column(s) 'time' (as request_ts) named by the spec"),
    ("-m data.ingest", ["--input={badlabel}", "--out={out}", "--yes",
                        "--rename=request_ts=ts,user_id=user,ad_id=item,label.click=clicked"],
     "expected 0/1 labels"),
    ("-m kunlun.transfer.export", ["--workdir={fresh}", "--out={wd}"], "no checkpoint"),
    ("-m kunlun.transfer.export", ["--workdir={old}", "--out={wd}"], "--trust_workdir"),
    ("-m kunlun.transfer.export", ["--workdir={fresh}"], "--out"),
    ("-m kunlun.transfer.export", ["--workdir={ck}", "--out={wd}", "--batch_size=0"],
     "--batch_size=0: allowed an integer >= 1"),
    ("-m kunlun.transfer.export", ["--workdir={info_nomodel}", "--out={wd}"],
     "config.model: missing"),
    ("-m kunlun.transfer.export", ["--workdir={ck}", "--out={file}"],
     "--out={file}: exists and is not a directory"),
    ("-m kunlun.serving.export", ["--workdir={fresh}"], "--out"),
    ("-m kunlun.serving.export", ["--workdir={fresh}", "--out={wd}", "--step=two"],
     "invalid int value: 'two'"),
    ("-m kunlun.serving.export", ["--workdir={missing}", "--out={wd}"], "no such directory"),
    ("-m kunlun.serving.export", ["--workdir={fresh}", "--out={wd}"], "no checkpoint"),
    ("-m kunlun.serving.export", ["--workdir={fresh}", "--out={wd}", "--candidates=many"],
     "--candidates='many'"),
    ("-m kunlun.serving.export", ["--workdir={fresh}", "--out={wd}", "--platforms=metal"],
     "--platforms=metal"),
    ("-m kunlun.serving.export", ["--workdir={old}", "--out={wd}"], "--trust_workdir"),
    ("-m kunlun.serving.export", ["--workdir={info_nomodel}", "--out={wd}"],
     "config.model: missing"),
    ("-m kunlun.serving.export", ["--workdir={ck}", "--out={file}"],
     "--out={file}: exists and is not a directory"),
    ("-m kunlun.serving.export", ["--workdir={old}", "--out={wd}", "--trust_workdir",
                                  "--data_dir={data}"], "incomplete or corrupt"),
    # {inter} (rows that do not parse) stops the bench early should a flag check ever be lost:
    # without --inter it would download MovieLens and train
    ("bench/experiments/real_data.py", ["--inter={inter}", "--archs=kunlun,gbdt"], "unknown ['gbdt']"),
    ("bench/experiments/real_data.py", ["--inter={inter}", "--seeds=a,b"], "--seeds=a,b"),
    ("bench/experiments/real_data.py", ["--inter={inter}", "--Cs=0,1"], "--Cs=0,1"),
    ("bench/experiments/real_data.py", ["--inter={inter}", "--max_epochs=-1"], "--max_epochs=-1"),
    ("bench/experiments/real_data.py", ["--inter={missing}"], "--inter={missing}: no such file"),
    ("bench/experiments/real_data.py", ["--inter={log}"], "not a known MovieLens format"),
    ("bench/experiments/real_data.py", ["--inter={inter}", "--archs=lr"], "{inter}: line 2"),
    ("-m data.ingest", ["--input={dupcol}", "--out={out}", "--yes",
                        "--rename=request_ts=ts,user_id=user,ad_id=item,label.click=clicked"],
     "column name(s) ['user'] appear more than once"),
    ("-m data.ingest", ["--input={bigid}", "--out={out}", "--yes",
                        "--rename=request_ts=ts,user_id=user,ad_id=item,label.click=clicked"],
     "has integer ids outside the int64 range"),
    ("-m data.ingest", ["--input={held}", "--out={holder}", "--yes", "--overwrite",
                        "--rename=request_ts=ts,user_id=user,ad_id=item,label.click=clicked"],
     "--out={holder} contains the input {held}"),
    ("-m data.ingest", ["--input={log}", "--out={out}", "--runner=spark"],
     "invalid choice: 'spark'"),
    ("-m data.ingest", ["--input={log}", "--out={out}", "--workers=0"], "--workers=0 must be"),
    ("-m data.ingest", ["--input={log}", "--out={out}", "--yes", "--runner=beam",
                        "--rename=request_ts=ts,user_id=user,ad_id=item,label.click=clicked",
                        "--ids_as_features"], "--runner beam needs apache-beam"),
]


def _cmd(case, paths, i=0):
  prog, args, _ = case
  paths = dict(paths, wd=f"{paths['wd']}{i}")          # cases run in parallel: own workdirs
  return [*(prog.split() if prog.startswith("-m") else [prog]), *(a.format(**paths) for a in args)]


def _env():
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, XLA_FLAGS="",
             KUNLUN_COMPILATION_CACHE="")
  env.pop("JAX_NUM_CPU_DEVICES", None)
  env.pop("JAX_COMPILATION_CACHE_DIR", None)    # the suite's cache (tests/conftest.py): "" is off
  return env


@pytest.fixture(scope="module")
def progs():
  """One interpreter that imported jax & co. once; each case is the real program forked from it."""
  with subproc.Programs(_env(), PRELOAD) as p:
    yield p


def _check_table(cases, paths, progs):
  results = progs.run([_cmd(c, paths, i) for i, c in enumerate(cases)], timeout=300)
  failures = []
  for i, ((prog, args, want), p) in enumerate(zip(cases, results, strict=True)):
    out = p.stdout + p.stderr
    errors = [x for x in out.splitlines() if "error:" in x.lower()]
    want = want.format(**dict(paths, wd=f"{paths['wd']}{i}"))
    ok = (p.returncode == 2 and "Traceback" not in out and len(errors) == 1
          and want in errors[0])
    if not ok:
      failures.append(f"{prog} {args}: rc={p.returncode} errors={errors} want {want!r}\n"
                      f"{out[-1500:]}")
  assert not failures, "\n\n".join(failures)


def test_bad_invocations_give_one_error_line(paths, progs):
  _check_table(CASES, paths, progs)


def test_show_config_lists_every_field_with_overrides(paths):
  """``train.py --show_config``: every field, its value after overrides, a description; no
  workdir needed, nothing written."""
  p = subprocess.run([sys.executable, "train.py", "--show_config", "--config.train.lr=0.25",
                      "--config.seed=3"], cwd=ROOT, env=_env(), capture_output=True, text=True,
                     timeout=300)
  assert p.returncode == 0, p.stderr[-2000:]
  rows = {x.split(" = ")[0].strip(): x for x in p.stdout.splitlines() if " = " in x}
  assert "0.25" in rows["train.lr"] and "learning rate" in rows["train.lr"]
  assert rows["seed"].split(" = ")[1].split()[0] == "3"
  assert {"data.batch_size", "train.epochs", "model.arch", "model.backend", "train.remat",
          "sharding.rules", "model.towers.click.width"} <= set(rows)
  assert "(no description)" not in p.stdout and "all settings within" in p.stdout


@pytest.fixture(scope="module")
def fs_paths(paths, tmp_path_factory):
  """A read-only copy of the checkpointed workdir and of an empty directory, and a full disk
  (a 1 MB tmpfs filled up); skipped where this machine can make neither."""
  base = tmp_path_factory.mktemp("fs")
  ro_ck, ro = str(base / "ro_ck"), str(base / "ro")
  shutil.copytree(paths["ck"], ro_ck)
  os.makedirs(ro)
  cleanups = [fs_faults.make_readonly(ro_ck), fs_faults.make_readonly(ro)]
  full = str(base / "full")
  cleanups.append(fs_faults.small_fs(full, "1m"))
  if cleanups[-1] is not None:
    with open(os.path.join(full, "filler"), "wb") as f:
      try:
        f.write(b"\0" * (2 << 20))
      except OSError:
        pass
  if any(c is None for c in cleanups[:2]):
    pytest.skip("cannot make a read-only directory on this machine")
  yield dict(paths, ro_ck=ro_ck, ro=ro, full=full if cleanups[-1] else None)
  for c in reversed(cleanups):
    if c is not None:
      c()


def test_read_only_and_full_outputs_fail_before_work(fs_paths, progs):
  """A read-only workdir (train.py before writing anything; eval.py's default --out before it
  evaluates) and a full --out are one line naming the path and the OS reason."""
  cases = [
      ("train.py", ["--workdir={ro}", "--data_dir={data}"],
       "--workdir={ro}: cannot create train.lock (Read-only file system)"),
      ("train.py", ["--workdir={ro}/new", "--data_dir={data}"],
       "--workdir={ro}/new: cannot create it (Read-only file system)"),
      ("eval.py", ["--workdir={ro_ck}"],
       "--out (default)={ro_ck}/metrics.json: cannot write in {ro_ck} (Read-only file system)"),
      ("-m kunlun.transfer.export", ["--workdir={ck}", "--out={ro}/e"], "{ro}/e"),
  ]
  if fs_paths["full"]:
    cases.append(("eval.py", ["--workdir={ck}", "--out={full}/m.json"],
                  "--out={full}/m.json: cannot write in {full} (No space left on device)"))
  _check_table(cases, fs_paths, progs)


def test_resume_with_a_changed_model_is_refused_before_writing(paths, progs, tmp_path):
  """A resume whose model flags differ from the recorded run stops in one line (issue 29, 11)
  and leaves run_info.json as it was (issue 29, 7: it was rewritten before the refusal, so
  eval.py then built the new model and called the intact checkpoint corrupt)."""
  flags = ["--config.model.attention.kind=full", "--config.model.score_clip=0"]
  wds = [str(tmp_path / f"wd{i}") for i in range(len(flags))]
  before = []
  for wd in wds:
    shutil.copytree(paths["ck"], wd)
    before.append(open(os.path.join(wd, "run_info.json"), "rb").read())
  runs = progs.run([["train.py", f"--workdir={wd}", f"--data_dir={paths['data']}", flag]
                    for wd, flag in zip(wds, flags, strict=True)], timeout=600)
  for wd, flag, old, p in zip(wds, flags, before, runs, strict=True):
    out = p.stdout + p.stderr
    errors = [x for x in out.splitlines() if "error:" in x.lower()]
    assert p.returncode == 2 and "Traceback" not in out and len(errors) == 1, out[-3000:]
    assert "resuming with a changed model" in errors[0], errors
    assert flag.split(".")[-1].split("=")[0] in errors[0], errors
    assert "--allow_config_change" in errors[0]
    assert open(os.path.join(wd, "run_info.json"), "rb").read() == old
