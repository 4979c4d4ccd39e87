"""A third-party implementation's adapter for the conformance kit
(``kvwire conformance run --impl``; the protocol is conformance/PROTOCOL.md).

What it shows: the whole contract an engine author implements to be checked against the
gold vectors: a command line that the runner calls as ``ADAPTER validate IN.kvw``,
``ADAPTER decode IN.kvw OUT_DIR`` and ``ADAPTER info``; exit 0 on success, exit 1 with
the registry error code (and the rule id) on the first line of standard output when the
input is rejected; ``decode`` writes each tensor's canonical bytes and ``decoded.json``
(the neutral JSON of PROTOCOL.md section 2). This one is a *reader-level* adapter
(``info`` lists only ``validate`` and ``decode``, so the writer checks are reported as
skipped). ``EngineReader`` is where your engine's own decoder goes; here it calls
kvwire's public API so that the example passes. ``--bug accept-all`` makes ``validate``
accept everything, to see how the kit reports a broken reader.

Run it from the repository root:

    kvwire conformance run --impl "python examples/conformance_adapter.py" --levels reader -q
    kvwire conformance run --impl "python examples/conformance_adapter.py --bug accept-all" --levels reader -q
"""

from __future__ import annotations

import argparse
import json
import sys

import kvwire
from kvwire.conformance.impl import (
    write_cache,  # neutral JSON + canonical tensor files (PROTOCOL.md 2)
)

EXIT_OK, EXIT_REJECTED, EXIT_UNSUPPORTED = 0, 1, 2


class EngineReader:
    """Your engine's reader goes here: full validation (every check of spec section 14.1,
    every checksum) and decoding into your own tensors, exposed as a ``kvwire.KVCache`` for
    the report. Errors must carry the spec's registry code (``FormatError.code``)."""

    def __init__(self, path: str):
        self.path = path

    def validate(self) -> None:
        with kvwire.open(self.path, mmap=False) as r:
            r.validate()

    def decode(self) -> tuple[kvwire.KVCache, dict]:
        with kvwire.open(self.path, mmap=False) as r:
            r.validate()
            return r.load(), {"form": r.form, "chunk_count": r.chunk_count}


def reject(exc: kvwire.FormatError) -> int:
    print(f"{exc.code} {exc.rule or ''}".rstrip())      # first stdout line: the registry code
    print(str(exc))
    return EXIT_REJECTED


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bug", choices=["accept-all"], help="behave like a broken reader")
    ap.add_argument("command", choices=["info", "validate", "decode", "encode", "reassemble", "serve"])
    ap.add_argument("args", nargs="*")
    a = ap.parse_args(argv)
    if a.command == "info":
        print(json.dumps({"name": "example-adapter" + (f" ({a.bug})" if a.bug else ""), "version": "0.1",
                          "protocol": 1, "commands": ["validate", "decode"]}))
        return EXIT_OK
    try:
        if a.command == "validate" and len(a.args) == 1:
            if a.bug != "accept-all":
                EngineReader(a.args[0]).validate()
            print("VALID")
            return EXIT_OK
        if a.command == "decode" and len(a.args) == 2:
            cache, info = EngineReader(a.args[0]).decode()
            write_cache(cache, a.args[1], **info)
            print("DECODED")
            return EXIT_OK
    except kvwire.FormatError as exc:
        return reject(exc)
    return EXIT_UNSUPPORTED                                  # not implemented: its checks are skipped


if __name__ == "__main__":
    sys.exit(main())
