"""Shared fixtures: one small synthetic tiny-preset dataset per test session."""

import pytest

from data import synthetic


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("tiny"))
  synthetic.generate(d, "tiny", num_examples=3000, seed=0)
  return d
