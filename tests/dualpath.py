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
    FormatError it raised, ("err", code, class name, rule). Native is off again after."""
    def run():
        try:
            return ("ok", result(fn()))
        except FormatError as e:
            return ("err", e.code, type(e).__name__, e.rule)
    native.disable()
    a = run()
    native.enable(lib)
    try:
        b = run()
    finally:
        native.disable()
    return a, b
