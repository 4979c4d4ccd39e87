#!/usr/bin/env python3
"""atheris (libFuzzer) target: decode, validate, touch every tensor, compare both readers.

    python conformance/fuzz/fuzz_reader.py CORPUS_DIR [libFuzzer flags]

Usually run through ``campaign.py`` (``make fuzz``), which seeds the corpus from the
gold vectors and turns findings into regression vectors. Three of four mutations are
"resealed" (every checksum recomputed, see harness.reseal) so that they reach the
parsers behind the checksums, and one in eight is structure-aware instead: one chunk
record field set to an interesting value in its frame, the index or both
(``mutators.edit_record``). A finding is any exception other than ``FormatError``
(including ``harness.Differential`` and the memory oracle's ``harness.OverAllocation``),
a timeout or running out of memory.
"""

import os
import sys

import atheris

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

with atheris.instrument_imports(include=["kvwire", "harness"]):
    import harness
    import mutators

    import kvwire  # noqa: F401 (imported inside the block so atheris instruments it)


def test_one_input(data: bytes) -> None:
    harness.check(bytes(data))


def custom_mutator(data: bytes, max_size: int, seed: int) -> bytes:
    if seed % 8 == 0:
        fields = sorted(mutators.RECORD_FIELDS)
        value = mutators.INTERESTING[(seed >> 3) % len(mutators.INTERESTING)] if seed & 0x800 else seed * 0x9E3779B1
        field = fields[(seed >> 8) % len(fields)]
        where = mutators.WHERE[(seed >> 12) % len(mutators.WHERE)]
        return mutators.edit_record(bytes(data), seed >> 14, field, value, where)[:max_size]
    out = atheris.Mutate(data, max_size)
    if seed % 4:
        out = harness.reseal(out)
    return out[:max_size]


def main() -> None:
    atheris.Setup(sys.argv, test_one_input, custom_mutator=custom_mutator)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
