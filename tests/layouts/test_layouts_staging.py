"""The device path on the CPU: the pinned staging ring with simulated asynchronous copies.

``SimulatedStream`` runs launched copies later, on a worker thread, after a delay, like a
device stream. A checking ring snapshots each staging slot when a copy is launched and
compares when the copy runs: the host must never have written a slot a pending copy
still reads. A ring that does not wait is caught (negative control).
"""

from __future__ import annotations

import numpy as np
import pytest

import forge
import kvwire
from kvwire.format import registry as R

torch = pytest.importorskip("torch")
from kvwire import layouts
from kvwire.cache.cuda import SimulatedStream, StagingRing
from kvwire.cache.device_load import load_to_device


class CheckingRing(StagingRing):
    """Records every copy that found its staging slot changed since launch."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.overwritten = 0

    def launch(self, slot, fn, keep=None):
        host = self.host[slot]
        snapshot = host.clone()

        def checked():
            if not torch.equal(host, snapshot):
                self.overwritten += 1
            fn()

        return super().launch(slot, checked, keep)


class CarelessRing(CheckingRing):
    def acquire(self, nbytes):  # hands out slots without waiting for their copies
        i = self._next
        self._next = (i + 1) % self.slots
        return i


def _equal(a: kvwire.KVCache, b: kvwire.KVCache) -> bool:
    return forge.cache_bytes_equal(a, b)


@pytest.mark.parametrize("codec", ["raw", "zstd"])
@pytest.mark.parametrize("form", ["file", "stream"])
def test_load_through_the_ring_is_bit_exact_and_never_overwrites_a_pending_slot(codec, form):
    with SimulatedStream(delay=0.002) as stream:
        for dtype in ("bf16", "f8_e4m3fn", "f32"):
            cache = forge.small_cache(3, 2, 16, 70, dtype=dtype, chunk_tokens=16, compressible=codec == "zstd",
                                      head_dim_v=8, seed=11)
            data = kvwire.encode(cache, form=form, codec=codec)
            ring = CheckingRing(stream, 1, 2)
            with kvwire.open(data) as r:
                loaded = load_to_device(r, "cpu", ring=ring)
            assert loaded.header == cache.header and _equal(loaded, cache), dtype
            assert ring.overwritten == 0 and ring.waits > 0  # the ring did have to wait for copies


def test_a_ring_that_does_not_wait_is_caught():
    cache = forge.small_cache(2, 2, 16, 200, dtype="bf16", chunk_tokens=16, seed=1)
    with SimulatedStream(delay=0.002) as stream, kvwire.open(kvwire.encode(cache)) as r:
        ring = CarelessRing(stream, 1, 2)
        loaded = load_to_device(r, "cpu", ring=ring)
    assert ring.overwritten > 0 or not _equal(loaded, cache)


def test_one_ring_is_reused_across_loads_and_grows():
    with SimulatedStream() as stream:
        ring = StagingRing(stream, 64, 3)
        small, big = forge.small_cache(tokens=20, seed=1), forge.small_cache(heads=4, tokens=90, seed=2)
        for cache in (small, big, small):
            with kvwire.open(kvwire.encode(cache)) as r:
                assert _equal(load_to_device(r, "cpu", ring=ring), cache)
        assert ring.slot_bytes == max(int(x) for x in kvwire.open(kvwire.encode(big)).records["raw_length"])


def test_registered_buffers_are_copied_without_staging(tmp_path):
    cache = forge.small_cache(2, 2, 16, 50, dtype="f16", seed=4)
    kvwire.save(tmp_path / "c.kvw", cache)
    with SimulatedStream(delay=0.001) as stream, kvwire.open(tmp_path / "c.kvw") as r:
        ring = CheckingRing(stream, 1, 2)
        loaded = load_to_device(r, "cpu", ring=ring, registered=True)
        assert _equal(loaded, cache) and stream.launched >= r.chunk_count
        assert ring.waits == 0  # nothing went through the staging slots


@pytest.mark.parametrize("name", ["vllm.v0_9_1_to_0_22.flash_hnd", "sglang.mha", "vllm.v0_7_1_to_0_28.mla"])
@pytest.mark.parametrize("registered", [False, True])
def test_scatter_through_the_ring_layer_by_layer(name, registered):
    from test_layouts import SPECS, _bind, _bytes, _ids, _pos

    make, ref, kw = SPECS[name]
    gen = torch.Generator().manual_seed(2)
    bufs, st = make(torch.bfloat16, gen, None)
    src = _bind(name, bufs, kw)
    ids = _ids(name, 13, np.random.default_rng(0))
    data = layouts.encode_from_engine(src, ids, 13, chunk_tokens=3)
    bufs2, st2 = make(torch.bfloat16, gen, 0)
    dst = _bind(name, bufs2, kw)
    ids2 = _ids(name, 13, np.random.default_rng(1))
    with SimulatedStream(delay=0.003) as stream, kvwire.open(data) as r:
        ring = CheckingRing(stream, 1, 2, device_mirror=True)
        handle = dst.scatter(r, ids2, ring=ring, registered=registered)
        assert not handle.done()  # asynchronous: copies are still pending
        handle.wait_layer(0)
        for comp in r.header.arch.layers[0].components:
            for t in range(13):
                assert np.array_equal(_bytes(ref(st2, 0, comp, _pos(name, ids2, t))),
                                      _bytes(ref(st, 0, comp, _pos(name, ids, t))))
        handle.synchronize()
        assert handle.done() and ring.overwritten == 0
    again = layouts.gather(dst, ids2, 13)
    for layer, want in enumerate(layouts.gather(src, ids, 13)):
        for comp in want:
            assert np.array_equal(_bytes(again[layer][comp]), _bytes(want[comp]))


def test_scatter_to_a_device_needs_a_mirrored_ring():
    cache_buf = [torch.zeros((2, 4, 4, 1, 8), dtype=torch.float16)]
    eb = layouts.bind("vllm.v0_4_3_to_0_22.flash_nhd", cache_buf, num_heads=1, block_size=4)
    data = layouts.encode_from_engine(eb, [0], 4)
    with SimulatedStream() as stream, kvwire.open(data) as r, pytest.raises(ValueError, match="device_mirror"):
        eb.scatter(r, [1], ring=StagingRing(stream, 64, 2))


def test_load_to_device_needs_a_device_or_a_stream():
    with kvwire.open(kvwire.encode(forge.small_cache())) as r, pytest.raises(ValueError, match="stream"):
        load_to_device(r, "cpu")


def test_every_dtype_through_the_ring():
    with SimulatedStream() as stream:
        for dtype in sorted(R.DTYPES):
            cache = forge.small_cache(1, 1, 8, 9, dtype=dtype, chunk_tokens=4, seed=3)
            with kvwire.open(kvwire.encode(cache)) as r:
                assert _equal(load_to_device(r, "cpu", stream=stream), cache), dtype
