"""One test per reader check: each forges a container that breaks exactly one rule and
asserts the exception class, the stable ``code`` and the ``rule`` id.

Forged containers come from tests/forge.py, which recomputes every checksum the defect
would otherwise break, so the check under test is the one that fires. ``stage`` pins
where a check runs: at ``open`` (structure), ``validate`` (padding, every body) or
``load`` (bodies as they are read).
"""

import ast
import pathlib
import re
import struct

import numpy as np
import pytest
import zstandard

import forge
import kvwire
from forge import expect, raises_code, set_records
from kvwire.format import limits as L
from kvwire.format.container import FRAME_SIZE, PREAMBLE_SIZE, RECORD_DTYPE, build_frame, parse_preamble
from kvwire.format.errors import (
    ChecksumError,
    CodecError,
    FeatureError,
    FormatError,
    HeaderError,
    LayoutError,
    LimitError,
    MagicError,
    SchemaError,
    TruncatedError,
    VersionError,
)

CACHE = forge.small_cache()  # 2 layers x (k, v) x 3 chunks (tokens 0-16, 16-32, 32-40): 12 records
ENC = {(f, c): kvwire.encode(CACHE, form=f, codec=c) for f in ("file", "stream") for c in ("raw", "zstd")}
FORMS = ("file", "stream")
PKG = pathlib.Path(kvwire.__file__).parent


def test_forge_rebuilds_valid_containers_byte_for_byte():
    """The forge itself: split + assemble with no defect reproduces the encoder's bytes."""
    for data in ENC.values():
        assert forge.rebuild(data) == data
        assert forge.cache_bytes_equal(forge.read_all(data), CACHE)


def test_fb_header_builds_what_parse_header_reads():
    h = kvwire.probe(forge.wrap_header(forge.fb_header(token_count=5, metadata=[("ns.k", b"v")])))
    assert (h.dtype, h.token_count, h.chunk_tokens, h.metadata) == ("f16", 5, 16, {"ns.k": b"v"})
    assert h.arch.layers == (kvwire.LayerSpec("full_attention", 1, 8, 8),)


def hdr(**kw) -> bytes:
    """A zero-chunk container whose header is ``fb_header(**kw)``."""
    return forge.wrap_header(forge.fb_header(**kw))


# =======================================================================================
# Preamble (KVW-PRE-*)
# =======================================================================================

@pytest.mark.parametrize("junk", [b"PK\x03\x04" + bytes(60), b"\x89PNG\r\n\x1a\n" + bytes(60), bytes(64)])
def test_pre1_bad_magic(junk):
    expect(junk, MagicError, "BAD_MAGIC", "KVW-PRE-1")


def test_pre1_bad_magic_on_short_input():
    expect(b"\x89KVX", MagicError, "BAD_MAGIC", "KVW-PRE-1")


@pytest.mark.parametrize("mangle", [
    lambda d: d.replace(b"\r\n", b"\n"),  # CRLF -> LF (text-mode download on Windows)
    lambda d: d.replace(b"\n", b"\r\n"),  # LF -> CRLF (text-mode upload)
    lambda d: bytes(b & 0x7F for b in d),  # 7-bit channel strips the high bit
], ids=["crlf-to-lf", "lf-to-crlf", "7-bit"])
def test_pre1_text_mode_mangled(mangle):
    expect(mangle(ENC["file", "raw"]), MagicError, "TEXT_MODE_MANGLED", "KVW-PRE-1")


@pytest.mark.parametrize("n", [0, 1, 8, 31])
def test_pre1_truncated_preamble(n):
    err = expect(ENC["stream", "raw"][:n], TruncatedError, "TRUNCATED", "KVW-PRE-1")
    assert err.needed == PREAMBLE_SIZE


def test_pre1_truncated_preamble_from_an_empty_file(tmp_path):
    path = tmp_path / "empty.kvw"
    path.write_bytes(b"")
    err = expect(path, TruncatedError, "TRUNCATED", "KVW-PRE-1")
    assert err.needed == PREAMBLE_SIZE


@pytest.mark.parametrize("major", [0, 2, 0xFFFF])
def test_pre2_unsupported_version_in_preamble(major):
    expect(forge.patch_preamble(ENC["file", "raw"], major=major), VersionError, "UNSUPPORTED_VERSION", "KVW-PRE-2")


def test_pre2_unsupported_version_in_header():
    expect(hdr(format_major=2), VersionError, "UNSUPPORTED_VERSION", "KVW-PRE-2")


def test_pre3_preamble_reserved_nonzero():
    expect(forge.patch_preamble(ENC["file", "raw"], reserved=1), LayoutError, "RESERVED_NONZERO", "KVW-PRE-3")


@pytest.mark.parametrize("byte", range(PREAMBLE_SIZE))
def test_pre4_preamble_checksum_covers_every_byte(byte):
    data = ENC["stream", "raw"]
    if byte < 8:  # the magic is diagnosed before the self-check
        with pytest.raises(MagicError):
            forge.read_all(forge.xor_byte(data, byte))
        return
    expect(forge.xor_byte(data, byte), ChecksumError, "PREAMBLE_CHECKSUM", "KVW-PRE-4", stage="open")


def test_pre5_header_too_large_is_refused_before_reading_it():
    data = forge.patch_preamble(ENC["file", "raw"][:PREAMBLE_SIZE], header_length=L.MAX_HEADER_LENGTH + 1)
    expect(data, LimitError, "HEADER_TOO_LARGE", "KVW-PRE-5")


def test_pre5_header_at_the_limit_is_only_truncated():
    data = forge.patch_preamble(ENC["file", "raw"][:PREAMBLE_SIZE], header_length=L.MAX_HEADER_LENGTH)
    err = expect(data, TruncatedError, "TRUNCATED", "KVW-PRE-5")
    assert err.needed == PREAMBLE_SIZE + L.MAX_HEADER_LENGTH


def test_pre5_truncated_header():
    data = ENC["file", "raw"]
    _, hlen, _ = parse_preamble(data)
    err = expect(data[: PREAMBLE_SIZE + hlen - 1], TruncatedError, "TRUNCATED", "KVW-PRE-5")
    assert err.needed == PREAMBLE_SIZE + hlen


def test_pre6_header_checksum():
    data = ENC["file", "raw"]
    expect(forge.xor_byte(data, PREAMBLE_SIZE + 20), ChecksumError, "HEADER_CHECKSUM", "KVW-PRE-6", stage="open")
    expect(forge.patch_preamble(data, header_checksum=1), ChecksumError, "HEADER_CHECKSUM", "KVW-PRE-6")


# =======================================================================================
# Header FlatBuffer structure (KVW-HDR-1..8): raw FlatBuffer bytes
# =======================================================================================

BASE_HB = forge.fb_header(token_count=0, metadata=[("ns.key", b"value")], model={1: "org/model"})


def root_parts(hb=BASE_HB):
    t = forge.root_table(hb)
    return t, t.pos, t.vt


def test_hdr1_header_shorter_than_root_offset_and_identifier():
    expect(forge.wrap_header(b"\x08\x00\x00\x00"), HeaderError, "FB_BOUNDS", "KVW-HDR-1")


def test_hdr1_wrong_file_identifier():
    expect(hdr(identifier=b"KVWX"), HeaderError, "FB_IDENTIFIER", "KVW-HDR-1")
    # an index where a header belongs
    expect(forge.wrap_header(forge.fb_index(np.zeros(0, RECORD_DTYPE))), HeaderError, "FB_IDENTIFIER", "KVW-HDR-1")


def test_hdr3_root_offset_outside_buffer():
    bad = forge.patch(BASE_HB, 0, "I", len(BASE_HB) + 4 - len(BASE_HB) % 4)
    expect(forge.wrap_header(bad), HeaderError, "FB_BOUNDS", "KVW-HDR-3")


def test_hdr4_misaligned_root_table():
    _, pos, _ = root_parts()
    expect(forge.wrap_header(forge.patch(BASE_HB, 0, "I", pos + 2)), HeaderError, "FB_ALIGNMENT", "KVW-HDR-4")


