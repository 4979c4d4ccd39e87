"""The fast paths of save and load: same bytes and same errors as the plain ones.

``save`` writes through ``writev.write_all`` (a container under one batch on the calling
thread, larger ones in batches to a writer thread) and the encoder packs records
without numpy scalars; ``Reader.layer(out=)`` checksums each raw
chunk and copies it from the view of the container while it is in the CPU caches
(``tensors.copy_raw``). These tests check the bytes on disk, the tensors placed in
caller buffers (strided windows and torch tensors too), and that a bad checksum or frame
is still reported, for the first bad chunk in order.
The speed itself is measured by benchmarks/bench_core.py, never here.
"""

import functools
import io
import os
import threading

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import forge
import kvwire
from kvwire.cache import encoder, files, writev
from kvwire.format.container import FRAME_SIZE


def _chunk_offsets(data: bytes):
    with kvwire.open(data) as r:
        return [(r.info(i).offset, r.info(i).stored_length, r.info(i).checksum) for i in range(r.chunk_count)]


BATCH = 64 << 10  # batch_bytes of the write_all tests: several batches, and the writer thread


# -- encoder pieces -----------------------------------------------------------------------


def test_body_pieces_are_one_zero_copy_view_per_head():
    a = np.arange(3 * 8 * 4, dtype=np.uint16).reshape(3, 8, 4)
    whole = encoder.body_pieces(a)
    assert [bytes(p) for p in whole] == [a[h].tobytes() for h in range(3)]
    part = encoder.body_pieces(a[:, 2:5, :])
    assert len(part) == 3 and b"".join(map(bytes, part)) == np.ascontiguousarray(a[:, 2:5, :]).tobytes()
    assert all(np.frombuffer(p, np.uint16).ctypes.data == a[h, 2:5].ctypes.data for h, p in enumerate(part))
    one = encoder.body_pieces(a[:, 3:4, :])  # one token per head
    assert b"".join(map(bytes, one)) == a[:, 3, :].tobytes()
    strided = encoder.body_pieces(a[:, :, ::2])  # inner stride: each head copied to be contiguous
    assert b"".join(map(bytes, strided)) == np.ascontiguousarray(a[:, :, ::2]).tobytes()


@pytest.mark.parametrize("chunk_tokens", [8, 16, 64])
def test_checksums_are_xxh3_of_each_stored_body(chunk_tokens):
    """Chunks shorter than, or as long as, their layer."""
    cache = forge.small_cache(layers=2, heads=3, head_dim=8, tokens=40, chunk_tokens=chunk_tokens, compressible=False)
    data = kvwire.encode(cache)
    for off, length, checksum in _chunk_offsets(data):
        assert xxhash.xxh3_64_intdigest(data[off : off + length]) == checksum
    with kvwire.open(data) as r:
        r.validate()
        assert forge.cache_bytes_equal(r.load(), cache)


# -- write_all ----------------------------------------------------------------------------


def test_write_all_writes_every_buffer_in_order_across_batches(tmp_path):
    rng = np.random.default_rng(1)
    sizes = [0, 1, 7, BATCH - 3, 0, 5, BATCH * 3, 4096, 1, 2 * BATCH + 11]
    bufs = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes] + [b"tail"]
    path = tmp_path / "w.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        n = files.write_all(fd, iter(bufs), batch_bytes=BATCH)
    finally:
        os.close(fd)
    want = b"".join(bytes(memoryview(b)) for b in bufs)
    assert n == len(want) and path.read_bytes() == want


def test_write_all_many_small_buffers_beyond_iov_max(tmp_path):
    bufs = [bytes([i % 251]) * (1 + i % 3) for i in range(5000)]
    path = tmp_path / "w.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        files.write_all(fd, bufs)  # few bytes, but more buffers than one writev takes: several batches
    finally:
        os.close(fd)
    assert path.read_bytes() == b"".join(bufs)


def test_write_all_small_container_needs_no_thread(tmp_path, monkeypatch):
    def no_thread(*a, **k):
        raise AssertionError("a writer thread for less than one batch")

    monkeypatch.setattr(writev.threading, "Thread", no_thread)
    cache = forge.small_cache(compressible=False)
    path = tmp_path / "s.kvw"
    assert kvwire.save(path, cache) == path.stat().st_size
    assert path.read_bytes() == kvwire.encode(cache)
    ro = tmp_path / "ro.bin"
    ro.write_bytes(b"")
    fd = os.open(ro, os.O_RDONLY)
    try:
        with pytest.raises(OSError):
            files.write_all(fd, [b"x" * 100])
    finally:
        os.close(fd)


