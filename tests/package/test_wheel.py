"""The built wheel on its own: what a user who installs the wheel,
with no checkout around, gets.

The wheel (and the sdist) are built from a copy of the working tree (git's tracked and
untracked-not-ignored files), so the checkout's ``build/`` and egg-info are never touched or
reused. A fresh venv gets the wheel and its dependencies only, offline: the dependencies are
the exact builds the main .venv runs, repacked into wheels from their installed files
(``importlib.metadata``'s file lists; ``pip install --no-index --find-links``), so the test
needs no network and no pip cache. Everything then runs from a temporary directory outside
the checkout: ``kvwire conformance run`` (the gold vectors and PROTOCOL.md ship as package
data, copied by setup.py's build step) and ``kvwire demo`` (without torch: the install hint
and the synthetic demo). About 30 s on two cores.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import kvwire
from kvwire.conformance.vectors import find_protocol, find_vectors_root

ROOT = Path(__file__).resolve().parents[2]
VECTORS = ROOT / "conformance" / "vectors"
PROTOCOL = ROOT / "conformance" / "PROTOCOL.md"
DIST = f"kvwire-{kvwire.__version__}"
DATA = "kvwire/conformance/data"
CORE_DEPS = {"kvwire", "numpy", "flatbuffers", "zstandard", "xxhash", "ml-dtypes"}


def run(argv, cwd, timeout=300, env=None):
    p = subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert p.returncode == 0, f"{argv}: rc {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


def source_files() -> list[Path]:
    """The working tree as a build sees it: tracked and untracked-not-ignored files."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.fail("tests/package/test_wheel.py copies the source tree with `git ls-files`: run it from a git checkout")
    return sorted({Path(n) for n in out.decode().split("\0") if n and (ROOT / n).is_file()})


def copy_tree(dst: Path) -> Path:
    for rel in source_files():
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dst / rel)
    return dst


def pip(*args, cwd):
    return run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args], cwd=cwd)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """{"wheel": the wheel built from the tree, "sdist": the sdist, "out": their folder}."""
    try:
        import setuptools  # noqa: F401 (only checks that it imports)
    except ImportError:
        pytest.fail("building the wheel needs setuptools in the test venv: pip install 'setuptools>=77'")
    base = tmp_path_factory.mktemp("wheel")
    src, out = copy_tree(base / "src"), base / "dist"
    pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", out, src, cwd=base)
    run([sys.executable, "-c", "import sys; from setuptools import build_meta as b; b.build_sdist(sys.argv[1])", out],
        cwd=src)
    wheels, sdists = list(out.glob("kvwire-*.whl")), list(out.glob("kvwire-*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, list(out.iterdir())
    return {"wheel": wheels[0], "sdist": sdists[0], "out": out}


def core_distributions() -> list:
    """kvwire's install requirements (no extras) and theirs, as installed in this venv."""
    seen, todo, out = set(), ["kvwire"], []
    while todo:
        d = metadata.distribution(todo.pop())
        name = re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower()
        if name in seen:
            continue
        seen.add(name)
        if name != "kvwire":
            out.append(d)
        for r in map(Requirement, d.requires or ()):
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                todo.append(r.name)
    return out


def repack(dist, out: Path) -> Path:
    """A wheel of an installed distribution, from its RECORD'ed files (scripts outside
    site-packages are left out: pip makes them again from entry_points.txt)."""
    info = next(f.parts[0] for f in dist.files if f.parts[0].endswith(".dist-info"))
    tags = [ln.split(":", 1)[1].strip() for ln in dist.read_text("WHEEL").splitlines() if ln.startswith("Tag:")]
    py, abi, plat = (".".join(sorted({t.split("-")[i] for t in tags})) for i in range(3))
    path = out / f"{info[: -len('.dist-info')]}-{py}-{abi}-{plat}.whl"
    skip = {f"{info}/{n}" for n in ("RECORD", "INSTALLER", "REQUESTED", "direct_url.json")}
    record = io.StringIO()
    rows = csv.writer(record, lineterminator="\n")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for f in dist.files:
            name = f.as_posix()
            if f.parts[0] == ".." or "__pycache__" in f.parts or name in skip:
                continue
            data = Path(dist.locate_file(f)).read_bytes()
            z.writestr(name, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            rows.writerow([name, f"sha256={digest}", len(data)])
        rows.writerow([f"{info}/RECORD", "", ""])
        z.writestr(f"{info}/RECORD", record.getvalue())
    return path


@pytest.fixture(scope="module")
def venv(built, tmp_path_factory):
    """A fresh venv holding the wheel and its dependencies only; returns its bin folder."""
    base = tmp_path_factory.mktemp("venv")
    house = base / "wheelhouse"
    house.mkdir()
    for d in core_distributions():
        repack(d, house)
    env_dir = base / "env"
    run([sys.executable, "-m", "venv", "--without-pip", env_dir], cwd=base)
    pip("--python", env_dir / "bin" / "python", "install", "-q", "--no-index", "--find-links", house,
        built["wheel"], cwd=base)
    return env_dir / "bin"


@pytest.fixture
def outside(tmp_path):
    """A working directory with no checkout above it, and an environment without this one's paths."""
    assert not any((d / "conformance" / "vectors").is_dir() for d in (tmp_path, *tmp_path.parents)), tmp_path
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "PIP_"))}
    return tmp_path, {**env, "PYTHONNOUSERSITE": "1"}


