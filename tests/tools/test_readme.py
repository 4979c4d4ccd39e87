"""Every ```python block of README.md and of the docs' guides runs as written; the README
stays a short page for users whose links resolve.

Why: a README whose examples drift from the API is the first thing a new user trips over.
The first block (the quickstart) must run alone, copied into a fresh interpreter; the
others continue from it, so they run in order in one namespace, in a fresh directory
that sees the repository's ``benchmarks/`` (the shipped fidelity model). Each guide page
in docs/ continues from the docs' front-page example the same way. A block that cannot
run here is preceded by ``<!-- not run: REASON -->``; those are counted, listed in the
test output and kept few.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
NOT_RUN = re.compile(r"<!--\s*not run:\s*(?P<why>[^>]*?)\s*-->")
MAX_NOT_RUN = 2
MAX_README_LINES = 320
# docs pages whose ```python blocks run, each after the front page's example (docs/index.md)
GUIDES = ["guide.md", "store.md", "engines.md", "codecs.md", "crossmodel.md", "errors.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# words of the project's own bookkeeping that a user should never have to read
INTERNAL = re.compile(r"issue #|issues? [0-9]|the brief|\blent\b|\bsession\b", re.IGNORECASE)


def python_blocks(text: str) -> list[dict]:
    """The ```python blocks of ``text``: start line, source, and the not-run reason if the
    last non-blank line before the fence is a ``<!-- not run: ... -->`` marker."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            j = i + 1
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            k = i - 1
            while k >= 0 and not lines[k].strip():
                k -= 1
            m = NOT_RUN.fullmatch(lines[k].strip()) if k >= 0 else None
            blocks.append({"line": i + 1, "source": "\n".join(lines[i + 1:j]) + "\n",
                           "not_run": m.group("why") if m else None})
            i = j
        i += 1
    return blocks


DRIVER = r"""
import json, sys, traceback
blocks = json.load(open(sys.argv[1]))
ns = {"__name__": "__main__"}
for b in blocks:
    try:
        exec(compile(b["source"], "README.md:%d" % b["line"], "exec"), ns)
    except BaseException:
        traceback.print_exc()
        print("README block at line %d failed" % b["line"], file=sys.stderr)
        sys.exit(1)
    print("README block at line %d ran" % b["line"], flush=True)
"""


def _run(args, cwd, timeout=600):
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)


def test_parser_finds_blocks_and_markers():
    """The extraction itself: a marked block is recognised, an unmarked one is run, and a
    marker separated from its block only by blank lines still counts."""
    text = "x\n```python\na = 1\n```\n<!-- not run: needs a GPU -->\n\n```python\nb = 2\n```\n```sh\nls\n```\n"
    got = python_blocks(text)
    assert [(b["line"], b["source"], b["not_run"]) for b in got] == [(2, "a = 1\n", None), (7, "b = 2\n", "needs a GPU")]


def test_readme_opens_with_an_install_line_from_the_checkout():
    """kvwire is not on a package index: the first shell block installs from the checkout
    or a built wheel, never ``pip install kvwire``; it comes before the quickstart, and
    both, with the vLLM connector, are within the first screens of a short page."""
    text = README.read_text()
    lines = text.splitlines()
    first_sh = text.split("```sh\n", 1)[1].split("```", 1)[0]
    assert re.search(r"pip install (-e )?\.(\s|$)", first_sh) and ".whl" in first_sh
    assert not re.search(r"pip install kvwire(\s|$|\[)", text), "kvwire is not published on an index"
    assert "not on PyPI" in text or "not published on a package index" in text
    assert text.index("```sh\n") < text.index("```python\n")
    heading = {ln: i for i, ln in enumerate(lines) if ln.startswith("## ")}
    assert heading["## Quickstart"] < 120 and heading["## Use with vLLM"] < 170, heading
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines: move material into docs/"


def test_readme_set_up_is_make_demo_and_make_test():
    """The two set-up commands, each said in a sentence."""
    text = README.read_text()
    setup = [b.split("```", 1)[0] for b in text.split("```sh\n")[1:] if "make demo" in b.split("```", 1)[0]]
    assert len(setup) == 1
    commands = [ln.split("#")[0].strip() for ln in setup[0].splitlines() if ln.strip()]
    assert commands == ["make demo", "make test"]


def test_readme_and_docs_links_resolve():
    """Every relative link of the README and of the docs pages names a file of the
    repository (mkdocs checks links between docs pages, not those leaving docs/)."""
    pages = [README] + sorted((ROOT / "docs").glob("*.md"))
    broken = []
    for page in pages:
        for url in LINK.findall(page.read_text()):
            if url.startswith(("http://", "https://", "mailto:", "#")):
                continue
            target = (page.parent / url.split("#", 1)[0]).resolve()
            if not target.exists() or ROOT not in target.parents and target != ROOT:
                broken.append(f"{page.relative_to(ROOT)}: {url}")
    assert not broken, broken


