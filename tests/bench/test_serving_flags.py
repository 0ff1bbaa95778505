"""bench/serving.py's flags: each out of range is a one-line error before any work."""

import re

import pytest

from bench import serving


@pytest.mark.parametrize("argv, why", [
    (["--config", "nope"], r"--config nope: not a preset"),
    (["--candidates", "16,x"], r"--candidates 16,x: expected positive integers"),
    (["--candidates", "0,16"], r"--candidates 0,16: expected positive integers"),
    (["--seconds", "0"], r"need seconds > 0"),
    (["--min_iters", "5", "--max_iters", "2"], r"1 <= min_iters <= max_iters"),
])
def test_bad_flags_are_one_line_errors(argv, why, monkeypatch):
  monkeypatch.setattr(serving, "run", lambda a: pytest.fail("ran with bad flags"))
  with pytest.raises(SystemExit) as e:
    serving.main(argv)
  msg = str(e.value.code)
  assert len(msg.splitlines()) == 1 and re.search(why, msg), msg


def test_good_flags_parse():
  a = serving._parse(["--config", "tiny", "--candidates", "4,8"])
  assert a.candidates == [4, 8] and a.config == "tiny"
