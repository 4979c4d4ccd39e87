"""kvwire.stream: layer-wise transport, decode-phase segments, multi-target writes, stats;
and the StreamDecoder extensions they run on (read targets, placement, stop_at_end)."""

import io
import multiprocessing as mp
import os
import socket
import threading
import time
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvwire
from kvwire import stream
from kvwire.cache.decoder import RECORD_STRUCT, Placed
from kvwire.format.chunks import ChunkTable, check_record_fields
from kvwire.format.container import RECORD_DTYPE
from kvwire.format.errors import FormatError
from kvwire.tools.synth import synth_cache

CACHE = synth_cache(4, 2, 16, 300, chunk_tokens=128, seed=1)  # 3 chunks per component and layer
ENC = {(f, c): kvwire.encode(CACHE, form=f, codec=c) for f in ("stream", "file") for c in ("raw", "zstd")}
FORK = mp.get_context("fork")


def u16(x):
    return np.asarray(x).view(np.uint16)


def same_chunk(e):
    ref = CACHE.layers[e.layer][e.component][:, e.token_start : e.token_start + e.data.shape[1]]
    return np.array_equal(u16(ref), u16(e.data))


class Trickle(io.RawIOBase):
    """A source that returns at most ``step`` bytes per call, and counts the bytes taken."""

    def __init__(self, data, step):
        self.data, self.step, self.pos = memoryview(data), step, 0

    def readable(self):
        return True

    def readinto(self, b):
        n = min(len(b), self.step, len(self.data) - self.pos)
        b[:n] = self.data[self.pos : self.pos + n]
        self.pos += n
        return n


def placement_into(tensors):
    def place(layer, comp, t0, n):
        return tensors[layer][comp][:, t0 : t0 + n, :]
    return place


def empty_like_cache(cache):
    return [{c: np.zeros_like(x) for c, x in layer.items()} for layer in cache.layers]


# ---------------------------------------------------------------------------------------
# StreamDecoder: read targets, placement, stop_at_end
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("form,codec", sorted(ENC))
@pytest.mark.parametrize("placed", [False, True])
@settings(max_examples=8, deadline=None)
@given(step=st.integers(1, 5000))
def test_read_targets_any_read_size(form, codec, placed, step):
    blob = ENC[form, codec]
    dest = empty_like_cache(CACHE)
    dec = kvwire.StreamDecoder(placement=placement_into(dest) if placed else None)
    src, events = Trickle(blob, step), []
    while targets := dec.read_targets():
        n = src.readinto(targets[0])
        if not n:
            break
        dec.filled(n)
        events += dec.events()
    assert dec.close() == form
    chunks = [e for e in events if isinstance(e, kvwire.ChunkEvent)]
    assert len(chunks) == 24 and all(same_chunk(e) for e in chunks)
    if placed:
        assert all(np.array_equal(u16(d[c]), u16(x)) for d, layer in zip(dest, CACHE.layers) for c, x in layer.items())
        assert all(np.shares_memory(e.data, dest[e.layer][e.component]) for e in chunks)


@pytest.mark.parametrize("codec", ["raw", "zstd"])
@pytest.mark.parametrize("as_pieces", [False, True])
def test_feed_into_a_placement(codec, as_pieces):
    dest = empty_like_cache(CACHE)

    def place(layer, comp, t0, n):
        x = dest[layer][comp][:, t0 : t0 + n, :]
        return Placed(x, [memoryview(h.view(np.uint16)).cast("B") for h in x]) if as_pieces else x

    dec = kvwire.StreamDecoder(placement=place)
    dec.feed(ENC["file", codec])
    chunks = [e for e in dec.events() if isinstance(e, kvwire.ChunkEvent)]
    assert dec.close() == "file" and len(chunks) == 24
    assert all(np.array_equal(u16(d[c]), u16(x)) for d, layer in zip(dest, CACHE.layers) for c, x in layer.items())


def test_read_targets_never_read_past_the_end_frame():
    a, b = ENC["stream", "raw"], kvwire.encode(synth_cache(2, 1, 8, 20, chunk_tokens=16, seed=2), form="stream")
    src = io.BytesIO(a + b)
    for blob in (a, b):
        dec = kvwire.StreamDecoder(stop_at_end=True)
        while targets := dec.read_targets():
            dec.filled(src.readinto(targets[0]))
            list(dec.events())
        assert dec.done and src.tell() == (len(a) if blob is a else len(a) + len(b))
        assert dec.close() == "stream"


