"""libkvwire's numbers that cross the ABI stay put.

Why: kvw_code values are compiled into every caller of libkvwire.so.0 (and stored or sent
by some), so a code inserted in the middle of the enum would silently renumber every later
one. c/tests/error_codes.txt pins each number; these tests fail when kvwire.h, the built
library's names, the spec's registry (section 18) or the Python side's use of the codes
(kvwire.codecs.native) drift from it. Every public enum of kvwire.h must spell its numbers.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest
from test_c_impl import _make, _require_toolchain

from kvwire.codecs import native
from kvwire.format import errors as E

ROOT = Path(__file__).resolve().parents[2]
HEADER = ROOT / "c" / "include" / "kvwire.h"
TABLE = ROOT / "c" / "tests" / "error_codes.txt"
SPEC = ROOT / "spec" / "kvwire-v1.md"
LIB = ROOT / "build" / "c" / "libkvwire.so"


def _table() -> list[tuple[int, str, str]]:
    rows = []
    for line in TABLE.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            num, enumerator, name = line.split()
            rows.append((int(num), enumerator, name))
    return rows


def _enum_body(name: str) -> str:
    text = HEADER.read_text()
    m = re.search(rf"typedef enum {name} \{{(.*?)\}} {name};", text, re.S)
    assert m, f"kvwire.h has no enum {name}"
    return re.sub(r"/\*.*?\*/", "", m.group(1), flags=re.S)


def _enumerators(body: str) -> list[tuple[str, str | None]]:
    out = []
    for item in body.split(","):
        item = item.strip()
        if item:
            m = re.fullmatch(r"(KVW_[A-Z0-9_]+)(?:\s*=\s*(\S+))?", item)
            assert m, f"unexpected enumerator text {item!r}"
            out.append((m.group(1), m.group(2)))
    return out


def _spec_registry() -> dict[str, set[str]]:
    """code -> its categories (exception classes), from the registry table of spec section 18
    and the companion specs' tables of the codes they add."""
    text = SPEC.read_text()
    start = text.index("\n## 18. Error code registry")
    texts = [text[start:text.index("\n## 19.", start)]]
    texts += [(SPEC.parent / f).read_text() for f in ("codecs.md", "sparse.md", "crossmodel.md")]
    out: dict[str, set[str]] = {}
    for t in texts:
        for code, category in re.findall(r"^\| `([A-Z_0-9]+)` \| ([^|]*`[A-Za-z]*Error`[^|]*)\|", t, re.M):
            out.setdefault(code, set()).update(re.findall(r"`([A-Za-z]*Error)`", category))
    return out


def test_every_public_enum_spells_its_numbers():
    """A positional enumerator renumbers when one is inserted before it: none is allowed."""
    names = re.findall(r"typedef enum (\w+) \{", HEADER.read_text())
    assert {"kvw_code", "kvw_dtype", "kvw_codec", "kvw_event_type"} <= set(names)
    for enum in names:
        for enumerator, value in _enumerators(_enum_body(enum)):
            assert value is not None and re.fullmatch(r"\d+", value), \
                f"{enum}.{enumerator} has no explicit number in kvwire.h (append only, never positional)"


def test_kvwire_h_codes_match_the_pinned_table():
    header = {e: int(v) for e, v in _enumerators(_enum_body("kvw_code"))}
    count = header.pop("KVW_FORMAT_CODE_COUNT")
    table = _table()
    numbers = [n for n, _, _ in table]
    assert len(numbers) == len(set(numbers)), "a number is used twice in error_codes.txt"
    assert numbers == sorted(numbers), "error_codes.txt is append only, in number order"
    assert {e: n for n, e, _ in table} == header, "kvwire.h's kvw_code numbers differ from c/tests/error_codes.txt"
    assert count == max(n for n in numbers if n < 1000) + 1
    assert all(n < count or n >= 1000 for n in numbers)


def test_registry_codes_are_the_spec_registry():
    """Every registry code of the spec has a C number and every C number below 1000 is one."""
    spec = _spec_registry()
    live = {name for n, _, name in _table() if 0 < n < 1000 and not name.startswith("RETIRED:")}
    assert live == set(spec), f"C only: {sorted(live - set(spec))}; spec only: {sorted(set(spec) - live)}"


@pytest.fixture(scope="module")
def lib():
    _require_toolchain()
    _make("lib")
    so = ctypes.CDLL(str(LIB))
    so.kvw_code_name.restype = ctypes.c_char_p
    so.kvw_code_name.argtypes = [ctypes.c_int]
    so.kvw_code_from_name.restype = ctypes.c_int
    so.kvw_code_from_name.argtypes = [ctypes.c_char_p]
    so.kvw_code_is_format_error.restype = ctypes.c_int
    so.kvw_code_is_format_error.argtypes = [ctypes.c_int]
    return so


def test_the_library_names_each_pinned_number(lib):
    for num, enumerator, name in _table():
        if name.startswith("RETIRED:"):
            assert lib.kvw_code_name(num) == b"UNKNOWN" and not lib.kvw_code_is_format_error(num)
            continue
        assert lib.kvw_code_name(num).decode() == name, enumerator
        assert lib.kvw_code_is_format_error(num) == (0 < num < 1000), enumerator
        if 0 < num < 1000:
            assert lib.kvw_code_from_name(name.encode()) == num, enumerator
    assert lib.kvw_code_name(999) == b"UNKNOWN" and lib.kvw_code_name(-1) == b"UNKNOWN"


def test_python_side_agrees_with_the_table_and_the_spec():
    """kvwire.codecs.native maps C codes by name (kvw_code_name) except two numbers it
    spells; its name -> exception class table must be the spec's."""
    by_enum = {e: n for n, e, _ in _table()}
    assert native._ERR_INVALID_ARGUMENT == by_enum["KVW_ERR_INVALID_ARGUMENT"]
    assert native._ERR_UNSUPPORTED == by_enum["KVW_ERR_UNSUPPORTED"]
    spec = _spec_registry()
    for name, cls in native._CLASSES.items():
        assert name in spec, name
        assert cls in {getattr(E, c) for c in spec[name]}, \
            f"{name}: native raises {cls.__name__}, the spec says {sorted(spec[name])}"
