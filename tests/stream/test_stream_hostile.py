"""Hostile and stalled peers on the streaming receive paths (StreamDecoder in both input
styles, stream.LayerReader, stream.LayerWriter): declared lengths that no byte backs (KVW-LIM-8),
the header-implied decoded size (KVW-LIM-5, KVW-LIM-8), transport timeouts, and the
one-copy decoding of compressed chunks."""

import io
import os
import socket
import struct
import threading
import time
import tracemalloc

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

import kvwire
from forge import header_of, layout, refix_frame, wrap_header
from kvwire import stream
from kvwire.cache import placement
from kvwire.cache.decoder import REC_CODEC, REC_STORED, RECORD_STRUCT, ChunkEvent, StreamDecoder
from kvwire.codecs.zstd import decode_body
from kvwire.format.errors import CodecError, FormatError, LimitError, TruncatedError
from kvwire.format.header import Architecture, Header
from kvwire.stream.reader import implied_bytes
from kvwire.tools.synth import synth_cache


def zero_cache(layers=1, heads=1, dim=8, tokens=64, chunk=64):
    c = synth_cache(layers, heads, dim, tokens, chunk_tokens=chunk)
    for layer in c.layers:
        for x in layer.values():
            x[...] = 0  # compresses: the writer keeps zstd
    return c


ZSTD = kvwire.encode(zero_cache(), form="stream", codec="zstd")


def forged_stored_length(stored: int) -> bytes:
    """Preamble, header and the first chunk frame of a zstd stream, its ``stored_length``
    set to ``stored``: about 320 bytes declaring a body that never comes."""
    f0 = layout(ZSTD).frames[0]
    d = bytearray(ZSTD[: f0 + 64])
    rec = list(RECORD_STRUCT.unpack_from(d, f0 + 8))  # the frame's record follows marker and check
    assert rec[REC_CODEC] == 1  # zstd
    rec[REC_STORED] = stored
    RECORD_STRUCT.pack_into(d, f0 + 8, *rec)
    return refix_frame(bytes(d), f0)


def read_into(dec: StreamDecoder, data, step=1 << 30, close=True) -> list:
    """Drive the read-into style from ``data``, at most ``step`` bytes per call; at the end
    of ``data`` call ``close()`` (or, with ``close=False``, just return)."""
    events, pos, mv = [], 0, memoryview(data)
    while (targets := dec.read_targets()):
        got = 0
        for t in targets:
            n = min(t.nbytes, len(data) - pos, step - got)
            t[:n] = mv[pos : pos + n]
            pos, got = pos + n, got + n
            if n < t.nbytes:
                break
        if got == 0:
            if close:
                dec.close()
            break
        dec.filled(got)
        events += dec.events()
    return events


