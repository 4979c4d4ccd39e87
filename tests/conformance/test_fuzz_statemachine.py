"""A bounded run of the hypothesis state machine that mutates valid containers
(conformance/fuzz/statemachine.py): after every mutation both reference readers raise
only FormatErrors and agree; resealing really gets mutations past the checksums."""

import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

FUZZ = Path(__file__).resolve().parents[2] / "conformance" / "fuzz"
sys.path.insert(0, str(FUZZ))

import harness
from statemachine import SEEDS, ContainerMutations, frame_positions


@pytest.mark.slow
def test_state_machine_mutations_keep_the_reader_contract():
    run_state_machine_as_test(ContainerMutations, settings=settings(
        max_examples=150, stateful_step_count=15, deadline=None, suppress_health_check=list(HealthCheck)))


@pytest.mark.slow
def test_seeds_are_valid_and_frames_are_found():
    assert len(SEEDS) >= 20
    for p in SEEDS:
        data = p.read_bytes()
        assert harness.check(data) == "ok", p.name
        assert harness.reseal(data) == data, p.name  # resealing a valid container changes nothing


def test_reseal_gets_past_the_checksums():
    data = bytearray(next(p for p in SEEDS if p.name == "stream-raw.kvw").read_bytes())
    frames = frame_positions(bytes(data))
    assert len(frames) == 12
    data[frames[3] + 8 + 42] = 7  # component code 7 in record 3, frame check now wrong
    assert harness.check(bytes(data)) == "FRAME_CHECKSUM"
    assert harness.check(harness.reseal(bytes(data))) == "ENUM_OUT_OF_RANGE"
    data = bytearray(next(p for p in SEEDS if p.name == "zstd-file.kvw").read_bytes())
    data[40] ^= 0x10  # a header byte: the header checksum fails first, the verifier after resealing
    assert harness.check(bytes(data)) == "HEADER_CHECKSUM"
    assert harness.check(harness.reseal(bytes(data))) not in ("HEADER_CHECKSUM", "PREAMBLE_CHECKSUM")


@pytest.mark.slow
def test_structured_record_edits_reach_the_record_checks():
    """Structure-aware mutation (conformance/fuzz/mutators.py): a record field edited in
    its frame and in the file-form index at once, every checksum recomputed, passes the
    checksums and the frame/index agreement, so the record's own check fires; edited in
    one place only, a structure check (the index's records or the agreement) fires, never
    a checksum."""
    import mutators

    data = next(p for p in SEEDS if p.name == "zstd-file.kvw").read_bytes()
    assert mutators.index_span(data) is not None and frame_positions(data)
    assert harness.check(mutators.edit_record(data, 2, "component", 7, "both")) == "ENUM_OUT_OF_RANGE"
    one_side = {harness.check(mutators.edit_record(data, 2, "component", 7, w)) for w in ("frame", "index")}
    assert one_side <= {"INDEX_MISMATCH", "ENUM_OUT_OF_RANGE"} and "INDEX_MISMATCH" in one_side, one_side
    sealed = {"FRAME_CHECKSUM", "INDEX_CHECKSUM", "HEADER_CHECKSUM", "PREAMBLE_CHECKSUM"}
    for field in sorted(set(mutators.RECORD_FIELDS) - {"checksum"}):  # checksum: the body's own check, rightly
        for where in mutators.WHERE:
            for value in (0, 7, 2**32 - 1):
                got = harness.check(mutators.edit_record(data, 1, field, value, where))
                assert got not in sealed, (field, where, value, got)
    own = data[frame_positions(data)[2] + 8 + 42]
    assert mutators.edit_record(data, 2, "component", own, "both") == data  # its own value: nothing changes


def test_memory_oracle_flags_an_over_allocation(monkeypatch):
    """The memory oracle (harness.check): a header DAG that a reader without the parse
    budget (KVW-LIM-7, disabled here) materialises is an OverAllocation finding; with the
    budget it is an ordinary FB_TOO_COMPLEX rejection within the bound."""
    import pytest

    import kvwire.format.flatbuf as F

    sys.path.insert(0, str(FUZZ.parent))
    try:
        import add_parse_budget
    finally:
        sys.path.remove(str(FUZZ.parent))
    data = add_parse_budget.dag_container("metadata", k=256, size=1 << 18)
    assert harness.check(data) == "FB_TOO_COMPLEX"
    monkeypatch.setattr(F.Buffer, "charge", lambda self, units, what: None)
    with pytest.raises(harness.OverAllocation, match="peak allocation"):
        harness.check(data)
    assert harness.memory_bound(len(data), 0) < 64 << 20
