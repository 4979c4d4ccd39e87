#!/usr/bin/env python3
"""The vectors of the minimal reader profile (spec/minimal-reader.md), and a run of them.

A minimal reader reads file-form containers of dense caches whose chunks are raw, and
refuses every other container with UNSUPPORTED_FEATURE (KVW-MIN-2). Which vectors it must
pass follows from the bytes of each vector, not from a list kept by hand, so sets appended
later are classified too:

* core: file form (the last 8 bytes are "KVWINDEX", KVW-FILE-7), no required feature bit,
  every chunk record raw; and every invalid vector whose defect lies in the preamble or
  header before the point where a minimal reader refuses the part it leaves out. The reader
  level of ``kvwire conformance run``, strict: valid vectors decode to their twins, invalid
  ones are rejected with the vector's code (KVW-MIN-3).
* rest, invalid: every other invalid vector; it must be rejected, with any registry code
  (the runner's ``--lenient-codes``): a minimal reader may meet the part it leaves out
  before the defect.
* rest, valid: every other valid vector; ``validate`` must reject it with UNSUPPORTED_FEATURE,
  or accept it and decode it right (a reader may implement more than the profile). Segment
  streams (``reassemble``) are outside the profile and not run.

    python conformance/minimal_reader.py --list core          # vector ids, one per line
    python conformance/minimal_reader.py --impl "./my-reader" # run the profile (exit 0: conforms)
"""

from __future__ import annotations

import argparse
import struct
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VECTORS = ROOT / "conformance" / "vectors" / "1.0"
FRAME = 64
RECORD_CODEC = 8 + 43  # frame marker and check, then ChunkRecord byte 43 (codec)
_PREAMBLE = struct.Struct("<8sHHIQII")


def required_features(data: bytes) -> int | None:
    """``Header.required_features`` read without any check, or None when the bytes hold no
    readable header (a minimal reader then fails exactly where a full reader fails)."""
    from kvwire.format.fbs.Header import Header

    if len(data) < _PREAMBLE.size:
        return None
    hlen = _PREAMBLE.unpack_from(data)[3]
    hb = data[_PREAMBLE.size:_PREAMBLE.size + hlen]
    try:
        return int(Header.GetRootAs(hb, 0).RequiredFeatures())
    except Exception:  # a forged header: the field cannot be located
        return None


def record_codecs(data: bytes) -> set:
    """The codec byte of every chunk frame (frames start at multiples of 64, KVW-LAYOUT-1)."""
    return {data[p + RECORD_CODEC] for p in range(0, len(data) - FRAME + 1, FRAME) if data[p:p + 4] == b"KWCH"}


def left_out(data: bytes) -> list:
    """The parts of the format a minimal reader leaves out that ``data`` uses (KVW-MIN-2)."""
    out = []
    if not (len(data) >= FRAME and data[-8:] == b"KVWINDEX"):
        out.append("stream form")
    rf = required_features(data)
    if rf:
        out.append(f"required features {rf:#x}")
    codecs = record_codecs(data) - {0}
    if codecs:
        out.append(f"codecs {sorted(codecs)}")
    return out


def classify(vectors: Path = DEFAULT_VECTORS) -> dict:
    """{"core": [...], "rest_invalid": [...], "rest_valid": [...], "segments": [...]}: vector
    entries (the manifest's, with "path" and "id" added)."""
    import json

    manifest = json.loads((vectors / "manifest.json").read_text())
    version = manifest.get("format_version", vectors.name)
    entries = list(manifest["vectors"])
    reg = vectors / manifest.get("regressions", "regressions/manifest.json")
    if reg.is_file():
        entries += [{**e, "_base": reg.parent} for e in json.loads(reg.read_text()).get("vectors", [])]
    out: dict = {"core": [], "rest_invalid": [], "rest_valid": [], "segments": []}
    for e in entries:
        path = Path(e.get("_base", vectors)) / e["file"]
        e = {k: v for k, v in e.items() if k != "_base"} | {"path": path, "id": f"{version}/{e['name']}"}
        if e.get("input") == "segments":
            out["segments"].append(e)
            continue
        data = path.read_bytes()
        parts = left_out(data)
        e["left_out"] = parts
        if not parts or (e["kind"] != "valid" and found_before_refusal(data)):
            out["core"].append(e)
        else:
            out["rest_valid" if e["kind"] == "valid" else "rest_invalid"].append(e)
    return out