def test_hdr3_vtable_outside_buffer():
    _, pos, _ = root_parts()
    bad = forge.patch(BASE_HB, pos, "i", pos - (len(BASE_HB) + 8))  # vtable = pos - soffset beyond the end
    expect(forge.wrap_header(bad), HeaderError, "FB_BOUNDS", "KVW-HDR-3")
    bad = forge.patch(BASE_HB, pos, "i", pos + 8)  # vtable before the start of the buffer
    expect(forge.wrap_header(bad), HeaderError, "FB_BOUNDS", "KVW-HDR-3")


def test_hdr4_misaligned_vtable():
    _, pos, vt = root_parts()
    expect(forge.wrap_header(forge.patch(BASE_HB, pos, "i", pos - vt - 1)), HeaderError, "FB_ALIGNMENT", "KVW-HDR-4")


@pytest.mark.parametrize("vtsize", [0, 2, 5, 7])
def test_hdr5_vtable_size_odd_or_too_small(vtsize):
    _, _, vt = root_parts()
    expect(forge.wrap_header(forge.patch(BASE_HB, vt, "H", vtsize)), HeaderError, "FB_VTABLE", "KVW-HDR-5")


def test_hdr3_vtable_larger_than_buffer():
    _, _, vt = root_parts()
    expect(forge.wrap_header(forge.patch(BASE_HB, vt, "H", 0xFFFE)), HeaderError, "FB_BOUNDS", "KVW-HDR-3")


@pytest.mark.parametrize("inline", [0, 3])
def test_hdr5_table_inline_size_below_4(inline):
    _, _, vt = root_parts()
    expect(forge.wrap_header(forge.patch(BASE_HB, vt + 2, "H", inline)), HeaderError, "FB_VTABLE", "KVW-HDR-5")


def test_hdr3_table_inline_size_beyond_buffer():
    _, _, vt = root_parts()
    expect(forge.wrap_header(forge.patch(BASE_HB, vt + 2, "H", 0xFFFC)), HeaderError, "FB_BOUNDS", "KVW-HDR-3")


def test_hdr5_field_offset_beyond_inline_size():
    t, _, _ = root_parts()
    bad = forge.patch(BASE_HB, forge.vtable_entry(t, 6), "H", t.inline)  # arch (a 4-byte offset) past the table
    expect(forge.wrap_header(bad), HeaderError, "FB_VTABLE", "KVW-HDR-5")


def test_hdr5_field_offset_inside_the_soffset():
    t, _, _ = root_parts()
    bad = forge.patch(BASE_HB, forge.vtable_entry(t, 6), "H", 2)
    expect(forge.wrap_header(bad), HeaderError, "FB_VTABLE", "KVW-HDR-5")


def test_hdr4_misaligned_field():
    t, pos, _ = root_parts()
    off = next(o for o in range(5, t.inline - 4) if (pos + o) % 4 == 2)
    bad = forge.patch(BASE_HB, forge.vtable_entry(t, 6), "H", off)
    expect(forge.wrap_header(bad), HeaderError, "FB_ALIGNMENT", "KVW-HDR-4")


def _arch_vector_ref(hb, fid):
    """(position of the uoffset to arch field ``fid``, position of the vector's length)."""
    arch = forge.root_table(hb).table(6)
    at = forge.field_pos(arch, fid, 4)
    return at, at + struct.unpack_from("<I", hb, at)[0]


def test_hdr3_vector_body_outside_buffer():
    _, length_at = _arch_vector_ref(BASE_HB, 3)  # layer_spec_index
    expect(forge.wrap_header(forge.patch(BASE_HB, length_at, "I", 1000)), HeaderError, "FB_BOUNDS", "KVW-HDR-3")


def test_hdr4_misaligned_vector():
    at, _ = _arch_vector_ref(BASE_HB, 3)
    bad = forge.patch(BASE_HB, at, "I", struct.unpack_from("<I", BASE_HB, at)[0] + 2)
    expect(forge.wrap_header(bad), HeaderError, "FB_ALIGNMENT", "KVW-HDR-4")


def test_lim1_vector_count_over_limit_is_refused_before_bounds():
    _, length_at = _arch_vector_ref(BASE_HB, 3)
    bad = forge.patch(BASE_HB, length_at, "I", L.MAX_LAYERS + 1)
    expect(forge.wrap_header(bad), LimitError, "LIMIT_EXCEEDED", "KVW-LIM-1")


def test_lim1_too_many_metadata_entries():
    t = forge.root_table(BASE_HB)
    at = forge.field_pos(t, 15, 4)
    length_at = at + struct.unpack_from("<I", BASE_HB, at)[0]
    bad = forge.patch(BASE_HB, length_at, "I", L.MAX_METADATA_ENTRIES + 1)
    expect(forge.wrap_header(bad), LimitError, "LIMIT_EXCEEDED", "KVW-LIM-1")


def test_lim1_string_longer_than_limit():
    expect(hdr(model={1: "x" * (L.MAX_STRING_LENGTH + 1)}), LimitError, "LIMIT_EXCEEDED", "KVW-LIM-1")
    kvwire.probe(hdr(model={1: "x" * L.MAX_STRING_LENGTH}))  # the limit itself is fine


def test_hdr7_string_without_nul():
    producer = forge.root_table(BASE_HB).table(4)
    at = forge.field_pos(producer, 0, 4)
    start = at + struct.unpack_from("<I", BASE_HB, at)[0]
    n = struct.unpack_from("<I", BASE_HB, start)[0]
    assert BASE_HB[start + 4 : start + 4 + n] == b"kvwire" and BASE_HB[start + 4 + n] == 0
    expect(forge.wrap_header(forge.set_byte(BASE_HB, start + 4 + n, ord("x"))), HeaderError, "FB_STRING", "KVW-HDR-7")


def test_hdr7_string_with_embedded_nul():
    expect(hdr(model={1: b"org/\x00model"}), HeaderError, "FB_STRING", "KVW-HDR-7")


@pytest.mark.parametrize("where", ["model_id", "metadata key"])
def test_hdr7_string_not_utf8(where):
    if where == "model_id":
        data = hdr(model={1: b"bad \xff\xfe utf-8"})
    else:
        data = hdr(metadata=[(b"ns.\xc3\x28", b"v")])
    expect(data, HeaderError, "FB_STRING", "KVW-HDR-7")


def test_hdr6_missing_required_arch():
    expect(hdr(arch=False), HeaderError, "FB_REQUIRED", "KVW-HDR-6")


def test_hdr6_missing_required_metadata_key():
    expect(hdr(metadata=[(None, b"v")]), HeaderError, "FB_REQUIRED", "KVW-HDR-6")


def test_hdr8_too_many_tables(monkeypatch):
    """The table budget. With the v1 limits it cannot be reached from the wire (see the
    next test), so the mechanism is exercised with a lowered budget."""
    import kvwire.format.flatbuf

    data = hdr(metadata=[(f"ns.k{i}", b"") for i in range(8)])
    kvwire.probe(data)
    monkeypatch.setattr(kvwire.format.flatbuf, "MAX_FB_TABLES", 6)
    expect(data, LimitError, "FB_TOO_COMPLEX", "KVW-HDR-8")


def _budget_dag(kind: str, **kw) -> bytes:
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "conformance"))
    try:
        import add_parse_budget
    finally:
        sys.path.pop(0)
    return add_parse_budget.dag_header(kind, **kw)


@pytest.mark.slow
def test_hdr8_table_count_reachable_within_the_count_limits():
    """KVW-HDR-8: the old rationale ("a valid header visits at most about 12,300 tables")
    was wrong. Unreferenced layer specs sharing one state_tensors vector of 64 tables reach
    65,520 visits at 1008 specs (accepted) and 65,538 at 1009 (FB_TOO_COMPLEX). Padding
    (unreferenced bytes) raises the parse budget (KVW-LIM-7) above those visits, so the
    table count is the check that fires."""
    pad = bytes(400 << 10)
    h = kvwire.probe(forge.wrap_header(_budget_dag("state_tensors", k=1008, size=64) + pad))
    assert h.num_layers == 1
    expect(forge.wrap_header(_budget_dag("state_tensors", k=1009, size=64) + pad), LimitError, "FB_TOO_COMPLEX",
           "KVW-HDR-8")


