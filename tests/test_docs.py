"""The front page and the package READMEs that point into the docs site (issue #40): README.md
stays a front page (at most 200 lines, no measured figure copied by hand: those live on the
generated results pages), its test command is the one CI runs, and every relative link of the
three READMEs reaches a file and, for a Markdown page, a heading. The site's own links are checked
by `mkdocs build --strict` (scripts/docs.sh, run by scripts/test.sh)."""

import os
import re
import unicodedata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
READMES = ("README.md", "data/README.md", "pallas_kernels/README.md")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _read(rel):
  with open(os.path.join(ROOT, rel), encoding="utf-8") as fh:
    return fh.read()


def _slug(heading):
  """A heading's anchor as Python-Markdown's toc extension makes it (mkdocs's default)."""
  text = unicodedata.normalize("NFKD", re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading))
  text = re.sub(r"[^\w\s-]", "", text.encode("ascii", "ignore").decode()).strip().lower()
  return re.sub(r"[-\s]+", "-", text)


def _anchors(rel):
  text = re.sub(r"```.*?```", "", _read(rel), flags=re.S)
  return {_slug(m) for m in re.findall(r"^#+ (.+?)\s*$", text, flags=re.M)}


def test_readme_is_a_front_page():
  lines = _read("README.md").splitlines()
  assert len(lines) <= 200, f"README.md has {len(lines)} lines: at most 200 (move the rest to docs/)"
  figures = [ln for ln in lines if re.search(r"\d\.\d", re.sub(r"[Pp]ython ?>?=? ?3\.1\d", "", ln))]
  assert not figures, f"README.md quotes figures (link docs/results/ instead): {figures[0]!r}"


def test_readme_test_command_is_what_ci_runs():
  assert "bash scripts/test.sh" in _read(".ci/run")
  readme = _read("README.md")
  assert "```bash\nbash scripts/test.sh\n```" in readme
  assert "```bash\nbash scripts/demo.sh\n```" in readme
  assert "PYTHON=/path/to/python3.12" in readme


def test_readme_links_reach_their_files_and_headings():
  bad = []
  for rel in READMES:
    for target in LINK.findall(_read(rel)):
      if re.match(r"[a-z]+:", target):
        continue
      path, _, anchor = target.partition("#")
      full = os.path.normpath(os.path.join(ROOT, os.path.dirname(rel), path)) if path else \
          os.path.join(ROOT, rel)
      if not os.path.exists(full):
        bad.append(f"{rel}: {target} (no such file)")
      elif anchor and full.endswith(".md") and anchor not in _anchors(os.path.relpath(full, ROOT)):
        bad.append(f"{rel}: {target} (no such heading)")
  assert not bad, "; ".join(bad)