def test_no_project_bookkeeping_in_what_users_read():
    """No issue numbers or session talk in what users and implementers read (the README, the
    CHANGELOG, the docs, the spec, the C library's and the conformance kit's READMEs, the
    benchmark results the docs cite); and no table row a reader has to scroll through."""
    pages = ([README, ROOT / "CHANGELOG.md", ROOT / "c" / "README.md", ROOT / "benchmarks" / "README.md"]
             + sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "spec").glob("*.md"))
             + sorted((ROOT / "conformance").glob("*.md")) + sorted((ROOT / "benchmarks" / "results").glob("*.md")))
    found = [f"{p.relative_to(ROOT)}:{i}: {m.group(0)!r}" for p in pages
             for i, ln in enumerate(p.read_text().splitlines(), 1) for m in INTERNAL.finditer(ln)]
    assert not found, found
    wide = [f"{p.relative_to(ROOT)}:{i}" for p in [README] + sorted((ROOT / "docs").glob("*.md"))
            for i, ln in enumerate(p.read_text().splitlines(), 1) if ln.startswith("|") and len(ln) > 240]
    assert not wide, wide


@pytest.mark.slow
def test_quickstart_runs_alone_in_a_fresh_process(tmp_path):
    """The first block, copied as is, runs in a fresh interpreter and an empty directory."""
    first = python_blocks(README.read_text())[0]
    assert first["not_run"] is None
    assert len([ln for ln in first["source"].splitlines() if ln.strip()]) <= 13
    (tmp_path / "quickstart.py").write_text(first["source"])
    p = _run(["quickstart.py"], tmp_path, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["300", "(8,", "256,", "64)"]


@pytest.mark.slow
def test_every_readme_python_block_runs_in_order(tmp_path):
    blocks = python_blocks(README.read_text())
    skipped = [b for b in blocks if b["not_run"]]
    runnable = [b for b in blocks if not b["not_run"]]
    print(f"README: {len(runnable)} python blocks run, {len(skipped)} marked not run:")
    for b in skipped:
        print(f"  line {b['line']}: {b['not_run']}")
    assert len(skipped) <= MAX_NOT_RUN and all(b["not_run"].strip() for b in skipped)
    assert len(runnable) >= 3
    (tmp_path / "benchmarks").symlink_to(ROOT / "benchmarks")
    (tmp_path / "blocks.json").write_text(json.dumps(runnable))
    (tmp_path / "driver.py").write_text(DRIVER)
    p = _run(["driver.py", "blocks.json"], tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    assert p.stdout.count("ran") == len(runnable)


@pytest.mark.slow
@pytest.mark.parametrize("page", GUIDES)
def test_every_docs_guide_python_block_runs_in_order(page, tmp_path):
    """A guide's blocks continue from the front page's example (its ``cache``, ``keys``
    and ``values``), in order, in one namespace and a fresh directory."""
    seed = python_blocks((ROOT / "docs" / "index.md").read_text())[0]
    blocks = python_blocks((ROOT / "docs" / page).read_text())
    skipped = [b for b in blocks if b["not_run"]]
    runnable = [b for b in blocks if not b["not_run"]]
    assert runnable and len(skipped) <= 1 and all(b["not_run"].strip() for b in skipped)
    (tmp_path / "benchmarks").symlink_to(ROOT / "benchmarks")
    (tmp_path / "blocks.json").write_text(json.dumps([seed] + runnable))
    (tmp_path / "driver.py").write_text(DRIVER.replace("README.md:%d", page + ":%d"))
    p = _run(["driver.py", "blocks.json"], tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    assert p.stdout.count("ran") == len(runnable) + 1


def _mkdocs_or_fail():
    try:
        import mkdocs  # noqa: F401 (only checks that it imports)
        import mkdocstrings  # noqa: F401 (only checks that it imports)
    except ImportError:
        pytest.fail("mkdocs/mkdocstrings are not installed in this venv: `make docs` installs the pinned versions")


def _copy_docs(tmp_path):
    import shutil
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    (tmp_path / "python").symlink_to(ROOT / "python")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")


@pytest.mark.slow
def test_api_reference_builds_strictly(tmp_path):
    """``make docs``'s build: every ``::: name`` resolves and the pages link up; the
    reference shows the docstrings of the public API."""
    _mkdocs_or_fail()
    _copy_docs(tmp_path)
    p = _run(["-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")], tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "kvwire.KVCache" in api and "from_tensors" in api
    assert "kvwire.store.KVStore" in (tmp_path / "site" / "api-io" / "index.html").read_text()


@pytest.mark.slow
def test_a_broken_reference_fails_the_docs_build(tmp_path):
    """Strict mode: a reference to an object that does not exist fails the build."""
    _mkdocs_or_fail()
    _copy_docs(tmp_path)
    with open(tmp_path / "docs" / "api.md", "a") as f:
        f.write("\n::: kvwire.no_such_function\n")
    p = _run(["-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")], tmp_path, timeout=300)
    assert p.returncode != 0 and "kvwire.no_such_function" in p.stderr


@pytest.mark.slow
def test_docs_index_example_runs(tmp_path):
    """The ten lines on the docs' front page run as written too."""
    blocks = python_blocks((ROOT / "docs" / "index.md").read_text())
    assert len(blocks) == 1
    (tmp_path / "index_example.py").write_text(blocks[0]["source"])
    p = _run(["index_example.py"], tmp_path, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["300", "(8,", "256,", "64)"]