# ---------------------------------------------------------------------------------------
# KVW-LIM-7: the parse budget
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind,kw", [
    ("metadata", dict(k=64, size=2048)), ("rope_factors", dict(k=64, size=256)),
    ("layer_spec", dict(k=1024, size=8)), ("state_tensors", dict(k=64, size=64)),
], ids=["metadata-value", "rope-factors", "layer-spec", "state-tensors"])
def test_lim7_shared_objects_exceed_the_parse_budget(kind, kw):
    """KVW-LIM-7: a header DAG (many references to one object) is rejected with
    FB_TOO_COMPLEX; the same header with one copy per reference is accepted, so the
    budget is the only rule it breaks. (Before the budget, all four were accepted.)"""
    expect(forge.wrap_header(_budget_dag(kind, **kw)), LimitError, "FB_TOO_COMPLEX", "KVW-LIM-7")
    with kvwire.open(forge.wrap_header(_budget_dag(kind, shared=False, **kw))) as r:
        r.validate()


def test_lim7_dag_amplification_memory_and_time_are_bounded():
    """KVW-LIM-7, the reported attack: 4096 metadata entries sharing one 1 MiB value, a
    1.1 MB header that passes every count limit. probe() used to materialise 4 GiB (17 s)
    and accept it; now it is rejected after decoding at most 8 x length + 65,536 bytes'
    worth, and its peak allocation is bounded by a small multiple of the header."""
    import time
    import tracemalloc

    data = forge.wrap_header(_budget_dag("metadata", k=4096, size=1 << 20))
    assert 1_000_000 < len(data) < 1_200_000
    tracemalloc.start()
    try:
        t0 = time.perf_counter()
        with raises_code(LimitError, "FB_TOO_COMPLEX", "KVW-LIM-7"):
            kvwire.probe(data)
        elapsed = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * len(data) + (4 << 20), peak
    assert elapsed < 60, elapsed  # refused early, not after walking the DAG (generous: a loaded CI machine)


def _spent(hb: bytes) -> tuple[int, int]:
    """(units charged, budget) of parsing header bytes ``hb``."""
    import kvwire.format.flatbuf as F
    from kvwire.format.header import parse_header

    seen = []
    orig = F.Buffer.__init__

    def record(self, *a, **k):
        orig(self, *a, **k)
        seen.append(self)

    F.Buffer.__init__ = record
    try:
        parse_header(hb)
    finally:
        F.Buffer.__init__ = orig
    return seen[0].spent, seen[0].budget


@pytest.mark.slow
def test_lim7_budget_is_generous_for_the_largest_real_headers():
    """KVW-LIM-7: the reference writer's largest realistic headers cost about one unit per
    header byte, far below the budget of 8 per byte: a 4096-layer model with distinct
    layer specs sharing a longrope RoPE table, 4096 metadata entries, all fingerprints, a
    layer map and a 1M-token prefix chain; and a 4096-layer hybrid model whose layers all
    have distinct state tensors."""
    from kvwire.format.crossmodel import PrefixChain, StateTensor
    from kvwire.format.header import (
        Architecture,
        Header,
        LayerMapEntry,
        LayerSpec,
        ModelIdentity,
        RopeParams,
        build_header,
    )

    n = L.MAX_LAYERS
    rope = RopeParams("longrope", 10000.0, 128, False, 32.0, 4096, short_factor=tuple(1 + i / 64 for i in range(64)),
                      long_factor=tuple(2 + i / 64 for i in range(64)))
    specs = tuple(LayerSpec("sliding_attention" if i % 2 else "full_attention", 1 + i % 64, 128, 128,
                            window=(4096 + i) if i % 2 else 0, rope=rope) for i in range(n))
    model = ModelIdentity("llama", "org/model", "main", bytes(32), bytes(32), bytes(32), bytes(32), "transformers",
                          "4.50", bytes(32 * n), 1)
    h = Header(Architecture(specs, rope=rope), token_count=1 << 20, first_position=256, chunk_tokens=256,
               model=model, metadata={f"app.key{i:04d}": bytes(64) for i in range(4096)},
               prefix=PrefixChain(1, bytes(32), bytes(32 * 4096)), layer_map=tuple(LayerMapEntry(i, i) for i in range(n)))
    hb = build_header(h)
    spent, budget = _spent(hb)
    assert spent < 1.3 * len(hb) and spent < budget / 6, (spent, len(hb), budget)
    st = tuple(LayerSpec("state", state_tensors=(StateTensor("conv", (1, 4, 8192 + i)),
                                                 StateTensor("ssm", (1, 64, 128, i + 1)))) for i in range(n))
    hb = build_header(Header(Architecture(st), token_count=100, required_features=4))
    spent, budget = _spent(hb)
    assert spent < 1.4 * len(hb) and spent < budget / 5, (spent, len(hb), budget)


