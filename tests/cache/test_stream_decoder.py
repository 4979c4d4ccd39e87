"""StreamDecoder: events as bytes arrive, every form and codec, any split of the input."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvwire
from kvwire.tools.synth import synth_cache

CACHE = synth_cache(3, 2, 16, 300, chunk_tokens=128, seed=1)
ENCODED = {(f, c): kvwire.encode(CACHE, form=f, codec=c) for f in ("stream", "file") for c in ("raw", "zstd")}


def _decode(data, cuts):
    dec = kvwire.StreamDecoder()
    events, last = [], 0
    for cut in sorted(cuts) + [len(data)]:
        dec.feed(data[last:cut])
        last = cut
        events += list(dec.events())
    return events, dec.close()


@pytest.mark.parametrize("form,codec", sorted(ENCODED))
@settings(max_examples=25, deadline=None)
@given(st.data())
def test_any_split_gives_the_same_chunks(form, codec, data):
    blob = ENCODED[form, codec]
    cuts = data.draw(st.lists(st.integers(0, len(blob)), max_size=12))
    events, got_form = _decode(blob, cuts)
    assert got_form == form
    assert isinstance(events[0], kvwire.HeaderEvent) and events[0].header == CACHE.header
    assert isinstance(events[-1], kvwire.EndEvent) and events[-1].chunk_count == 18
    chunks = [e for e in events if isinstance(e, kvwire.ChunkEvent)]
    assert len(chunks) == 18
    for e in chunks:
        ref = CACHE.layers[e.layer][e.component]
        part = ref[:, e.token_start : e.token_start + e.data.shape[1]]
        assert np.array_equal(e.data.view(np.uint16), part.view(np.uint16))


def test_layer_zero_is_usable_before_the_rest_arrives():
    blob = ENCODED["stream", "raw"]
    with kvwire.open(blob) as r:
        layer0_end = max(int(x["offset"] + x["stored_length"]) for x in r.records if x["layer"] == 0)
    dec = kvwire.StreamDecoder()
    dec.feed(blob[:layer0_end])
    got = [e for e in dec.events() if isinstance(e, kvwire.ChunkEvent)]
    assert {(e.layer, e.component) for e in got} == {(0, "k"), (0, "v")}
    assert len(got) == 2 * 3  # 300 tokens in chunks of 128: three chunks per component
    with pytest.raises(kvwire.TruncatedError):
        dec.close()


def test_cut_short_and_trailing_bytes_are_errors():
    blob = ENCODED["stream", "zstd"]
    dec = kvwire.StreamDecoder()
    dec.feed(blob[:-1])
    list(dec.events())
    with pytest.raises(kvwire.TruncatedError) as info:  # KVW-LAYOUT-3
        dec.close()
    assert info.value.code == "TRUNCATED"
    dec = kvwire.StreamDecoder()
    dec.feed(blob + b"\0" * 40)
    list(dec.events())
    with pytest.raises(kvwire.LayoutError) as info:  # KVW-LAYOUT-4
        dec.close()
    assert info.value.code == "TRAILING_BYTES"


def test_bad_magic_is_rejected_from_the_first_byte():
    dec = kvwire.StreamDecoder()
    dec.feed(b"P")
    with pytest.raises(kvwire.MagicError):  # KVW-PRE-1
        list(dec.events())


def test_corrupt_body_is_rejected_before_its_event():
    blob = bytearray(ENCODED["stream", "raw"])
    with kvwire.open(bytes(blob)) as r:
        off = int(r.records[4]["offset"])
    blob[off + 3] ^= 0x10
    dec = kvwire.StreamDecoder()
    dec.feed(bytes(blob))
    with pytest.raises(kvwire.ChecksumError) as info:  # KVW-CSUM-1
        list(dec.events())
    assert info.value.code == "BODY_CHECKSUM"


def test_torch_backend_events():
    torch = pytest.importorskip("torch")
    dec = kvwire.StreamDecoder(backend="torch")
    dec.feed(ENCODED["file", "zstd"])
    chunks = [e for e in dec.events() if isinstance(e, kvwire.ChunkEvent)]
    assert all(isinstance(e.data, torch.Tensor) and e.data.dtype == torch.bfloat16 for e in chunks)
    assert dec.close() == "file"
