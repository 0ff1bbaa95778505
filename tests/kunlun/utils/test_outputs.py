"""The output-path rules every program shares (kunlun/utils/outputs.py, issue 39): an output is
not an input, not inside an input directory, not another output of the run, not an entry of a
directory another program owns, and not something other than what it writes; the allowed
layouts stay allowed. Expected messages are written out here."""

import os

import pytest

from kunlun.utils import outputs


@pytest.fixture()
def tree(tmp_path):
  """A dataset, a train.py workdir, a log, a config, a link to the dataset's parent."""
  (tmp_path / "data" / "train").mkdir(parents=True)
  (tmp_path / "data" / "schema.json").write_text("{}")
  (tmp_path / "wd" / "checkpoints" / "3").mkdir(parents=True)
  (tmp_path / "wd" / "run_info.json").write_text("{}")
  (tmp_path / "log.csv").write_text("a,b\n")
  (tmp_path / "cfg.py").write_text("")
  os.link(tmp_path / "log.csv", tmp_path / "hard.csv")
  (tmp_path / "alias").symlink_to(tmp_path)
  os.mkfifo(tmp_path / "fifo")
  return tmp_path


def test_an_output_is_no_input(tree):
  t = str(tree)
  inputs = [("--input", f"{t}/log.csv"), ("--data_dir", f"{t}/data"), ("--config", None)]
  assert outputs.problem([("--out", f"{t}/log.csv")], inputs=inputs) == (
      f"--out={t}/log.csv is the input {t}/log.csv (--input): give another path")
  for same in (f"{t}/alias/log.csv", f"{t}/hard.csv", f"{t}/data/../log.csv"):
    assert outputs.problem([("--out", same)], inputs=inputs).startswith(
        f"--out={same} is the input {t}/log.csv (--input)"), same
  assert outputs.problem([("--out", f"{t}/alias/data/m.json")], inputs=inputs) == (
      f"--out={t}/alias/data/m.json lies inside the input {t}/data (--data_dir): give another "
      "path")
  assert outputs.problem(dirs=[("--out", t, ("*",))], inputs=inputs) == (
      f"--out={t} contains the input {t}/log.csv (--input): give another path")
  assert outputs.problem(dirs=[("--out", t, ("log.csv",))], inputs=inputs).startswith(
      f"--out={t} contains the input {t}/log.csv")
  # a directory output that writes none of the inputs' names, and a new file beside them: fine
  assert outputs.problem([("--out", f"{t}/m.json")], dirs=[("--plots", t, ("calib_*.png",))],
                         inputs=inputs) is None


def test_two_outputs_of_a_run_never_meet(tree):
  t = str(tree)
  assert outputs.problem([("--out", f"{t}/x.json"), ("--predictions", f"{t}/alias/x.json")]) == (
      f"--out={t}/x.json and --predictions={t}/alias/x.json are the same path: give each output "
      "its own")
  plots = ("--plots_dir", f"{t}/p", ("calibration_*.png",))
  assert outputs.problem([("--out", f"{t}/p/calibration_click.png")], dirs=[plots]) == (
      f"--out={t}/p/calibration_click.png lies inside --plots_dir={t}/p, which this run writes: "
      "give another path")
  assert outputs.problem([("--out", f"{t}/p/metrics.json")], dirs=[plots]) is None
  assert outputs.problem(dirs=[("--a", f"{t}/o", ("*",)), ("--b", f"{t}/o/sub", ("*",))]) == (
      f"--b={t}/o/sub lies inside --a={t}/o, which this run writes: give another path")


def test_the_entries_of_a_train_workdir_belong_to_it(tree):
  t = str(tree)
  owned = [("the train.py workdir", f"{t}/wd", outputs.TRAIN_WORKDIR)]
  assert outputs.problem([("--out", f"{t}/wd/run_info.json")], owned=owned) == (
      f"--out={t}/wd/run_info.json: run_info.json belongs to the train.py workdir {t}/wd (this "
      "program never writes it): give another path")
  assert "checkpoints belongs to" in outputs.problem(
      [("--out", f"{t}/alias/wd/checkpoints/3/x")], owned=owned)
  assert "best belongs to" in outputs.problem(dirs=[("--out", f"{t}/wd/best", ("*",))],
                                              owned=owned)
  assert "belongs to" in outputs.problem(dirs=[("--out", f"{t}/wd", ("*",))], owned=owned)
  # eval's default metrics.json and an export of its own names beside the run: fine
  assert outputs.problem([("--out", f"{t}/wd/metrics.json")], owned=owned) is None
  assert outputs.problem(dirs=[("--out", f"{t}/wd", ("signature.json", "params.npz"))],
                         owned=owned) is None
  assert outputs.problem(dirs=[("--out", f"{t}/wd/export", ("*",))], owned=owned) is None


def test_what_exists_at_an_output_path_must_be_of_its_kind(tree):
  t = str(tree)
  assert outputs.problem([("--out", f"{t}/fifo")]) == (
      f"--out={t}/fifo: is a FIFO (named pipe); give the path of a regular file or a new one")
  assert outputs.problem([("--out", f"{t}/alias")]).startswith(
      f"--out={t}/alias: is a symbolic link;")
  assert outputs.problem([("--out", f"{t}/data")]).startswith(f"--out={t}/data: is a directory;")
  assert outputs.problem([("--out", "/dev/null")]).startswith(
      "--out=/dev/null: is a character device;")
  assert outputs.problem(dirs=[("--out", f"{t}/log.csv", ("*",))]) == (
      f"--out={t}/log.csv: exists and is not a directory")
  assert outputs.problem(dirs=[("--out", f"{t}/fifo", ("*",))]) == (
      f"--out={t}/fifo: exists and is not a directory")
  assert outputs.problem(dirs=[("--out", f"{t}/alias", ("*",))]) is None   # written through
  assert outputs.problem([("--out", f"{t}/log.csv"), ("--predictions", None)],
                         dirs=[("--plots_dir", None, ("*",))],
                         inputs=[("--data_dir", None)]) is None
  assert outputs.not_regular(f"{t}/log.csv") is None and outputs.not_regular(f"{t}/nope") is None