def test_feed_with_stop_at_end_keeps_the_next_container():
    nxt = ENC["stream", "zstd"]
    dec = kvwire.StreamDecoder(stop_at_end=True)
    dec.feed(ENC["stream", "raw"] + nxt[:100])
    assert isinstance(list(dec.events())[-1], kvwire.EndEvent)
    dec.feed(nxt[100:200])
    assert dec.unused_data == nxt[:200]
    assert dec.close() == "stream"


def test_input_styles_do_not_mix_and_placement_is_checked():
    dec = kvwire.StreamDecoder()
    dec.feed(ENC["stream", "raw"][:10])
    with pytest.raises(RuntimeError):
        dec.read_targets()
    dec = kvwire.StreamDecoder(placement=lambda *a: np.zeros((2, 5, 16), np.float32))
    dec.feed(ENC["stream", "raw"])
    with pytest.raises(ValueError, match="placement"):
        list(dec.events())


def test_read_targets_corrupt_body_is_rejected():
    blob = bytearray(ENC["stream", "raw"])
    with kvwire.open(bytes(blob)) as r:
        off = int(r.records[5]["offset"])
    blob[off + 1] ^= 1
    for prefetch in (0, 2):  # the caller's thread, and the receive thread
        with pytest.raises(kvwire.ChecksumError) as info:  # KVW-CSUM-1, checked in place
            list(stream.LayerReader(io.BytesIO(bytes(blob)), prefetch=prefetch))
        assert info.value.code == "BODY_CHECKSUM"
    dec = kvwire.StreamDecoder(placement=lambda *chunk: Placed(None, [memoryview(bytearray(10))]))
    dec.feed(bytes(blob))
    with pytest.raises(ValueError, match="do not hold"):  # Placed pieces must hold the raw length
        list(dec.events())


RECORDS = kvwire.open(ENC["stream", "zstd"]).records
HEADER = CACHE.header
TABLE = ChunkTable.of(HEADER)
FIELDS = [n for n in RECORD_DTYPE.names if n != "offset" and n != "checksum"]


@settings(max_examples=300, deadline=None)
@given(i=st.integers(0, len(RECORDS) - 1), edits=st.lists(
    st.tuples(st.sampled_from(FIELDS), st.sampled_from([0, 1, 2, 3, 7, 15, 16, 64, 127, 128, 255, 256, 300, 4096,
                                                        2 ** 16 - 1, 0xFF00])), max_size=3))
def test_fast_record_check_accepts_only_what_the_full_check_accepts(i, edits):
    rec = RECORDS[i : i + 1].copy()
    for name, value in edits:
        info = np.iinfo(RECORD_DTYPE[name])
        rec[name] = min(value, info.max)
    dec = kvwire.StreamDecoder()
    dec.feed(ENC["stream", "zstd"][: 32 + 4096])  # header only
    list(dec.events())
    fast = dec._fast_slot(RECORD_STRUCT.unpack(rec.tobytes()))
    try:
        full = int(check_record_fields(HEADER, TABLE, rec)[0])
    except FormatError:
        full = None
    if fast is not None:
        assert fast == full


# ---------------------------------------------------------------------------------------
# LayerWriter / LayerReader
# ---------------------------------------------------------------------------------------

def send_cache(sink, cache=CACHE, **kw):
    with stream.LayerWriter(sink, cache.header, **kw) as w:
        for i, layer in enumerate(cache.layers):
            w.write_layer(i, **layer)
    return w


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_socketpair_round_trip(prefetch, codec):
    a, b = socket.socketpair()
    with a, b:
        t = threading.Thread(target=send_cache, args=(a,), kwargs={"codec": codec})
        t.start()
        r = stream.LayerReader(b, prefetch=prefetch, link_gbps=10.0)
        got = r.cache()
        t.join()
    assert got.equal(CACHE)
    assert r.stats.bytes == len(kvwire.encode(CACHE, form="stream", codec=codec))
    assert sorted(r.stats.layer_s) == [0, 1, 2, 3] and 0 < r.stats.first_layer_s <= r.stats.seconds
    assert r.stats.gbps > 0 and r.stats.utilization == pytest.approx(r.stats.gbps / 10.0)


