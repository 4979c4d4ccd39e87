"""Spec 1.0 Final corrections: reader behaviour the text now decides.

Each test cites the rule whose text the reference follows; the conformance set
``final_1_0`` (conformance/add_final.py) carries the same cases as vectors.
"""

from __future__ import annotations

import dataclasses
import io
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest

import forge
import kvwire
import kvwire.conformance.neutral
from kvwire import stream
from kvwire.conformance.compare import compare_header
from kvwire.format import limits as L
from kvwire.format.crossmodel import PrefixChain, StateTensor
from kvwire.format.header import Architecture, Header, LayerSpec, TokenRange, parse_header
from kvwire.format.prefix import prefix_hashes, prefix_root

FULL = LayerSpec("full_attention", 2, 8, 8)
JAMBA = LayerSpec("state", state_tensors=(StateTensor("conv", (1, 4, 3)), StateTensor("ssm", (1, 2, 4, 3), "bf16")))
STATE_BIT = kvwire.format.registry.REQUIRED_FEATURES["state_layers"]


def _state_header(**kw) -> bytes:
    spec = dataclasses.replace(JAMBA, **kw)
    h = Header(Architecture((FULL, spec)), token_count=0, dtype="f16", chunk_tokens=4, required_features=STATE_BIT)
    return forge.header_of(h)


def test_state2_name_over_256_bytes_is_state_invalid_not_limit_exceeded():
    """KVW-STATE-2: within the string limit a long name is STATE_INVALID (KVW-LIM-1 bounds only at 65,536)."""
    with forge.raises_code(kvwire.SchemaError, "STATE_INVALID", "KVW-STATE-2"):
        parse_header(_state_header(state_tensors=(StateTensor("n" * 257, (1, 2)),)))
    with forge.raises_code(kvwire.SchemaError, "STATE_INVALID", "KVW-STATE-2"):
        parse_header(_state_header(state_tensors=(StateTensor("conv", (1,) * 9),)))


def test_state2_governs_a_state_layers_source_layer():
    """KVW-STATE-2 over KVW-ARCH-4: a state layer with source_layer 0 is STATE_INVALID."""
    with forge.raises_code(kvwire.SchemaError, "STATE_INVALID", "KVW-STATE-2"):
        parse_header(_state_header(source_layer=0))


def _prefix_header(chunks: int) -> Header:
    arch = Architecture((LayerSpec("sliding_attention", 1, 4, 4, window=4),))
    return Header(arch, token_count=chunks, dtype="f16", chunk_tokens=1, layer_tokens=(TokenRange(chunks - 1, 1),),
                  prefix=PrefixChain(1, prefix_root(b"", 1), prefix_hashes(list(range(chunks)), 1, b"")))


def test_prefix7_chain_over_2_20_bytes_is_accepted():
    """KVW-PREFIX-7, KVW-LIM-2: 32,769 token chunks (over the old 2^20-byte cap) are valid."""
    h = _prefix_header(32769)
    assert parse_header(forge.header_of(h, check=True)).prefix == h.prefix


def test_prefix7_hashes_over_2_23_bytes_is_limit_exceeded():
    """KVW-PREFIX-7: the hashes vector is bounded at 2^23 bytes when the header is decoded."""
    h = _prefix_header(2)
    big = h.replace(prefix=PrefixChain(1, h.prefix.root, bytes(L.MAX_PREFIX_HASH_BYTES + 32)))
    with forge.raises_code(kvwire.LimitError, "LIMIT_EXCEEDED", "KVW-LIM-1"):
        parse_header(forge.header_of(big))
    with pytest.raises(ValueError):  # a writer refuses it too (PREFIX_INVALID first, then KVW-PREFIX-7)
        forge.header_of(big, check=True)


def test_prefix3_empty_hashes_equal_absent_when_no_tokens():
    """KVW-PREFIX-3: with T = 0 an empty hashes vector is valid."""
    h = Header(Architecture((FULL,)), token_count=0, chunk_tokens=4, prefix=PrefixChain(1, prefix_root(b"", 4), b""))
    assert parse_header(forge.header_of(h, check=True)).prefix.hashes == b""


