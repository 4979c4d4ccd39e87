"""Error family of the package, rooted here because ``format`` is the lowest layer.

``Error`` is the root of every exception kvwire raises on purpose, so ``except
kvwire.Error`` catches them all and nothing else. Each class carries a stable ``code``
string; callers branch on ``code`` (or on the class), never on message text, so the
messages can improve without breaking anyone. Every class also keeps the builtin base
that says what kind of failure it is (``ValueError`` for bad input, ``TimeoutError`` for
a stalled peer, ...), so ``except ValueError`` in existing code still works.

Every way a container can be wrong maps to one ``FormatError`` code listed in the spec
(spec/kvwire-v1.md section 18, "Error code registry"); the codes of the other classes are
listed in docs/errors.md. Anything that is not a ``FormatError`` escaping a reader is a
bug in the reader.
"""

from __future__ import annotations


class Error(Exception):
    """Root of every kvwire exception: ``except kvwire.Error`` catches any of them.

    ``code`` is the stable identifier of the failure (a class attribute; ``FormatError``
    sets one per instance from the spec's registry). ``KVWIRE_ERROR`` is reserved for this
    root and never raised by kvwire itself.
    """

    code: str = "KVWIRE_ERROR"


class FormatError(Error, ValueError):
    """The input is not a valid kvwire container (or not one this reader supports)."""

    code = "FORMAT_ERROR"

    def __init__(self, code: str, message: str, *, rule: str | None = None):
        self.code = code
        self.rule = rule
        prefix = f"{code}" + (f" [{rule}]" if rule else "")
        super().__init__(f"{prefix}: {message}")


class TruncatedError(FormatError):
    """The input ended early. ``needed`` is the total length required, when known."""

    def __init__(self, message: str, *, needed: int | None = None, rule: str | None = None):
        super().__init__("TRUNCATED", message, rule=rule)
        self.needed = needed


class MagicError(FormatError):
    """The input does not start with the kvwire signature."""


class VersionError(FormatError):
    """The container's major version is not one this reader implements."""


class FeatureError(FormatError):
    """The container requires a feature this reader does not implement."""


class ChecksumError(FormatError):
    """Stored bytes do not match their checksum."""


class HeaderError(FormatError):
    """The FlatBuffers structure of the header or index is malformed."""


class SchemaError(FormatError):
    """The header is well formed but its values break a rule of the spec."""


class LayoutError(FormatError):
    """Frames, bodies, padding or chunk coverage break the container layout rules (spec
    section 9.3: where bytes sit in the container; an engine's memory layout is
    ``kvwire.layouts``, whose mismatches are ``LayoutMismatchError``)."""


class CodecError(FormatError):
    """A body cannot be decoded with its declared codec."""


class LimitError(FormatError):
    """A declared size exceeds a limit of the spec or of the caller."""