@pytest.mark.slow
def test_lim7_shared_rope_table_is_exempt_and_decoded_once():
    """KVW-LIM-7 exemption: the reference writer shares one RopeParams table among the
    layer specs that use it. 4096 specs sharing a table of 2 x 4096 factors would cost
    256 MiB of factor bytes if each reference were charged; the revisits cost a table visit
    each, and every layer gets the same decoded object."""
    from kvwire.format.header import Architecture, Header, LayerSpec, RopeParams, build_header, parse_header

    rope = RopeParams("longrope", 1e4, 8192, False, 8.0, 4096, short_factor=(1.0,) * 4096, long_factor=(2.0,) * 4096)
    specs = tuple(LayerSpec("full_attention", 1 + i % 64, 64 + i // 64, 64, rope=rope) for i in range(L.MAX_LAYERS))
    hb = build_header(Header(Architecture(specs), token_count=0, chunk_tokens=16))
    assert len(hb) < 300_000
    h = parse_header(hb)
    assert all(s.rope is h.arch.layers[0].rope for s in h.arch.layers) and h.arch.layers[0].rope == rope
    spent, budget = _spent(hb)
    assert spent < 3 * len(hb) and spent < budget / 2, (spent, len(hb), budget)


# =======================================================================================
# Header values (KVW-HDR-9..13, KVW-ARCH-*, KVW-MAP-*, KVW-META-*, KVW-LIM-*, KVW-EVOL-3)
# =======================================================================================

def test_hdr9_version_mismatch_preamble_minor():
    expect(forge.wrap_header(forge.fb_header(), minor=1), VersionError, "VERSION_MISMATCH", "KVW-HDR-9")


def test_hdr9_version_mismatch_header_minor():
    expect(hdr(format_minor=1), VersionError, "VERSION_MISMATCH", "KVW-HDR-9")


def test_hdr9_newer_minor_in_both_places_is_accepted():
    h = kvwire.probe(forge.wrap_header(forge.fb_header(format_minor=3), minor=3))
    assert (h.format_major, h.format_minor) == (1, 3)


@pytest.mark.parametrize("kw", [
    dict(dtype=8), dict(dtype=255), dict(checksum_algorithm=1),
    dict(layers=[dict(forge.DEFAULT_LAYER, kind=5)]),
    dict(layers=[dict(forge.DEFAULT_LAYER, rope=dict(rope_type=7))]),
    dict(arch_rope=dict(rope_type=200)),
    dict(layer_map=[(0, 0, 4)]),
], ids=["dtype", "dtype-255", "checksum", "layer-kind", "layer-rope-type", "arch-rope-type", "map-op"])
def test_hdr10_enum_out_of_range(kw):
    expect(hdr(**kw), SchemaError, "ENUM_OUT_OF_RANGE", "KVW-HDR-10")


@pytest.mark.parametrize("bits", [1 << 6, 1 << 17, 1 << 63])  # bits 0-5 are assigned (section 20.8; 3: 1.1 kv_scales, 4: 1.2 rotation, 5: 1.3 turboquant)
def test_evol3_unknown_required_feature(bits):
    expect(hdr(required_features=bits), FeatureError, "UNSUPPORTED_FEATURE", "KVW-EVOL-3")


def test_evol3_unknown_optional_features_are_ignored():
    assert kvwire.probe(hdr(optional_features=(1 << 64) - 1)).optional_features == (1 << 64) - 1


@pytest.mark.parametrize("alignment", [0, 32, 96, 100, L.MAX_ALIGNMENT * 2])
def test_conv2_bad_alignment(alignment):
    expect(hdr(alignment=alignment), SchemaError, "BAD_ALIGNMENT", "KVW-CONV-2")


@pytest.mark.parametrize("alignment", [L.MIN_ALIGNMENT, L.MAX_ALIGNMENT])
def test_conv2_alignment_bounds_are_valid(alignment):
    assert kvwire.probe(hdr(alignment=alignment)).alignment == alignment


@pytest.mark.parametrize("chunk_tokens", [0, L.MAX_CHUNK_TOKENS + 1])
def test_hdr11_bad_chunk_tokens(chunk_tokens):
    expect(hdr(chunk_tokens=chunk_tokens), SchemaError, "BAD_CHUNK_TOKENS", "KVW-HDR-11")


@pytest.mark.parametrize("kw", [dict(token_count=L.MAX_TOKENS + 1),
                                dict(first_position=(1 << 63) - 1, token_count=1),
                                dict(first_position=(1 << 64) - 1)])
def test_lim3_token_count_and_positions(kw):
    expect(hdr(**kw), LimitError, "LIMIT_EXCEEDED", "KVW-LIM-3")


def test_lim4_chunk_body_over_4_gib():
    layer = dict(num_kv_heads=L.MAX_HEADS, head_dim_k=128, head_dim_v=128)
    expect(hdr(layers=[layer], dtype=2, chunk_tokens=L.MAX_CHUNK_TOKENS), LimitError, "LIMIT_EXCEEDED", "KVW-LIM-4")


def test_lim1_header_implying_too_many_chunks():
    data = hdr(chunk_tokens=1, token_count=L.MAX_CHUNKS)  # 2 components x 2^20 one-token chunks
    kvwire.probe(data)  # the header itself is fine
    expect(data, LimitError, "LIMIT_EXCEEDED", "KVW-LIM-1", stage="open")


def test_arch1_too_many_layers():
    expect(hdr(layers=[forge.DEFAULT_LAYER], layer_spec_index=[0] * (L.MAX_LAYERS + 1)),
           LimitError, "LIMIT_EXCEEDED", "KVW-ARCH-1")


def test_arch1_zero_layers():
    expect(hdr(layer_spec_index=[]), SchemaError, "ARCH_INVALID", "KVW-ARCH-1")


@pytest.mark.parametrize("kw", [dict(num_layers=2, layer_spec_index=[0]), dict(layer_spec_index=[1]),
                                dict(layer_spec_index=False, num_layers=1)],
                         ids=["index-short", "index-out-of-range", "index-missing"])
def test_arch1_layer_spec_index_invalid(kw):
    expect(hdr(**kw), SchemaError, "ARCH_INVALID", "KVW-ARCH-1")


FULL = forge.DEFAULT_LAYER


@pytest.mark.parametrize("layers,rule", [
    ([dict(FULL, head_dim_v=0)], "KVW-ARCH-2"),
    ([dict(FULL, num_kv_heads=0)], "KVW-ARCH-2"),
    ([dict(FULL, num_kv_heads=L.MAX_HEADS + 1)], "KVW-ARCH-2"),
    ([dict(FULL, head_dim_k=0)], "KVW-ARCH-2"),
    ([dict(FULL, head_dim_k=L.MAX_HEAD_DIM + 1)], "KVW-ARCH-2"),
    ([dict(FULL, head_dim_v=L.MAX_HEAD_DIM + 1)], "KVW-ARCH-2"),
    ([dict(kind=4, source_layer=0)], "KVW-ARCH-4"),  # shared layer 0 refers to itself
    ([FULL, dict(kind=4, source_layer=2), FULL], "KVW-ARCH-4"),  # forward reference
    ([FULL, dict(kind=4, source_layer=-1)], "KVW-ARCH-4"),
    ([FULL, dict(kind=4, source_layer=0), dict(kind=4, source_layer=1)], "KVW-ARCH-4"),  # source is shared
    ([FULL, dict(kind=4, source_layer=0, num_kv_heads=1)], "KVW-ARCH-4"),  # shared declares dims
    ([FULL, dict(FULL, source_layer=0)], "KVW-ARCH-4"),  # not shared but has a source
    ([FULL, dict(kind=4, source_layer=0, window=8)], "KVW-ARCH-4"),  # shared declares a window
    ([FULL, dict(kind=4, source_layer=0, kv_lora_rank=8)], "KVW-ARCH-4"),  # shared declares MLA fields
    ([dict(FULL, kv_lora_rank=8)], "KVW-ARCH-5"),  # MLA fields on a non-MLA layer
    ([dict(FULL, qk_rope_head_dim=4)], "KVW-ARCH-5"),
    ([dict(kind=3, num_kv_heads=2, head_dim_k=12, kv_lora_rank=8, qk_rope_head_dim=4)], "KVW-ARCH-5"),
    ([dict(kind=3, num_kv_heads=1, head_dim_k=12, head_dim_v=4, kv_lora_rank=8, qk_rope_head_dim=4)],
     "KVW-ARCH-5"),
    ([dict(kind=3, num_kv_heads=1, head_dim_k=4, qk_rope_head_dim=4)], "KVW-ARCH-5"),  # rank 0
    ([dict(kind=3, num_kv_heads=1, head_dim_k=13, kv_lora_rank=8, qk_rope_head_dim=4)], "KVW-ARCH-5"),
    ([dict(FULL, kind=1)], "KVW-ARCH-6"),  # sliding without a window
    ([dict(FULL, kind=2)], "KVW-ARCH-6"),  # chunked without a window
    ([dict(FULL, window=4)], "KVW-ARCH-6"),  # full attention with a window
])
def test_arch_invalid(layers, rule):
    expect(hdr(layers=layers), SchemaError, "ARCH_INVALID", rule)


def test_arch_valid_kinds_parse():
    layers = [FULL, dict(FULL, kind=1, window=8), dict(FULL, kind=2, window=8),
              dict(kind=3, num_kv_heads=1, head_dim_k=12, kv_lora_rank=8, qk_rope_head_dim=4),
              dict(kind=4, source_layer=3)]
    h = kvwire.probe(hdr(layers=layers, token_count=4))
    R = kvwire.format.header.R
    assert [s.kind for s in h.arch.layers] == [k for k in R.LAYER_KINDS if k not in R.FEATURE_GATED["layer_kind"]]
    assert h.layer_tokens[4] == kvwire.TokenRange(0, 0)


@pytest.mark.parametrize("kw", [
    dict(token_count=4, layer_tokens=[(0, 4), (0, 4)]),  # two ranges for one layer
    dict(token_count=4, layer_tokens=[(1, 4)]),  # past token_count
    dict(token_count=4, layer_tokens=[(5, 0)]),  # starts past token_count
    dict(token_count=4, layers=[FULL, dict(kind=4, source_layer=0)], layer_tokens=[(0, 4), (0, 1)]),
], ids=["count", "past-end", "start-past-end", "shared-with-tokens"])
def test_hdr13_token_range_invalid(kw):
    expect(hdr(**kw), SchemaError, "TOKEN_RANGE_INVALID", "KVW-HDR-13")


@pytest.mark.parametrize("layer_map", [
    [(L.MAX_LAYERS, 0, 0)],  # receiver out of range
    [(0, 0, 0), (0, 0, 1)],  # receiver mapped twice
    [(0, 1, 0)],  # copy from a layer that is not transmitted
    [(0, -1, 1)],  # alias from nothing
    [(0, 0, 2)],  # recompute must not name a transmitted layer
    [(0, 0, 3)],  # drop neither
])
def test_map1_layer_map_invalid(layer_map):
    expect(hdr(layer_map=layer_map), SchemaError, "LAYER_MAP_INVALID", "KVW-MAP-1")


def test_map1_valid_layer_map():
    h = kvwire.probe(hdr(layer_map=[(0, 0, 0), (1, 0, 1), (2, -1, 2), (3, -1, 3)]))
    assert [e.op for e in h.layer_map] == ["copy", "alias", "recompute", "drop"]


@pytest.mark.parametrize("key", ["nodot", "Upper.name", "ns.", ".name", "ns..name", "ns.na me", "ns.name\n",
                                 "\nns.name", ""])
def test_meta1_metadata_key_invalid(key):
    expect(hdr(metadata=[(key, b"v")]), SchemaError, "METADATA_KEY_INVALID", "KVW-META-1")


def test_meta1_metadata_key_too_long_on_the_wire():
    key = "ns." + "k" * 254  # 257 characters: over the key string limit
    expect(hdr(metadata=[(key, b"v")]), LimitError, "LIMIT_EXCEEDED", "KVW-LIM-1")
    assert kvwire.probe(hdr(metadata=[(key[:256], b"v")])).metadata == {key[:256]: b"v"}


def test_meta1_metadata_key_invalid_refused_by_the_writer():
    with raises_code(SchemaError, "METADATA_KEY_INVALID", "KVW-META-1"):
        kvwire.encode(CACHE.with_header(metadata={"ns." + "k" * 254: b""}))
    with raises_code(SchemaError, "METADATA_KEY_INVALID", "KVW-META-1"):
        kvwire.encode(CACHE.with_header(metadata={"ns.name\n": b""}))


def test_meta2_metadata_key_duplicate():
    expect(hdr(metadata=[("ns.a", b"1"), ("ns.a", b"2")]), SchemaError, "METADATA_KEY_DUPLICATE", "KVW-META-2")


@pytest.mark.parametrize("value", ["text", None, b"x" * (L.MAX_BYTES_LENGTH + 1)], ids=["str", "none", "too-long"])
def test_meta1_metadata_value_invalid_refused_by_the_writer(value):
    """METADATA_VALUE_INVALID can only fire in the writer: on the wire a value is always
    a byte vector, and one over the limit is refused as a vector (LIMIT_EXCEEDED) first."""
    with raises_code(SchemaError, "METADATA_VALUE_INVALID", "KVW-META-1"):
        kvwire.encode(CACHE.with_header(metadata={"ns.key": value}))


def test_meta1_metadata_value_too_long_on_the_wire():
    expect(hdr(metadata=[("ns.key", b"x" * (L.MAX_BYTES_LENGTH + 1))]), LimitError, "LIMIT_EXCEEDED", "KVW-LIM-1")


# =======================================================================================
# Chunk records (KVW-CHUNK-*, KVW-EVOL-4): every defect in both forms, frames and index
# agreeing, checksums recomputed
# =======================================================================================

RECORD_CASES = [
    # (edit, class, code, rule)
    (set_records(layer=(0, 2)), LayoutError, "LAYER_OUT_OF_RANGE", "KVW-CHUNK-1"),
    (set_records(layer=(0, 0xFFFF)), LayoutError, "LAYER_OUT_OF_RANGE", "KVW-CHUNK-1"),
    (set_records(component=(0, 3)), LayoutError, "ENUM_OUT_OF_RANGE", "KVW-CHUNK-1"),
    (set_records(component=(0, 2)), LayoutError, "COMPONENT_INVALID", "KVW-CHUNK-1"),
    (set_records(reserved0=(3, 1)), LayoutError, "RESERVED_NONZERO", "KVW-CHUNK-7"),
    (set_records(reserved1=(3, 1 << 31)), LayoutError, "RESERVED_NONZERO", "KVW-CHUNK-7"),
    (set_records(flags=(1, 0x0100)), FeatureError, "UNSUPPORTED_FEATURE", "KVW-EVOL-4"),
    (set_records(flags=(1, 0x8000)), FeatureError, "UNSUPPORTED_FEATURE", "KVW-EVOL-4"),
    (set_records(codec=(0, 2)), CodecError, "UNKNOWN_CODEC", "KVW-CHUNK-5"),
    (set_records(codec=(0, 255)), CodecError, "UNKNOWN_CODEC", "KVW-CHUNK-5"),
    (set_records(token_start=(0, 1)), LayoutError, "CHUNK_BOUNDARY", "KVW-CHUNK-2"),  # [1, 17) straddles
    (set_records(token_start=(1, 8)), LayoutError, "CHUNK_BOUNDARY", "KVW-CHUNK-2"),  # [8, 24) two cells
    (set_records(token_count=(2, 9)), LayoutError, "CHUNK_BOUNDARY", "KVW-CHUNK-2"),  # [32, 41) past the layer
    (set_records(token_count=(0, 0)), LayoutError, "CHUNK_BOUNDARY", "KVW-CHUNK-2"),  # empty
    (set_records(head_start=(0, 1)), LayoutError, "HEAD_RANGE", "KVW-CHUNK-3"),
    (set_records(head_count=(0, 1)), LayoutError, "HEAD_RANGE", "KVW-CHUNK-3"),
    (set_records(raw_length=(0, 511)), LayoutError, "LENGTH_MISMATCH", "KVW-CHUNK-4"),
]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("edit,cls,code,rule", RECORD_CASES, ids=[c[2] + "-" + str(i) for i, c in enumerate(RECORD_CASES)])
def test_chunk_record_rules(form, edit, cls, code, rule):
    expect(forge.rebuild(ENC[form, "raw"], edit=edit), cls, code, rule, stage="open")


def test_evol4_optional_chunk_flags_are_ignored(form):
    def edit(recs):
        recs["flags"] = 0x00FF

    data = forge.rebuild(ENC[form, "raw"], edit=edit)
    assert forge.cache_bytes_equal(forge.read_all(data), CACHE)


def test_chunk4_stored_length_zero(form):
    p = forge.split(ENC[form, "zstd"])
    p.bodies[0] = b""  # a zstd chunk whose body is empty (stored_length recomputed to 0)
    expect(forge.assemble(p), LayoutError, "LENGTH_MISMATCH", "KVW-CHUNK-4", stage="open")


def test_chunk6_raw_length_mismatch(form):
    p = forge.split(ENC[form, "raw"])
    p.bodies[4] = p.bodies[4] + b"\x00"  # raw body one byte longer than raw_length
    expect(forge.assemble(p), CodecError, "RAW_LENGTH_MISMATCH", "KVW-CHUNK-6", stage="open")


def test_chunk8_chunk_missing(form):
    p = forge.split(ENC[form, "raw"])
    p.records = np.delete(p.records, 5)
    del p.bodies[5]
    expect(forge.assemble(p), LayoutError, "CHUNK_MISSING", "KVW-CHUNK-8", stage="open")


def test_chunk8_chunk_duplicate_extra_record(form):
    p = forge.split(ENC[form, "raw"])
    p.records = np.concatenate([p.records, p.records[:1]])
    p.bodies.append(p.bodies[0])
    expect(forge.assemble(p), LayoutError, "CHUNK_DUPLICATE", "KVW-CHUNK-8", stage="open")


def test_chunk8_chunk_duplicate_same_cell_twice(form):
    p = forge.split(ENC[form, "raw"])
    p.records[1] = p.records[0]  # record 1 now also describes layer 0 k tokens [0, 16)
    p.bodies[1] = p.bodies[0]
    expect(forge.assemble(p), LayoutError, "CHUNK_DUPLICATE", "KVW-CHUNK-8", stage="open")


# =======================================================================================
# Layout (KVW-LAYOUT-*), frames (KVW-FRAME-*), end frame (KVW-STREAM-1)
# =======================================================================================

def test_layout1_bad_body_offset(form):
    def edit(recs):
        recs[3]["offset"] += 64  # an aligned hole before body 3

    expect(forge.rebuild(ENC[form, "raw"], edit=edit), LayoutError, "BAD_OFFSET", "KVW-LAYOUT-1", stage="open")


@pytest.mark.parametrize("form", ["file", "stream"])
@pytest.mark.parametrize("offset, stored", [(2**64 - 64, 2**63), (64, 2**64 - 1)])
def test_conv4_offset_and_length_sums_never_wrap(form, offset, stored):
    """KVW-CONV-4: offset + stored_length past 2**64 must not wrap into a passing check; the
    error is that of the rule whose check needed the sum (bounds in the file form, the
    layout rule in the stream form)."""
    data = kvwire.encode(forge.small_cache(), form=form, codec="zstd")

    def edit(recs):
        recs[1]["offset"], recs[1]["stored_length"] = offset, stored

    code, rule = ("BODY_OUT_OF_BOUNDS", "KVW-LAYOUT-5") if form == "file" else ("BAD_OFFSET", "KVW-LAYOUT-1")
    expect(forge.rebuild(data, edit=edit), LayoutError, code, rule, stage="open")


def test_layout1_misaligned_body_offset_in_the_index():
    def edit(recs):
        recs[0]["offset"] -= 8

    expect(forge.rebuild(ENC["file", "raw"], edit=edit), LayoutError, "BAD_OFFSET", "KVW-LAYOUT-1", stage="open")


def test_layout1_end_frame_not_where_the_layout_puts_it():
    expect(forge.rebuild(ENC["file", "raw"], gap_before_end=64), LayoutError, "BAD_OFFSET", "KVW-LAYOUT-1",
           stage="open")


@pytest.mark.parametrize("which", ["offset", "length", "length-overflow"])
def test_layout5_body_out_of_bounds(which):
    """File form: the index is checked against the container size before any body is read."""
    def edit(recs):
        if which == "offset":
            recs[0]["offset"] = 1 << 40
        elif which == "length":
            recs[-1]["stored_length"] += 1 << 20
        else:
            recs[-1]["stored_length"] = (1 << 64) - 1  # the end must not wrap around

    expect(forge.rebuild(ENC["file", "zstd"], edit=edit), LayoutError, "BODY_OUT_OF_BOUNDS", "KVW-LAYOUT-5",
           stage="open")


def test_layout5_stream_body_truncated():
    data = ENC["stream", "raw"]
    off, n = forge.layout(data).bodies[2]
    err = expect(data[: off + n - 1], TruncatedError, "TRUNCATED", "KVW-LAYOUT-5")
    assert err.needed == off + n


def test_layout3_stream_frame_truncated():
    data = ENC["stream", "raw"]
    frame = forge.layout(data).frames[2]
    err = expect(data[: frame + 10], TruncatedError, "TRUNCATED", "KVW-LAYOUT-3")
    assert err.needed == frame + FRAME_SIZE


def test_frame1_bad_frame_marker_stream():
    data = ENC["stream", "raw"]
    frame = forge.layout(data).frames[0]
    expect(data[:frame] + b"KWCX" + data[frame + 4 :], LayoutError, "BAD_FRAME_MARKER", "KVW-FRAME-1", stage="open")


def test_frame1_bad_frame_marker_file_is_caught_when_the_body_is_read():
    data = ENC["file", "raw"]
    frame = forge.layout(data).frames[4]
    bad = data[:frame] + b"XXXX" + data[frame + 4 :]
    expect(bad, LayoutError, "BAD_FRAME_MARKER", "KVW-FRAME-1", stage="load")
    expect(bad, LayoutError, "BAD_FRAME_MARKER", "KVW-FRAME-1", stage="validate")


def test_frame1_bad_end_frame_marker(form):
    data = ENC[form, "raw"]
    at = forge.layout(data).end_frame
    expect(data[:at] + b"KWEX" + data[at + 4 :], LayoutError, "BAD_FRAME_MARKER", "KVW-FRAME-1", stage="open")


def test_frame2_frame_checksum_stream():
    data = ENC["stream", "raw"]
    frame = forge.layout(data).frames[1]
    expect(forge.xor_byte(data, frame + 8 + 30), ChecksumError, "FRAME_CHECKSUM", "KVW-FRAME-2", stage="open")


def test_frame2_frame_checksum_file_is_caught_when_the_body_is_read():
    data = ENC["file", "raw"]
    frame = forge.layout(data).frames[1]
    bad = forge.xor_byte(data, frame + 8 + 30)
    expect(bad, ChecksumError, "FRAME_CHECKSUM", "KVW-FRAME-2", stage="load")
    with kvwire.open(bad) as r:
        r.chunk(0, "k", 0)  # other chunks stay readable
        with raises_code(ChecksumError, "FRAME_CHECKSUM", "KVW-FRAME-2"):
            r.chunk(0, "k", 1)


def test_frame2_end_frame_checksum(form):
    data = ENC[form, "raw"]
    at = forge.layout(data).end_frame
    expect(forge.xor_byte(data, at + 8), ChecksumError, "FRAME_CHECKSUM", "KVW-FRAME-2", stage="open")
    expect(forge.xor_byte(data, at + 5), ChecksumError, "FRAME_CHECKSUM", "KVW-FRAME-2", stage="open")


def test_layout3_missing_end_frame_file():
    p = forge.split(ENC["file", "raw"])
    expect(forge.assemble(p, end_frame=build_frame(p.records[0])), LayoutError, "MISSING_END", "KVW-LAYOUT-3",
           stage="open")


def test_missing_end_frame_stream_is_a_bad_offset():
    """In the stream form a chunk frame where the end frame belongs is read as a chunk:
    its record names another body, so the layout check fires (MISSING_END cannot)."""
    p = forge.split(ENC["stream", "raw"])
    expect(forge.assemble(p, end_frame=build_frame(p.records[0])), LayoutError, "BAD_OFFSET", "KVW-LAYOUT-1")


@pytest.mark.parametrize("kw", [dict(end_count=11), dict(end_count=13), dict(end_digest=12345)])
def test_stream1_end_frame_disagrees_with_records(form, kw):
    expect(forge.rebuild(ENC[form, "raw"], **kw), LayoutError, "INDEX_MISMATCH", "KVW-STREAM-1", stage="open")


def test_stream1_end_frame_reserved_nonzero(form):
    expect(forge.rebuild(ENC[form, "raw"], end_reserved=bytes(39) + b"\x01"), LayoutError, "RESERVED_NONZERO",
           "KVW-STREAM-1", stage="open")


def test_layout4_trailing_bytes_after_stream():
    data = ENC["stream", "raw"]
    expect(data + b"\x00", LayoutError, "TRAILING_BYTES", "KVW-LAYOUT-4", stage="open")
    expect(data + bytes(64), LayoutError, "TRAILING_BYTES", "KVW-LAYOUT-4", stage="open")


@pytest.mark.parametrize("region", ["after-header", "between-bodies", "before-end"])
def test_layout2_nonzero_padding(region):
    """Padding is checked by validate() (open and load read only structures and bodies)."""
    data = ENC["file", "zstd"]
    regions = forge.layout(data).padding()
    start, stop = {"after-header": regions[0], "between-bodies": regions[1], "before-end": regions[-2]}[region]
    bad = forge.set_byte(data, (start + stop) // 2, 0x20)
    assert forge.cache_bytes_equal(kvwire.load(bad), CACHE)
    expect(bad, LayoutError, "NONZERO_PADDING", "KVW-LAYOUT-2", stage="validate")


def test_layout2_nonzero_index_padding():
    ok = forge.rebuild(ENC["file", "raw"], index_tail=bytes(4))  # index length 4 mod 8: 4 bytes of padding
    forge.read_all(ok)
    bad = forge.rebuild(ENC["file", "raw"], index_tail=bytes(4), index_pad=b"\x00\x00\x01\x00")
    expect(bad, LayoutError, "NONZERO_PADDING", "KVW-LAYOUT-2", stage="open")


# =======================================================================================
# File form: index and trailer (KVW-FILE-*)
# =======================================================================================

def test_file1_trailer_reserved_nonzero():
    expect(forge.rebuild(ENC["file", "raw"], trailer_reserved=1), LayoutError, "RESERVED_NONZERO", "KVW-FILE-1",
           stage="open")


def test_file2_index_too_large():
    data = forge.patch_trailer(ENC["file", "raw"], index_length=L.MAX_INDEX_LENGTH + 1)
    expect(data, LimitError, "INDEX_TOO_LARGE", "KVW-FILE-2", stage="open")


@pytest.mark.parametrize("change", ["offset+8", "offset-8", "length+8", "offset-too-small"])
def test_file2_index_position(change):
    data = ENC["file", "raw"]
    lay = forge.layout(data)
    off, length = lay.index
    fields = {"offset+8": dict(index_offset=off + 8), "offset-8": dict(index_offset=off - 8),
              "length+8": dict(index_length=length + 8),
              # ends at the trailer, but starts inside the preamble/first frame
              "offset-too-small": dict(index_offset=64, index_length=len(data) - 32 - 64)}[change]
    expect(forge.patch_trailer(data, fix_checksum=True, **fields), LayoutError, "INDEX_POSITION", "KVW-FILE-2",
           stage="open")


def test_file3_index_checksum():
    data = ENC["file", "raw"]
    off, length = forge.layout(data).index
    expect(forge.xor_byte(data, off + length - 3), ChecksumError, "INDEX_CHECKSUM", "KVW-FILE-3", stage="open")
    expect(forge.patch_trailer(data, index_checksum=0), ChecksumError, "INDEX_CHECKSUM", "KVW-FILE-3")


def test_file4_frame_disagrees_with_index():
    def edit_frames(recs):
        recs[4]["flags"] = 0x0001  # optional flag only in the frame: valid alone, but not the index's record

    bad = forge.rebuild(ENC["file", "raw"], edit_frames=edit_frames)
    expect(bad, LayoutError, "INDEX_MISMATCH", "KVW-FILE-4", stage="load")
    expect(bad, LayoutError, "INDEX_MISMATCH", "KVW-FILE-4", stage="validate")


def test_file4_end_frame_where_a_chunk_frame_belongs():
    data = ENC["file", "raw"]
    lay = forge.layout(data)
    end = data[lay.end_frame : lay.end_frame + FRAME_SIZE]
    bad = data[: lay.frames[11]] + end + data[lay.frames[11] + FRAME_SIZE :]
    expect(bad, LayoutError, "INDEX_MISMATCH", "KVW-FILE-4", stage="load")


def test_file5_index_identifier():
    p = forge.split(ENC["file", "raw"])
    expect(forge.assemble(p, index=forge.fb_index(p.records, identifier=b"KVWH")), HeaderError, "FB_IDENTIFIER",
           "KVW-FILE-5", stage="open")


def test_file5_index_without_records():
    p = forge.split(ENC["file", "raw"])
    expect(forge.assemble(p, index=forge.fb_index(None)), HeaderError, "FB_REQUIRED", "KVW-HDR-6", stage="open")


def _index_length_field(index: bytes) -> int:
    t = forge.root_table(index, b"KVWI")
    at = forge.field_pos(t, 0, 4)
    return at + struct.unpack_from("<I", index, at)[0]


def test_file5_index_vector_past_the_index():
    p = forge.split(ENC["file", "raw"])
    index = forge.fb_index(p.records)
    bad = forge.patch(index, _index_length_field(index), "I", len(p.records) + 1)
    expect(forge.assemble(p, index=bad), HeaderError, "FB_BOUNDS", "KVW-HDR-3", stage="open")


def test_lim1_index_with_too_many_records():
    p = forge.split(ENC["file", "raw"])
    index = forge.fb_index(p.records)
    bad = forge.patch(index, _index_length_field(index), "I", L.MAX_CHUNKS + 1)
    expect(forge.assemble(p, index=bad), LimitError, "LIMIT_EXCEEDED", "KVW-LIM-1", stage="open")


def test_lim1_stream_with_too_many_frames(monkeypatch):
    """The frame walk stops at MAX_CHUNKS frames. Reaching 2^20 + 1 frames takes 64 MiB, so
    the limit is lowered to the 12 chunks the header implies and a 13th frame is sent."""
    import kvwire.cache.reader

    p = forge.split(ENC["stream", "raw"])
    p.records = np.concatenate([p.records, p.records[:1]])
    p.bodies.append(p.bodies[0])
    data = forge.assemble(p)
    expect(data, LayoutError, "CHUNK_DUPLICATE", "KVW-CHUNK-8")  # with the real limit
    monkeypatch.setattr(kvwire.cache.reader, "MAX_CHUNKS", 12)
    expect(data, LimitError, "LIMIT_EXCEEDED", "KVW-LIM-1", stage="open")


# =======================================================================================
# Bodies: checksums (KVW-CSUM-1), codecs (KVW-CODEC-2), decoded size (KVW-LIM-5)
# =======================================================================================

@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_csum1_body_checksum(form, codec):
    data = ENC[form, codec]
    off, n = forge.layout(data).bodies[7]
    bad = forge.xor_byte(data, off + n // 2, 0x40)
    kvwire.open(bad).close()  # bodies are not read at open
    expect(bad, ChecksumError, "BODY_CHECKSUM", "KVW-CSUM-1", stage="load")
    expect(bad, ChecksumError, "BODY_CHECKSUM", "KVW-CSUM-1", stage="validate")
    with kvwire.open(bad) as r:
        with raises_code(ChecksumError, "BODY_CHECKSUM", "KVW-CSUM-1"):
            r.chunk(1, "k", 1)
        r.chunk(1, "k", 0)


def test_csum1_verify_false_skips_body_checksums():
    data = ENC["stream", "raw"]
    off, _ = forge.layout(data).bodies[0]
    bad = forge.xor_byte(data, off)
    loaded = kvwire.load(bad, verify=False)
    assert not forge.cache_bytes_equal(loaded, CACHE)  # the documented cost of verify=False


def _zstd_body_case(make_body):
    p = forge.split(ENC["file", "zstd"])
    assert p.records[0]["codec"] == 1 and p.records[0]["raw_length"] == 512
    raw = zstandard.ZstdDecompressor().decompress(p.bodies[0])
    p.bodies[0] = make_body(p.bodies[0], raw)
    return forge.assemble(p)


@pytest.mark.parametrize("make_body", [
    lambda body, raw: b"not a zstd frame at all",
    lambda body, raw: body[:-3],  # frame cut short
    lambda body, raw: body + body,  # a second frame after the first
    lambda body, raw: b"\x28\xb5\x2f\xfd",  # magic only
], ids=["garbage", "truncated", "two-frames", "magic-only"])
def test_codec2_decode_failed(make_body):
    data = _zstd_body_case(make_body)
    expect(data, CodecError, "DECODE_FAILED", "KVW-CODEC-2", stage="load")
    expect(data, CodecError, "DECODE_FAILED", "KVW-CODEC-2", stage="validate")


@pytest.mark.parametrize("make_body", [
    lambda body, raw: zstandard.ZstdCompressor().compress(raw[:-2]),  # declares 510 bytes
    lambda body, raw: zstandard.ZstdCompressor().compress(raw + b"\0\0"),  # declares 514 bytes
    lambda body, raw: zstandard.ZstdCompressor(write_content_size=False).compress(raw),  # declares nothing
], ids=["short", "long", "no-size"])
def test_codec2_decoded_size_mismatch(make_body):
    data = _zstd_body_case(make_body)
    expect(data, CodecError, "DECODED_SIZE_MISMATCH", "KVW-CODEC-2", stage="load")
    expect(data, CodecError, "DECODED_SIZE_MISMATCH", "KVW-CODEC-2", stage="validate")


def test_codec2_frame_declaring_more_than_it_holds_is_a_decode_failure():
    """A frame whose declared size equals raw_length but whose blocks hold less: libzstd
    rejects it itself, so codecs.py's check of the decoded length after decompression
    (the second DECODED_SIZE_MISMATCH) is unreachable."""
    def make_body(body, raw):
        frame = bytearray(zstandard.ZstdCompressor().compress(raw[:-2]))
        assert frame[4] & 0xC0 == 0x40 and frame[4] & 0x20  # 2-byte content size, single segment
        struct.pack_into("<H", frame, 5, 512 - 256)
        assert zstandard.frame_content_size(bytes(frame)) == 512
        return bytes(frame)

    expect(_zstd_body_case(make_body), CodecError, "DECODE_FAILED", "KVW-CODEC-2", stage="load")


def test_lim5_decoded_size_limit():
    data = ENC["file", "zstd"]
    total = sum(x.nbytes for layer in CACHE.layers for x in layer.values())
    with kvwire.open(data, max_decoded_bytes=total) as r:
        assert forge.cache_bytes_equal(r.load(), CACHE)
    with raises_code(LimitError, "DECODED_SIZE_LIMIT", "KVW-LIM-5"):
        kvwire.open(data, max_decoded_bytes=total - 1)
    with raises_code(LimitError, "DECODED_SIZE_LIMIT", "KVW-LIM-5"):
        kvwire.load(ENC["stream", "raw"], max_decoded_bytes=0)


# =======================================================================================
# Paths: the mapped-file reader reports the same errors and releases the file
# =======================================================================================

def test_errors_from_a_mapped_file(tmp_path):
    path = tmp_path / "bad.kvw"
    data = ENC["file", "raw"]
    path.write_bytes(forge.patch_preamble(data, reserved=7))
    expect(path, LayoutError, "RESERVED_NONZERO", "KVW-PRE-3")
    off, _ = forge.layout(data).bodies[0]
    path.write_bytes(forge.xor_byte(data, off))
    expect(path, ChecksumError, "BODY_CHECKSUM", "KVW-CSUM-1", stage="load")


# =======================================================================================
# Completeness: every error code raised in python/kvwire is exercised above
# =======================================================================================

_ERROR_CALLS = {"FormatError", "MagicError", "VersionError", "FeatureError", "ChecksumError", "HeaderError",
                "SchemaError", "LayoutError", "CodecError", "LimitError", "_fail", "SegmentError"}


def _codes_in_package() -> set:
    """Every code string passed to an error constructor (or ``_fail``) anywhere in the package."""
    codes = set()
    for path in PKG.rglob("*.py"):
        if "fbs" in path.relative_to(PKG).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            if name not in _ERROR_CALLS:
                continue
            for arg in node.args:  # positional arguments only: rule ids are keywords
                for sub in ast.walk(arg):
                    if isinstance(sub, ast.Constant) and isinstance(sub.value, str) \
                            and re.fullmatch(r"[A-Z][A-Z0-9_]{4,}", sub.value):
                        codes.add(sub.value)
    codes.add("TRUNCATED")  # TruncatedError sets its code itself
    return codes


@pytest.mark.slow
def test_every_error_code_has_a_test():
    text = "".join(p.read_text() for p in pathlib.Path(__file__).resolve().parents[1].rglob("test_*.py"))
    codes = _codes_in_package()
    assert {"TRUNCATED", "BAD_MAGIC", "BODY_CHECKSUM", "SEGMENT_ORDER"} <= codes
    missing = sorted(c for c in codes if f'"{c}"' not in text)
    assert not missing, f"error codes without a test: {missing}"


def test_every_error_is_a_format_error_subclass():
    for cls in (ChecksumError, CodecError, FeatureError, HeaderError, LayoutError, LimitError, MagicError,
                SchemaError, TruncatedError, VersionError):
        assert issubclass(cls, FormatError) and issubclass(cls, ValueError)
    err = TruncatedError("x", needed=5, rule="KVW-PRE-1")
    assert (err.code, err.needed, err.rule) == ("TRUNCATED", 5, "KVW-PRE-1")
    assert str(err).startswith("TRUNCATED [KVW-PRE-1]: ")



# =======================================================================================
# The incremental StreamDecoder reports the same defects as the Reader
# =======================================================================================

def _stream_cases():
    base = ENC["stream", "raw"]
    cases = {f"{c[2]}-{i}": forge.rebuild(base, edit=c[0]) for i, c in enumerate(RECORD_CASES)}
    p = forge.split(base)
    p.records, p.bodies = np.delete(p.records, 5), p.bodies[:5] + p.bodies[6:]
    cases["CHUNK_MISSING"] = forge.assemble(p)
    p = forge.split(base)
    p.records[1], p.bodies[1] = p.records[0], p.bodies[0]
    cases["CHUNK_DUPLICATE"] = forge.assemble(p)
    cases["TRAILING_BYTES"] = base + b"\x00"
    cases["INDEX_MISMATCH"] = forge.rebuild(base, end_count=11)
    cases["RESERVED_NONZERO-end"] = forge.rebuild(base, end_reserved=bytes(39) + b"\x01")
    lay = forge.layout(base)
    cases["BODY_CHECKSUM"] = forge.xor_byte(base, lay.bodies[7][0])
    cases["FRAME_CHECKSUM"] = forge.xor_byte(base, lay.frames[1] + 20)
    cases["BAD_FRAME_MARKER"] = base[: lay.frames[0]] + b"KWCX" + base[lay.frames[0] + 4 :]
    cases["NONZERO_PADDING"] = forge.set_byte(base, lay.padding()[0][0], 1)
    cases["HEADER_CHECKSUM"] = forge.xor_byte(base, PREAMBLE_SIZE + 20)
    cases["PREAMBLE_CHECKSUM"] = forge.xor_byte(base, 12)
    cases["TEXT_MODE_MANGLED"] = base.replace(b"\r\n", b"\n")
    cases["ENUM_OUT_OF_RANGE-hdr"] = hdr(dtype=9)
    cases["VERSION_MISMATCH"] = hdr(format_minor=1)
    cases["TRUNCATED"] = base[:-1]
    zs = forge.split(ENC["stream", "zstd"])
    zs.bodies[0] = b"not zstd"
    cases["DECODE_FAILED"] = forge.assemble(zs)
    return cases


STREAM_CASES = _stream_cases()


@pytest.mark.parametrize("name", sorted(STREAM_CASES))
def test_stream_decoder_agrees_with_the_reader(name):
    data = STREAM_CASES[name]
    with pytest.raises(FormatError) as by_reader:
        forge.read_all(data)
    dec = kvwire.StreamDecoder()
    with pytest.raises(FormatError) as by_decoder:
        for i in range(0, len(data), 97):  # arbitrary packet boundaries
            dec.feed(data[i : i + 97])
            list(dec.events())
        dec.close()
    assert type(by_decoder.value) is type(by_reader.value)
    assert by_decoder.value.code == by_reader.value.code
    if by_reader.value.code != "TRUNCATED":  # the decoder only learns at close() that input ended
        assert by_decoder.value.rule == by_reader.value.rule


@pytest.mark.parametrize("value", [2, 0xFF])
def test_bool_field_must_be_0_or_1(value):
    """KVW-HDR-10: a bool is a two-value enum, so each header has one encoding."""
    hb = forge.fb_header(layers=[dict(FULL, uses_rope=False)])
    spec = forge.root_table(hb).table(6).tables(2, 16)[0]
    bad = forge.patch(hb, forge.field_pos(spec, 6, 1), "B", value)
    expect(forge.wrap_header(bad), SchemaError, "ENUM_OUT_OF_RANGE", "KVW-HDR-10")
    assert kvwire.probe(forge.wrap_header(hb)).arch.layers[0].uses_rope is False
