"""A hypothesis state machine that mutates valid containers step by step.

Each run starts from a valid gold vector and applies a sequence of mutations: byte and
bit edits, insertions, deletions, truncation, appended junk, edits of a chunk record
field (located by walking the frames), structure-aware edits of one record field in its
frame, in the file-form index or in both at once (``mutators.edit_record``: checksums,
index and end frame digest recomputed, so the record and layout checks run, not only the
checksums), edits of header bytes, and "reseal" steps that recompute every checksum
(harness.reseal). After every step the reader contract (harness.check, memory oracle
included) must hold. Used by tests/conformance/test_fuzz_statemachine.py (a bounded run in
``make test``) and by campaign.py (``make fuzz``).
"""

from __future__ import annotations

import struct
from pathlib import Path

from harness import check, reseal
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from mutators import INTERESTING, RECORD_FIELDS, WHERE, edit_record, frame_positions

VECTORS = Path(__file__).resolve().parents[1] / "vectors"
SEEDS = sorted(VECTORS.glob("*/valid/*.kvw"))
__all__ = ["ContainerMutations", "INTERESTING", "RECORD_FIELDS", "SEEDS", "frame_positions"]


class ContainerMutations(RuleBasedStateMachine):
    """Mutate one container; the reader contract holds after every step."""

    def __init__(self):
        super().__init__()
        self.data = bytearray()

    @initialize(i=st.integers(0, max(0, len(SEEDS) - 1)))
    def start(self, i):
        self.data = bytearray(SEEDS[i].read_bytes())

    def _at(self, where: float) -> int:
        return min(int(where * len(self.data)), max(0, len(self.data) - 1))

    @rule(where=st.floats(0, 1, exclude_max=True), value=st.integers(0, 255))
    def set_byte(self, where, value):
        if self.data:
            self.data[self._at(where)] = value

    @rule(where=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
    def flip_bit(self, where, bit):
        if self.data:
            self.data[self._at(where)] ^= 1 << bit

    @rule(where=st.floats(0, 1), n=st.integers(1, 96))
    def delete(self, where, n):
        at = int(where * len(self.data))
        del self.data[at : at + n]

    @rule(where=st.floats(0, 1), junk=st.binary(min_size=1, max_size=96))
    def insert(self, where, junk):
        at = int(where * len(self.data))
        self.data[at:at] = junk

    @rule(where=st.floats(0, 1))
    def truncate(self, where):
        del self.data[int(where * len(self.data)) :]

    @rule(junk=st.binary(min_size=1, max_size=128))
    def append(self, junk):
        self.data += junk

    @rule(i=st.integers(0, 1023), field=st.sampled_from(sorted(RECORD_FIELDS)),
          value=st.one_of(st.sampled_from(INTERESTING), st.integers(0, 2**64 - 1)), seal=st.booleans())
    def edit_record(self, i, field, value, seal):
        frames = frame_positions(bytes(self.data))
        if not frames:
            return
        off, fmt = RECORD_FIELDS[field]
        value &= (1 << (8 * struct.calcsize(fmt))) - 1
        struct.pack_into(fmt, self.data, frames[i % len(frames)] + 8 + off, value)
        if seal:
            self.data = bytearray(reseal(bytes(self.data)))

    @rule(i=st.integers(0, 1023), field=st.sampled_from(sorted(RECORD_FIELDS)),
          value=st.one_of(st.sampled_from(INTERESTING), st.integers(0, 2**64 - 1)), where=st.sampled_from(WHERE))
    def edit_record_structured(self, i, field, value, where):
        self.data = bytearray(edit_record(bytes(self.data), i, field, value, where))

    @rule(where=st.floats(0, 1, exclude_max=True), value=st.integers(0, 255))
    def edit_header(self, where, value):
        if len(self.data) < 40:
            return
        hlen = struct.unpack_from("<I", self.data, 12)[0]
        end = min(len(self.data), 32 + hlen)
        if end > 32:
            self.data[32 + int(where * (end - 32))] = value
            self.data = bytearray(reseal(bytes(self.data)))

    @rule()
    def reseal_all(self):
        self.data = bytearray(reseal(bytes(self.data)))

    @invariant()
    def reader_contract(self):
        check(bytes(self.data))