def peak_of(fn):
    """(result or exception, tracemalloc peak in bytes above the start) of ``fn()``."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        try:
            out = fn()
        except Exception as exc:  # the caller checks which
            out = exc
        return out, tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


# ---------------------------------------------------------------------------------------
# KVW-LIM-8: declared lengths do not size allocations
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("stored", [1 << 30, 1 << 40, (1 << 64) - 1])
@pytest.mark.parametrize("style", ["into", "feed", "reader"])
def test_lim8_declared_compressed_body_costs_no_memory(stored, style):
    """KVW-LIM-8: a 320-byte input whose frame declares a compressed body of 1 GiB, 1 TiB
    or 2^64 - 1 bytes waits for the bytes (TRUNCATED at the end of input) with bounded
    memory, in every receive path; never a MemoryError or OverflowError."""
    data = forged_stored_length(stored)
    assert len(data) <= 384

    def run():
        if style == "reader":
            return stream.LayerReader(io.BytesIO(data), prefetch=0).cache()
        dec = StreamDecoder()
        if style == "into":
            return read_into(dec, data)
        dec.feed(data)
        list(dec.events())
        return dec.close()

    out, peak = peak_of(run)
    assert isinstance(out, TruncatedError), out
    assert isinstance(out, FormatError)
    assert peak < placement.BODY_FIRST + (1 << 20)


def test_lim8_compressed_body_buffer_follows_the_bytes():
    """KVW-LIM-8: a compressed body's receive buffer grows as its bytes arrive (doubling
    from BODY_FIRST), so the memory held is within twice the bytes received plus
    BODY_FIRST, whatever the frame declares (here 1 TiB, followed by 20 MiB of bytes)."""
    head = forged_stored_length(1 << 40)
    dec = StreamDecoder()
    read_into(dec, head, close=False)
    assert dec._state == "body"
    junk = memoryview(bytes(20 << 20))
    held, pos = [], 0
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for stop in (1000, 3 << 20, 5 << 20, 9 << 20, 17 << 20, 20 << 20):
            while pos < stop:
                t = dec.read_targets()
                assert len(t) == 1  # no read-ahead past a body that is still growing
                n = min(t[0].nbytes, stop - pos)
                t[0][:n] = junk[pos : pos + n]
                dec.filled(n)
                assert list(dec.events()) == []
                pos += n
            held.append((pos, tracemalloc.get_traced_memory()[0] - base))
    finally:
        tracemalloc.stop()
    for got, mem in held:
        assert mem <= 2 * got + placement.BODY_FIRST + (64 << 10), (got, mem)
    assert held[-1][1] > 20 << 20  # the bytes that arrived are held
    assert "(20971520 of 1099511627776 bytes)" in dec.waiting_for()
    with pytest.raises(TruncatedError):
        dec.close()


ROUND = synth_cache(2, 2, 16, 300, chunk_tokens=128, seed=4)
for _layer in ROUND.layers:
    _layer["v"][..., 1::2] = 0  # compressible: zstd bodies of several hundred bytes
ROUND_ZSTD = kvwire.encode(ROUND, form="stream", codec="zstd")


@settings(max_examples=25, deadline=None)
@given(first=st.integers(1, 700), step=st.integers(1, 3000), placed=st.booleans())
def test_lim8_growing_body_round_trip(first, step, placed):
    """KVW-LIM-8 growth path: with a tiny first buffer every compressed body is received
    through one or more doublings, at any read size, and decodes to the cache."""
    dest = [{c: np.zeros_like(x) for c, x in layer.items()} for layer in ROUND.layers]
    place = (lambda L, c, t0, n: dest[L][c][:, t0 : t0 + n, :]) if placed else None
    saved, placement.BODY_FIRST = placement.BODY_FIRST, first
    try:
        events = read_into(StreamDecoder(placement=place, stop_at_end=True), ROUND_ZSTD, step)
    finally:
        placement.BODY_FIRST = saved
    chunks = [e for e in events if isinstance(e, ChunkEvent)]
    assert len(chunks) == 2 * 2 * 3
    for e in chunks:
        ref = ROUND.layers[e.layer][e.component][:, e.token_start : e.token_start + e.data.shape[1]]
        assert np.array_equal(np.asarray(ref).view(np.uint16), np.asarray(e.data).view(np.uint16))


def huge_header_stream(tokens=(1 << 31) - 1) -> bytes:
    """A container whose header implies 2^44 decoded bytes (within every count limit)."""
    h = Header(arch=Architecture.uniform(2, 8, 128), token_count=tokens, dtype="bf16", chunk_tokens=1 << 20)
    return wrap_header(header_of(h, check=True))


def test_lim8_reader_checks_the_header_implied_size_before_allocating():
    """KVW-LIM-8 / KVW-LIM-5: stream.LayerReader refuses a header implying more than
    max_decoded_bytes (default 64 GiB) with DECODED_SIZE_LIMIT before its receive buffer is
    allocated: no MemoryError, the buffer callable is never asked."""
    asked = []
    data = huge_header_stream()
    out, peak = peak_of(lambda: stream.LayerReader(io.BytesIO(data), prefetch=0, buffer=asked.append))
    assert isinstance(out, LimitError) and out.code == "DECODED_SIZE_LIMIT", out
    assert asked == [] and peak < (1 << 20)


def test_lim8_reader_limit_is_exact():
    """KVW-LIM-8: the header-implied size is the sum of raw_length over the chunks, so a
    limit of exactly that accepts the container and one byte less refuses it."""
    data = kvwire.encode(ROUND, form="stream")
    need = implied_bytes(kvwire.probe(data))
    assert need == sum(x.nbytes for layer in ROUND.layers for x in layer.values())
    cache = stream.LayerReader(io.BytesIO(data), max_decoded_bytes=need, prefetch=0).cache()
    assert cache.header.token_count == ROUND.header.token_count
    with pytest.raises(LimitError) as e:
        stream.LayerReader(io.BytesIO(data), max_decoded_bytes=need - 1, prefetch=0, buffer=lambda n: pytest.fail(f"allocated {n} bytes"))
    assert e.value.code == "DECODED_SIZE_LIMIT"
    for bad in (-1, 1.5, "64", True):
        with pytest.raises(ValueError, match="max_decoded_bytes"):
            stream.LayerReader(io.BytesIO(data), max_decoded_bytes=bad)


# ---------------------------------------------------------------------------------------
# One copy: compressed chunks decode straight into their final buffer
# ---------------------------------------------------------------------------------------

BIG = synth_cache(1, 8, 128, 8192, chunk_tokens=8192, seed=7)  # one 16 MiB chunk per component
for _x in BIG.layers[0].values():
    _x[..., 8:] = 0  # compresses well: the stored body is small next to the raw chunk
BIG_RAW = 8 * 128 * 8192 * 2
BIG_ZSTD = kvwire.encode(BIG, form="stream", codec="zstd")
BIG_STORED = layout(BIG_ZSTD).bodies[0][1]


def first_chunk_peak(dec: StreamDecoder, feed: bool):
    """Peak memory while the decoder produces the first chunk event (input already in)."""
    if feed:
        dec.feed(BIG_ZSTD)
    else:
        f0 = layout(BIG_ZSTD).frames[0]
        read_into(dec, BIG_ZSTD[: f0 + 64], close=False)  # header and first frame: the body is next
        assert dec._state == "body"
        return peak_of(lambda: read_into(dec, BIG_ZSTD[dec.received : f0 + 64 + BIG_STORED], close=False))
    assert dec.next_event() is not None  # the header
    return peak_of(dec.next_event)


def test_feed_decodes_zstd_without_a_second_copy():
    """A fed zstd chunk is decoded from the stream buffer straight into the buffer its
    event owns: peak memory about 1x the raw chunk (it was 2x and more: a copy of the
    stored bytes, the decompressor's output, then a writable copy of it)."""
    ev, peak = first_chunk_peak(StreamDecoder(), feed=True)
    assert isinstance(ev, ChunkEvent) and ev.data.flags.writeable
    assert np.array_equal(np.asarray(ev.data).view(np.uint16), BIG.layers[0][ev.component].view(np.uint16))
    assert peak < 1.15 * BIG_RAW, peak / BIG_RAW


@pytest.mark.parametrize("feed", [True, False])
def test_placed_zstd_decodes_straight_into_the_placement(feed):
    """With a placement, a zstd chunk is decompressed into the caller's tensor (one run per
    head of a token slice), in both input styles: no chunk-sized temporary at all."""
    dest = {c: np.zeros((8, 8192 + 64, 128), x.dtype) for c, x in BIG.layers[0].items()}  # heads' rows apart
    dec = StreamDecoder(placement=lambda L, c, t0, n: dest[c][:, t0 : t0 + n, :])
    out, peak = first_chunk_peak(dec, feed)
    # read-into: the compressed body's own receive buffer (growing, KVW-LIM-8) is the only large allocation
    assert peak < 0.1 * BIG_RAW + (0 if feed else 2 * BIG_STORED + placement.BODY_FIRST), (peak, BIG_STORED)
    assert BIG_STORED < 0.2 * BIG_RAW
    comp = "k" if np.any(dest["k"]) else "v"
    assert np.array_equal(dest[comp][:, :8192].view(np.uint16), BIG.layers[0][comp].view(np.uint16))


def small_block_frame(raw: bytes) -> bytes:
    """One zstd frame of many small blocks (a flush every 64 bytes), content size declared."""
    cobj = zstandard.ZstdCompressor(write_content_size=True).compressobj(size=len(raw))
    out = b"".join(cobj.compress(raw[i : i + 64]) + cobj.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK)
                   for i in range(0, len(raw), 64))
    return out + cobj.flush()