def mixed_cache(tokens=50, first_position=0):
    specs = (
        kvwire.LayerSpec("full_attention", 2, 8, 6),
        kvwire.LayerSpec("sliding_attention", 2, 8, 8, window=16),
        kvwire.LayerSpec("mla_latent", 1, 16, 0, kv_lora_rank=12, qk_rope_head_dim=4),
        kvwire.LayerSpec("shared", source_layer=0),
    )
    ranges = (kvwire.TokenRange(0, tokens), kvwire.TokenRange(tokens - 16, 16), kvwire.TokenRange(0, tokens),
              kvwire.TokenRange(0, 0))
    h = kvwire.Header(kvwire.Architecture(specs), token_count=tokens, dtype="f16", layer_tokens=ranges,
                      chunk_tokens=16, first_position=first_position)
    rng = np.random.default_rng(7)
    layers = [{c: rng.standard_normal(spec.shape(c, r.count)).astype(np.float16) for c in spec.components}
              for spec, r in zip(specs, ranges)]
    return kvwire.KVCache(h, layers)


@pytest.mark.parametrize("keep", [True, False])
def test_mixed_layer_kinds(keep):
    cache = mixed_cache()
    sink = io.BytesIO()
    send_cache(sink, cache)
    assert sink.getvalue() == kvwire.encode(cache, form="stream")
    r = stream.LayerReader(io.BytesIO(sink.getvalue()), keep=keep, prefetch=1)
    for layer in r:
        assert set(layer.tensors) == set(cache.layers[layer.index])
        for c, x in layer.tensors.items():
            assert np.array_equal(x, cache.layers[layer.index][c])
    if keep:
        assert r.cache().equal(cache)


def test_torch_backend_and_caller_buffer():
    torch = pytest.importorskip("torch")
    blob = ENC["stream", "raw"]
    slab = torch.empty(1 << 20, dtype=torch.uint8)
    r = stream.LayerReader(io.BytesIO(blob), backend="torch", buffer=slab)
    layers = list(r)
    assert all(isinstance(layer.k, torch.Tensor) and layer.k.dtype == torch.bfloat16 for layer in layers)
    assert layers[0].k.data_ptr() == slab.data_ptr()  # carved from the caller's buffer
    assert r.cache().equal(CACHE)
    with pytest.raises(ValueError, match="bytes"):
        stream.LayerReader(io.BytesIO(blob), buffer=bytearray(100))
    if torch.cuda.is_available():
        r = stream.LayerReader(io.BytesIO(blob), backend="torch", pin=True)
        assert next(iter(r)).k.is_pinned()
    else:
        with pytest.raises(RuntimeError, match="pin=True"):
            stream.LayerReader(io.BytesIO(blob), pin=True)


def test_ring_buffer_reuses_slots_and_needs_layer_order():
    r = stream.LayerReader(io.BytesIO(ENC["stream", "raw"]), keep=False, prefetch=1)
    seen = []
    for layer in r:
        assert np.array_equal(u16(layer.k), u16(CACHE.layers[layer.index]["k"]))
        seen.append(layer.k.__array_interface__["data"][0])
    assert seen[0] == seen[2] and seen[1] == seen[3] and seen[0] != seen[1]  # 2 slots
    # chunks interleaved across layers: fine with keep=True, refused by the ring
    enc = kvwire.Encoder(CACHE.header)
    bufs = enc.begin()
    for t0 in (0, 128, 256):
        for i, layer in enumerate(CACHE.layers):
            for c in ("k", "v"):
                bufs += enc.chunk(i, c, t0, layer[c][:, t0 : t0 + 128])
    blob = b"".join(bufs + enc.end(form="stream"))
    assert stream.LayerReader(io.BytesIO(blob)).cache().equal(CACHE)
    with pytest.raises(RuntimeError, match="layer"):
        list(stream.LayerReader(io.BytesIO(blob), keep=False))


def test_prefetch_bounds_read_ahead():
    big = synth_cache(6, 2, 16, 256, chunk_tokens=128, seed=3)
    a, b = socket.socketpair()
    with a, b:
        t = threading.Thread(target=send_cache, args=(a, big))
        t.start()
        r = stream.LayerReader(b, prefetch=1)
        it = iter(r)
        next(it)  # using layer 0: the receiver may complete layer 1, not 2
        time.sleep(0.3)
        assert r.layers_ready == 2
        rest = list(it)
        t.join()
    assert [x.index for x in rest] == [1, 2, 3, 4, 5]


