"""The benchmarks' flags: a value out of range, a preset that does not exist or a --workdir that
cannot be made is a one-line error before any work (argparse's usage error for a flag's type)."""

import argparse
import importlib
import re

import pytest

from bench import embedding_update, output, serving
from bench.faults import run as faults


def test_at_least_and_int_list():
  assert output.at_least(0)("0") == 0 and output.int_list(1)("4,16") == [4, 16]
  for bad, why in (("-1", "-1 is below 0"), ("x", "'x' is not an integer"), ("1.5", "not an")):
    with pytest.raises(argparse.ArgumentTypeError, match=why):
      output.at_least(0)(bad)
  with pytest.raises(argparse.ArgumentTypeError, match="0 is below 1"):
    output.int_list(1)("4,0")


def _one_line(e, why):
  msg = str(e.value.code)
  assert len(msg.splitlines()) == 1 and re.search(why, msg), msg


@pytest.mark.parametrize("argv, why", [
    (["--config", "nope"], r"--config nope: not a preset"),
    (["--seconds", "0"], r"need seconds > 0"),
    (["--min_iters", "5", "--max_iters", "2"], r"min_iters <= max_iters"),
])
def test_serving_flags(argv, why, monkeypatch):
  monkeypatch.setattr(serving, "run", lambda a: pytest.fail("ran with bad flags"))
  with pytest.raises(SystemExit) as e:
    serving.main(argv)
  _one_line(e, why)


def test_serving_good_flags_parse():
  a = serving._parse(["--config", "tiny", "--candidates", "4,8"])
  assert a.candidates == [4, 8] and a.config == "tiny"


@pytest.mark.parametrize("main, argv, why", [
    (faults.main, ["--kills", "-1"], r"argument --kills: -1 is below 0"),
    (faults.main, ["--steps", "x"], r"argument --steps: 'x' is not an integer"),
    (embedding_update.main, ["--rows", "abc"], r"argument --rows: 'abc' is not an integer"),
    (embedding_update.main, ["--dim", "-4"], r"argument --dim: -4 is below 1"),
    (embedding_update.main, ["--step_bytes", "1,0"], r"argument --step_bytes: 0 is below 1"),
    (serving.main, ["--candidates", "16,x"], r"argument --candidates: 'x' is not an integer"),
    (serving.main, ["--candidates", "0,16"], r"argument --candidates: 0 is below 1"),
    (serving.main, ["--min_iters", "0"], r"argument --min_iters: 0 is below 1"),
])
def test_numbers_out_of_range_are_usage_errors(main, argv, why, capsys):
  with pytest.raises(SystemExit) as e:
    main(argv + ["--out", "/nonexistent/never.json"])
  assert e.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert re.search(why, err[-1]) and "Traceback" not in "\n".join(err), err


def test_embedding_update_unknown_config_before_any_work(monkeypatch):
  monkeypatch.setattr(embedding_update, "bench_one", lambda *a: pytest.fail("ran"))
  with pytest.raises(SystemExit) as e:
    embedding_update.main(["--train_step", "nope", "--out", "/nonexistent/never.json"])
  _one_line(e, r"--config nope: not a preset")


@pytest.mark.parametrize("module", ["bench.experiments.transfer", "bench.experiments.ablations",
                                    "bench.experiments.ladder", "bench.experiments.real_data",
                                    "bench.experiments.scaling", "bench.faults.run"])
def test_a_workdir_that_cannot_be_made_is_one_line(module, tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("")                          # a file where the folder's parent should be
  with pytest.raises(SystemExit) as e:
    importlib.import_module(module).main(["--workdir", str(blocker / "work"), "--out",
                                          str(tmp_path / "never.json")])
  _one_line(e, r"--workdir .*/file/work: cannot make the folder \(Not a directory\)")


@pytest.mark.parametrize("module, argv, why", [
    ("bench.jagged_buckets", ["--padded", "p.json", "--buckets", "b.json", "--batches", "0"],
     r"argument --batches: 0 is below 1"),
    ("bench.collectives", ["--batch", "-64"], r"argument --batch: -64 is below 1"),
    ("bench.jagged_capacity", ["--sample", "x"], r"argument --sample: 'x' is not an integer"),
    ("bench.experiments.ladder", ["--seeds", "0", "-1"], r"argument --seeds: -1 is below 0"),
    ("bench.experiments.scaling", ["--batch_size", "0"], r"argument --batch_size: 0 is below 1"),
    ("bench.experiments.transfer", ["--fm_steps", "0"], r"argument --fm_steps: 0 is below 1"),
    ("bench.experiments.real_data", ["--max_len", "0"], r"argument --max_len: 0 is below 1"),
    ("bench.experiments.ablations", ["--size", "-1"], r"argument --size: -1 is below 0"),
])
def test_every_bench_count_flag_is_checked(module, argv, why, capsys):
  with pytest.raises(SystemExit) as e:
    importlib.import_module(module).main(argv)
  assert e.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert re.search(why, err[-1]), err
