"""Error family of the format.

Every way a container can be wrong maps to one stable ``code`` string listed in the
spec ("Error code registry"). Callers branch on ``code`` (or on the subclass), never
on message text, so the messages can improve without breaking anyone. Anything that is
not a ``FormatError`` escaping a reader is a bug in the reader.
"""

from __future__ import annotations


class FormatError(ValueError):
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
    """Frames, bodies, padding or chunk coverage break the container layout rules."""


class CodecError(FormatError):
    """A body cannot be decoded with its declared codec."""


class LimitError(FormatError):
    """A declared size exceeds a limit of the spec or of the caller."""