def test_truncated_stream_and_empty_source():
    a, b = socket.socketpair()
    with a, b:
        w = stream.LayerWriter(a, CACHE.header)
        w.write_layer(0, **CACHE.layers[0])
        w.abort()  # no end frame (KVW-WRITE-2)
        a.shutdown(socket.SHUT_WR)
        r = stream.LayerReader(b)
        with pytest.raises(kvwire.TruncatedError):
            list(r)
    with pytest.raises(EOFError):
        stream.LayerReader(io.BytesIO(b""))
    with pytest.raises(ValueError, match="never written"):
        stream.LayerWriter(io.BytesIO(), CACHE.header).close()


def test_files_and_file_form(tmp_path):
    path = tmp_path / "c.kvws"
    with open(path, "wb") as f:
        send_cache(f)
    assert path.read_bytes() == ENC["stream", "raw"]
    with open(path, "rb", buffering=0) as f:  # FileIO: readv
        assert stream.LayerReader(f).cache().equal(CACHE)
    kvwire.save(tmp_path / "c.kvw", CACHE)
    with open(tmp_path / "c.kvw", "rb") as f:  # file form: tail read and checked
        r = stream.LayerReader(f, to_eof=True)
        assert r.cache().equal(CACHE) and r.form == "file"
    bad = bytearray(ENC["file", "raw"])
    bad[-40] ^= 1  # damage the index
    with pytest.raises(kvwire.FormatError):
        stream.LayerReader(io.BytesIO(bytes(bad)), to_eof=True).cache()


def _child_tcp(port, go):
    s = socket.create_connection(("127.0.0.1", port))
    with s, stream.LayerWriter(s, CACHE.header) as w:
        w.write_layer(0, **CACHE.layers[0])
        assert go.wait(20), "the receiver never used layer 0"  # the rest only after layer 0 was used
        for i in range(1, 4):
            w.write_layer(i, **CACHE.layers[i])


def _child_pipe(fd, go):
    with stream.LayerWriter(fd, CACHE.header) as w:
        w.write_layer(0, **CACHE.layers[0])
        assert go.wait(20), "the receiver never used layer 0"
        for i in range(1, 4):
            w.write_layer(i, **CACHE.layers[i])
    os.close(fd)


@pytest.mark.parametrize("transport", ["tcp", "pipe"])
def test_two_processes_layer_zero_usable_before_the_rest_is_sent(transport):
    go = FORK.Event()
    if transport == "tcp":
        srv = socket.create_server(("127.0.0.1", 0))
        p = FORK.Process(target=_child_tcp, args=(srv.getsockname()[1], go))
        p.start()
        source, _ = srv.accept()
        srv.close()
    else:
        rfd, wfd = os.pipe()
        p = FORK.Process(target=_child_pipe, args=(wfd, go))
        p.start()
        os.close(wfd)
        source = rfd
    try:
        r = stream.LayerReader(source)
        it = iter(r)
        first = next(it)
        assert r.layers_ready == 1 and np.array_equal(u16(first.k), u16(CACHE.layers[0]["k"]))
        go.set()
        assert [x.index for x in it] == [1, 2, 3]
        assert r.cache().equal(CACHE)
    finally:
        source.close() if transport == "tcp" else os.close(source)
        p.join(30)
    assert p.exitcode == 0


# ---------------------------------------------------------------------------------------
# Decode phase: segments
# ---------------------------------------------------------------------------------------

class CountingSink:
    def __init__(self):
        self.buf, self.writes = io.BytesIO(), 0

    def write(self, b):
        self.writes += 1
        return self.buf.write(b)


def decode_tokens(n, seed=0, layers=3, heads=2, dim=8):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((layers, heads, n, dim)).astype(np.float16)
    return k, -k


