"""The vLLM connector's layer pipeline (kvwire.integrations.vllm_pipeline) and its partial
tail chunk (vllm_plan.tail_to_save), tested without vLLM: a step's loads read by a thread
one layer ahead and scattered into vLLM 0.32's paged view bit for bit, at most ``depth``
layers staged; a corrupt chunk found at layer 2 cuts what every layer holds; a thread
error, a stuck store and a layer the forward pass never waited for all count as failed
loads (vLLM recomputes), never as a hang or wrong data (spec/store.md KVW-STORE-17, 27)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from test_vllm_plan import MODEL_DIR, fidelity, fidelity_key, paged_buffer, random_bits  # noqa: F401 (fixtures)

import kvwire
from kvwire.cache.tensors import as_numpy
from kvwire.integrations.vllm_pipeline import LayerPipeline, Loader
from kvwire.integrations.vllm_plan import (
    ModelKey,
    RequestState,
    chunk_cache,
    chunks_to_save,
    place_parts,
    slots,
    stored_chunks,
    tail_to_save,
)
from kvwire.layouts import PagedLayer, gather_slots, scatter_slots
from kvwire.store import KVStore, MemoryStore

C, BS = 32, 16


def stored_prompt(key: ModelKey, kv: KVStore, n_tokens: int, seed: int, partial: bool = False):
    """A prompt whose K/V were written into paged buffers and saved chunk by chunk, as a
    producer connector saves them; returns (prompt, per-layer [heads, tokens, dim] K/V)."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 256, (n_tokens,), generator=gen).tolist()
    specs = key.arch.layers
    kvs = [{"k": random_bits((s.num_kv_heads, n_tokens, s.head_dim_k), torch.bfloat16, gen),
            "v": random_bits((s.num_kv_heads, n_tokens, s.head_dim_v), torch.bfloat16, gen)} for s in specs]
    end = n_tokens if partial else n_tokens // C * C
    if end:
        cache = chunk_cache(key, [{c: as_numpy(x[:, :end]) for c, x in layer.items()} for layer in kvs], 0, end)
        kv.put_cache(cache, prompt[:end] if not partial else prompt, partial=partial)
    return prompt, kvs


def consumer_buffers(key, n_blocks, seed):
    gen = torch.Generator().manual_seed(seed)
    return [paged_buffer(n_blocks, s.num_kv_heads, BS, 2 * s.head_dim_k, torch.bfloat16, gen) for s in key.arch.layers]


