"""The minimal reader profile (spec/minimal-reader.md, KVW-MIN-1..3) is consistent with the vectors.

A minimal reader is made from the reference codec the way KVW-MIN-2 says one behaves: it
knows no required feature bit (so every bit is UNSUPPORTED_FEATURE at KVW-EVOL-3's place),
and refuses the stream form and zstd records with UNSUPPORTED_FEATURE. Run through
``conformance/minimal_reader.py``, it must pass the profile: the vectors the script puts in
the profile are exactly those on which such a reader reports the vector's own code.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "conformance"))
import minimal_reader as M

VECTORS = ROOT / "conformance" / "vectors" / "1.0"

SHIM = textwrap.dedent('''
    """A minimal reader (spec/minimal-reader.md) made from the reference codec."""
    import sys
    from kvwire.format import registry as R
    R.KNOWN_REQUIRED_FEATURES = 0  # KVW-MIN-2: no feature bit is implemented (refused by KVW-EVOL-3)
    from kvwire.conformance import impl
    from kvwire.format.errors import FeatureError

    _open = impl.kv_open

    class MinimalOpen:
        def __init__(self, path):
            self.r = _open(path)

        def __enter__(self):
            r = self.r.__enter__()
            if r.form != "file":
                raise FeatureError("UNSUPPORTED_FEATURE", "the stream form is outside the profile", rule="KVW-MIN-2")
            if any(r.info(i).codec != "raw" for i in range(r.chunk_count)):
                raise FeatureError("UNSUPPORTED_FEATURE", "codec zstd is outside the profile", rule="KVW-MIN-2")
            return r

        def __exit__(self, *exc):
            return self.r.__exit__(*exc)

    impl.kv_open = MinimalOpen
    impl.COMMANDS = ("decode", "validate", "serve")
    sys.exit(impl.main())
''')


def test_min3_groups_follow_from_the_bytes():
    """KVW-MIN-3: the profile's vectors are file form, raw and without bits, or rejected early."""
    groups = M.classify(VECTORS)
    core = groups["core"]
    assert len(core) >= 190 and len(groups["rest_valid"]) >= 60
    for e in core:
        if e["kind"] == "valid":
            assert e["left_out"] == [], e["id"]
        elif e["left_out"]:
            assert M.found_before_refusal(e["path"].read_bytes()), e["id"]
    names = {e["id"] for e in core}
    assert "1.0/valid/dtype-bf16" in names and "1.0/valid/evol-future-minor" in names
    assert "1.0/valid/clar-unreferenced-state-spec-without-bit" in names  # KVW-HDR-22 is in the profile
    assert "1.0/valid/clar-turboquant-4bit-only" in {e["id"] for e in groups["rest_valid"]}
    # every code the parts of KVW-MIN-1 report has a vector in the profile
    codes = {e["expected_code"] for e in core if e["kind"] == "invalid"}
    assert {"BAD_MAGIC", "FB_BOUNDS", "ENUM_OUT_OF_RANGE", "CODEC_SPEC_INVALID", "SPARSE_INVALID",
            "PREFIX_INVALID", "BODY_CHECKSUM", "INDEX_MISMATCH", "UNSUPPORTED_FEATURE"} <= codes, codes


@pytest.mark.slow  # one interpreter per vector: about 30 s on 2 cores
def test_min2_min3_a_minimal_reader_passes_the_profile(tmp_path: Path):
    """KVW-MIN-2, KVW-MIN-3: a reader that refuses as KVW-MIN-2 says passes all three checks."""
    shim = tmp_path / "minimal_reader_shim.py"
    shim.write_text(SHIM)
    cmd = f"{sys.executable} {shim}"
    p = subprocess.run([sys.executable, str(ROOT / "conformance" / "minimal_reader.py"), "--impl", cmd,
                        "--vectors", str(VECTORS), "-j", "2"], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    assert "0 accepted, 0 wrong" in p.stdout, p.stdout[-2000:]