def test_decode_writer_sends_whole_chunks_and_partial_tails():
    header = kvwire.Header(kvwire.Architecture.uniform(3, 2, 8), dtype="f16", chunk_tokens=16, first_position=0,
                           token_count=10)
    k, v = decode_tokens(60)
    sink = CountingSink()
    w = stream.DecodeWriter(sink, header)  # continues at position 10
    sends = []
    for t in range(30):  # positions 10..39: full [10,16), full [16,32), then 8 staged
        before = sink.buf.tell()
        w.append([x[:, t] for x in k], [x[:, t] for x in v])
        sends.append(sink.buf.tell() != before)
    assert sum(sends) == 2 and w.segments == 2  # no I/O for the other 28 tokens
    assert w.flush() and not w.flush()  # partial [32, 40); nothing new to flush
    w.append(k[:, :, 30:40], v[:, :, 30:40])  # a block of tokens: [32, 48) full, supersedes
    w.close()  # partial [48, 50)
    segs = list(stream.read_segments(io.BytesIO(sink.buf.getvalue())))
    spans = [(s.header.first_position, s.header.first_position + s.header.token_count) for s in segs]
    assert spans == [(10, 16), (16, 32), (32, 40), (32, 48), (48, 50)]
    assert w.stats.calls == w.segments == 5  # one send per segment
    ra = stream.Reassembler()
    for s in segs:
        ra.add(s)
    assert (ra.start, ra.end, ra.partial) == (10, 50, True)
    got = ra.cache()
    assert got.header.first_position == 10 and got.header.token_count == 40
    for i in range(3):
        assert np.array_equal(got.layers[i]["k"], k[i, :, :40]) and np.array_equal(got.layers[i]["v"], v[i, :, :40])


def test_decode_writer_mixed_layer_kinds():
    base = mixed_cache().header
    rng = np.random.default_rng(3)
    toks = [{c: rng.standard_normal(spec.shape(c, 40)).astype(np.float16) for c in spec.components}
            for spec in base.arch.layers]
    sink = io.BytesIO()
    w = stream.DecodeWriter(sink, base)  # continues at position 50
    for t in range(40):
        w.append([x["k"][:, t] if "k" in x else None for x in toks], [x["v"][:, t] if "v" in x else None for x in toks],
                 latent=[x["latent"][:, t] if "latent" in x else None for x in toks])
    w.close()
    ra = stream.Reassembler()
    for seg in stream.read_segments(io.BytesIO(sink.getvalue())):
        ra.add(seg)
    assert (ra.start, ra.end, ra.partial) == (50, 90, True)  # [50,64) [64,80) [80,90)
    got = ra.cache()
    for i, layer in enumerate(toks):
        assert set(got.layers[i]) == set(layer)
        for c, x in layer.items():
            assert np.array_equal(got.layers[i][c], x)


def test_concatenated_containers_end_cleanly_or_fail():  # KVW-STREAM-3
    a, b = ENC["stream", "raw"], ENC["stream", "zstd"]
    assert [c.equal(CACHE) for c in stream.read_segments(io.BytesIO(a + b))] == [True, True]
    with pytest.raises(kvwire.MagicError):
        list(stream.read_segments(io.BytesIO(a + b"not a container" + bytes(40))))
    with pytest.raises(kvwire.TruncatedError):
        list(stream.read_segments(io.BytesIO(a + b[:-1])))


def test_segments_over_a_socket_and_reassembly_errors():
    header = kvwire.Header(kvwire.Architecture.uniform(3, 2, 8), dtype="f16", chunk_tokens=16)
    k, v = decode_tokens(40, seed=4)
    a, b = socket.socketpair()
    with a, b:
        w = stream.DecodeWriter(a, header)
        w.append(k[:, :, :20], v[:, :, :20])
        w.close()
        a.shutdown(socket.SHUT_WR)
        segs = list(stream.read_segments(b))
    assert [s.header.token_count for s in segs] == [16, 4]
    assert segs[1].header.first_position == 16

    def seg(s, n, **changes):
        h = header.replace(first_position=s, token_count=n, **changes)
        return kvwire.KVCache(h, [{"k": x[:, s : s + n], "v": y[:, s : s + n]} for x, y in zip(k, v)])

    ra = stream.Reassembler()
    ra.add(seg(0, 16))
    with pytest.raises(kvwire.LayoutError) as info:
        ra.add(seg(20, 4))  # a gap
    assert (info.value.code, info.value.rule) == ("SEGMENT_ORDER", "KVW-STREAM-6")
    with pytest.raises(kvwire.LayoutError) as info:
        ra.add(seg(0, 16))  # the previous segment was full: no supersede
    assert info.value.code == "SEGMENT_ORDER"
    ra.add(seg(16, 4))
    with pytest.raises(kvwire.LayoutError) as info:
        ra.add(seg(16, 2))  # supersedes, but shorter than what it replaces
    assert info.value.code == "SEGMENT_ORDER"
    with pytest.raises(kvwire.LayoutError) as info:
        ra.add(seg(20, 4, chunk_tokens=32))
    assert (info.value.code, info.value.rule) == ("SEGMENT_MISMATCH", "KVW-STREAM-5")
    ra.add(seg(16, 16))
    assert (ra.end, ra.partial) == (32, False)


