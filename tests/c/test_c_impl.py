"""libkvwire (c/) under the same conformance kit as the Python reference.

Builds c/ (``make -C c``), runs its unit tests, drives ``build/c/kvwire-c`` through
``kvwire conformance run`` at the reader, writer and roundtrip levels (the runner's
producer x consumer matrix always includes the in-process Python reference, so the
matrix covers C -> Python and Python -> C), runs the reader level again against the
ASan/UBSan build, builds with clang -Werror, and runs a bounded libFuzzer campaign
(KVWIRE_C_FUZZ_SECONDS, default 60; only an explicit 0 skips it) plus the replay of the
regression inputs. A missing toolchain fails with the apt command: it never skips.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
C_DIR = ROOT / "c"
BUILD = ROOT / "build" / "c"
ASAN_BUILD = ROOT / "build" / "c-asan"
CLANG_BUILD = ROOT / "build" / "c-clang"
FUZZ_BUILD = ROOT / "build" / "c-fuzz"
VECTORS = ROOT / "conformance" / "vectors" / "1.0"
FINDINGS = ROOT / "conformance" / "fuzz" / "findings" / "c"
APT = "sudo apt-get install -y libzstd-dev libxxhash-dev clang"
JOBS = str(min(2, os.cpu_count() or 1))

_fuzz_env = os.environ.get("KVWIRE_C_FUZZ_SECONDS")
FUZZ_SECONDS = float(_fuzz_env) if _fuzz_env not in (None, "") else 60.0

SAN_ENV = {
    # a sanitizer report is an exit status the protocol calls an implementation error (not 1)
    "ASAN_OPTIONS": "detect_leaks=1:halt_on_error=1:abort_on_error=0:exitcode=86:allocator_may_return_null=1",
    "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1:exitcode=87",
    "LSAN_OPTIONS": "exitcode=88",
}


def _header_ok(cc: str, header: str) -> bool:
    p = subprocess.run([cc, "-E", "-x", "c", "-"], input=f"#include <{header}>\n", text=True, capture_output=True)
    return p.returncode == 0


def _require_toolchain(*, clang: bool = False) -> None:
    missing = []
    if shutil.which("make") is None:
        missing.append("make")
    cc = "gcc" if shutil.which("gcc") else None
    if cc is None:
        missing.append("gcc")
    else:
        if not _header_ok(cc, "zstd.h"):
            missing.append("libzstd-dev")
        if not _header_ok(cc, "xxhash.h"):
            missing.append("libxxhash-dev")
    if clang and shutil.which("clang") is None:
        missing.append("clang")
    if missing:
        pytest.fail(f"libkvwire's toolchain is missing {', '.join(missing)}: {APT} gcc make "
                    "(or `make c` as root, which installs them)", pytrace=False)


def _make(*args, timeout=600, env=None) -> None:
    p = subprocess.run(["make", "-C", str(C_DIR), f"-j{JOBS}", *args], capture_output=True, text=True,
                       timeout=timeout, env=env)
    assert p.returncode == 0, f"make -C c {' '.join(args)} failed:\n{p.stderr[-6000:]}\n{p.stdout[-2000:]}"


@pytest.fixture(scope="module")
def c_build():
    _require_toolchain()
    _make()
    for name in ("libkvwire.a", "libkvwire.so", "kvwire-c", "test_unit", "bench_c"):
        assert (BUILD / name).exists(), f"make -C c did not produce build/c/{name}"
    return BUILD


def test_unit_tests(c_build):
    p = subprocess.run([str(c_build / "test_unit")], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"test_unit failed:\n{p.stdout[-4000:]}\n{p.stderr[-8000:]}"
    assert re.search(r"test_unit: \d+ checks, 0 failed", p.stdout), p.stdout


def test_shared_library_soname(c_build):
    # binutils comes with gcc (ld is one of them)
    assert shutil.which("objdump") and shutil.which("nm"), "binutils missing: sudo apt-get install -y binutils"
    p = subprocess.run(["objdump", "-p", str(c_build / "libkvwire.so")], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert re.search(r"SONAME\s+libkvwire\.so\.0", p.stdout), p.stdout[:2000]
    nm = subprocess.run(["nm", "-D", "--defined-only", str(c_build / "libkvwire.so")], capture_output=True, text=True)
    assert nm.returncode == 0, nm.stderr
    for sym in ("kvw_open", "kvw_validate", "kvw_read_tensor", "kvw_decoder_new", "kvw_writer_new"):
        assert re.search(rf"\b{sym}\b", nm.stdout), f"{sym} not exported"
    # only the functions of include/kvwire.h: internal names (kvw_fail, kvw_grid_build) stay hidden
    public = set(re.findall(r"\b(kvw_[a-z0-9_]+)\(", (ROOT / "c" / "include" / "kvwire.h").read_text()))
    exported = set(re.findall(r"\s[TDBR]\s+(kvw_[a-z0-9_]+)", nm.stdout))
    assert exported and exported <= public, f"exported but not in kvwire.h: {sorted(exported - public)}"
    assert "kvw_fail" not in exported and "kvw_grid_build" not in exported


# ---------------------------------------------------------------------------------------
# The conformance kit
# ---------------------------------------------------------------------------------------

def _conformance(tmp_path: Path, impls, levels: str, env=None, timeout=900, extra=()):
    junit, md = tmp_path / "report.xml", tmp_path / "report.md"
    cmd = [sys.executable, "-m", "kvwire", "conformance", "run", "--levels", levels, "--vectors", str(VECTORS),
           "--junit", str(junit), "--markdown", str(md), "-q", "-j", JOBS, *extra]
    for impl in impls:
        cmd += ["--impl", str(impl)]
    full_env = dict(os.environ, **(env or {}))
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=str(ROOT), env=full_env)
    assert junit.exists() and md.exists(), f"no report ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    return p, ET.parse(junit).getroot(), md.read_text()


def _junit_results(root) -> dict:
    """{(impl, level): (total, [failing 'case: message'])} from the runner's JUnit XML."""
    out: dict = {}
    for suite in root.iter("testsuite"):
        impl, _, level = suite.get("name").rpartition(".")
        bad = []
        total = 0
        for tc in suite.iter("testcase"):
            if tc.find("skipped") is not None:
                continue
            total += 1
            for tag in ("failure", "error"):
                el = tc.find(tag)
                if el is not None:
                    msg, text = el.get("message") or "", (el.text or "").strip()
                    extra = "" if text in ("", msg) else "\n    " + text.replace("\n", "\n    ")[:600]
                    bad.append(f"{tag.upper()} {tc.get('name')}: {msg}{extra}")
        out[impl, level] = (total, bad)
    return out


