"""One call on both decode paths, the numpy reference and libkvwire (kvwire.codecs.native),
for the tests that compare them: two conforming readers must agree on every input
(spec/kvwire-v1.md section 19), so each outcome is reduced to comparable values."""

from __future__ import annotations

from kvwire.codecs import native
from kvwire.format.errors import FormatError


def as_bytes(got) -> bytes:
    return bytes(memoryview(got).cast("B"))


def both(fn, lib, result=as_bytes):
    """(numpy outcome, native outcome) of ``fn()``: ("ok", ``result(value)``) or, for the
    FormatError it raised, ("err", code, class name, rule). Native is back as it was after."""
    def run():
        try:
            return ("ok", result(fn()))
        except FormatError as e:
            return ("err", e.code, type(e).__name__, e.rule)
    before = native.library()
    native.disable()
    try:
        a = run()
        native.enable(lib)
        b = run()
    finally:
        native.enable(before) if before else native.disable()
    return a, b