@pytest.mark.slow
def test_wheel_ships_the_conformance_kit_py_typed_and_the_license(built):
    """Issue 16 items 2-3: every vector file and PROTOCOL.md byte for byte under
    kvwire/conformance/data/, py.typed, the Apache-2.0 LICENSE and its metadata; nothing
    from outside the package (no conformance/*.py generators, no tests)."""
    with zipfile.ZipFile(built["wheel"]) as z:
        names = set(z.namelist())
        for f in sorted(p for p in VECTORS.rglob("*") if p.is_file()):
            name = f"{DATA}/vectors/{f.relative_to(VECTORS).as_posix()}"
            assert name in names, name
            assert z.read(name) == f.read_bytes(), name
        assert z.read(f"{DATA}/PROTOCOL.md") == PROTOCOL.read_bytes()
        assert z.read("kvwire/py.typed") == b""
        assert z.read(f"{DIST}.dist-info/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
        meta = z.read(f"{DIST}.dist-info/METADATA").decode()
    data_files = {n for n in names if n.startswith(f"{DATA}/")}
    assert len(data_files) == sum(1 for p in VECTORS.rglob("*") if p.is_file()) + 1
    assert not [n for n in names if not n.startswith(("kvwire/", f"{DIST}.dist-info/"))]
    assert "License-Expression: Apache-2.0" in meta and "Classifier: Typing :: Typed" in meta
    assert "Classifier: Programming Language :: Python :: 3 :: Only" in meta
    assert "Project-URL" not in meta  # none exists yet (pyproject.toml says why); add them when they do
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text


@pytest.mark.slow
def test_sdist_carries_the_kit_and_builds_the_same_wheel(built, tmp_path):
    """A wheel built from the sdist (what `python -m build` does) has the same files."""
    with tarfile.open(built["sdist"]) as t:
        members = {m.name.split("/", 1)[1] for m in t.getmembers() if "/" in m.name and m.isfile()}
    for f in [*VECTORS.rglob("*"), PROTOCOL, ROOT / "LICENSE", ROOT / "setup.py", ROOT / "python/kvwire/py.typed"]:
        if f.is_file():
            assert f.relative_to(ROOT).as_posix() in members, f
    pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp_path, built["sdist"], cwd=tmp_path)
    (again,) = tmp_path.glob("kvwire-*.whl")
    with zipfile.ZipFile(again) as a, zipfile.ZipFile(built["wheel"]) as b:
        assert sorted(a.namelist()) == sorted(b.namelist())


@pytest.mark.slow
def test_fresh_venv_holds_only_the_wheel_and_its_dependencies(venv, outside):
    cwd, env = outside
    p = pip("--python", venv / "python", "list", "--format", "json", cwd=cwd)
    assert {re.sub(r"[-_.]+", "-", d["name"]).lower() for d in json.loads(p.stdout)} == CORE_DEPS
    p = run([venv / "python", "-c", "import kvwire, importlib.util as u; print(kvwire.__file__); "
             "print(u.find_spec('torch'), u.find_spec('transformers'))"], cwd=cwd, env=env)
    where, missing = p.stdout.splitlines()
    assert Path(where).is_relative_to(venv.parent) and missing == "None None"


