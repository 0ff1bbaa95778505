"""Bad invocations of every command line program fail fast with one error line, never a
traceback: train.py, eval.py, ``python -m data.synthetic``, ``data.ingest``, ``data.validate``,
the FM export, ``kunlun.serving.export`` and ``bench/real_data.py``. Every case is a subprocess
that stops before any compilation (most before importing jax); two run at a time."""

import concurrent.futures
import json
import os
import pickle
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
  from data import synthetic
  from kunlun.configs import tiny
  from kunlun.train import runtime
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
  runtime.save_run_info(fresh, tiny.get_config(), data)
  old = base / "old"                                      # an older workdir: config.pkl only
  (old / "checkpoints" / "2").mkdir(parents=True)
  (old / "checkpoints" / "2" / "commit_success.txt").write_text("ok")
  (old / "config.pkl").write_bytes(pickle.dumps(tiny.get_config()))
  afile = base / "afile"
  afile.write_text("x")
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
  return {"data": data, "cut": cut, "shard": shard, "fresh": fresh, "old": str(old),
          "file": str(afile), "wd": str(base / "wd"), "missing": str(base / "missing"),
          "out": str(base / "ingest_out"), "badschema": str(badschema),
          "dupcol": str(base / "dupcol.csv"), "bigid": str(base / "bigid.csv"),
          "holder": str(holder), "held": str(holder / "log.csv"),
          **{k: str(base / v) for k, v in names.items()}}


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
     "config.train.microbatches=3 must be >= 1 and divide"),
    ("train.py", ["--workdir={wd}", "--data_dir={cut}"], "{shard}: "),
    ("train.py", ["--workdir={wd}", "--data_dir={data}",
                  "--config.data.surface_weights=feed=1,search=1"], "unknown surface(s) ['search']"),
    ("eval.py", ["--workdir={missing}"], "no checkpoint"),
    ("eval.py", ["--workdir={old}"], "--trust_workdir"),
    ("eval.py", ["--workdir={old}", "--step=two"], "--step=two"),
    ("-m data.synthetic", ["--out={file}/sub", "--num_examples=50"], "Not a directory"),
    ("-m data.synthetic", ["--out={wd}", "--num_examples=-5"], "num_examples must be > 0"),
    ("-m data.synthetic", ["--out={wd}", "--preset=huge"], "invalid choice: 'huge'"),
    ("-m data.validate", ["{missing}"], "no such directory"),
    ("-m data.validate", ["{file}"], "not a directory"),
    ("-m data.validate", ["{fresh}"], "no schema.json"),
    ("-m data.validate", ["{badschema}"], "schema.json: not valid JSON"),
    ("-m data.validate", ["{data}", "--split=nope"], "unknown split(s) ['nope']"),
    ("-m data.validate", ["{data}", "--update_manifest"], "--update_manifest needs --deep"),
    ("-m data.validate", ["{data}", "--json={missing}/r.json"], "--json={missing}/r.json"),
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
    ("-m kunlun.serving.export", ["--workdir={old}", "--out={wd}", "--trust_workdir",
                                  "--data_dir={data}"], "incomplete or corrupt"),
    # {inter} (rows that do not parse) stops the bench early should a flag check ever be lost:
    # without --inter it would download MovieLens and train
    ("bench/real_data.py", ["--inter={inter}", "--archs=kunlun,gbdt"], "unknown ['gbdt']"),
    ("bench/real_data.py", ["--inter={inter}", "--seeds=a,b"], "--seeds=a,b"),
    ("bench/real_data.py", ["--inter={inter}", "--Cs=0,1"], "--Cs=0,1"),
    ("bench/real_data.py", ["--inter={inter}", "--max_epochs=-1"], "--max_epochs=-1"),
    ("bench/real_data.py", ["--inter={missing}"], "--inter={missing}: no such file"),
    ("bench/real_data.py", ["--inter={log}"], "not a known MovieLens format"),
    ("bench/real_data.py", ["--inter={inter}", "--archs=lr"], "{inter}: line 2"),
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
                        "--rename=request_ts=ts,user_id=user,ad_id=item,label.click=clicked"],
     "--runner beam needs apache-beam"),
]


def _run(case, paths, env):
  prog, args, _ = case
  args = [a.format(**paths) for a in args]
  cmd = [sys.executable, *(prog.split() if prog.startswith("-m") else [prog]), *args]
  try:
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  except subprocess.TimeoutExpired as e:     # e.g. a case that no longer fails and trains
    out = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
    return subprocess.CompletedProcess(cmd, "timeout", out, "")


def test_bad_invocations_give_one_error_line(paths):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, XLA_FLAGS="",
             KUNLUN_COMPILATION_CACHE="")
  env.pop("JAX_NUM_CPU_DEVICES", None)
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    results = list(pool.map(lambda c: _run(c, paths, env), CASES))
  failures = []
  for (prog, args, want), p in zip(CASES, results, strict=True):
    out = p.stdout + p.stderr
    errors = [x for x in out.splitlines() if "error:" in x.lower()]
    want = want.format(**paths)
    ok = (p.returncode == 2 and "Traceback" not in out and len(errors) == 1
          and want in errors[0])
    if not ok:
      failures.append(f"{prog} {args}: rc={p.returncode} errors={errors} want {want!r}\n"
                      f"{out[-1500:]}")
  assert not failures, "\n\n".join(failures)
