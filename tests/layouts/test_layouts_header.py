"""Header.engine_layout (schema field 16, spec 5.9): written, read, verified, never judged.

KVW-HDR-18: readers accept any content and decode identically.
KVW-HDR-19: writers emit well-formed axes and a stride order that is a permutation.
KVW-LIM-1: its vector and strings are bounded like every other.
"""

from __future__ import annotations

import pytest

import forge
import kvwire
from kvwire.format.fbs import Header as fbHeader
from kvwire.format.header import MAX_LAYOUT_DIMS, EngineLayout, build_header, parse_header

LAYOUT = EngineLayout("vllm.flash_hnd", "KV,B,N,H,C", (0, 1, 3, 2, 4), 16, "vllm/0.9.2")


def _cache(engine_layout=None):
    return forge.small_cache(2, 2, 8, 40, seed=9, engine_layout=engine_layout)


def test_roundtrip_and_generated_accessors_agree():
    h = _cache(LAYOUT).header
    data = build_header(h)
    assert parse_header(data) == h and parse_header(data).engine_layout == LAYOUT
    e = fbHeader.Header.GetRootAs(data, 0).EngineLayout()
    assert (e.Name(), e.Axes(), e.Engine()) == (b"vllm.flash_hnd", b"KV,B,N,H,C", b"vllm/0.9.2")
    assert [e.StrideOrder(i) for i in range(e.StrideOrderLength())] == [0, 1, 3, 2, 4] and e.BlockSize() == 16
    assert kvwire.probe(kvwire.encode(_cache(LAYOUT))).engine_layout == LAYOUT


def test_absent_and_empty_tables():
    assert parse_header(build_header(_cache().header)).engine_layout is None
    assert fbHeader.Header.GetRootAs(build_header(_cache().header), 0).EngineLayout() is None
    assert parse_header(build_header(_cache(EngineLayout()).header)).engine_layout == EngineLayout()


@pytest.mark.parametrize("content", [
    EngineLayout("no.such.layout", "not an axes string", (9, 9, 9), 7, "?"),
    EngineLayout(axes="KV,B", stride_order=(0, 1, 2, 3)),
    EngineLayout(name="x" * 300, stride_order=tuple(range(MAX_LAYOUT_DIMS))),
])
def test_kvw_hdr_18_readers_accept_any_content_and_decode_identically(content):
    plain = kvwire.encode(_cache())
    parts = forge.split(plain)
    parts.header = forge.header_of(_cache(content).header)  # bypasses the writer's checks
    data = forge.assemble(parts)
    with kvwire.open(data) as r, kvwire.open(plain) as p:
        assert r.header.engine_layout == content
        assert r.header.replace(engine_layout=None) == p.header
        r.validate()
        assert forge.cache_bytes_equal(r.load(), p.load().with_header(engine_layout=content))


@pytest.mark.parametrize("bad", [
    EngineLayout(axes="KV,,B"), EngineLayout(axes="kv,B"), EngineLayout(axes="KV,B*"), EngineLayout(axes=" KV"),
    EngineLayout(axes="KV,B,N", stride_order=(0, 1)), EngineLayout(axes="KV,B", stride_order=(1, 1)),
    EngineLayout(stride_order=(0,)), EngineLayout(name="a\0b"), EngineLayout(block_size=-1),
    EngineLayout(axes=",".join(["B"] * 65), stride_order=tuple(range(65))),
])
def test_kvw_hdr_19_writers_refuse_malformed_layouts(bad):
    with pytest.raises(ValueError, match="engine_layout"):
        kvwire.encode(_cache(bad))


def test_writers_accept_the_registry_spellings():
    from kvwire import layouts

    for name in layouts.layout_names():
        d = layouts.get_layout(name)
        build_header(_cache(EngineLayout(name, d.axes, d.stride_order, 16)).header)


def test_kvw_lim_1_bounds():
    long_order = EngineLayout(stride_order=tuple(range(MAX_LAYOUT_DIMS + 1)))
    with forge.raises_code(kvwire.LimitError, "LIMIT_EXCEEDED", "KVW-LIM-1"):
        parse_header(forge.header_of(_cache(long_order).header))
    long_name = EngineLayout(name="n" * (65536 + 1))
    with forge.raises_code(kvwire.LimitError, "LIMIT_EXCEEDED", "KVW-LIM-1"):
        parse_header(forge.header_of(_cache(long_name).header))


def test_kvw_hdr_7_strings_are_verified():
    hb = forge.header_of(_cache(EngineLayout(name="abc", axes="KV")).header)
    at = hb.index(b"abc")
    with forge.raises_code(kvwire.HeaderError, "FB_STRING", "KVW-HDR-7"):
        parse_header(hb[:at] + b"a\0c" + hb[at + 3 :])
    with forge.raises_code(kvwire.HeaderError, "FB_STRING", "KVW-HDR-7"):
        parse_header(hb[:at] + b"a\xffc" + hb[at + 3 :])
