"""A bounded run of the hypothesis state machine that mutates valid containers
(conformance/fuzz/statemachine.py): after every mutation both reference readers raise
only FormatErrors and agree; resealing really gets mutations past the checksums."""

import sys
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

FUZZ = Path(__file__).resolve().parents[1] / "conformance" / "fuzz"
sys.path.insert(0, str(FUZZ))

import harness  # noqa: E402
from statemachine import SEEDS, ContainerMutations, frame_positions  # noqa: E402


def test_state_machine_mutations_keep_the_reader_contract():
    run_state_machine_as_test(ContainerMutations, settings=settings(
        max_examples=150, stateful_step_count=15, deadline=None, suppress_health_check=list(HealthCheck)))


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
