"""Every place that names the current format revision names the same one.

The source of truth is the code: ``FORMAT_MINOR_IMPLEMENTED`` of ``kvwire.format.registry``
(the newest revision the reference reads and writes). The spec's title, its status table and
its change log, spec/README.md, the header schema's comment, libkvwire's ``KVW_FORMAT_MINOR``
and conformance/PROTOCOL.md repeat it; a revision that forgets one of them fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

from kvwire.format import registry as R

ROOT = Path(__file__).resolve().parents[2]
MINOR = R.FORMAT_MINOR_IMPLEMENTED
CURRENT = f"{R.FORMAT_MAJOR}.{MINOR}"


def _text(rel: str) -> str:
    return (ROOT / rel).read_text()


def test_spec_title_and_status_table():
    spec = _text("spec/kvwire-v1.md")
    assert spec.splitlines()[0] == f"# kvwire format, version {CURRENT}"
    row = re.search(r"^\| Format version \| major (\d+), minor (\d+) \(revision (\d+\.\d+);", spec, re.M)
    assert row and (int(row[1]), int(row[2]), row[3]) == (R.FORMAT_MAJOR, MINOR, CURRENT), row
    status = re.search(r"^\| Status \|(.*)$", spec, re.M)[1]
    assert f"revision **{CURRENT}**" in status
    assert not re.search(rf"revision \*\*{R.FORMAT_MAJOR}\.(?!{'|'.join(str(m) for m in range(1, MINOR + 1))})\d+\*\*",
                         status), "the status names a revision newer than the code's"


def test_spec_change_log_newest_entry():
    spec = _text("spec/kvwire-v1.md")
    log = spec[spec.index("## Appendix D. Change log"):]
    versions = re.findall(r"^### (\d+\.\d+)", log, re.M)
    assert versions[0] == CURRENT, versions[:3]
    assert max(versions, key=lambda v: tuple(map(int, v.split(".")))) == CURRENT


def test_spec_readme():
    readme = _text("spec/README.md")
    said = set(re.findall(r"the current revision is \*\*(\d+\.\d+)\*\*", readme, re.I))
    said |= set(re.findall(r"revision \*\*(\d+\.\d+)\*\* \(format\s+minor \d+, the current revision\)", readme))
    assert said == {CURRENT}, said
    assert f"revisions **1.1** to **{CURRENT}**" in readme


def test_schema_comment():
    fbs = _text("schemas/kvwire.fbs")
    said = re.findall(r"^// Current revision: (\d+\.\d+) \(format minor (\d+)\)", fbs, re.M)
    assert said == [(CURRENT, str(MINOR))], said


def test_libkvwire_format_minor():
    h = _text("c/include/kvwire.h")
    said = re.findall(r"^#define KVW_FORMAT_MINOR (\d+)\b.*?\((\d+\.\d+)\)", h, re.M)
    assert said == [(str(MINOR), CURRENT)], said


def test_conformance_protocol_note():
    proto = _text("conformance/PROTOCOL.md")
    said = re.findall(r"revision (\d+\.\d+), the current revision\s+\(format minor (\d+)", proto)
    assert said == [(CURRENT, str(MINOR))], said