# ---------------------------------------------------------------------------------------
# Multi-target writes
# ---------------------------------------------------------------------------------------

def test_fanout_to_file_socket_and_store_without_copies(tmp_path):
    cache = synth_cache(4, 4, 64, 1024, seed=5)  # 4 MiB of tensors
    expected = kvwire.encode(cache, form="stream")
    store = stream.MemorySink()
    freed = []
    shared = stream.encode_shared(cache, on_free=freed.append)
    assert shared.nbytes == len(expected) and shared.owned_nbytes < 64 << 10  # bodies are views
    recv_buf = bytearray(len(expected))
    a, b = socket.socketpair()

    def drain():
        mv, got = memoryview(recv_buf), 0
        while got < len(recv_buf):
            got += b.recv_into(mv[got:])

    t = threading.Thread(target=drain)
    t.start()
    f = open(tmp_path / "out.kvws", "wb")
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        stats = stream.fanout(shared, [f, a, store.sink("seq-1")], link_gbps=1.0)
        t.join()
        growth = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
        f.close()
        a.close()
        b.close()
    assert growth < len(expected) // 8, f"{growth} B allocated writing {len(expected)} B to 3 sinks"
    assert (tmp_path / "out.kvws").read_bytes() == expected and bytes(recv_buf) == expected
    assert store.get("seq-1").tobytes() == expected
    assert [s.bytes for s in stats] == [len(expected)] * 3 and all(s.utilization is not None for s in stats)
    assert shared.refcount == 2  # creator + store
    shared.release()
    assert not freed
    store.evict("seq-1")
    assert freed == [shared] and shared.freed
    with pytest.raises(RuntimeError):
        _ = shared.buffers


def test_shared_zstd_buffers_are_freed_by_the_last_holder():
    cache = synth_cache(2, 4, 64, 1024, seed=6)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        shared = stream.encode_shared(cache, codec="zstd")
        held = tracemalloc.get_traced_memory()[0] - base
        assert shared.owned_nbytes > 100_000 and held >= shared.owned_nbytes
        store = stream.MemorySink()
        stream.fanout(shared, [store.sink("a"), store.sink("b"), io.BytesIO()])
        assert tracemalloc.get_traced_memory()[0] - base < held + (64 << 10)  # nothing copied per sink
        shared.release()
        store.evict("a")
        assert not shared.freed
        store.evict("b")
        assert shared.freed
        owned = shared.owned_nbytes
        del shared
        assert tracemalloc.get_traced_memory()[0] - base < held - owned * 9 // 10  # the compressed bodies are gone
    finally:
        tracemalloc.stop()


def test_store_lookup_counts_hits_and_misses():
    store = stream.MemorySink()
    shared = stream.encode_shared(CACHE)
    for key in ("c0", "c1", "c2"):
        store.put(key, shared)
    assert store.lookup(["c0", "c1", "c2", "c3", "c4"]) == 3  # 3 hits, then a miss stops the prefix
    assert store.get("c9") is None and store.get("c0") is shared
    assert (store.hits, store.misses) == (4, 2) and store.hit_rate == pytest.approx(4 / 6)
    assert len(store) == 3 and "c1" in store


def test_writer_stats_and_layer_marks():
    sink = io.BytesIO()
    w = send_cache(sink, link_gbps=2.0)
    s = w.stats
    assert s.bytes == len(sink.getvalue()) == len(ENC["stream", "raw"])
    assert sorted(s.layer_s) == [0, 1, 2, 3] and s.seconds > 0 and s.utilization is not None
    assert set(s.as_dict()) >= {"bytes", "seconds", "gbps", "utilization"} and "GB/s" in str(s)
