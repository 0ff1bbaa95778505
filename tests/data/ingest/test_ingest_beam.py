"""``data.ingest --runner beam`` (Apache Beam, DirectRunner) = the embedded engine, example by
example, on the edge-case logs (same-second rows, a heavy user, null labels, unicode ids),
with histories and statistics, explicit splits and several buckets; the manifest written by
the pipeline's final step checks out (sizes, SHA-256, record counts).

apache-beam caps numpy / pyarrow / protobuf below the main venv's, so it lives in .venv-beam
(``bash scripts/setup.sh --beam``; scripts/test.sh creates it): from the main venv this test
runs itself there in a subprocess."""

import json
import os
import subprocess

import pyarrow.parquet as pq
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
BEAM_PY = os.environ.get("KUNLUN_BEAM_PYTHON", os.path.join(ROOT, ".venv-beam", "bin", "python"))

try:
  import apache_beam  # noqa: F401
  HAVE_BEAM = True
except ImportError:
  HAVE_BEAM = False


def _both(tmp_path, spec, sources, beam_args, **kw):
  from data import ingest
  from data.ingest.infer import Spec
  out = {}
  for eng in ("duckdb", "beam"):
    out[eng] = str(tmp_path / eng)
    ingest.run(sources(), out[eng], Spec.from_dict(spec), yes=True, engine=eng,
               out=open(os.devnull, "w"), err=open(os.devnull, "w"), beam_args=beam_args,
               **kw)
  return out


def check_beam_equals_engine(tmp_path):
  from data import ingest
  from data.verify import verify
  from tests.data.ingest.logs import SPEC, assert_same_examples, flat_log
  for i, (n, seed) in enumerate(((500, 0), (300, 1))):
    pq.write_table(flat_log(n, seed), str(tmp_path / f"log{i}.parquet"), row_group_size=97)
  srcs = lambda: {None: [ingest.Source(str(tmp_path / f"log{i}.parquet")) for i in range(2)]}
  out = _both(tmp_path, SPEC, srcs, ["--buckets", "4"], split="time:0.7,0.15,0.15")
  assert_same_examples(out["duckdb"], out["beam"])
  a, b = (json.load(open(f"{out[k]}/ingest.json")) for k in ("duckdb", "beam"))
  for k in ("counts", "examples", "split", "encodings", "coercions"):
    assert a[k] == b[k], k
  for s, rates in a["positive_rate"].items():
    assert rates == pytest.approx(b["positive_rate"][s])
  rep = verify(out["beam"], deep=True, stream=open(os.devnull, "w"),
               bar_stream=open(os.devnull, "w"))
  assert rep["ok"] and rep["sized"]                         # manifest: sizes, sha256, counts


def check_beam_equals_engine_explicit_splits_no_history(tmp_path):
  from data import ingest
  from tests.data.ingest.logs import SPEC, assert_same_examples, flat_log
  t = flat_log(300, 2)
  pq.write_table(t.slice(0, 200), str(tmp_path / "a.parquet"), row_group_size=64)
  import pyarrow.csv as pcsv
  pcsv.write_csv(t.slice(200), str(tmp_path / "b.csv"))
  srcs = lambda: {"train": [ingest.Source(str(tmp_path / "a.parquet"))],
                  "eval": [ingest.Source(str(tmp_path / "b.csv"))]}
  spec = {k: v for k, v in SPEC.items() if k != "history"}
  out = _both(tmp_path, spec, srcs, ["--buckets=2"], allow_overlap=True)   # a shuffled log
  assert_same_examples(out["duckdb"], out["beam"])


CHECKS = ("check_beam_equals_engine", "check_beam_equals_engine_explicit_splits_no_history")


def test_beam_equals_engine(tmp_path):
  """The checks above, here when this interpreter has Beam, else by .venv-beam's."""
  if HAVE_BEAM:
    for name in CHECKS:
      (tmp_path / name).mkdir()
      globals()[name](tmp_path / name)
    return
  if not os.path.exists(BEAM_PY):
    if os.environ.get("CI"):
      pytest.fail(f"{BEAM_PY} missing: scripts/test.sh creates it (bash scripts/setup.sh --beam)")
    pytest.skip(f"no {BEAM_PY}: create it with bash scripts/setup.sh --beam")
  # the system temp dir of the Beam process: empty again when it has exited (Beam's own
  # temporary dirs and caches go to a dir of the run's, removed at exit)
  sys_tmp = tmp_path / "system-tmp"
  sys_tmp.mkdir()
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", TMPDIR=str(sys_tmp))
  code = ("import pathlib, sys; import tests.data.ingest.test_ingest_beam as t; "
          "[getattr(t, n)(pathlib.Path(sys.argv[1]) / n) or print('ok', n) for n in t.CHECKS "
          "if (pathlib.Path(sys.argv[1]) / n).mkdir() is None]")
  p = subprocess.run([BEAM_PY, "-c", code, str(tmp_path)], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=1200)
  tail = (p.stdout + p.stderr)[-4000:]
  assert p.returncode == 0, tail
  assert all(f"ok {n}" in p.stdout for n in CHECKS), tail
  assert not os.listdir(sys_tmp), f"left in the temp dir: {sorted(os.listdir(sys_tmp))}"