def test_write_all_reports_the_writer_threads_error(tmp_path):
    path = tmp_path / "ro.bin"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDONLY)  # writev fails with EBADF in the writer thread
    try:
        with pytest.raises(OSError):
            files.write_all(fd, [b"x" * 1000] * 1000, batch_bytes=BATCH)
    finally:
        os.close(fd)


def test_write_all_stops_when_the_producer_fails(tmp_path):
    def buffers():
        yield b"a" * (BATCH + 1)
        raise RuntimeError("producer failed")

    fd = os.open(tmp_path / "p.bin", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with pytest.raises(RuntimeError, match="producer failed"):
            files.write_all(fd, buffers(), batch_bytes=BATCH)
    finally:
        os.close(fd)


# -- the threaded save path: same bytes as the plain one, old file kept on failure --------


def _threaded(monkeypatch):
    """save through write_all in small batches, so the writer thread runs."""
    monkeypatch.setattr(files, "write_all", functools.partial(writev.write_all, batch_bytes=BATCH))


@pytest.mark.parametrize("codec", ["raw", "zstd", "int8", "byteplane"])
@pytest.mark.parametrize("fsync", [False, True])
def test_threaded_save_is_byte_identical_to_the_plain_paths(tmp_path, monkeypatch, codec, fsync):
    cache = forge.small_cache(layers=3, heads=4, head_dim=32, tokens=200, chunk_tokens=32, compressible=True)
    plain = io.BytesIO()  # the file-object path: one write per buffer, no thread
    kvwire.save(plain, cache, codec=codec)
    _threaded(monkeypatch)
    seen = []
    real = writev.os.writev
    monkeypatch.setattr(writev.os, "writev", lambda fd, b: (seen.append(threading.current_thread()), real(fd, b))[1])
    path = tmp_path / "t.kvw"
    size = kvwire.save(path, cache, codec=codec, fsync=fsync)
    assert any(t is not threading.current_thread() for t in seen)  # the writer thread wrote
    assert path.read_bytes() == plain.getvalue() == kvwire.encode(cache, codec=codec) and size == len(plain.getvalue())


@pytest.mark.parametrize("where", ["producer", "writer"])
@pytest.mark.parametrize("tmpfile", [True, False])
def test_failure_mid_save_leaves_the_old_file_intact(tmp_path, monkeypatch, where, tmpfile):
    old_cache = forge.small_cache(layers=2, heads=2, head_dim=16, tokens=64, seed=1, compressible=False)
    new_cache = forge.small_cache(layers=3, heads=4, head_dim=32, tokens=200, chunk_tokens=32, seed=2,
                                  compressible=False)
    path = tmp_path / "c.kvw"
    kvwire.save(path, old_cache)
    old = path.read_bytes()
    monkeypatch.setattr(files, "USE_O_TMPFILE", tmpfile and files.USE_O_TMPFILE)
    _threaded(monkeypatch)
    calls = []
    if where == "producer":  # the encoder fails after several batches went to the writer thread
        real_chunk = encoder.Encoder.chunk

        def chunk(self, *a, **k):
            calls.append(1)
            if len(calls) == 20:
                raise RuntimeError("encoder failed mid-save")
            return real_chunk(self, *a, **k)

        monkeypatch.setattr(encoder.Encoder, "chunk", chunk)
    else:  # the kernel refuses a later batch (ENOSPC)
        real = writev.os.writev

        def writev_(fd, b):
            calls.append(1)
            if len(calls) == 3:
                raise OSError(28, "No space left on device")
            return real(fd, b)

        monkeypatch.setattr(writev.os, "writev", writev_)
    with pytest.raises((RuntimeError, OSError)):
        kvwire.save(path, new_cache)
    assert len(calls) >= 3 and path.read_bytes() == old
    assert sorted(os.listdir(tmp_path)) == ["c.kvw"]  # no temporary file left behind


# -- save round trips (property) ----------------------------------------------------------


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layers=st.integers(1, 3), heads=st.integers(1, 4), head_dim=st.sampled_from([4, 8, 16]),
       tokens=st.integers(1, 70), chunk_tokens=st.sampled_from([8, 16, 32, 128]),
       dtype=st.sampled_from(["f16", "bf16", "f32", "f8_e4m3fn"]), seed=st.integers(0, 2**16))