@pytest.mark.parametrize("frame", ["plain", "small_blocks", "checksum"])
def test_codec2_decode_into_out_and_pieces(frame):
    """KVW-CODEC-2 on the direct path: into one buffer or pieces, the same bytes; trailing
    bytes, a second or skippable frame, a short or long frame are still rejected."""
    raw = np.random.default_rng(1).integers(0, 4, 20000, dtype=np.uint8).tobytes()
    stored = {"plain": zstandard.ZstdCompressor(write_content_size=True).compress(raw),
              "checksum": zstandard.ZstdCompressor(write_content_size=True, write_checksum=True).compress(raw),
              "small_blocks": small_block_frame(raw)}[frame]
    out = bytearray(len(raw))
    assert decode_body("zstd", stored, len(raw), out) is out and out == raw
    pieces = [bytearray(7), bytearray(len(raw) - 107), bytearray(100)]
    decode_body("zstd", stored, len(raw), pieces)
    assert b"".join(pieces) == raw
    skippable = struct.pack("<II", 0x184D2A50, 0)
    for extra in (b"\0", b"x", stored[:4], stored[:12], stored, skippable):
        with pytest.raises(CodecError) as e:
            decode_body("zstd", stored + extra, len(raw), bytearray(len(raw)))
        assert e.value.code == "DECODE_FAILED"
    for cut in (1, 3, 40):
        with pytest.raises(CodecError) as e:
            decode_body("zstd", stored[:-cut], len(raw), bytearray(len(raw)))
        assert e.value.code in ("DECODE_FAILED", "DECODED_SIZE_MISMATCH")
    with pytest.raises(ValueError, match="out holds"):
        decode_body("zstd", stored, len(raw), bytearray(len(raw) - 1))


