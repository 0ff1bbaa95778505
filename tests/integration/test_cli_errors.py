"""Bad invocations of every command line program fail fast with one error line, never a
traceback: train.py, eval.py, ``python -m data.synthetic``, ``python -m data.validate`` and the
FM export. Every case is a subprocess that stops before any compilation; two run at a time."""

import concurrent.futures
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
  return {"data": data, "cut": cut, "shard": shard, "fresh": fresh, "old": str(old),
          "file": str(afile), "wd": str(base / "wd"), "missing": str(base / "missing")}


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
    ("train.py", ["--workdir={wd}", "--data_dir={cut}"], "{shard}: "),
    ("train.py", ["--workdir={wd}", "--data_dir={data}", "--config=kunlun/configs/dev.py"],
     "config does not fit the data schema"),
    ("eval.py", ["--workdir={missing}"], "no checkpoint"),
    ("eval.py", ["--workdir={old}"], "--trust_workdir"),
    ("eval.py", ["--workdir={old}", "--step=two"], "--step=two"),
    ("-m data.synthetic", ["--out={file}/sub", "--num_examples=50"], "Not a directory"),
    ("-m data.synthetic", ["--out={wd}", "--num_examples=-5"], "num_examples must be > 0"),
    ("-m data.synthetic", ["--out={wd}", "--preset=huge"], "invalid choice: 'huge'"),
    ("-m data.validate", ["{missing}"], "no such directory"),
    ("-m kunlun.transfer.export", ["--workdir={fresh}", "--out={wd}"], "no checkpoint"),
    ("-m kunlun.transfer.export", ["--workdir={old}", "--out={wd}"], "--trust_workdir"),
    ("-m kunlun.transfer.export", ["--workdir={fresh}"], "--out"),
]


def _run(case, paths, env):
  prog, args, _ = case
  args = [a.format(**paths) for a in args]
  cmd = [sys.executable, *(prog.split() if prog.startswith("-m") else [prog]), *args]
  return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


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