@pytest.mark.slow
def test_conformance_run_passes_from_the_installed_wheel(venv, outside):
    """`kvwire conformance run` with no checkout: the vectors the wheel carries, 100% PASS."""
    cwd, env = outside
    p = run([venv / "kvwire", "conformance", "run", "-q"], cwd=cwd, env=env)
    shipped = next(venv.parent.glob(f"lib/python*/site-packages/{DATA}"))
    assert f"vectors: {shipped / 'vectors'}  (protocol: {shipped / 'PROTOCOL.md'})" in p.stdout
    assert "RESULT: PASS" in p.stdout
    reader = re.search(r"reader\s+pass\s+(\d+)/\1 passed \(100\.0%\)", p.stdout)
    manifest = json.loads((VECTORS / "1.0" / "manifest.json").read_text())
    assert reader and int(reader.group(1)) >= len(manifest["vectors"]), p.stdout[-2000:]
    for level in ("writer", "roundtrip"):
        assert re.search(rf"{level}\s+pass\s+(\d+)/\1 passed \(100\.0%\)", p.stdout), p.stdout[-2000:]


def test_checkout_vectors_are_found_before_the_shipped_copy(venv, outside):
    """Run from a checkout, the installed package uses the checkout's vectors; elsewhere its own."""
    cwd, env = outside
    code = "import kvwire; from kvwire.conformance.vectors import find_vectors_root as f; print(kvwire.__file__, f())"
    where, found = run([venv / "python", "-c", code], cwd=ROOT / "conformance", env=env).stdout.split()
    assert Path(where).is_relative_to(venv.parent) and found == str(VECTORS)
    where, shipped = run([venv / "python", "-c", code], cwd=cwd, env=env).stdout.split()
    assert shipped.endswith(f"site-packages/{DATA}/vectors") and Path(shipped).is_relative_to(venv.parent)


@pytest.mark.slow
def test_demo_from_the_installed_wheel_names_the_cpu_torch_and_falls_back(venv, outside):
    """`kvwire demo` without torch: an install hint for torch's CPU build (never a bare
    `pip install torch`, which pulls a multi-GB CUDA build), then the synthetic demo."""
    cwd, env = outside
    p = run([venv / "kvwire", "demo"], cwd=cwd, env=env)
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in p.stdout
    assert "round trip bit-exact: True" in p.stdout and "chunk view shares the mapping: True" in p.stdout


def joined_literals(text: str) -> str:
    """Source text with adjacent string literals split over lines joined ("a "\\n  "b" -> "a b")."""
    return re.sub(r"""["']\s*\n\s*f?["']""", "", text)


def bare_torch_hints(text: str) -> list[str]:
    """`pip install ...` commands that name torch without its CPU index (a bare `torch`,
    `kvwire[torch]`, ...): on PyPI they resolve to a multi-GB CUDA build."""
    bad = []
    for m in re.finditer(r"pip install[^\n]*", joined_literals(text)):
        cmd = m.group().split("&&")[0]
        if re.search(r"\btorch\b", cmd) and "download.pytorch.org/whl/cpu" not in cmd:
            bad.append(cmd)
    return bad


def test_bare_torch_hint_detector():
    assert bare_torch_hints('raise X("needs torch (pip install torch); leave")')
    assert bare_torch_hints("print(\"install:  pip install 'kvwire[hf]' torch   -- fallback\")")
    assert bare_torch_hints("pip install -e '.[torch]'")
    assert not bare_torch_hints('f"(pip install torch==2.13.0 --index-url "\n    "https://download.pytorch.org/whl/cpu)"')
    assert not bare_torch_hints("pip install 'kvwire[redis]'")


def test_no_install_hint_suggests_a_bare_torch():
    """Every missing-torch hint in the package and the benchmarks names torch's CPU build."""
    files = [*sorted((ROOT / "python" / "kvwire").rglob("*.py")), *sorted((ROOT / "benchmarks").glob("*.py"))]
    bad = {f.relative_to(ROOT).as_posix(): b for f in files if (b := bare_torch_hints(f.read_text()))}
    assert not bad


def test_find_protocol_beside_the_vectors():
    assert find_vectors_root(ROOT / "python") == VECTORS
    assert find_protocol(VECTORS) == PROTOCOL and find_protocol(VECTORS / "1.0") == PROTOCOL
    assert find_protocol(ROOT / "python") is None


@pytest.mark.slow
def test_readme_quickstart_runs_from_the_installed_wheel(venv, outside):
    """Issue 16's "done when": the README's first example, copied as is, runs in the fresh
    venv that holds only the wheel and its core dependencies (no checkout, no torch)."""
    from test_readme import python_blocks

    cwd, env = outside
    first = python_blocks((ROOT / "README.md").read_text())[0]
    assert first["not_run"] is None
    (cwd / "quickstart.py").write_text(first["source"])
    p = run([venv / "python", "quickstart.py"], cwd=cwd, env=env, timeout=120)
    assert p.stdout.split() == ["300", "(8,", "256,", "64)"], p.stdout + p.stderr
