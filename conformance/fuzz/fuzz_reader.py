#!/usr/bin/env python3
"""atheris (libFuzzer) target: decode, validate, touch every tensor, compare both readers.

    python conformance/fuzz/fuzz_reader.py CORPUS_DIR [libFuzzer flags]

Usually run through ``campaign.py`` (``make fuzz``), which seeds the corpus from the
gold vectors and turns findings into regression vectors. Three of four mutations are
"resealed" (every checksum recomputed, see harness.reseal) so that they reach the
parsers behind the checksums. A finding is any exception other than ``FormatError``
(including ``harness.Differential``), a timeout or running out of memory.
"""

import os
import sys

import atheris

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

with atheris.instrument_imports(include=["kvwire", "harness"]):
    import harness
    import kvwire  # noqa: F401


def test_one_input(data: bytes) -> None:
    harness.check(bytes(data))


def custom_mutator(data: bytes, max_size: int, seed: int) -> bytes:
    out = atheris.Mutate(data, max_size)
    if seed % 4:
        out = harness.reseal(out)
    return out[:max_size]


def main() -> None:
    atheris.Setup(sys.argv, test_one_input, custom_mutator=custom_mutator)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