def _unesc(s: str) -> str:
    return s.strip().replace("\\|", "|")


def _labels(md: str) -> dict:
    """{label: command line} from the Markdown report's "Implementations:" list."""
    out = {}
    for m in re.finditer(r"^- `(.+?)`: `(.*)`$", md, re.M):
        out[_unesc(m.group(1))] = _unesc(m.group(2))
    return out


def _matrix(md: str) -> dict:
    """{(producer, consumer): (passed, total)} from the Markdown report's matrix table."""
    lines = md.splitlines()
    try:
        i = lines.index("## Producer x consumer matrix")
    except ValueError:
        return {}
    rows = []
    for ln in lines[i + 1:]:
        if ln.startswith("## "):
            break
        if ln.startswith("| ") and not ln.startswith("|---"):
            rows.append(ln)
    if not rows:
        return {}
    split = lambda row: [_unesc(c) for c in re.split(r"(?<!\\)\|", row.strip())[1:-1]]
    head = split(rows[0])[1:]
    out = {}
    for row in rows[1:]:
        cells = split(row)
        for cons, cell in zip(head, cells[1:]):
            m = re.fullmatch(r"(\d+)/(\d+)", cell)
            if m:
                out[cells[0], cons] = (int(m.group(1)), int(m.group(2)))
    return out


def _assert_all_pass(p, root, levels, n_impls) -> None:
    res = _junit_results(root)
    impls = sorted({impl for impl, _ in res})
    assert len(impls) == n_impls, f"expected {n_impls} implementations in the report, got {impls}"
    failures = []
    for impl in impls:
        for level in levels:
            total, bad = res.get((impl, level), (0, []))
            assert total > 0, f"level {level}: no checks ran for {impl}\n{p.stdout[-3000:]}"
            failures += [f"[{impl} {level}] {b}" for b in bad]
    assert not failures, (f"{len(failures)} conformance checks did not pass:\n"
                          + "\n".join(failures[:150]) + (f"\n... {len(failures) - 150} more" if len(failures) > 150 else ""))
    assert p.returncode == 0, f"conformance run exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"


