"""Rules of spec/kvwire-v1.md that no single-defect vector covers: writer obligations,
checksum ordering and the test values of the spec. Each test names its rule."""

import struct

import numpy as np
import pytest
import xxhash
import zstandard

import forge
import kvwire
from kvwire.format.container import MAGIC, RECORD_DTYPE, check32, xxh3
from kvwire.format.header import Architecture, Header, LayerSpec, build_header
from kvwire.tools.synth import synth_cache

CACHE = synth_cache(2, 2, 8, 40, chunk_tokens=16, seed=5)


def test_conv3_xxh3_test_values():
    """KVW-CONV-3: the table of XXH3-64 values implementations must reproduce."""
    assert xxh3(b"") == 0x2D06800538D394C2
    assert xxh3(b"kvwire") == 0x3F79916E9B5AA22D
    assert xxh3(MAGIC) == 0xC55A6C3362214774
    assert xxh3(bytes(range(256))) == 0x9408A4433B952D71
    assert check32(b"kvwire") == 0x3F79916E9B5AA22D & 0xFFFFFFFF


def test_conv5_pre7_chunk10_what_the_writer_writes():
    """KVW-CONV-5 absolute offsets; KVW-PRE-7 version fields; KVW-CHUNK-10 flags 0."""
    data = kvwire.encode(CACHE)
    _, major, minor, hlen, hsum, reserved, _ = struct.unpack_from("<8sHHIQII", data)
    assert (major, minor, reserved) == (1, 0, 0)
    assert hsum == xxhash.xxh3_64_intdigest(data[32 : 32 + hlen])
    h = kvwire.probe(data)
    assert (h.format_major, h.format_minor) == (1, 0)
    with kvwire.open(data) as r:
        assert (r.records["flags"] == 0).all()
        for rec in r.records:  # the frame sits right before the absolute body offset
            off = int(rec["offset"])
            assert data[off - 64 : off - 60] == b"KWCH"
            assert np.frombuffer(data[off - 56 : off], RECORD_DTYPE)[0] == rec


def test_csum3_checksum_is_verified_before_decoding():
    """KVW-CSUM-3: a corrupt zstd body is a checksum error, not a decoder error."""
    data = kvwire.encode(CACHE, codec="zstd")
    off, _ = forge.layout(data).bodies[0]
    bad = forge.xor_byte(data, off + 5, 0xFF)
    with pytest.raises(kvwire.ChecksumError) as info:
        kvwire.load(bad)
    assert info.value.code == "BODY_CHECKSUM"
    with pytest.raises(kvwire.CodecError):  # only an explicit opt-out reaches the decoder
        kvwire.load(bad, verify=False)


def test_csum4_structural_checks_cannot_be_skipped():
    """KVW-CSUM-4: verify=False skips body checksums only, never frame or index checks."""
    data = kvwire.encode(CACHE)
    off, _ = forge.layout(data).bodies[1]
    bad = forge.xor_byte(data, off - 20)  # inside the frame's record
    with pytest.raises(kvwire.FormatError) as info:
        kvwire.load(bad, verify=False)
    assert info.value.code in ("FRAME_CHECKSUM", "INDEX_MISMATCH")


def test_file7_form_is_decided_by_the_last_8_bytes():
    """KVW-FILE-7."""
    for form in ("file", "stream"):
        data = kvwire.encode(CACHE, form=form)
        assert (data[-8:] == b"KVWINDEX") == (form == "file")
        with kvwire.open(data) as r:
            assert r.form == form


def test_stream2_chunks_usable_before_the_end_frame():
    """KVW-STREAM-2: a chunk event comes before the bytes of later chunks exist."""
    data = kvwire.encode(CACHE, form="stream")
    first_body_end = sum(forge.layout(data).bodies[0])
    dec = kvwire.StreamDecoder()
    dec.feed(data[:first_body_end])
    events = list(dec.events())
    assert [type(e) for e in events] == [kvwire.HeaderEvent, kvwire.ChunkEvent]


@pytest.mark.parametrize("changes,rule", [
    (dict(optional_features=1 << 5), "KVW-REG-1"),
    (dict(metadata={"kvwire.anything": b"x"}), "KVW-META-3"),
    (dict(format_minor=1), "KVW-PRE-7"),
])
def test_write1_writer_refuses_what_it_may_not_emit(changes, rule):
    """KVW-WRITE-1 and the writer-only rules it names."""
    with pytest.raises(ValueError, match=rule.split("-", 1)[1] if rule != "KVW-PRE-7" else "writes format"):
        build_header(CACHE.header.replace(**changes))


def test_arch9_writer_writes_schema_version_1():
    """KVW-ARCH-9."""
    arch = Architecture((LayerSpec("full_attention", 1, 4, 4),), schema_version=2)
    with pytest.raises(ValueError, match="ARCH-9"):
        build_header(Header(arch=arch, token_count=1))


def test_write1_lim2_writer_checks_every_header_rule():
    """KVW-WRITE-1 / KVW-LIM-2: the writer runs the reader's header rules and limits."""
    too_wide = Architecture((LayerSpec("full_attention", 4096, 65536, 65536),))
    with pytest.raises(kvwire.LimitError):  # a chunk body over 2^32 bytes (KVW-LIM-4)
        build_header(Header(arch=too_wide, token_count=1, chunk_tokens=256))
    with pytest.raises(kvwire.SchemaError):  # a sliding layer without a window (KVW-ARCH-6)
        build_header(Header(arch=Architecture((LayerSpec("sliding_attention", 1, 4, 4),)), token_count=1))


def test_arch7_meaningless_fields_must_be_zero():
    """KVW-ARCH-7: one encoding per layer (rejected through KVW-ARCH-4 / KVW-ARCH-5)."""
    bad = Architecture((LayerSpec("full_attention", 1, 4, 4, kv_lora_rank=2),))
    with pytest.raises(kvwire.SchemaError) as info:
        build_header(Header(arch=bad, token_count=1))
    assert info.value.rule == "KVW-ARCH-5"


def test_lim6_default_limits_accept_what_the_spec_allows():
    """KVW-LIM-6: stricter limits only when the caller asks."""
    data = kvwire.encode(CACHE)
    assert kvwire.load(data).equal(CACHE)
    with pytest.raises(kvwire.LimitError) as info:
        kvwire.load(data, max_decoded_bytes=100)
    assert info.value.code == "DECODED_SIZE_LIMIT"


def test_err3_truncated_reports_bytes_needed():
    """KVW-ERR-3."""
    data = kvwire.encode(CACHE)
    hlen = struct.unpack_from("<I", data, 12)[0]
    with pytest.raises(kvwire.TruncatedError) as info:
        kvwire.probe(data[:40])
    assert info.value.needed == 32 + hlen


def test_zstd_frames_carry_their_content_checksum():
    """KVW-CODEC-4 (revision 1.4; it replaced CODEC-3's "writers SHOULD omit it"): the record
    checksum covers the stored bytes, zstd's own content checksum the decoded ones."""
    data = kvwire.encode(CACHE, codec="zstd")
    off, length = forge.layout(data).bodies[0]
    params = zstandard.get_frame_parameters(data[off : off + length])
    assert params.has_checksum and params.content_size > 0