# ---------------------------------------------------------------------------------------
# Timeouts: a stalled peer raises StreamTimeout
# ---------------------------------------------------------------------------------------

SMALL = kvwire.encode(ROUND, form="stream")


@pytest.mark.parametrize("prefetch", [0, 2])
def test_reader_timeout_on_a_stalled_socket(prefetch):
    """stream.LayerReader(timeout=): a sender that stops mid-body raises StreamTimeout (a
    TimeoutError) naming what was awaited and how many bytes had arrived; the socket's
    own timeout is left as it was."""
    a, b = socket.socketpair()
    with a, b:
        cut = layout(SMALL).bodies[2][0] + 100
        a.sendall(SMALL[:cut])
        t = time.monotonic()
        with pytest.raises(stream.StreamTimeout) as e:
            stream.LayerReader(b, timeout=0.2, prefetch=prefetch).cache()
        assert time.monotonic() - t < 60  # timed out, did not hang (generous: a loaded CI machine)
        assert isinstance(e.value, TimeoutError) and e.value.timeout == 0.2
        assert e.value.transferred == cut
        msg = str(e.value)
        assert "0.2 s" in msg and f"{cut} bytes had arrived" in msg and "the body of chunk layer" in msg
        assert "(100 of" in msg
        assert b.gettimeout() is None