def test_save_writes_encode_bytes_and_layer_out_round_trips(tmp_path, layers, heads, head_dim, tokens, chunk_tokens,
                                                            dtype, seed):
    cache = forge.small_cache(layers, heads, head_dim, tokens, dtype=dtype, chunk_tokens=chunk_tokens, seed=seed,
                              compressible=False)
    path = tmp_path / "c.kvw"
    size = kvwire.save(path, cache)
    data = path.read_bytes()
    assert size == len(data) and data == kvwire.encode(cache)
    with kvwire.open(path) as r:
        for i, layer in enumerate(cache.layers):
            out = {c: np.zeros_like(x) for c, x in layer.items()}
            assert r.layer(i, out=out) is out
            for c, x in layer.items():
                assert out[c].view(np.uint8).tobytes() == x.view(np.uint8).tobytes()


# -- layer(out=) into caller buffers --------------------------------------------------------


def _big_cache():
    return forge.small_cache(layers=2, heads=4, head_dim=16, tokens=96, chunk_tokens=16, compressible=False)


def test_layer_out_copies_every_chunk():
    cache = _big_cache()
    with kvwire.open(kvwire.encode(cache)) as r:
        got = [r.layer(i, out={c: np.full_like(x, 7) for c, x in layer.items()}) for i, layer in enumerate(cache.layers)]
        assert forge.cache_bytes_equal(kvwire.KVCache(cache.header, got), cache)
        assert forge.cache_bytes_equal(r.load(), cache)


def test_layer_out_into_strided_caller_views():
    """Caller buffers that are token windows of larger engine tensors (store/layerwise.py)."""
    cache = _big_cache()
    with kvwire.open(kvwire.encode(cache)) as r:
        for i, layer in enumerate(cache.layers):
            big = {c: np.zeros((x.shape[0], x.shape[1] + 10, x.shape[2]), x.dtype) for c, x in layer.items()}
            r.layer(i, out={c: b[:, 5 : 5 + layer[c].shape[1], :] for c, b in big.items()})
            for c, x in layer.items():
                assert big[c][:, 5:-5].view(np.uint8).tobytes() == x.view(np.uint8).tobytes()
                assert not big[c][:, :5].any() and not big[c][:, -5:].any()


def _corrupt(data: bytes, chunks) -> bytes:
    buf = bytearray(data)
    offsets = _chunk_offsets(data)
    for i in chunks:
        buf[offsets[i][0] + 3] ^= 0x40
    return bytes(buf)


@pytest.mark.parametrize("bad", [[0], [1], [5], [3, 6], [2, 5, 7]])
def test_layer_out_reports_the_first_bad_chunk(bad):
    cache = _big_cache()  # layer 0: chunks 0-5 (k), 6-11 (v)
    data = _corrupt(kvwire.encode(cache), bad)
    with kvwire.open(data) as r:
        out = {c: np.zeros_like(x) for c, x in cache.layers[0].items()}
        with pytest.raises(kvwire.ChecksumError, match=rf"chunk {min(bad)} \(layer 0\)"):
            r.layer(0, out=out)
        r.layer(0, out=out, verify=False)  # unverified: the bytes as stored, flipped bit included
        k = out["k"].view(np.uint8)
        assert not np.array_equal(k, cache.layers[0]["k"].view(np.uint8))


def test_load_reports_checksum_and_ignores_it_unverified():
    cache = _big_cache()
    data = _corrupt(kvwire.encode(cache), [13])  # layer 1
    with pytest.raises(kvwire.ChecksumError):
        kvwire.load(data)
    loaded = kvwire.load(data, verify=False)
    assert not forge.cache_bytes_equal(loaded, cache)  # the flipped bit arrived
    assert loaded.layers[0]["k"].view(np.uint8).tobytes() == cache.layers[0]["k"].view(np.uint8).tobytes()


def test_layer_out_torch_cpu_buffers():
    torch = pytest.importorskip("torch")
    cache = forge.small_cache(layers=1, heads=2, head_dim=8, tokens=64, dtype="bf16", chunk_tokens=16,
                              compressible=False)
    with kvwire.open(kvwire.encode(cache)) as r:
        out = {c: torch.zeros(x.shape, dtype=torch.bfloat16) for c, x in cache.layers[0].items()}
        r.layer(0, out=out)
        for c, x in cache.layers[0].items():
            assert out[c].view(torch.int16).numpy().tobytes() == x.view(np.uint16).tobytes()


def test_frame_is_checked_once_per_chunk():
    """A frame that disagrees with the index is still refused (KVW-FILE-4)."""
    cache = _big_cache()
    data = bytearray(kvwire.encode(cache))
    off = _chunk_offsets(bytes(data))[4][0]
    data[off - FRAME_SIZE + 40] ^= 0x01  # inside the frame's record: its self-check fails
    with kvwire.open(bytes(data)) as r, pytest.raises(kvwire.FormatError):
        r.layer(0, out={c: np.zeros_like(x) for c, x in cache.layers[0].items()})
