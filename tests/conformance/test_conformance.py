"""The conformance kit: frozen gold vectors, the runner, the protocol, broken implementations.

* The reference codec passes ``kvwire conformance run`` at 100% (every level, the matrix).
* Committed vectors never change: every file is checked against the manifest and the
  manifest against a digest pinned here (editing both is caught too).
* Deliberately broken implementations, run as subprocess implementations of the
  protocol, are caught: a reader that skips checksums, one that misreads the alignment,
  one that skips padding, one with wrong codes, one that crashes, one that hangs, a
  broken writer; and a reader-only implementation is reported as not tested, not passing.
"""

import hashlib
import json
import re
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import kvwire
from kvwire.cache.files import open as kv_open
from kvwire.conformance import compare as C
from kvwire.conformance import digests as D
from kvwire.conformance import neutral as N
from kvwire.conformance.drivers import CommandImpl, default_impl_argv
from kvwire.conformance.runner import Runner
from kvwire.conformance.vectors import find_vectors_root, load_vector_set, load_vector_sets
from kvwire.tools.cli import main

ROOT = Path(__file__).resolve().parents[2]
VECTORS = ROOT / "conformance" / "vectors"

# SHA-256 of each version folder's manifest.json. A version folder is append-only: its files
# never change; `generate.py --add NAME` appends new vectors (new files, new manifest entries
# after the old ones) and the pin here is updated; a new format version adds a folder and a line.
# 1.0 history: 34f96eba... (frozen set), 25f1d286... (+ engine_layout, spec 5.9),
# 85a4ee1f... (+ crossmodel, codecs, sparse: spec/crossmodel.md, codecs.md, sparse.md),
# e30a13fe... (+ rope_truncate: RopeParams field 17),
# 0c53990d... (+ sparse_codecs: codec specs in sparse containers),
# 9bec6d3f... (+ parse_budget: KVW-LIM-7 FlatBuffer DAGs),
# 4b4d8d31... (+ final_1_0, lossy_extremes, stream_hostile),
# fb7225bf... (+ kv_scales: revision 1.1, per-layer fp8 scales, spec section 5.10; format 1.1 containers),
# 5645761f... (+ rotation: revision 1.2, spec/codecs.md section 8; format 1.2 containers),
# c03d5d46... (+ rotation_kchan: the presets kchan4-vlloyd4 and kchan3-vlloyd2),
# 8a718fe6... (+ turboquant: revision 1.3, spec/codecs.md section 9; format 1.3 containers),
# 6860fa62... (+ zstd_checksums: revision 1.4, zstd content checksums, KVW-CODEC-4/5; minor-4 containers),
# af4d74e4... (+ clarifications_1_4: the decisions of the 1.4 text clarifications, spec Appendix D).
PINNED_MANIFESTS = {
    "1.0": "af4d74e4326862c0369100bf3e87d0ce6832e02f993e2045747865061f63ddbb",
}
# Regression vectors from fuzzing (append-only): "<version>/regressions/<name>": sha256 of the input.
REGRESSIONS_PINNED: dict = {
    # libkvwire's libFuzzer target (c/fuzz): the empty input, which its stream decoder met with a NULL buffer
    "1.0/regressions/c-empty-input": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def version_dirs():
    return sorted(d for d in VECTORS.iterdir() if (d / "manifest.json").is_file())


# =======================================================================================
# Frozen vectors
# =======================================================================================

def test_every_version_folder_is_pinned_and_unchanged():
    dirs = version_dirs()
    assert [d.name for d in dirs] == sorted(PINNED_MANIFESTS), "a version folder without a pin (or a pin without a folder)"
    for d in dirs:
        assert sha256(d / "manifest.json") == PINNED_MANIFESTS[d.name], f"{d.name}/manifest.json changed"


@pytest.mark.parametrize("version", sorted(PINNED_MANIFESTS))
def test_every_committed_file_matches_the_manifest(version):
    d = VECTORS / version
    m = json.loads((d / "manifest.json").read_text())
    listed = {"manifest.json", m["regressions"]}
    for e in m["vectors"]:
        assert sha256(d / e["file"]) == e["sha256"], f"{e['file']} changed"
        assert (d / e["file"]).stat().st_size == e["size"]
        listed.add(e["file"])
        if "twin" in e:
            assert sha256(d / e["twin"]) == e["twin_sha256"], f"{e['twin']} changed"
            listed.add(e["twin"])
    reg_dir = Path(m["regressions"]).parent.as_posix()
    present = {p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file()}
    extra = {p for p in present - listed if not p.startswith(reg_dir + "/")}
    assert not extra, f"files in {version}/ that the manifest does not list: {sorted(extra)}"
    assert not listed - present


def test_regression_vectors_are_append_only():
    entries = {}
    for d in version_dirs():
        m = json.loads((d / "manifest.json").read_text())
        reg = d / m["regressions"]
        rm = json.loads(reg.read_text())
        for e in rm["vectors"]:
            assert sha256(reg.parent / e["file"]) == e["sha256"], f"{e['file']} changed"
            entries[f"{d.name}/{e['name']}"] = e["sha256"]
    for name, digest in REGRESSIONS_PINNED.items():
        assert entries.get(name) == digest, f"pinned regression vector {name} removed or changed"
    assert set(entries) <= set(REGRESSIONS_PINNED), f"pin new regression vectors: {sorted(set(entries) - set(REGRESSIONS_PINNED))}"


def _spec_codes() -> set:
    text = (ROOT / "spec" / "kvwire-v1.md").read_text()
    section = text[text.index("## 18. Error code registry") : text.index("## 19.")]
    return set(re.findall(r"^\| `([A-Z][A-Z0-9_]+)` \|", section, re.M))


def test_every_error_code_of_the_spec_has_a_vector_or_a_reason():
    covered, exempt = set(), {}
    for d in version_dirs():
        m = json.loads((d / "manifest.json").read_text())
        covered |= {e["expected_code"] for e in m["vectors"] if e["kind"] == "invalid"}
        exempt.update(m["codes_without_vector"])
        for a in m.get("additions", []):  # a later set that gives such a code its vectors says so
            for code in a.get("corrects_codes_without_vector", {}):
                exempt.pop(code, None)
    codes = _spec_codes()
    assert codes - covered - set(exempt) == set(), "error codes of spec section 18 without a vector"
    assert not covered & set(exempt)
    assert exempt.keys() <= codes


def test_manifest_content():
    m = json.loads((VECTORS / "1.0" / "manifest.json").read_text())
    inv = [e for e in m["vectors"] if e["kind"] == "invalid"]
    val = [e for e in m["vectors"] if e["kind"] == "valid"]
    assert len(inv) >= 40 and len(val) >= 20
    assert m["counts"] == {"valid": len(val), "invalid": len(inv)}
    assert set(m["error_codes"]) == {e["expected_code"] for e in inv} | set(m["codes_without_vector"])
    rule_ids = {r for p in sorted((ROOT / "spec").glob("*.md"))  # kvwire-v1.md and the companion specs
                for r in re.findall(r'<a id="(kvw-[a-z][a-z0-9]*-\d+)"></a>', p.read_text())}
    for e in m["vectors"]:
        assert all(r.lower() in rule_ids for r in e["rules"]), e["name"]
        if e["kind"] == "invalid":
            assert e["rule"] in e["rules"] and e["reference_stage"] in ("open", "validate", "reassemble")
    dtypes = {json.loads((VECTORS / "1.0" / e["twin"]).read_text())["header"]["dtype"] for e in val}
    assert dtypes == set(kvwire.format.registry.DTYPES)
    size = sum(p.stat().st_size for p in (VECTORS / "1.0").rglob("*") if p.is_file())
    # 8 MiB: valid/final-prefix7-chain-over-2-20-bytes alone takes 3 MiB (1 MiB of hashes and their hex twin),
    # the smallest container that shows a chain over the old 2^20-byte cap is accepted (KVW-PREFIX-7)
    assert size < 8 << 20, f"vectors take {size} bytes"


@pytest.mark.slow
def test_generator_refuses_to_overwrite_a_version_folder(tmp_path):
    (tmp_path / "1.0").mkdir()
    p = subprocess.run([sys.executable, str(ROOT / "conformance" / "generate.py"), "--out", str(tmp_path)],
                       capture_output=True, text=True)
    assert p.returncode == 1 and "refusing to overwrite" in p.stderr
    assert list((tmp_path / "1.0").iterdir()) == []


@pytest.mark.slow
def test_generator_adds_a_set_only_once_and_never_replaces_a_file(tmp_path):
    gen = str(ROOT / "conformance" / "generate.py")
    p = subprocess.run([sys.executable, gen, "--add", "engine_layout"], capture_output=True, text=True)
    assert p.returncode == 1 and "already lists it" in p.stderr
    m = json.loads((VECTORS / "1.0" / "manifest.json").read_text())
    added = [n for a in m["additions"] for n in a["vectors"]]
    assert [e["name"] for e in m["vectors"]][-len(added):] == added  # appended after the frozen ones
    # the manifest as it was before the set, its files still there: refused, nothing written
    import shutil

    shutil.copytree(VECTORS / "1.0", tmp_path / "1.0")
    del m["additions"]
    m["vectors"] = m["vectors"][: -len(added)]
    (tmp_path / "1.0" / "manifest.json").write_text(json.dumps(m, indent=1) + "\n")
    before = {p: sha256(p) for p in (tmp_path / "1.0").rglob("*") if p.is_file()}
    p = subprocess.run([sys.executable, gen, "--out", str(tmp_path), "--add", "engine_layout"],
                       capture_output=True, text=True)
    assert p.returncode == 1 and "refusing to overwrite existing files" in p.stderr, p.stderr
    assert before == {p: sha256(p) for p in (tmp_path / "1.0").rglob("*") if p.is_file()}


def test_twins_agree_with_the_reference_reader_and_round_trip_through_json():
    for v in load_vector_set(VECTORS / "1.0").vectors:
        if v.kind != "valid" or v.entry.get("input") == "segments":
            continue
        with kv_open(str(v.path)) as r:
            r.validate()
            cache = r.load()
            assert N.header_to_json(cache.header) == v.twin["header"], v.name
            assert D.tensor_digests(cache) == v.twin["tensors"], v.name
            assert N.header_from_json(v.twin["header"]) == cache.header, v.name


def test_the_reference_reader_reports_each_invalid_vectors_code_and_rule():
    from kvwire.format.errors import FormatError

    for v in load_vector_set(VECTORS / "1.0").vectors:
        if v.kind != "invalid" or v.entry.get("input") == "segments":
            continue
        with pytest.raises(FormatError) as info:
            with kv_open(str(v.path)) as r:
                r.validate()
        assert (info.value.code, info.value.rule) == (v.entry["expected_code"], v.entry["rule"]), v.name


def test_find_vectors_root():
    assert find_vectors_root(ROOT / "python") == VECTORS
    assert [vs.version for vs in load_vector_sets(VECTORS)] == sorted(PINNED_MANIFESTS)


# =======================================================================================
# The reference codec passes 100%
# =======================================================================================

@pytest.mark.slow
def test_kvwire_conformance_run_passes_for_the_reference_codec(tmp_path, capsys):
    junit, md = tmp_path / "r.xml", tmp_path / "r.md"
    assert main(["conformance", "run", "-q", "--junit", str(junit), "--markdown", str(md)]) == 0
    out = capsys.readouterr().out
    assert "RESULT: PASS" in out
    assert re.search(r"reader\s+pass\s+(\d+)/\1 passed \(100\.0%\)", out)
    assert re.search(r"writer\s+pass\s+(\d+)/\1 passed \(100\.0%\)", out)
    assert re.search(r"roundtrip\s+pass\s+(\d+)/\1 passed \(100\.0%\)", out)
    root = ET.parse(junit).getroot()
    suites = {s.get("name"): s for s in root.iter("testsuite")}
    assert set(suites) == {"kvwire-reference.reader", "kvwire-reference.writer", "kvwire-reference.roundtrip"}
    m = json.loads((VECTORS / "1.0" / "manifest.json").read_text())
    regressions = json.loads((VECTORS / "1.0" / m["regressions"]).read_text())["vectors"]
    assert int(suites["kvwire-reference.reader"].get("tests")) == len(m["vectors"]) + len(regressions)
    for s in suites.values():
        assert (s.get("failures"), s.get("errors"), s.get("skipped")) == ("0", "0", "0")
    text = md.read_text()
    assert "**Result: PASS**" in text and "## Producer x consumer matrix" in text


@pytest.mark.slow
def test_per_command_processes_without_serve(tmp_path):
    """The plain protocol (one process per command), on a sample of vectors of each kind."""
    impl = CommandImpl(default_impl_argv(), use_serve=False)
    run = Runner([impl], load_vector_sets(VECTORS), select=["*/pre1-bad-magic", "*/csum1-body-zstd",
                                                            "*/valid/mla-latent", "*/segments-gap"],
                 jobs=2).run()
    assert not impl.serving and run.ok
    assert {(c.level, c.case.split(" ")[0]) for c in run.cases} >= {
        ("reader", "1.0/invalid/pre1-bad-magic"), ("reader", "1.0/valid/mla-latent"),
        ("writer", "1.0/valid/mla-latent"), ("roundtrip", "1.0/valid/mla-latent"), ("reader", "1.0/invalid/segments-gap")}


# =======================================================================================
# The protocol implementation
# =======================================================================================

def impl_cmd(*args, **kw):
    return subprocess.run(default_impl_argv() + [str(a) for a in args], capture_output=True, text=True, **kw)


@pytest.mark.slow
def test_impl_info_validate_decode(tmp_path):
    info = json.loads(impl_cmd("info").stdout)
    assert info["protocol"] == 1 and {"decode", "encode", "validate", "serve"} <= set(info["commands"])
    v = VECTORS / "1.0"
    p = impl_cmd("validate", v / "invalid" / "pre4-preamble-check.kvw")
    assert p.returncode == 1 and p.stdout.splitlines()[0] == "PREAMBLE_CHECKSUM KVW-PRE-4"
    assert impl_cmd("validate", v / "valid" / "stream-raw.kvw").returncode == 0
    assert impl_cmd("decode", v / "valid" / "shared-layers.kvw", tmp_path / "out").returncode == 0
    doc = json.loads((tmp_path / "out" / "decoded.json").read_text())
    twin = json.loads((v / "valid" / "shared-layers.json").read_text())
    assert doc["header"] == twin["header"]
    assert [(t["layer"], t["component"]) for t in doc["tensors"]] == [(0, "k"), (0, "v"), (2, "k"), (2, "v")]
    for t, w in zip(doc["tensors"], twin["tensors"]):
        assert hashlib.sha256((tmp_path / "out" / t["file"]).read_bytes()).hexdigest() == w["sha256"]
    assert impl_cmd("frobnicate").returncode == 2


@pytest.mark.slow
def test_impl_serve_answers_like_separate_processes(tmp_path):
    v = VECTORS / "1.0"
    reqs = [["validate", v / "invalid" / "layout2-padding-after-header.kvw"],
            ["validate", v / "valid" / "zstd-file.kvw"], ["nonsense"],
            ["encode", tmp_path / "missing-spec.json", tmp_path / "o.kvw"]]
    lines = "".join(json.dumps({"id": i, "args": [str(a) for a in r]}) + "\n" for i, r in enumerate(reqs))
    p = impl_cmd("serve", input=lines)
    answers = [json.loads(x) for x in p.stdout.splitlines()]
    assert [a["id"] for a in answers] == [0, 1, 2, 3]
    assert answers[0]["exit"] == 1 and answers[0]["stdout"].startswith("NONZERO_PADDING KVW-LAYOUT-2")
    assert answers[1]["exit"] == 0
    assert answers[2]["exit"] == 2
    assert answers[3]["exit"] == 1 and answers[3]["stdout"] == "" and "FileNotFoundError" in answers[3]["stderr"]


@pytest.mark.slow
def test_encode_spec_round_trip(tmp_path):
    """``encode`` of a writer case reproduces the case's header and tensors."""
    v = VECTORS / "1.0" / "valid"
    assert impl_cmd("decode", v / "rope-positions.kvw", tmp_path / "d").returncode == 0
    doc = json.loads((tmp_path / "d" / "decoded.json").read_text())
    spec = {"format": N.ENCODE_SPEC_FORMAT, "version": 1, "form": "stream", "codec": "zstd",
            "header": doc["header"], "tensors": doc["tensors"]}
    (tmp_path / "d" / "spec.json").write_text(json.dumps(spec))
    assert impl_cmd("encode", tmp_path / "d" / "spec.json", tmp_path / "o.kvw").returncode == 0
    with kv_open(str(tmp_path / "o.kvw")) as r:
        r.validate()
        assert r.form == "stream"
        got = N.header_to_json(r.header)
        twin = json.loads((v / "rope-positions.json").read_text())
        assert C.compare_header(twin["header"], got) == ([], [])
        assert C.compare_tensors(twin["tensors"], D.tensor_digests(r.load())) == []


def test_compare_header_reports_missing_and_different_fields():
    twin = json.loads((VECTORS / "1.0" / "valid" / "rope-positions.json").read_text())["header"]
    core = {k: twin[k] for k in C.CORE_HEADER_FIELDS}
    errors, notes = C.compare_header(twin, core, ignore=())
    assert errors == [] and "metadata: not reported" in notes and "producer: not reported" in notes
    bad = dict(core, first_position=3)
    bad["arch"] = json.loads(json.dumps(core["arch"]))
    bad["arch"]["layers"][1]["rope"]["theta"] = 1.0
    del bad["token_count"]
    errors, _ = C.compare_header(twin, bad, ignore=())
    assert any(e.startswith("first_position: expected 1099511627779") for e in errors)
    assert "token_count: not reported" in errors
    assert any(e.startswith("arch.layers[1].rope: expected") for e in errors)


# =======================================================================================
# Broken implementations are caught
# =======================================================================================

BROKEN = textwrap.dedent('''
    """The reference implementation of the protocol, broken on purpose (MODE = argv[1])."""
    import json, sys, time
    import numpy as np
    import kvwire.cache.reader as reader
    import kvwire.cache.encoder as encoder
    from kvwire.conformance import impl
    from kvwire.format.errors import FormatError

    mode = sys.argv.pop(1)
    if mode == "skip-checksum":  # never verifies body checksums
        stored = reader.Reader.stored
        reader.Reader.stored = lambda self, i, verify: stored(self, i, False)
    elif mode == "alignment-64":  # assumes 64-byte alignment whatever the header says
        import kvwire.format.container as container
        parse = container.parse_header
        def parse_64(data):
            h = parse(data)
            object.__setattr__(h, "alignment", 64)
            return h
        container.parse_header = parse_64
    elif mode == "skip-padding":  # never looks at padding bytes
        reader.check_zero = lambda *a: None
    elif mode == "wrong-codes":  # rejects the right inputs, with one catch-all code
        reject = impl._reject
        def one_code(exc, out):
            return reject(FormatError("FB_BOUNDS", str(exc)), out)
        impl._reject = one_code
    elif mode == "crash":  # an internal error instead of a format error on BODY_CHECKSUM inputs
        validate = reader.Reader.validate
        def crash(self):
            try:
                validate(self)
            except FormatError as exc:
                if exc.code == "BODY_CHECKSUM":
                    raise IndexError("boom")
                raise
        reader.Reader.validate = crash
    elif mode == "hang":  # never answers for inputs one byte longer than a multiple of 64
        import os
        kv_open = impl.kv_open
        def hang(path, **kw):
            if os.path.getsize(path) % 64 == 1:
                time.sleep(3600)
            return kv_open(path, **kw)
        impl.kv_open = hang
    elif mode == "bad-writer":  # flips one bit of the last tensor it writes
        read_spec = impl.read_encode_spec
        def flipped(path):
            cache, form, codec = read_spec(path)
            for layer in reversed(cache.layers):
                for x in layer.values():
                    if x.size:
                        u = np.ascontiguousarray(x).view(np.uint8).copy()
                        u.reshape(-1)[0] ^= 1
                        layer[next(k for k, y in layer.items() if y is x)] = u.view(x.dtype).reshape(x.shape)
                        return cache, form, codec
            return cache, form, codec
        impl.read_encode_spec = flipped
    elif mode == "slow-start":  # every process starts slower than the runner's --timeout (a loaded machine)
        time.sleep(4)
    elif mode == "reader-only":
        info = impl.info
        impl.info = lambda: dict(info(), name="reader-only", commands=["decode", "validate"])
    sys.exit(impl.main(sys.argv[1:]))
''')


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    path = tmp_path_factory.mktemp("broken") / "broken_impl.py"
    path.write_text(BROKEN)

    def make(mode, **kw):
        return CommandImpl([sys.executable, str(path), mode], **kw)

    return make


def run_impls(impls, select, **kw):
    return Runner(impls, load_vector_sets(VECTORS), select=select, **kw).run()


def failing(run, level="reader", impl=None):
    return {c.case for c in run.cases if c.level == level and c.status in ("fail", "error")
            and (impl is None or c.impl == impl)}


@pytest.mark.slow
def test_a_reader_that_skips_checksums_is_caught(broken):
    run = run_impls([broken("skip-checksum")], ["*/csum1-*", "*/valid/zstd-file", "*/codec2-*"], levels=("reader",))
    assert not run.ok
    assert failing(run) == {"1.0/invalid/csum1-body-raw", "1.0/invalid/csum1-body-zstd", "1.0/invalid/csum1-body-stream"}
    msg = next(c.message for c in run.cases if c.case == "1.0/invalid/csum1-body-raw")
    assert "accepted an invalid vector (expected BODY_CHECKSUM)" in msg
    assert run.level_verdict(run.impls[0], "reader") == "FAIL"


@pytest.mark.slow
def test_a_reader_that_misreads_the_alignment_is_caught(broken):
    run = run_impls([broken("alignment-64")], ["*/align-4096-*", "*/valid/stream-raw"])
    assert failing(run) == {"1.0/valid/align-4096-file", "1.0/valid/align-4096-stream-zstd"}
    # its writer is fine, its reader fails the matrix cells that read 4096-aligned files
    assert failing(run, "writer") == set()
    assert {c.consumer for c in run.cases if c.level == "roundtrip" and c.status == "fail"} == {run.impls[0]}
    assert run.matrix[("reference", run.impls[0])] == [1, 3]


@pytest.mark.slow
def test_a_reader_that_skips_padding_is_caught(broken):
    run = run_impls([broken("skip-padding")], ["*/layout2-*"], levels=("reader",))
    assert failing(run) == {"1.0/invalid/layout2-padding-after-header", "1.0/invalid/layout2-padding-between-bodies",
                            "1.0/invalid/layout2-padding-before-end"}  # index padding is checked elsewhere


@pytest.mark.slow
def test_wrong_error_codes_fail_or_warn(broken):
    """KVW-ERR-1: a rejection with a code the violated rule does not prescribe fails the vector."""
    sel = ["*/pre1-bad-magic", "*/hdr3-root-offset", "*/valid/dtype-f16"]
    strict = run_impls([broken("wrong-codes")], sel, levels=("reader",))
    assert failing(strict) == {"1.0/invalid/pre1-bad-magic"}  # FB_BOUNDS is right for hdr3-root-offset
    msg = next(c.message for c in strict.cases if c.case == "1.0/invalid/pre1-bad-magic")
    assert msg == "validate: rejected, wrong code: FB_BOUNDS, expected BAD_MAGIC"
    lenient = run_impls([broken("wrong-codes")], sel, levels=("reader",), lenient_codes=True)
    assert lenient.ok and [c.status for c in lenient.cases if c.case.endswith("pre1-bad-magic")] == ["warn"]


@pytest.mark.slow
def test_crashes_and_hangs_are_errors(broken):
    run = run_impls([broken("crash")], ["*/csum1-body-raw", "*/valid/zstd-file"], levels=("reader",))
    (bad,) = [c for c in run.cases if c.status == "error"]
    assert bad.case == "1.0/invalid/csum1-body-raw" and "without a registry error code" in bad.message
    assert "IndexError: boom" in bad.message
    hang = broken("hang", timeout=3)
    run = run_impls([hang], ["*/layout4-trailing-byte", "*/pre1-bad-magic", "*/valid/stream-raw"], levels=("reader",))
    statuses = {c.case: c.status for c in run.cases}
    assert statuses == {"1.0/invalid/layout4-trailing-byte": "error", "1.0/invalid/pre1-bad-magic": "pass",
                        "1.0/valid/stream-raw": "pass"}
    assert "hang" in next(c.message for c in run.cases if c.status == "error")


@pytest.mark.slow
def test_a_slow_start_is_not_taken_for_a_hang(broken):
    """Each process of this implementation takes 4 s to start, twice the timeout: ``info``
    and a new server's first answer get the start-up grace, so every vector passes (the
    commands themselves answer at once)."""
    slow = broken("slow-start", timeout=2)
    run = run_impls([slow], ["*/pre1-bad-magic", "*/valid/stream-raw"], levels=("reader",), jobs=1)
    assert slow.serving, "info timed out: the runner fell back to one process per command"
    assert {c.case: c.status for c in run.cases} == {"1.0/invalid/pre1-bad-magic": "pass",
                                                     "1.0/valid/stream-raw": "pass"}, [c.message for c in run.cases]


@pytest.mark.slow
def test_a_broken_writer_is_caught_at_the_writer_level_and_in_the_matrix(broken):
    bad = broken("bad-writer")
    run = run_impls([CommandImpl(default_impl_argv()), bad], ["*/valid/dtype-bf16", "*/valid/layer-map"],
                    levels=("writer", "roundtrip"))
    good_label, bad_label = run.impls
    assert failing(run, "writer", bad_label) == {"1.0/valid/dtype-bf16", "1.0/valid/layer-map"}
    assert failing(run, "writer", good_label) == set()
    msg = next(c.message for c in run.cases if c.impl == bad_label and c.level == "writer")
    assert "bytes differ" in msg
    # the matrix: every cell the bad writer produced fails, every other cell passes
    for (p, c), (passed, total) in run.matrix.items():
        assert total == 2 and passed == (0 if p == bad_label else 2), (p, c)
    assert len(run.matrix) == 9


@pytest.mark.slow
def test_a_reader_only_implementation_is_not_tested_at_the_writer_levels(broken):
    run = run_impls([broken("reader-only")], ["*/valid/single-token", "*/pre2-*"])
    label = run.impls[0]
    assert label == "reader-only" and run.ok
    assert run.level_verdict(label, "reader") == "pass"
    assert run.level_verdict(label, "writer") == "not tested"
    assert run.level_verdict(label, "roundtrip") == "pass (partial)"  # it reads what the reference writes


@pytest.mark.slow
def test_modified_vector_files_are_reported(tmp_path):
    import shutil

    d = tmp_path / "1.0"
    shutil.copytree(VECTORS / "1.0", d)
    p = d / "invalid" / "pre3-reserved.kvw"
    p.write_bytes(p.read_bytes()[:-1])
    vs = load_vector_set(d)
    run = Runner([CommandImpl(default_impl_argv())], [vs], select=["*/pre3-reserved"], levels=("reader",)).run()
    (c,) = run.cases
    assert c.status == "error" and "sha256 differs" in c.message
