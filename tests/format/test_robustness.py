"""Damaged input: truncation at every length, single-bit flips, random mutations.

The reader's contract: any damage raises a ``FormatError`` subclass (never another
exception), and a load that succeeds returns exactly the encoded data. With checksums
verified and ``validate()`` run, every single-bit flip is detected.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import forge
import kvwire
from kvwire.format.container import FRAME_SIZE, PREAMBLE_SIZE, parse_preamble, xxh3
from kvwire.format.errors import FormatError, TruncatedError

# 1 layer x 2 heads x 16 dims x 20 tokens, chunks of 8: 6 chunks of 256-512 bytes.
CACHE = forge.small_cache(layers=1, heads=2, head_dim=16, tokens=20, chunk_tokens=8, seed=3)
COMBOS = [(f, c) for f in ("file", "stream") for c in ("raw", "zstd")]
ENC = {fc: kvwire.encode(CACHE, form=fc[0], codec=fc[1]) for fc in COMBOS}


def test_zstd_encodings_really_hold_zstd_bodies():
    for form in ("file", "stream"):
        with kvwire.open(ENC[form, "zstd"]) as r:
            assert (r.records["codec"] == 1).all()
        assert len(ENC[form, "zstd"]) < len(ENC[form, "raw"])


def outcome(data) -> str:
    """'ok' when open + load + validate all succeed (and the data is the original),
    'error' on a FormatError; anything else propagates and fails the test."""
    try:
        with kvwire.open(data) as r:
            loaded = r.load()
            # a load that succeeds must return exactly the encoded tensors
            assert forge.cache_bytes_equal(loaded, CACHE), "load succeeded with different data"
            r.validate()
    except FormatError:
        return "error"
    return "ok"


# ---------------------------------------------------------------------------------------
# Truncation
# ---------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("form,codec", COMBOS)
def test_truncation_at_every_length(form, codec):
    # KVW-ERR-2: every prefix terminates with a FormatError, no out-of-bounds read or crash
    data = ENC[form, codec]
    end_of_end_frame = forge.layout(data).end_frame + FRAME_SIZE
    for n in range(len(data)):
        if form == "file" and n == end_of_end_frame:
            # the file form cut right after its end frame is a complete stream-form container
            with kvwire.open(data[:n]) as r:
                assert r.form == "stream"
            assert outcome(data[:n]) == "ok"
            continue
        with pytest.raises(FormatError) as info:
            forge.read_all(data[:n])
        if form == "stream":
            assert isinstance(info.value, TruncatedError), (n, info.value)


def test_truncated_stream_reports_what_it_needs():
    data = ENC["stream", "raw"]
    _, hlen, _ = parse_preamble(data)
    for n in range(len(data)):
        with pytest.raises(TruncatedError) as info:
            kvwire.open(data[:n])
        needed = info.value.needed
        assert needed is not None and n < needed <= len(data), (n, needed)


def test_truncated_file_on_disk(tmp_path):
    data = ENC["file", "zstd"]
    path = tmp_path / "cut.kvw"
    for n in (0, 1, 31, 32, 100, len(data) // 2, len(data) - 1):
        path.write_bytes(data[:n])
        with pytest.raises(FormatError):
            forge.read_all(path)


# ---------------------------------------------------------------------------------------
# Single-bit flips
# ---------------------------------------------------------------------------------------

def flip_sample(data, target: int = 2200) -> list:
    """A deterministic sample of bit positions over every region: all bits of the
    preamble, the first frame, the end frame and the trailer, a stride over the rest."""
    n = len(data)
    lay = forge.layout(data)
    dense = set(range(0, PREAMBLE_SIZE))
    dense |= set(range(lay.frames[0], lay.frames[0] + FRAME_SIZE))
    dense |= set(range(lay.end_frame, lay.end_frame + FRAME_SIZE))
    if lay.trailer is not None:
        dense |= set(range(lay.trailer, n))
    bits = [8 * b + i for b in sorted(dense) for i in range(8)]
    rest = [b for b in range(8 * n) if b // 8 not in dense]
    stride = max(1, len(rest) // max(1, target - len(bits)))
    # an odd stride walks through every bit position within a byte
    stride |= 1
    return bits + rest[::stride]


@pytest.mark.parametrize("form,codec", COMBOS)
def test_every_sampled_bit_flip_is_detected(form, codec):
    data = ENC[form, codec]
    bits = flip_sample(data)
    assert len(bits) >= 2000
    covered = {b // 8 for b in bits}
    lay = forge.layout(data)
    for start, stop in [(PREAMBLE_SIZE, PREAMBLE_SIZE + lay.header_length), *lay.padding(),
                        *((o, o + n) for o, n in lay.bodies)]:
        assert covered & set(range(start, stop)), f"region [{start}, {stop}) not sampled"
    undetected = []
    for bit in bits:
        bad = bytearray(data)
        bad[bit // 8] ^= 1 << (bit % 8)
        if outcome(bytes(bad)) != "error":
            undetected.append(bit)
    assert not undetected, f"bit flips not detected at bits {undetected[:20]}"


def test_bit_flips_in_padding_leave_loaded_data_intact():
    """Padding is not covered by any checksum: a flip there is found by validate() only,
    and a plain load still returns the original data."""
    data = ENC["file", "zstd"]
    regions = forge.layout(data).padding()
    assert len(regions) >= 3
    for start, stop in regions:
        bad = forge.xor_byte(data, start + (stop - start) // 2, 0x80)
        assert forge.cache_bytes_equal(kvwire.load(bad), CACHE)
        with pytest.raises(FormatError):
            with kvwire.open(bad) as r:
                r.validate()


# ---------------------------------------------------------------------------------------
# Random mutation (hypothesis)
# ---------------------------------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(combo=st.sampled_from(COMBOS), edits=st.lists(st.tuples(st.floats(0, 1, exclude_max=True),
                                                               st.integers(0, 255)), min_size=1, max_size=4))
def test_random_byte_mutations_raise_format_error_or_decode_identically(combo, edits):
    data = ENC[combo]
    bad = bytearray(data)
    for where, value in edits:
        bad[int(where * len(data))] = value
    result = outcome(bytes(bad))
    assert result == "error" or bytes(bad) == data


@settings(max_examples=60, deadline=None)
@given(combo=st.sampled_from(COMBOS), cut=st.floats(0, 1), extra=st.binary(max_size=80))
def test_truncate_then_append_garbage(combo, cut, extra):
    data = ENC[combo]
    bad = data[: int(cut * len(data))] + extra
    assert outcome(bad) == "error" or bad == data or _is_valid_stream_prefix(data, bad)


def _is_valid_stream_prefix(data, bad) -> bool:
    lay = forge.layout(data)
    return lay.index is not None and bad == data[: lay.end_frame + FRAME_SIZE]


@settings(max_examples=40, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_after_a_valid_preamble_prefix(junk):
    for prefix in (b"", b"\x89KVW\r\n\x1a\n", ENC["stream", "raw"][:PREAMBLE_SIZE]):
        with pytest.raises(FormatError):
            forge.read_all(prefix + junk)


# The checksums stop almost every random mutation before the structure parsers see it.
# These mutators re-seal the checksums so the FlatBuffers verifier, the record checks and
# the layout checks get hostile input directly.

def reseal_header(data: bytes, mutate) -> bytes:
    _, hlen, _ = parse_preamble(data)
    header = bytearray(data[PREAMBLE_SIZE : PREAMBLE_SIZE + hlen])
    mutate(header)
    return forge.patch_preamble(data[:PREAMBLE_SIZE] + bytes(header) + data[PREAMBLE_SIZE + hlen :],
                                fix_header_checksum=True)


def reseal_frame(data: bytes, i: int, mutate) -> bytes:
    lay = forge.layout(data)
    at = lay.frames[i % len(lay.frames)]
    out = bytearray(data)
    body = bytearray(out[at + 8 : at + FRAME_SIZE])
    mutate(body)
    out[at + 8 : at + FRAME_SIZE] = body
    return forge.refix_frame(bytes(out), at)


def reseal_index(data: bytes, mutate) -> bytes:
    lay = forge.layout(data)
    off, length = lay.index
    out = bytearray(data)
    index = bytearray(out[off : off + length])
    mutate(index)
    out[off : off + length] = index
    return forge.patch_trailer(bytes(out), index_checksum=xxh3(bytes(index)))


def mutator(edits):
    def mutate(buf):
        for where, value in edits:
            buf[int(where * len(buf))] = value
    return mutate


EDITS = st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), min_size=1, max_size=3)


def only_format_errors(data) -> None:
    try:
        with kvwire.open(data) as r:
            r.validate()
            r.load()
    except FormatError:
        pass


@settings(max_examples=200, deadline=None)
@given(combo=st.sampled_from(COMBOS), edits=EDITS)
def test_resealed_header_mutations_raise_only_format_errors(combo, edits):
    only_format_errors(reseal_header(ENC[combo], mutator(edits)))


@settings(max_examples=100, deadline=None)
@given(combo=st.sampled_from(COMBOS), i=st.integers(0, 5), edits=EDITS)
def test_resealed_frame_mutations_raise_only_format_errors(combo, i, edits):
    data = ENC[combo]
    bad = reseal_frame(data, i, mutator(edits))
    try:
        with kvwire.open(bad) as r:
            r.validate()
            loaded = r.load()
    except FormatError:
        return
    # a frame edit that survives every check may only touch optional flag bits (0-7)
    assert forge.cache_bytes_equal(loaded, CACHE)


@settings(max_examples=100, deadline=None)
@given(combo=st.sampled_from([("file", "raw"), ("file", "zstd")]), edits=EDITS)
def test_resealed_index_mutations_raise_only_format_errors(combo, edits):
    only_format_errors(reseal_index(ENC[combo], mutator(edits)))


def test_reseal_helpers_produce_valid_containers_when_nothing_changes():
    for combo in COMBOS:
        data = ENC[combo]
        assert reseal_header(data, lambda b: None) == data
        assert reseal_frame(data, 0, lambda b: None) == data
        if combo[0] == "file":
            assert reseal_index(data, lambda b: None) == data


def test_resealed_header_bit_flips_exhaustively():
    """Every single-bit flip of the header with its checksum re-sealed: the verifier and
    the semantic checks alone must either reject it or yield a header that still opens."""
    data = ENC["stream", "raw"]
    _, hlen, _ = parse_preamble(data)
    accepted = 0
    for bit in range(hlen * 8):
        def flip(buf, bit=bit):
            buf[bit // 8] ^= 1 << (bit % 8)

        bad = reseal_header(data, flip)
        try:
            with kvwire.open(bad) as r:
                r.validate()
                r.load()
            accepted += 1
        except FormatError:
            pass
    assert accepted < hlen * 8  # most flips are caught by structure checks alone

