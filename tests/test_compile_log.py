"""tests/compile_log.py: jax's compile log recorded per test, and its summary."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import compile_log


def test_records_each_compile_with_its_test(tmp_path):
  logger = logging.getLogger("jax._src.dispatch")
  before = (jax.config.jax_log_compiles, logger.level, logger.propagate, list(logger.handlers))
  rec = compile_log.install(str(tmp_path))
  try:
    rec.current = "tests/x.py::test_a"
    jax.jit(lambda a: a * 3 + 1)(np.arange(7, dtype=np.float32)).block_until_ready()
    rec.current = "tests/y.py::test_b"
    jax.jit(lambda a: jnp.sin(a).sum())(np.ones((3, 5), np.float32)).block_until_ready()
  finally:
    compile_log.uninstall(rec)
  assert (jax.config.jax_log_compiles, logger.level, logger.propagate,
          list(logger.handlers)) == before
  rows = compile_log.read(str(tmp_path))
  assert [t for t, _, _ in rows] == ["tests/x.py::test_a", "tests/y.py::test_b"]
  assert all(p == "jit(<lambda>)" and s > 0 for _, s, p in rows)


def test_summary_counts_by_file_program_and_size():
  rows = [("tests/a.py::t1", 1.5, "jit(step)"), ("tests/a.py::t2", 0.05, "jit(add)"),
          ("tests/b.py::t[x]", 0.5, "jit(step)"), ("tests/b.py::t[y]", 0.1, "jit(add)"),
          ("tests/c.py::t", 3.0, "jit(init)")]
  s = compile_log.summarize(rows)
  assert s["total"] == (pytest.approx(5.15), 5)
  assert s["small"] == (pytest.approx(0.15), 2)
  assert list(s["files"]) == ["tests/c.py", "tests/a.py", "tests/b.py"]
  assert s["files"]["tests/a.py"] == (pytest.approx(1.55), 2)
  assert s["programs"]["jit(step)"] == (pytest.approx(2.0), 2)
  assert list(s["programs"]) == ["jit(init)", "jit(step)", "jit(add)"]


def test_command_prints_the_tables_and_refuses_an_empty_dir(tmp_path, capsys):
  (tmp_path / "gw0.1.tsv").write_text("tests/a.py::t\t2.5\tjit(step)\ntests/a.py::u\t0.01\tjit(add)\n")
  assert compile_log.main([str(tmp_path), "--top", "1"]) == 0
  out = capsys.readouterr().out
  assert out.startswith("3 s in 2 compiles; under 0.2 s each: 0 s in 1")
  assert "     2.5        2  tests/a.py" in out and "jit(add)" not in out
  with pytest.raises(SystemExit) as e:
    compile_log.main([str(tmp_path / "empty")])
  assert "no compile rows" in str(e.value) and "\n" not in str(e.value)
