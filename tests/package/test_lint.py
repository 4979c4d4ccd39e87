"""Lint rules a linter cannot hold: ``ruff check`` passes over the repository's Python trees
(configured in pyproject.toml), and every ``# noqa`` says why after its codes, so the next
reader knows whether it can go. mypy runs from ``make check`` and ``make test`` (a minute
cold: too slow to repeat inside a test)."""

import io
import re
import shutil
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TREES = ["python", "tests", "benchmarks", "conformance", "tools", "examples"]
GENERATED = ROOT / "python" / "kvwire" / "format" / "fbs"
NOQA = re.compile(r"^#.*?#?\s*noqa(?::\s*(?P<codes>[A-Z]+[0-9]+(?:\s*,\s*[A-Z]+[0-9]+)*))?(?P<rest>.*)$")


def python_files():
    for tree in TREES:
        for path in sorted((ROOT / tree).rglob("*.py")):
            if GENERATED not in path.parents:
                yield path


def noqa_without_reason(source: str):
    """(line number, comment) of each ``noqa`` comment with no codes or no reason after them."""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        m = NOQA.search(tok.string)
        if m and (not m["codes"] or len(re.sub(r"[^A-Za-z]", "", m["rest"])) < 4):
            yield tok.start[0], tok.string


def test_every_noqa_names_its_codes_and_a_reason():
    missing = [f"{p.relative_to(ROOT)}:{n}: {line}" for p in python_files()
               for n, line in noqa_without_reason(p.read_text())]
    assert missing == [], "a noqa needs its codes and why, e.g. `# noqa: F401 (registers the ops)`:\n" + "\n".join(missing)


def test_the_noqa_check_finds_what_it_should():
    source = ("import x  # noqa\nimport y  # noqa: F401\nimport z  # noqa: F401 (registers the ops)\n"
              "s = '# noqa: F401'\nt = 1  # noqa: E501 ()\n")
    assert [n for n, _ in noqa_without_reason(source)] == [1, 2, 5]


def test_ruff_passes():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent))
    if ruff is None:
        pytest.fail("ruff is not installed in this venv: pip install -e '.[test]' (make check installs it)")
    proc = subprocess.run([ruff, "check", "--no-cache", "--output-format", "concise", *TREES], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