def run_pipeline(key, kv, requests, bufs, depth=2, skip_layer=None, executor=None):
    """What the connector does in one step: a pipeline over the requests, each layer
    waited, scattered and released in order; returns (pipeline, served per request)."""
    pipe = LayerPipeline(kv, key.space, [(rid, toks, -(-stop // C)) for rid, toks, _, stop, _ in requests],
                         key.arch.num_layers, depth=depth, timeout=5, executor=executor)
    for i, spec in enumerate(key.arch.layers):
        if i == skip_layer:
            continue
        got = pipe.wait(i)
        for (_rid, _toks, start, stop, blocks), parts in zip(requests, got):
            place_parts(PagedLayer(bufs[i], spec.head_dim_k), parts, blocks, BS, start, stop)
        pipe.done(i)
    return pipe, pipe.close()


def corrupt_body(store, key: str, layer: int, at: int = 0) -> None:
    """Flip one bit of the object's first body of ``layer`` (byte ``at`` of it), in place in
    the store: a bit rot the checksum must catch."""
    data = bytearray(store.get(key))
    r = kvwire.open(bytes(data))
    data[r.info(next(i for i in range(r.chunk_count) if r.info(i).layer == layer)).offset + at] ^= 1
    store.delete(key)
    store.put(key, bytes(data))


def bits(x):
    return as_numpy(x).view(np.uint16)


@pytest.mark.slow
def test_pipeline_scatters_every_layer_of_two_requests_bit_exactly(fidelity_key):
    """Two requests of one step (4 and 2 chunks stored, loads of 120 and 64 tokens) land in
    their blocks of every layer exactly; blocks of other requests are untouched."""
    key, kv = fidelity_key, KVStore(MemoryStore())
    pa, ka = stored_prompt(key, kv, 4 * C + 7, 1)
    pb, kb = stored_prompt(key, kv, 2 * C, 2)
    bufs = consumer_buffers(key, 40, 3)
    before = [b.clone() for b in bufs]
    blocks_a, blocks_b = list(range(30, 39)), [5, 2, 9, 11]
    reqs = [("a", pa[:4 * C], 0, 120, blocks_a), ("b", pb, 0, 64, blocks_b)]
    pipe, served = run_pipeline(key, kv, reqs, bufs)
    assert served == [4 * C, 2 * C] and pipe.error is None
    for i, spec in enumerate(key.arch.layers):
        for (_, _, start, stop, blocks), src in ((reqs[0], ka[i]), (reqs[1], kb[i])):
            got = gather_slots(bufs[i], slots(blocks, BS, start, stop), spec.head_dim_k)
            assert np.array_equal(bits(got["k"]), bits(src["k"][:, start:stop]))
            assert np.array_equal(bits(got["v"]), bits(src["v"][:, start:stop]))
        used = {b for _, _, _, _, bl in reqs for b in bl}
        other = [b for b in range(40) if b not in used]
        assert torch.equal(bufs[i][other].view(torch.int16), before[i][other].view(torch.int16))


def test_pipeline_stays_at_most_depth_layers_ahead(fidelity_key):
    """With depth 1 the thread never stages layer i+1 before layer i is released."""
    key, kv = fidelity_key, KVStore(MemoryStore())
    prompt, _ = stored_prompt(key, kv, 3 * C, 4)
    pipe = LayerPipeline(kv, key.space, [("a", prompt, 3)], key.arch.num_layers, depth=1, timeout=5)
    pipe.wait(0)
    time.sleep(0.3)  # give the thread every chance to run ahead
    assert pipe.ready[0] is not None and all(r is None for r in pipe.ready[1:])
    assert not pipe.events[1].is_set()
    pipe.done(0)
    pipe.wait(1)
    assert pipe.ready[1] is not None
    pipe.done(1)
    for i in (2, 3):
        pipe.wait(i)
        pipe.done(i)
    assert pipe.close() == [3 * C]


def test_corrupt_chunk_found_at_layer_2_cuts_what_every_layer_holds(fidelity_key):
    """KVW-STORE-17/27: chunk 2's layer-2 body is corrupt; layers 0-1 got 4 chunks, 2-3 got
    2; the load serves 2 chunks (the connector reports the rest as load errors)."""
    key, store = fidelity_key, MemoryStore()
    kv = KVStore(store)
    prompt, src = stored_prompt(key, kv, 4 * C, 5)
    k2 = key.space.keys(prompt)[2]
    corrupt_body(store, k2, 2)
    bufs = consumer_buffers(key, 12, 6)
    blocks = list(range(8))
    _, served = run_pipeline(key, kv, [("a", prompt, 0, 4 * C - 1, blocks)], bufs)
    assert served == [2 * C] and kv.counts["checksum_failures"] == 1 and not store.exists(k2)
    got = gather_slots(bufs[0], slots(blocks, BS, 0, 4 * C - 1), 64)
    assert np.array_equal(bits(got["k"]), bits(src[0]["k"][:, :4 * C - 1]))  # layer 0 was whole
    got = gather_slots(bufs[3], slots(blocks, BS, 0, 2 * C), 64)
    assert np.array_equal(bits(got["v"]), bits(src[3]["v"][:, :2 * C]))


def test_a_layer_never_waited_for_fails_the_whole_load(fidelity_key):
    """Its attention ran without the loaded KV: nothing of the step's loads may count."""
    key, kv = fidelity_key, KVStore(MemoryStore())
    prompt, _ = stored_prompt(key, kv, 2 * C, 7)
    _, served = run_pipeline(key, kv, [("a", prompt, 0, 2 * C - 1, list(range(4)))],
                             consumer_buffers(key, 8, 8), skip_layer=1)
    assert served == [0]


class StuckStore(MemoryStore):
    """A real MemoryStore whose ranged batch reads block until released (a hung server)."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()

    def get_ranges(self, requests):
        self.release.wait(30)
        return super().get_ranges(requests)


class FailingStore(MemoryStore):
    def get_ranges(self, requests):
        raise kvwire.store.StoreError("connection reset by peer")


@pytest.mark.slow
@pytest.mark.parametrize("store_cls", [StuckStore, FailingStore])
def test_a_stuck_or_failing_store_never_hangs_the_engine(fidelity_key, store_cls):
    """A layer not ready within the timeout, or a store error in the thread, returns no
    data for the layer (the forward pass goes on) and the load serves 0 tokens."""
    key, store = fidelity_key, store_cls()
    kv = KVStore(store)
    big = stored_prompt(key, KVStore(store), 8 * C, 9)[0]
    pipe = LayerPipeline(kv, key.space, [("a", big, 8)], key.arch.num_layers, depth=2, timeout=0.5)
    t0 = time.perf_counter()
    results = []
    for i in range(key.arch.num_layers):
        results.append(pipe.wait(i))
        pipe.done(i)
    if isinstance(store, StuckStore):
        store.release.set()
    assert pipe.close() == [0]
    assert time.perf_counter() - t0 < 60  # the stuck layer timed out, the others did not wait (generous bound)
    assert all(r == [None] for r in results[1:]) or isinstance(store, FailingStore)
    assert pipe.error is not None


def test_steps_share_one_loader_thread(fidelity_key):
    """The connector's steps run their pipelines on one long-lived loader thread (no thread
    started per step), each delivering its layers as a pipeline of its own thread does."""
    key, kv = fidelity_key, KVStore(MemoryStore())
    prompt, src = stored_prompt(key, kv, 2 * C, 3)
    names = []
    with Loader() as loader:
        for step in range(3):
            bufs = consumer_buffers(key, 6, 11 + step)
            pipe, served = run_pipeline(key, kv, [("a", prompt, 0, 2 * C, [1, 3, 5, 2])], bufs, executor=loader)
            assert served == [2 * C] and pipe.thread is None
            got = gather_slots(bufs[0], slots([1, 3, 5, 2], BS, 0, 2 * C), 64)
            assert np.array_equal(bits(got["k"]), bits(src[0]["k"][:, :2 * C]))
            names.append(loader.submit(lambda: threading.current_thread().ident).result())
    assert len(set(names)) == 1 and names[0] == loader.thread.ident


def test_loader_threads_run_on_every_core_the_engines_threads_use():
    """vLLM's CPU worker binds each compute thread to one core and the main thread to the
    first; a loader started from it would inherit that one core, so its threads share it.
    engine_cores() is the union of the process's threads' cores, and the loader's threads
    run on all of them while the thread that started them keeps its own."""
    from kvwire.integrations.vllm_engine import compute_threads, engine_cores

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.fail(f"this test needs a machine with 2 cores or more, this process may use {cores}")
    first, rest = {cores[0]}, set(cores[1:])
    ready, stop = threading.Event(), threading.Event()

    def compute_thread():  # one of the engine's OpenMP threads, bound to the other cores
        os.sched_setaffinity(0, rest)
        ready.set()
        stop.wait(30)

    helper = threading.Thread(target=compute_thread, daemon=True)
    helper.start()
    assert ready.wait(10)
    main_before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, first)  # the worker's main thread, bound to the first core
    try:
        assert engine_cores() == set(cores)
        assert compute_threads(engine_cores()) == min(torch.get_num_threads(), len(cores))
        with Loader(threads=2, cores=engine_cores()) as loader:
            got = [loader.submit(os.sched_getaffinity, 0).result() for _ in range(4)]
        assert all(g == set(cores) for g in got)
        with Loader(threads=1) as inherited:  # without cores: the starting thread's one core
            assert inherited.submit(os.sched_getaffinity, 0).result() == first
        assert os.sched_getaffinity(0) == first  # the engine's main thread is left as it was
    finally:
        os.sched_setaffinity(0, main_before)
        stop.set()
        helper.join(10)


def test_a_stuck_loader_never_holds_up_the_engines_exit():
    """An engine that dies mid-step leaves its pipeline waiting for a forward pass that will
    not come; the loader thread is a daemon, so the process still exits (a
    ThreadPoolExecutor's worker would be joined at exit, forever)."""
    code = ("import threading; from kvwire.integrations.vllm_pipeline import Loader; "
            "Loader().submit(threading.Event().wait); print('submitted')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(Path(kvwire.__file__).parents[1])))
    assert p.returncode == 0 and p.stdout.strip() == "submitted", p.stderr[-2000:]


def test_the_loader_runs_calls_in_order_and_hands_back_errors():
    with Loader() as loader:
        order = []
        futures = [loader.submit(order.append, i) for i in range(5)]
        assert [f.result(timeout=30) for f in futures] == [None] * 5 and order == list(range(5))
        with pytest.raises(ZeroDivisionError):
            loader.submit(lambda: 1 / 0).result(timeout=30)


def test_the_loader_places_layers_before_it_says_they_are_ready(fidelity_key):
    """On the CPU the connector has the loader thread scatter each layer itself: when the
    engine's wait for a layer returns, the layer is in the paged buffer, bit-exact, and the
    engine thread copied nothing."""
    key, kv = fidelity_key, KVStore(MemoryStore())
    prompt, src = stored_prompt(key, kv, 2 * C, 4)
    bufs, blocks, placed_by = consumer_buffers(key, 6, 12), [4, 0, 2, 5], []

    def place(i, got):
        placed_by.append(threading.current_thread().name)
        (parts,) = got
        assert place_parts(PagedLayer(bufs[i], key.arch.layers[i].head_dim_k), parts, blocks, BS, 0, 2 * C) == 2 * C

    with Loader() as loader:
        pipe = LayerPipeline(kv, key.space, [("a", prompt, 2)], key.arch.num_layers, timeout=5, executor=loader,
                             place=place)
        for i in range(key.arch.num_layers):
            pipe.wait(i)
            got = gather_slots(bufs[i], slots(blocks, BS, 0, 2 * C), 64)
            assert np.array_equal(bits(got["k"]), bits(src[i]["k"])), i
            assert np.array_equal(bits(got["v"]), bits(src[i]["v"])), i
            pipe.done(i)
        assert pipe.close() == [2 * C]
    assert len(placed_by) == key.arch.num_layers and all(n.startswith("kvwire-layer-loads") for n in placed_by)


def test_nothing_is_placed_after_the_pipeline_is_stopped(fidelity_key):
    """A layer that times out stops the pipeline (vLLM recomputes the load): when the stuck
    store answers later, the loader writes nothing into the engine's buffers."""
    key, store = fidelity_key, StuckStore()
    kv = KVStore(store)
    prompt, _ = stored_prompt(key, kv, 2 * C, 5)
    placed = []
    pipe = LayerPipeline(kv, key.space, [("a", prompt, 2)], key.arch.num_layers, timeout=0.5,
                         place=lambda i, got: placed.append(i))
    assert pipe.wait(0) == [None]  # timed out: halted
    store.release.set()
    pipe.done(0)
    assert pipe.close() == [0]
    assert placed == []


def test_pipeline_depth_is_checked(fidelity_key):
    with pytest.raises(ValueError, match="depth"):
        LayerPipeline(KVStore(MemoryStore()), fidelity_key.space, [], 4, depth=0)


# -- chunks the store has already -----------------------------------------------------------

def test_chunks_the_lookup_found_are_not_saved_again():
    """A hit loads whole blocks up to the last prompt token; the chunk vLLM then completes by
    recomputing was found by the lookup, so it is not gathered from every layer to be skipped
    by the store. Chunks beyond what the lookup found are saved as before."""
    assert stored_chunks(1024, 1024, 256) == (4, False)  # 992 tokens loaded, chunk 3 completed by vLLM
    st = RequestState(list(range(1024)), saved=992 // 256, stored=4)
    assert chunks_to_save(st, 1024, 256) is None and st.saved == 4
    assert stored_chunks(1000, 1000, 256) == (3, True)  # the partial tail found too
    tail = RequestState(list(range(1000)), saved=3, stored=3, tail_stored=True)
    assert chunks_to_save(tail, 1000, 256) is None and tail_to_save(tail, 1000, 256) is None and tail.tail_saved
    assert stored_chunks(600, 1000, 256) == (2, False)  # a shorter stored prefix: the rest is saved
    part = RequestState(list(range(1000)), stored=2)
    assert chunks_to_save(part, 512, 256) is None  # both found
    assert chunks_to_save(part, 1000, 256) == (2, 3) and tail_to_save(part, 1000, 256) == 3
    fresh = RequestState(list(range(1000)))  # nothing found: everything saved, as before
    assert chunks_to_save(fresh, 1000, 256) == (0, 3) and tail_to_save(fresh, 1000, 256) == 3


# -- the trailing partial chunk ---------------------------------------------------------------

def test_tail_is_saved_once_after_the_whole_prompt_and_its_chunks():
    st = RequestState(list(range(700)))
    assert chunks_to_save(st, 512, 256) == (0, 2) and tail_to_save(st, 512, 256) is None
    assert chunks_to_save(st, 699, 256) is None and tail_to_save(st, 699, 256) is None
    assert chunks_to_save(st, 700, 256) is None and tail_to_save(st, 700, 256) == 2
    assert tail_to_save(st, 701, 256) is None  # once
    whole = RequestState(list(range(512)))
    chunks_to_save(whole, 512, 256)
    assert tail_to_save(whole, 512, 256) is None  # no partial chunk
    loaded = RequestState(list(range(700)), saved=0)
    assert tail_to_save(loaded, 700, 256) is None  # whole chunks first (chunks_to_save moves saved)


def test_partial_tail_round_trip_serves_all_but_the_last_token(fidelity_key):
    """KVW-STORE-11 "partial": a 116-token prompt (3 chunks + 20 tokens) stored with its tail
    is found whole by the lookup the connector makes, and loads back layer by layer up to
    the token before the last (vLLM computes the last one)."""
    key, kv = fidelity_key, KVStore(MemoryStore())
    prompt, src = stored_prompt(key, kv, 3 * C + 20, 10, partial=True)
    hit = kv.lookup(prompt, key.space, partial=True)
    assert hit.tokens == 3 * C + 20 and kv.lookup(prompt, key.space).tokens == 3 * C
    stop = len(prompt) - 1  # what matched_tokens gives: 115 (inside the last block)
    bufs = consumer_buffers(key, 8, 11)
    _, served = run_pipeline(key, kv, [("a", prompt, 0, stop, list(range(8)))], bufs)  # the prompt's 8 blocks
    assert served == [3 * C + 20]
    got = gather_slots(bufs[1], slots(list(range(8)), BS, 0, stop), 64)
    assert np.array_equal(bits(got["k"]), bits(src[1]["k"][:, :stop]))


# -- K/V packing of the CPU backend ------------------------------------------------------------

@pytest.mark.parametrize("seed", range(5))
def test_cpu_vec_packing_is_what_the_cpu_kernels_write(seed):
    """vLLM's CPU backend (vec/vec16 kernels) keeps, per block and head of the [blocks, heads,
    block_size, 2*D] view, K transposed ([D, block_size]) and then V ([block_size, D]), as
    measured through its cpu_attn_reshape_and_cache op (the e2e test checks the stored K/V
    against transformers): scatter with packing "tokens" and ISA "vec" puts token t's K and V exactly
    there, gather reads them back, and the "channels" reading of the bytes differs."""
    gen = torch.Generator().manual_seed(seed)
    nb, H, N, D = 6, 2, 16, 8
    buf = random_bits((nb, H, N, 2 * D), torch.bfloat16, gen)
    blocks = torch.randperm(nb, generator=gen)[:3].tolist()
    T = 3 * N - int(torch.randint(0, N, (1,), generator=gen))
    k = random_bits((H, T, D), torch.bfloat16, gen)
    v = random_bits((H, T, D), torch.bfloat16, gen)
    ids = slots(blocks, N, 0, T)
    scatter_slots(buf, ids, {"k": k, "v": v}, D, "tokens", "vec")
    mem = buf.view(nb, H, 2, N * D)
    for t in range(T):
        b, o = blocks[t // N], t % N
        assert torch.equal(mem[b, :, 0].view(H, D, N)[:, :, o].view(torch.int16), k[:, t].view(torch.int16))
        assert torch.equal(mem[b, :, 1].view(H, N, D)[:, o].view(torch.int16), v[:, t].view(torch.int16))
    got = gather_slots(buf, ids, D, "tokens", "vec")
    assert torch.equal(got["k"].view(torch.int16), k.view(torch.int16))
    assert torch.equal(got["v"].view(torch.int16), v.view(torch.int16))
    other = gather_slots(buf, ids, D, "channels")
    assert not torch.equal(other["k"].view(torch.int16), k.view(torch.int16))
    with pytest.raises(ValueError, match="packing"):
        gather_slots(buf, ids, D, "rows")


# -- fp8 KV caches: uint8 buffers and per-layer scales, as vLLM hands them over ----------------

def test_cache_dtype_of_maps_vllm_kv_cache_dtypes():
    from kvwire.integrations.vllm_plan import cache_dtype_of

    assert cache_dtype_of(torch.bfloat16, "auto") == "bf16"
    assert cache_dtype_of(torch.float16, None) == "f16"
    assert cache_dtype_of(torch.bfloat16, "fp8") == "f8_e4m3fn"
    assert cache_dtype_of(torch.bfloat16, "fp8", "f8_e4m3fnuz") == "f8_e4m3fnuz"  # ROCm's "fp8"
    assert cache_dtype_of(torch.bfloat16, "fp8_e4m3") == "f8_e4m3fn"
    assert cache_dtype_of(torch.bfloat16, "fp8_e5m2") == "f8_e5m2"
    for bad in ("fp8_per_token_head", "nvfp4_ds_mla", "int8", "turboquant_k8v4"):
        with pytest.raises(ValueError, match="per-token"):
            cache_dtype_of(torch.bfloat16, bad)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["f8_e4m3fn", "f8_e5m2"])
def test_fp8_uint8_buffers_round_trip_with_their_scales(fidelity, fmt):
    """An fp8 vLLM cache: per layer a uint8 [blocks, heads, block_size, 2*D] tensor of fp8
    elements and python-float k_scale/v_scale (the attention layer's _k_scale_float and
    _v_scale_float). Chunks gathered from it carry dtype ``fmt`` and the scales (KVW-SCALE-*),
    are keyed under the fp8 dtype (a bf16 engine never finds them), load back bit-exactly
    into another engine's uint8 buffers with the same scales, and are requantized for one
    whose K scales differ (KVW-SCALE-7, crossmodel.md KVW-XM-10)."""
    import ml_dtypes

    from kvwire.integrations.vllm_pipeline import same_scales
    from kvwire.integrations.vllm_plan import layer_scales
    from kvwire.model.rescale import rescale_fp8

    arch, cfg = fidelity
    key = ModelKey.of(arch, fmt, MODEL_DIR, chunk_tokens=C, config=cfg)
    bf16_key = ModelKey.of(arch, "bf16", MODEL_DIR, chunk_tokens=C, config=cfg)
    gen = torch.Generator().manual_seed(12)
    nb, T = 12, 3 * C
    src = [torch.randint(0, 256, (nb, s.num_kv_heads, BS, 2 * s.head_dim_k), dtype=torch.uint8, generator=gen)
           for s in arch.layers]
    scales = tuple(layer_scales(0.5 + i / 8, 2.0 - i / 8, False) for i in range(arch.num_layers))
    blocks = torch.randperm(nb, generator=gen)[:T // BS].tolist()
    ids = slots(blocks, BS, 0, T)
    prompt = torch.randint(0, 256, (T,), generator=gen).tolist()
    kv = KVStore(MemoryStore())
    layers = [gather_slots(x, ids, s.head_dim_k) for x, s in zip(src, arch.layers)]
    cache = chunk_cache(key, layers, 0, T, kv_scales=scales)
    assert cache.header.dtype == fmt and [(x.k_scale, x.v_scale) for x in cache.header.kv_scales] == list(scales)
    kv.put_cache(cache, prompt)
    assert all(f"/{fmt}/" in k for k in kv.store.list())
    assert kv.lookup(prompt, bf16_key.space).tokens == 0 and kv.lookup(prompt, key.space).tokens == T
    # the stored values are fp8 element x scale (what another engine reads)
    got = kv.get_cache(prompt, key.space)
    npfp8 = getattr(ml_dtypes, {"f8_e4m3fn": "float8_e4m3fn", "f8_e5m2": "float8_e5m2"}[fmt])
    raw_k = as_numpy(layers[1]["k"]).view(npfp8).astype(np.float32)
    deq = got.cache.dequantize_layer(1, dtype="f32")["k"]
    assert np.array_equal(np.asarray(deq), raw_k * np.float32(scales[1][0]), equal_nan=True)

    def load(engine_scales):
        dst = [torch.zeros_like(x) for x in src]
        pipe = LayerPipeline(kv, key.space, [("r", prompt, T // C)], arch.num_layers, kv_scales=engine_scales)
        for i, s in enumerate(arch.layers):
            place_parts(PagedLayer(dst[i], s.head_dim_k), pipe.wait(i)[0], blocks, BS, 0, T)
            pipe.done(i)
        return dst, pipe.close(), pipe

    dst, served, _ = load(scales)
    assert served == [T]
    assert all(torch.equal(d[blocks], x[blocks]) for d, x in zip(dst, src))
    other = tuple((k * 2, v) for k, v in scales)  # an engine with other K scales: the elements are requantized
    dst, served, pipe = load(other)
    assert served == [T] and pipe.rescaled == 1
    for i, s in enumerate(arch.layers):
        got = gather_slots(dst[i], ids, s.head_dim_k)
        want_k = rescale_fp8(layers[i]["k"], scales[i][0], other[i][0], fmt)
        assert np.array_equal(as_numpy(got["k"]).view(np.uint8), want_k.view(np.uint8))
        assert torch.equal(got["v"], layers[i]["v"])  # V scales unchanged: V elements as stored
    assert same_scales(cache.header, scales) and not same_scales(cache.header, other)
    assert not same_scales(cache.header, None)


def inline_pipeline(key, kv, requests, bufs, threads=2):
    """The CPU schedule (``inline=True``): every layer read and placed on the loader's
    threads before the constructor returns; returns (pipeline, served per request)."""
    paged = [PagedLayer(b, s.head_dim_k) for b, s in zip(bufs, key.arch.layers)]
    plans: dict = {}

    def place(i, got):
        for (rid, _toks, start, stop, blocks), parts in zip(requests, got):
            place_parts(paged[i], parts, blocks, BS, start, stop, plans.setdefault(rid, {}))

    with Loader(threads=threads) as loader:
        pipe = LayerPipeline(kv, key.space, [(rid, toks, -(-stop // C)) for rid, toks, _, stop, _ in requests],
                             key.arch.num_layers, timeout=5, executor=loader, place=place, inline=True)
        return pipe, pipe.close()


@pytest.mark.parametrize("threads", [1, 2])
def test_inline_loads_place_every_layer_of_two_requests_before_returning(fidelity_key, threads):
    """The CPU schedule: when the constructor returns every layer of both requests is in its
    blocks, bit-exact, whatever thread placed it; other blocks are untouched."""
    key, kv = fidelity_key, KVStore(MemoryStore())
    pa, ka = stored_prompt(key, kv, 3 * C + 5, 11)
    pb, kb = stored_prompt(key, kv, 2 * C, 12)
    bufs = consumer_buffers(key, 30, 13)
    before = [b.clone() for b in bufs]
    reqs = [("a", pa[:3 * C], 0, 3 * C - 1, [20, 3, 7, 8, 9, 21]), ("b", pb, 32, 2 * C - 1, [1, 2, 25, 26])]
    pipe, served = inline_pipeline(key, kv, reqs, bufs, threads)
    assert served == [3 * C, 2 * C] and pipe.error is None and not pipe.running(0)
    for i, spec in enumerate(key.arch.layers):
        for (_, _, start, stop, blocks), src in ((reqs[0], ka[i]), (reqs[1], kb[i])):
            got = gather_slots(bufs[i], slots(blocks, BS, start, stop), spec.head_dim_k)
            assert np.array_equal(bits(got["k"]), bits(src["k"][:, start:stop]))
            assert np.array_equal(bits(got["v"]), bits(src["v"][:, start:stop]))
        other = [b for b in range(30) if b not in {*reqs[0][4], *reqs[1][4]}]
        assert torch.equal(bufs[i][other].view(torch.int16), before[i][other].view(torch.int16))
        assert torch.equal(bufs[i][1].view(torch.int16), before[i][1].view(torch.int16))  # b's first block: start 32


def test_inline_loads_cut_at_a_corrupt_chunk_on_any_thread(fidelity_key):
    """KVW-CSUM-1 with layers read on two threads: chunk 1's layer-3 body is corrupt, so the
    load serves chunk 0 only, however the layers interleaved, and the object is deleted."""
    key, store = fidelity_key, MemoryStore()
    kv = KVStore(store)
    prompt, _ = stored_prompt(key, kv, 3 * C, 14)
    k1 = key.space.keys(prompt)[1]
    corrupt_body(store, k1, 3, at=5)
    _, served = inline_pipeline(key, kv, [("a", prompt, 0, 3 * C - 1, list(range(6)))], consumer_buffers(key, 8, 15))
    assert served == [C] and kv.counts["checksum_failures"] == 1 and not store.exists(k1)


def test_inline_needs_an_executor_and_a_place_and_a_failure_is_a_failed_load(fidelity_key):
    """Misuse is refused; an error while placing fails the whole step (vLLM recomputes)."""
    key, kv = fidelity_key, KVStore(MemoryStore())
    prompt, _ = stored_prompt(key, kv, 2 * C, 16)
    with pytest.raises(ValueError, match="give executor and place"):
        LayerPipeline(kv, key.space, [("a", prompt, 2)], key.arch.num_layers, inline=True)

    def place(i, got):
        if i == 2:
            raise RuntimeError("scatter failed")

    with Loader(threads=2) as loader:
        pipe = LayerPipeline(kv, key.space, [("a", prompt, 2)], key.arch.num_layers, executor=loader, place=place,
                             inline=True)
    assert isinstance(pipe.error, RuntimeError) and pipe.close() == [0]