def test_conformance_reader_writer_roundtrip(c_build, tmp_path):
    """100% at every level for kvwire-c, and the producer x consumer matrix full between it, the
    in-process reference and the reference run as a subprocess (`kvwire conformance impl`)."""
    cli = c_build / "kvwire-c"
    py_impl = f"{sys.executable} -m kvwire conformance impl"
    p, root, md = _conformance(tmp_path, [cli, py_impl], "reader,writer,roundtrip")
    _assert_all_pass(p, root, ("reader", "writer", "roundtrip"), 2)
    labels = _labels(md)
    c_label = [k for k, v in labels.items() if str(cli) in v]
    py_label = [k for k, v in labels.items() if "conformance impl" in v]
    assert len(c_label) == 1 and len(py_label) == 1, labels
    c_label, py_label = c_label[0], py_label[0]
    m = _matrix(md)
    for cell in ((c_label, "reference"), ("reference", c_label), (c_label, py_label), (py_label, c_label),
                 (c_label, c_label)):
        assert cell in m, f"matrix cell {cell} missing: {sorted(m)}\n{md[-3000:]}"
        passed, total = m[cell]
        assert total > 0 and passed == total, f"matrix {cell[0]} -> {cell[1]}: {passed}/{total}"


def test_conformance_reader_under_asan_ubsan(tmp_path):
    """The reader level against the ASan + UBSan build: every report is fatal, leaks too."""
    _require_toolchain()
    _make("asan")
    impl = ASAN_BUILD / "kvwire-c"
    assert impl.exists()
    # one process per command (--no-serve): LeakSanitizer reports at each exit, not once after the run
    p, root, _ = _conformance(tmp_path, [impl], "reader", env=SAN_ENV, extra=("--no-serve",))
    _assert_all_pass(p, root, ("reader",), 1)
    t = subprocess.run([str(ASAN_BUILD / "test_unit")], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, **SAN_ENV))
    assert t.returncode == 0, f"test_unit under ASan/UBSan:\n{t.stdout[-3000:]}\n{t.stderr[-8000:]}"


def test_clang_werror_build():
    _require_toolchain(clang=True)
    _make("CC=clang", f"BUILD={CLANG_BUILD}")
    p = subprocess.run([str(CLANG_BUILD / "test_unit")], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"test_unit (clang build):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"


# ---------------------------------------------------------------------------------------
# libFuzzer
# ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fuzz_target():
    _require_toolchain(clang=True)
    _make("fuzz")
    target = FUZZ_BUILD / "fuzz_kvwire"
    assert target.exists()
    return target


def _seed_files() -> list:
    return sorted(p for p in VECTORS.rglob("*") if p.suffix in (".kvw", ".kvws") and p.is_file())


def _regression_inputs() -> list:
    out = [p for p in (VECTORS / "regressions").rglob("*") if p.is_file() and p.suffix != ".json"]
    if FINDINGS.is_dir():
        out += [p for p in FINDINGS.iterdir() if p.is_file() and not p.name.startswith(".")
                and p.suffix not in (".md", ".txt", ".json")]
    return sorted(out)


def test_fuzz_replay_regressions(fuzz_target, tmp_path):
    """Every regression input and earlier C finding, and every gold vector, runs clean."""
    inputs = _regression_inputs() + _seed_files()
    # libFuzzer runs each file argument once; in batches to keep the command line short
    for k in range(0, len(inputs), 200):
        batch = inputs[k:k + 200]
        p = subprocess.run([str(fuzz_target), "-rss_limit_mb=2048", "-malloc_limit_mb=1024", "-timeout=30",
                            f"-artifact_prefix={tmp_path}/", *map(str, batch)],
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, f"replay failed on one of {len(batch)} inputs:\n{p.stderr[-6000:]}"


@pytest.mark.skipif(FUZZ_SECONDS <= 0, reason="KVWIRE_C_FUZZ_SECONDS=0")
def test_bounded_libfuzzer_campaign(fuzz_target, tmp_path):
    corpus, artifacts = tmp_path / "corpus", tmp_path / "artifacts"
    corpus.mkdir()
    artifacts.mkdir()
    for f in _seed_files():
        shutil.copy(f, corpus / ("seed-" + "_".join(f.relative_to(VECTORS).parts)))
    p = subprocess.run([str(fuzz_target), f"-max_total_time={int(FUZZ_SECONDS)}", "-rss_limit_mb=2048",
                        "-malloc_limit_mb=1024", "-timeout=10", "-print_final_stats=1",
                        f"-artifact_prefix={artifacts}/", str(corpus)],
                       capture_output=True, text=True, timeout=FUZZ_SECONDS + 300)
    found = sorted(artifacts.iterdir())
    if found:
        FINDINGS.mkdir(parents=True, exist_ok=True)
        for f in found:
            shutil.copy(f, FINDINGS / f.name)
    tail = p.stderr[-6000:]
    assert not found, (f"libFuzzer findings (copied to {FINDINGS.relative_to(ROOT)}; reproduce with "
                       f"build/c-fuzz/fuzz_kvwire FILE): {[f.name for f in found]}\n{tail}")
    assert p.returncode == 0, tail
    runs = re.search(r"stat::number_of_executed_units:\s*(\d+)", p.stderr)
    assert runs and int(runs.group(1)) > 0, tail
