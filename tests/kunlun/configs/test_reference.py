"""The configuration reference page (docs/reference/config.md) is what ``python -m
kunlun.configs.reference`` writes from the table ``kunlun.configs.fields`` now, and lists every
field of it (issue #40): a field added or changed without regenerating the page fails here in one
line."""

import dataclasses

import pytest

from kunlun.configs import fields, reference


def _page() -> str:
  with open(f"{reference.ROOT}/{reference.PAGE}", encoding="utf-8") as fh:
    return fh.read()


def _missing(page: str) -> list[str]:
  return [p for p in fields.FIELDS if f"| `{p}` |" not in page]


def test_committed_page_is_what_the_generator_writes():
  problem = reference.stale()
  if problem:
    pytest.fail(problem, pytrace=False)


def test_every_field_of_the_table_is_on_the_page():
  missing = _missing(_page())
  if missing:
    pytest.fail(f"{reference.PAGE} lacks {len(missing)} field(s) of kunlun/configs/fields.py "
                f"({', '.join(missing[:5])}): run {reference.COMMAND}", pytrace=False)


def test_a_field_added_without_regenerating_is_caught(monkeypatch):
  new = dict(fields.FIELDS)
  new["train.new_knob"] = dataclasses.replace(fields.FIELDS["train.lr"], doc="a new knob")
  monkeypatch.setattr(fields, "FIELDS", new)
  problem = reference.stale()
  assert problem is not None and "\n" not in problem and reference.COMMAND in problem
  assert _missing(_page()) == ["train.new_knob"]
  assert "| `train.new_knob` |" in reference.render()     # regenerating would list it


def test_check_exits_1_in_one_line(tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(reference, "ROOT", str(tmp_path))
  assert reference.stale() == f"{reference.PAGE} is missing: run {reference.COMMAND}"
  reference.write()
  assert reference.main(["--check"]) == 0
  with open(tmp_path / reference.PAGE, "a", encoding="utf-8") as fh:
    fh.write("edited by hand\n")
  capsys.readouterr()
  assert reference.main(["--check"]) == 1
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "differs from kunlun/configs/fields.py" in err
