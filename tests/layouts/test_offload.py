"""The offload ring on the CPU, with simulated asynchronous device->host copies.

Pointers: ``end`` (planned offload boundary), ``current`` (offloaded so far), ``start``
(pages handed back to the engine), plus the encoder's ``released``.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import kvwire

torch = pytest.importorskip("torch")
from kvwire import layouts
from kvwire.cache.cuda import SimulatedStream
from kvwire.layouts import OffloadRing, RingFullError

L, B, N, H, C = 2, 12, 4, 2, 8
DELAY = 0.06


def engine(seed=0, layout="vllm.v0_9_1_to_0_22.flash_hnd"):
    gen = torch.Generator().manual_seed(seed)
    raw = [torch.randint(0, 256, (2, B, H, N, C * 2), dtype=torch.uint8, generator=gen).view(torch.bfloat16)
           for _ in range(L)]
    return raw, layouts.bind(layout, raw, num_heads=H, block_size=N)


def decoded_equals_engine(data, eb, blocks, tokens) -> bool:
    want = layouts.gather(eb, blocks, tokens)
    with kvwire.open(data) as r:
        return all(np.array_equal(r.layer(i)[c].view(np.uint16), want[i][c].contiguous().view(torch.int16).numpy()
                                  .view(np.uint16)) for i in range(L) for c in want[i])


@pytest.fixture
def stream():
    with SimulatedStream(delay=DELAY) as s:
        yield s


def test_allocation_past_current_waits_for_the_offload(stream):
    raw, eb = engine()
    ring = OffloadRing(eb, 8, stream=stream)
    saved = [t.clone() for t in raw]
    pos = ring.plan([5, 1, 9])
    assert (ring.start, ring.current, ring.end) == (0, 0, 3)  # planned, not yet offloaded
    t = time.perf_counter()
    assert ring.allocate(2) == [5, 1]  # past current: waits for the copies
    assert time.perf_counter() - t >= DELAY * 0.8
    assert ring.current == 3 and ring.start == 2 and ring.stats["alloc_waits"] == 1
    for x in raw:  # the engine reuses its blocks at once: the ring already holds their content
        x.view(torch.uint8).fill_(0)
    data = b"".join(ring.iter_buffers(pos, 3 * N - 1))
    ring.release(pos.stop)
    saved_eb = layouts.bind("vllm.v0_9_1_to_0_22.flash_hnd", saved, num_heads=H, block_size=N)
    assert decoded_equals_engine(data, saved_eb, [5, 1, 9], 3 * N - 1)
    with pytest.raises(ValueError, match="planned offload boundary"):
        ring.allocate(2)  # only block 9 is planned


def test_planning_ahead_means_allocations_do_not_wait(stream):
    _, eb = engine()
    ring = OffloadRing(eb, 8, stream=stream)
    ring.plan([0, 1, 2, 3])  # end - start = 4: memory spent so that allocation finds pages offloaded
    ring.wait(ring.end)
    assert ring.allocate(4) == [0, 1, 2, 3]
    assert ring.stats["alloc_waits"] == 0  # no wall-clock bound: a loaded machine stalls anything


def test_wrap_around(stream):
    _, eb = engine(1)
    ring = OffloadRing(eb, 4, stream=stream)
    first = ring.plan([0, 1, 2])
    first_bytes = b"".join(ring.iter_buffers(first, 3 * N))
    ring.release(first.stop)
    copies = ring.stats["copies"]
    second = ring.plan([7, 3, 11])  # positions 3, 4, 5 -> slots 3, 0, 1
    assert list(ring.slots(second)) == [3, 0, 1] and ring.stats["copies"] == copies + 2  # split at the wrap
    data = b"".join(ring.iter_buffers(second, 3 * N - 2))
    assert decoded_equals_engine(data, eb, [7, 3, 11], 3 * N - 2)
    assert decoded_equals_engine(first_bytes, eb, [0, 1, 2], 3 * N)


def test_pages_not_yet_encoded_are_never_overwritten(stream):
    _, eb = engine(2)
    ring = OffloadRing(eb, 4, stream=stream)
    pos = ring.plan([0, 1, 2, 3])
    ring.wait(pos.stop)
    before = ring.buffer.clone()
    with pytest.raises(RingFullError):
        ring.plan([4], timeout=0.05)
    done = threading.Event()
    worker = threading.Thread(target=lambda: (ring.plan([4, 5]), done.set()))
    worker.start()
    time.sleep(0.1)
    assert not done.is_set() and ring.stats["plan_waits"] == 2  # waiting for the encoder
    assert torch.equal(ring.buffer.view(torch.uint8), before.view(torch.uint8))
    ring.release(1)  # only one page encoded: still no room for two
    time.sleep(0.05)
    assert not done.is_set()
    ring.release(2)
    worker.join(5)
    assert done.is_set()
    ring.wait(ring.end)
    # slots 0 and 1 now hold blocks 4 and 5; pages 2 and 3 (not yet encoded) are intact
    assert torch.equal(ring.buffer[2:].view(torch.uint8), before[2:].view(torch.uint8))
    assert not torch.equal(ring.buffer[:2].view(torch.uint8), before[:2].view(torch.uint8))
    with pytest.raises(ValueError, match="outside the live pages"):
        ring.slots(range(0, 2))  # released pages are gone


def test_encoding_reads_straight_from_the_ring(stream, tmp_path):
    _, eb = engine(3)
    ring = OffloadRing(eb, 6, stream=stream)
    pos = ring.plan([10, 4, 6, 0])
    base = ring.buffer.untyped_storage().data_ptr()
    end = base + ring.buffer.untyped_storage().nbytes()
    bodies = inside = 0
    buffers = list(ring.iter_buffers(pos, 4 * N - 3))  # chunk_tokens = page tokens: every body is a view
    for buf in buffers:
        if isinstance(buf, memoryview) and buf.nbytes in (N * C * 2, (N - 3) * C * 2):  # one head of a chunk
            bodies += 1
            inside += base <= np.frombuffer(buf, np.uint8).ctypes.data < end
    assert bodies == 4 * L * 2 * H and inside == bodies  # per head, per chunk: all zero-copy
    data = b"".join(buffers)
    assert decoded_equals_engine(data, eb, [10, 4, 6, 0], 4 * N - 3)
    with kvwire.open(data) as r:
        assert r.header.chunk_tokens == N and r.header.engine_layout.name == "vllm.v0_9_1_to_0_22.flash_hnd"
    # save(): writes atomically, then releases
    size = ring.save(tmp_path / "r.kvw", pos, 4 * N - 3, chunk_tokens=2 * N)
    assert size == (tmp_path / "r.kvw").stat().st_size and ring.released == pos.stop
    assert decoded_equals_engine((tmp_path / "r.kvw").read_bytes(), eb, [10, 4, 6, 0], 4 * N - 3)


def test_release_cannot_pass_the_offloaded_pages(stream):
    _, eb = engine()
    ring = OffloadRing(eb, 4, stream=stream)
    gate = threading.Event()
    stream.launch(gate.wait)  # the stream is busy: the page's copy cannot have run
    ring.plan([1])
    with pytest.raises(ValueError, match="past the offloaded pages"):
        ring.release(1)
    gate.set()
    ring.wait(1)
    ring.release(1)


@pytest.mark.parametrize("layout", ["vllm.v0_7_1_to_0_28.mla", "sglang.mha", "sglang.mla"])
def test_other_engines(layout):
    gen = torch.Generator().manual_seed(4)
    if layout == "vllm.v0_7_1_to_0_28.mla":
        bufs = [torch.randint(0, 256, (B, N, 24), dtype=torch.uint8, generator=gen) for _ in range(L)]
        eb, pages, kw = layouts.bind(layout, [b.view(torch.float8_e4m3fn) for b in bufs], kv_lora_rank=16), [3, 7], {}
    elif layout == "sglang.mha":
        bufs = {c: [torch.randint(0, 256, (B * N, H, C), dtype=torch.uint8, generator=gen) for _ in range(L)]
                for c in "kv"}
        eb, pages, kw = layouts.bind(layout, bufs), [2, 0, 5], {"page_tokens": N}
    else:
        bufs = [torch.randint(0, 256, (B * N, 1, 24), dtype=torch.uint8, generator=gen) for _ in range(L)]
        eb, pages, kw = layouts.bind(layout, bufs, kv_lora_rank=16), [2, 0], {"page_tokens": N}
    with SimulatedStream(delay=0.001) as s:
        ring = OffloadRing(eb, 3, stream=s, **kw)
        pos = ring.plan(pages)
        tokens = len(pages) * N - 1
        data = b"".join(ring.iter_buffers(pos, tokens))
    ids = pages if eb.layout.addressing == "block" else layouts.slots_from_blocks(pages, N, tokens)
    want = layouts.gather(eb, ids, tokens)
    with kvwire.open(data) as r:
        for i in range(L):
            for c, x in want[i].items():
                assert np.array_equal(r.layer(i)[c].view(np.uint8), x.contiguous().view(torch.uint8).numpy())


def test_synchronous_ring_for_cpu_buffers():
    _, eb = engine(5)
    ring = OffloadRing(eb, 2)  # no stream: copies happen in plan()
    pos = ring.plan([3, 8])
    assert ring.current == 2 and ring.allocate(2) == [3, 8] and ring.stats["alloc_waits"] == 0
    assert decoded_equals_engine(b"".join(ring.iter_buffers(pos, 2 * N)), eb, [3, 8], 2 * N)