def test_reader_timeout_on_a_stalled_pipe_before_the_header():
    """A pipe that carries nothing: the constructor raises after the timeout."""
    r, w = os.pipe()
    try:
        os.write(w, SMALL[:10])
        t = time.monotonic()
        with pytest.raises(stream.StreamTimeout, match=r"the preamble \(bytes 10 of 32\); 10 bytes had arrived"):
            stream.LayerReader(r, timeout=0.1)
        assert time.monotonic() - t < 60  # timed out, did not hang (generous: a loaded CI machine)
        assert os.get_blocking(r)
    finally:
        os.close(r)
        os.close(w)


def test_reader_timeout_does_not_fire_on_a_slow_but_live_peer():
    """The timeout bounds each wait, not the transfer: a peer that keeps sending is read."""
    a, b = socket.socketpair()

    def trickle():
        for i in range(0, len(SMALL), len(SMALL) // 5 + 1):
            time.sleep(0.05)
            a.sendall(SMALL[i : i + len(SMALL) // 5 + 1])

    th = threading.Thread(target=trickle)
    th.start()
    with a, b:
        cache = stream.LayerReader(b, timeout=0.5).cache()
        th.join()
    assert cache.header.num_layers == ROUND.header.num_layers


def big_layer_cache():
    return synth_cache(1, 8, 128, 8192, chunk_tokens=1024, seed=2)  # 32 MiB: more than any socket buffer


@pytest.mark.parametrize("background", [False, True])
def test_writer_timeout_on_a_receiver_that_stops_reading(background):
    """stream.LayerWriter(timeout=): a receiver that takes nothing raises StreamTimeout from
    write_layer or close, saying what was being sent and how many bytes went out."""
    cache = big_layer_cache()
    a, b = socket.socketpair()
    with a, b:
        t = time.monotonic()
        w = stream.LayerWriter(a, cache.header, timeout=0.2, background=background)
        with pytest.raises(stream.StreamTimeout) as e:
            w.write_layer(0, **cache.layers[0])
            w.close()
        assert time.monotonic() - t < 10
        msg = str(e.value)
        assert "chunks of layer 0" in msg and "bytes had been sent" in msg
        assert 0 < e.value.transferred < 32 << 20
        assert a.gettimeout() is None


def test_writer_timeout_on_a_pipe_restores_blocking():
    """On a pipe the write end is non-blocking only during each write: a stall raises,
    and the descriptor is blocking again afterwards."""
    cache = big_layer_cache()
    r, w = os.pipe()
    try:
        wr = stream.LayerWriter(w, cache.header, timeout=0.1, background=False)
        with pytest.raises(stream.StreamTimeout, match="chunks of layer 0"):
            wr.write_layer(0, **cache.layers[0])
        assert os.get_blocking(w)
    finally:
        os.close(r)
        os.close(w)


def test_fanout_timeout():
    """fanout(timeout=): a sink that takes nothing fails the fan-out, the others finish."""
    shared = stream.encode_shared(big_layer_cache())
    a, b = socket.socketpair()
    good = io.BytesIO()
    with a, b:
        with pytest.raises(stream.StreamTimeout):
            stream.fanout(shared, [a], timeout=0.1)
        stream.fanout(shared, [good])
    assert len(good.getvalue()) == shared.nbytes


@pytest.mark.parametrize("bad", [0, -1, "1", True, float("nan")])
def test_timeout_misuse(bad):
    """A timeout that is not a positive number, or one on a source poll cannot watch,
    is a ValueError naming the valid choices."""
    with pytest.raises(ValueError, match="positive number of seconds or None"):
        stream.LayerReader(io.BytesIO(SMALL), timeout=bad)
    with pytest.raises(ValueError, match="positive number of seconds or None"):
        stream.LayerWriter(io.BytesIO(), ROUND.header, timeout=bad)


def test_timeout_needs_a_pollable_transport():
    with pytest.raises(ValueError, match="socket or a file descriptor"):
        stream.LayerReader(io.BytesIO(SMALL), timeout=1)
    with pytest.raises(ValueError, match="socket or a file descriptor"):
        stream.LayerWriter(io.BytesIO(), ROUND.header, timeout=1)