def found_before_refusal(data: bytes) -> bool:
    """Does a reader that implements no required feature bit reject ``data`` in section 14.1
    steps 1 to 4 with the reference reader's code? Then a minimal reader reports that code
    too (KVW-MIN-3): it refuses feature bits at EVOL-3's place in step 3, the stream form at
    step 6 and zstd records at CHUNK-5's place in step 8 (KVW-MIN-2). Such a reader does not
    follow the fields that features added after 1.0 (``Header.kv_scales`` without bit 3
    known, ``CodecSpec`` fields 11-13), so their FlatBuffers defects are not among them."""
    from kvwire.format import registry as R
    from kvwire.format.container import read_header
    from kvwire.format.errors import FormatError

    def first_error():
        try:
            read_header(data)
        except FormatError as err:
            return err.code
        return None

    full = first_error()
    if full is None:
        return False
    known = R.KNOWN_REQUIRED_FEATURES
    R.KNOWN_REQUIRED_FEATURES = 0  # the reference reader, told it implements no feature bit
    try:
        return first_error() == full
    finally:
        R.KNOWN_REQUIRED_FEATURES = known


def refusals(cmd: list, entries: list, timeout: float = 60.0) -> tuple[list, list]:
    """(accepted, problems) of ``cmd validate`` on valid vectors outside the profile: each must
    be refused with exit 1 and UNSUPPORTED_FEATURE (KVW-MIN-2) or accepted; the accepted ones
    must then decode right like any valid vector (a reader may implement more than the profile)."""
    accepted, problems = [], []
    for e in entries:
        try:
            p = subprocess.run([*cmd, "validate", str(e["path"])], capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            problems.append(f"{e['id']}: validate hangs")
            continue
        if p.returncode == 0:
            accepted.append(e)
        elif p.returncode != 1 or (p.stdout.split() or [""])[0] != "UNSUPPORTED_FEATURE":
            problems.append(f"{e['id']} ({', '.join(e['left_out'])}): exit {p.returncode}, {p.stdout.strip()[:80]!r}; "
                            f"expected UNSUPPORTED_FEATURE (or the vector decoded); stderr {p.stderr.strip()[-300:]!r}")
    return accepted, problems


def run_profile(cmd: str, vectors: Path, *, jobs: int | None = None, timeout: float = 60.0, quiet: bool = True) -> int:
    import shlex

    from kvwire.conformance.drivers import CommandImpl
    from kvwire.conformance.report import case_line, summary_text
    from kvwire.conformance.runner import Runner
    from kvwire.conformance.vectors import load_vector_set

    def progress(c):
        if not quiet or c.status != "pass":
            print(case_line(c), flush=True)

    def reader_level(title: str, entries: list, lenient: bool) -> bool:
        vs = load_vector_set(vectors)
        ids = {e["id"] for e in entries}
        vs.vectors = [v for v in vs.vectors if v.id in ids]
        run = Runner([CommandImpl(cmd, timeout=timeout)], [vs], levels=("reader",), jobs=jobs, lenient_codes=lenient,
                     progress=progress).run()
        print(f"{title}: {len(ids)} vectors\n{summary_text(run)}")
        return run.ok

    groups = classify(vectors)
    ok = reader_level("profile vectors (strict)", groups["core"], False)
    ok &= reader_level("other invalid vectors (rejected, any code)", groups["rest_invalid"], True)
    accepted, problems = refusals(shlex.split(cmd), groups["rest_valid"], timeout)
    print(f"other valid vectors: {len(groups['rest_valid'])}, {len(groups['rest_valid']) - len(accepted) - len(problems)} "
          f"refused with UNSUPPORTED_FEATURE, {len(accepted)} accepted, {len(problems)} wrong"
          + "".join(f"\n  {p}" for p in problems))
    if accepted:
        ok &= reader_level("other valid vectors it accepts (strict)", accepted, False)
    return 0 if ok and not problems else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vectors", default=str(DEFAULT_VECTORS), help="a version folder (with manifest.json)")
    ap.add_argument("--list", choices=("core", "rest_invalid", "rest_valid", "segments"),
                    help="print the ids of one group and exit")
    ap.add_argument("--impl", metavar="CMD", help="run the profile against this protocol command")
    ap.add_argument("--jobs", "-j", type=int, default=None)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("-v", "--verbose", action="store_true", help="print every check, not only those that fail")
    args = ap.parse_args(argv)
    vectors = Path(args.vectors)
    if args.list:
        for e in classify(vectors)[args.list]:
            print(e["id"])
        return 0
    if not args.impl:
        counts = {k: len(v) for k, v in classify(vectors).items()}
        print(f"{vectors}: {counts}; pass --impl CMD to run the profile, --list GROUP to list it")
        return 0
    return run_profile(args.impl, vectors, jobs=args.jobs, timeout=args.timeout, quiet=not args.verbose)


if __name__ == "__main__":
    sys.exit(main())