def test_hdr4_empty_vector_elements_are_aligned():
    """KVW-HDR-4: an empty [f64] vector whose element position is not 8-aligned is FB_ALIGNMENT."""
    from kvwire.format.flatbuf import Buffer

    # vtable at 8 (size 6, inline 8, field 0 at offset 4); table at 16; its field at 20 -> vector
    def fb(vec_at: int) -> bytes:
        b = bytearray(40)
        struct.pack_into("<I4s", b, 0, 16, b"KVWH")
        struct.pack_into("<HHH", b, 8, 6, 8, 4)
        struct.pack_into("<iI", b, 16, 8, vec_at - 20)
        struct.pack_into("<I", b, vec_at, 0)  # an empty vector
        return bytes(b)

    assert Buffer(fb(28), b"KVWH", "KVW-HDR-1").root().vector(0, 8, 8, 10) == (32, 0)  # elements at 32
    with forge.raises_code(kvwire.HeaderError, "FB_ALIGNMENT", "KVW-HDR-4"):
        Buffer(fb(24), b"KVWH", "KVW-HDR-1").root().vector(0, 8, 8, 10)  # elements at 28, none of them


# ---------------------------------------------------------------------------------------
# Segments (KVW-STREAM-7..10)
# ---------------------------------------------------------------------------------------

def _cache(h: Header, seed: int) -> kvwire.KVCache:
    return forge.random_cache(h, seed)


def test_stream8_segments_with_state_layers_take_the_last_state():
    """KVW-STREAM-8: no ZeroDivisionError; the reassembled state is the last segment's."""
    h = Header(Architecture((FULL, JAMBA)), dtype="f16", chunk_tokens=4, required_features=STATE_BIT)
    a, b = _cache(h.replace(token_count=4), 1), _cache(h.replace(first_position=4, token_count=3), 2)
    ra = stream.Reassembler()
    for seg in stream.read_segments(io.BytesIO(kvwire.encode(a, form="stream") + kvwire.encode(b, form="stream"))):
        ra.add(seg)
    got = ra.cache()
    assert got.header.token_count == 7
    assert np.asarray(got.layers[0]["k"][:, 4:]).tobytes() == np.asarray(b.layers[0]["k"]).tobytes()
    for name, x in b.layers[1]["state"].items():
        assert np.asarray(got.layers[1]["state"][name]).tobytes() == np.asarray(x).tobytes()  # bit patterns
    with pytest.raises(ValueError, match="KVW-STREAM-8"):
        stream.DecodeWriter(io.BytesIO(), h)


def test_stream9_prefix_chains_join_and_must_continue():
    """KVW-STREAM-9 (and KVW-STREAM-7: prefix is not a shared value)."""
    h = Header(Architecture((FULL,)), dtype="f16", chunk_tokens=4)
    toks = list(range(100, 110))
    chain = prefix_hashes(toks, 4, b"")
    seq = _cache(h.replace(token_count=10), 3)

    def seg(s, e, root=None):
        k0 = s // 4
        r = root if root is not None else (prefix_root(b"", 4) if s == 0 else chain[32 * (k0 - 1):32 * k0])
        hh = h.replace(first_position=s, token_count=e - s,
                       prefix=PrefixChain(1, r, prefix_hashes(toks[:e], 4, b"")[32 * k0:]))
        return kvwire.KVCache(hh, [{c: x[:, s:e] for c, x in seq.layers[0].items()}])

    ra = stream.Reassembler()
    for s in (seg(0, 4), seg(4, 6), seg(4, 10)):
        ra.add(s)
    assert ra.cache().header.prefix == PrefixChain(1, prefix_root(b"", 4), chain)
    ra = stream.Reassembler()
    ra.add(seg(0, 4))
    with forge.raises_code(kvwire.LayoutError, "SEGMENT_MISMATCH", "KVW-STREAM-9"):
        ra.add(seg(4, 8, root=prefix_root(b"", 4)))
    plain = kvwire.KVCache(h.replace(first_position=4, token_count=4), [{c: x[:, 4:8] for c, x in
                                                                         seq.layers[0].items()}])
    with forge.raises_code(kvwire.LayoutError, "SEGMENT_MISMATCH", "KVW-STREAM-5"):
        ra.add(plain)


def test_stream7_sparse_caches_are_not_segments():
    """KVW-STREAM-7/5: a sparse container on a segment stream is SEGMENT_MISMATCH, not a bare error."""
    sparse = kvwire.load(Path(__file__).resolve().parents[2] / "conformance/vectors/1.0/valid/sparse-streaming-llm.kvw")
    data = kvwire.encode(sparse, form="stream")
    with forge.raises_code(kvwire.LayoutError, "SEGMENT_MISMATCH", "KVW-STREAM-5"):
        list(stream.read_segments(io.BytesIO(data)))
    with forge.raises_code(kvwire.LayoutError, "SEGMENT_MISMATCH", "KVW-STREAM-5"):
        stream.Reassembler().add(sparse)


def test_stream10_no_segment_is_truncated():
    """KVW-STREAM-10: an empty stream, or a Reassembler without segments, is TRUNCATED (not ValueError)."""
    with forge.raises_code(kvwire.TruncatedError, "TRUNCATED", "KVW-STREAM-10"):
        stream.Reassembler().cache()
    from kvwire.conformance.impl import cmd_reassemble

    out = io.StringIO()
    d = tempfile.mkdtemp()
    path = f"{d}/empty.kvws"
    open(path, "wb").close()
    assert cmd_reassemble(path, path + ".d", out=out) == 1 and out.getvalue().startswith("TRUNCATED")


def test_protocol_optional_fields_with_defaults_compare_equal():
    """PROTOCOL.md 2.2: an optional field reported with its default equals an omitted one."""
    h = Header(Architecture((FULL,), rope=kvwire.RopeParams()))
    want = kvwire.conformance.neutral.header_to_json(h)
    got = kvwire.conformance.neutral.header_to_json(h)
    got["model"].update(framework="", framework_version="", layer_weights_fingerprints="", fingerprint_scheme=0)
    got["arch"]["rope"]["truncate"] = True
    assert compare_header(want, got)[0] == []
    got["arch"]["rope"]["truncate"] = False
    assert compare_header(want, got)[0]


def test_stream_reader_refuses_a_sparse_container_after_the_header():
    """A layer-wise stream.LayerReader cannot hand out a sparse layer before all its heads arrive:
    it says so right after the header (SparseNotSupported, a ValueError naming the readers
    that can), and read_segments turns that into SEGMENT_MISMATCH (KVW-STREAM-7)."""
    sparse = kvwire.load(Path(__file__).resolve().parents[2] / "conformance/vectors/1.0/valid/sparse-streaming-llm.kvw")
    data = kvwire.encode(sparse, form="stream")
    with pytest.raises(stream.SparseNotSupported, match="StreamDecoder or kvwire.open"):
        stream.LayerReader(io.BytesIO(data))
    with pytest.raises(kvwire.FormatError) as e:
        list(stream.read_segments(io.BytesIO(data)))
    assert e.value.code == "SEGMENT_MISMATCH"


def test_err4_the_first_violation_in_reading_order_is_reported():
    """KVW-ERR-4: with several defects the reader reports the first in the order of section
    14.1: preamble before header (steps 1-2), header rules before records (step 3 before 6),
    the first record before a later one (section 8.3), STATE-2 before ARCH-4 (step 3)."""
    data = kvwire.encode(forge.small_cache())
    lay = forge.layout(data)
    # preamble reserved field and a corrupted header byte: the preamble is read first
    two = forge.xor_byte(forge.patch_preamble(data, reserved=1), 32 + 8)
    forge.expect(two, kvwire.LayoutError, "RESERVED_NONZERO", "KVW-PRE-3")
    # a bad header checksum and a corrupted body: the header is checked before any body
    two = forge.xor_byte(forge.patch_preamble(data, header_checksum=1), lay.bodies[-1][0])
    forge.expect(two, kvwire.ChecksumError, "HEADER_CHECKSUM", "KVW-PRE-6")
    # two corrupted bodies: the one of the earlier record is reported
    two = forge.xor_byte(forge.xor_byte(data, lay.bodies[-1][0]), lay.bodies[1][0])
    with forge.raises_code(kvwire.ChecksumError, "BODY_CHECKSUM", "KVW-CSUM-1") as e:
        kvwire.open(two).validate()
    assert "chunk 1 " in str(e.value)
    # a state layer with source_layer 0 breaks ARCH-4 and STATE-2: STATE-2 is checked first
    with forge.raises_code(kvwire.SchemaError, "STATE_INVALID", "KVW-STATE-2"):
        parse_header(_state_header(source_layer=0, state_tensors=(StateTensor("n" * 257, (1, 2)),)))
