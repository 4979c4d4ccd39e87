"""kvwire.integrations.vllm_plan, the engine-neutral half of the vLLM connector, tested
without vLLM: the scheduler's arithmetic (a block-aligned match that leaves one prompt token
to compute, chunks saved once and only when whole, slots from block tables), the copies
between vLLM 0.32's paged view ``[num_blocks, heads, block_size, 2 * head_dim]`` (MLA:
``[num_blocks, 1, block_size, latent]``) and kvwire's ``[heads, tokens, dim]``, bit for bit,
chunk caches that store the same objects as a whole-cache put (KVW-STORE-11, 13), and the
model key that keeps other weights' caches apart (KVW-STORE-12, 13)."""

from __future__ import annotations

import json
import shutil

import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from kvwire.adapters.hf_model import arch_from_config
from kvwire.cache.kvcache import KVCache
from kvwire.cache.tensors import as_numpy
from kvwire.format.header import Architecture, Header, LayerSpec
from kvwire.integrations.vllm_plan import (
    ModelKey,
    RequestState,
    chunk_cache,
    chunks_to_save,
    dtype_of,
    files_digest,
    layer_index,
    matched_tokens,
    model_weights_fingerprint,
    slots,
)
from kvwire.layouts import gather_slots, scatter_slots
from kvwire.model.identity import config_fingerprint
from kvwire.store import KVStore, MemoryStore

MODEL_DIR = "benchmarks/fidelity/model"
LATENT = 576  # DeepSeek's MLA: kv_lora_rank 512 + qk_rope_head_dim 64, one "head"


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a 16-bit tensor (NaN payloads compare too)."""
    return t.view(torch.int16)


def random_bits(shape, dtype, gen: torch.Generator) -> torch.Tensor:
    """Arbitrary 16-bit patterns as ``dtype``: NaNs, infinities and subnormals included."""
    return torch.randint(-(1 << 15), 1 << 15, tuple(shape), dtype=torch.int16, generator=gen).view(dtype)


def as_form(t: torch.Tensor, form: str):
    """``t`` as the caller hands it: a torch tensor, or numpy (ml_dtypes.bfloat16 for bf16)."""
    if form == "torch":
        return t
    a = as_numpy(t).copy()
    assert a.dtype == (ml_dtypes.bfloat16 if t.dtype == torch.bfloat16 else np.float16)
    return a


def paged_buffer(num_blocks, heads, block_size, channels, dtype, gen, physical="BHNC") -> torch.Tensor:
    """vLLM 0.32's per-layer [B, H, N, C] view over random bits. ``physical="BNHC"``: the
    view of a buffer laid out [B, N, H, C] (KVCacheLayout LBNHC), a non-contiguous view."""
    if physical == "BHNC":
        return random_bits((num_blocks, heads, block_size, channels), dtype, gen)
    return random_bits((num_blocks, block_size, heads, channels), dtype, gen).permute(0, 2, 1, 3)


def hand_scatter(buf: torch.Tensor, slot_ids, arrays: dict) -> torch.Tensor:
    """What vllm.md says the view holds, written one slot and head at a time: K in
    C[:head_dim], V in C[head_dim:] (MLA: the latent is the whole of C)."""
    out = buf.clone()
    n = buf.shape[2]
    for j, s in enumerate(slot_ids):
        b, o = divmod(int(s), n)
        for h in range(buf.shape[1]):
            if "latent" in arrays:
                out[b, h, o, :] = arrays["latent"][h, j]
            else:
                d = arrays["k"].shape[2]
                out[b, h, o, :d] = arrays["k"][h, j]
                out[b, h, o, d:] = arrays["v"][h, j]
    return out


# -- matched_tokens -------------------------------------------------------------------------

@pytest.mark.parametrize("hit, prompt_len, computed, block_size, want", [
    (512, 512, 0, 32, 511),   # the whole prompt stored: all but its last token, which vLLM computes
    (256, 256, 0, 32, 255),   # one chunk = the whole prompt
    (256, 256, 0, 256, 255),  # block = chunk = prompt: a load may end inside a block
    (256, 257, 0, 32, 256),   # one token beyond the stored chunk: all of it
    (256, 300, 0, 32, 256),
    (300, 300, 0, 32, 299),   # a hit of the whole (partially stored) prompt
    (250, 300, 0, 32, 250),   # a hit that is not block-aligned is offered as it is
    (32, 32, 0, 32, 31),
    (33, 33, 0, 32, 32),
    (1, 1, 0, 16, 0),         # a one-token prompt: that token is computed
    (0, 100, 0, 16, 0),       # a miss
    (256, 300, 64, 32, 192),  # vLLM's local prefix cache has two blocks: the connector offers the rest
    (256, 300, 256, 32, 0),   # vLLM has all of it locally
    (128, 300, 256, 32, 0),   # vLLM has more than the store: never negative
    (512, 512, 480, 32, 31),
    (512, 512, 448, 32, 63),
])
def test_matched_tokens_examples(hit, prompt_len, computed, block_size, want):
    assert matched_tokens(hit, prompt_len, computed, block_size) == want


@given(block_size=st.sampled_from([1, 2, 16, 32, 64]), prompt_len=st.integers(1, 5000), hit=st.integers(0, 6000),
       computed_blocks=st.integers(0, 400))
def test_matched_tokens_property(block_size, prompt_len, hit, computed_blocks):
    """For vLLM's local hits (whole blocks, never the last prompt token): the offer is >= 0,
    ends within both the stored prefix and prompt_len - 1, and is the largest such: the
    stored prefix up to the last prompt token, wherever it ends in a block."""
    computed = min(computed_blocks * block_size, (prompt_len - 1) // block_size * block_size)
    n = matched_tokens(hit, prompt_len, computed, block_size)
    assert n >= 0
    end = computed + n
    if n:
        assert end <= hit and end <= prompt_len - 1  # at least one prompt token left to compute
        assert end == min(hit, prompt_len - 1)  # maximal
    else:
        assert min(hit, prompt_len - 1) <= computed


# -- chunks_to_save -------------------------------------------------------------------------

def test_chunks_to_save_whole_chunks_once_and_never_the_partial_last_one():
    """KVW-STORE-11: a writer stores whole chunks; a 1000-token prompt in chunks of 256 has
    three, saved as chunked prefill completes them, each once; its last 232 tokens never."""
    st_ = RequestState(list(range(1000)))
    steps = [(100, None), (256, (0, 1)), (256, None), (300, None), (700, (1, 2)), (1000, (2, 3)), (1001, None),
             (1500, None)]
    for computed_after, want in steps:
        assert chunks_to_save(st_, computed_after, 256) == want, computed_after
    assert st_.saved == 3


def test_chunks_to_save_prompt_of_whole_chunks_saves_them_all():
    st_ = RequestState(list(range(512)))
    assert chunks_to_save(st_, 511, 256) == (0, 1)
    assert chunks_to_save(st_, 512, 256) == (1, 2)
    assert chunks_to_save(st_, 600, 256) is None  # decode tokens are not the prompt's


def test_chunks_to_save_after_a_load_saves_nothing_before_it():
    """Loaded chunks came from the store: the state starts at them, so no step saves them again."""
    st_ = RequestState(list(range(1000)), saved=2)
    assert chunks_to_save(st_, 512, 256) is None
    assert chunks_to_save(st_, 600, 256) is None
    assert chunks_to_save(st_, 1000, 256) == (2, 3)
    # a load that ended inside chunk 1 (block-aligned, 480 tokens): chunk 1 is saved once whole
    st_ = RequestState(list(range(1000)), saved=480 // 256)
    assert chunks_to_save(st_, 480, 256) is None
    assert chunks_to_save(st_, 520, 256) == (1, 2)


@given(chunk=st.sampled_from([1, 16, 256]), prompt_chunks=st.integers(0, 12), tail=st.integers(0, 255),
       loaded_frac=st.floats(0, 1), steps=st.lists(st.integers(1, 700), min_size=1, max_size=30))
def test_chunks_to_save_property(chunk, prompt_chunks, tail, loaded_frac, steps):
    """Chunked prefill over random steps (then decode steps): every whole chunk after the
    loaded ones is saved exactly once, in order, only once computed; no partial chunk."""
    prompt_len = prompt_chunks * chunk + tail % chunk
    whole = prompt_len // chunk
    loaded = int(loaded_frac * whole)
    st_ = RequestState(list(range(prompt_len)), saved=loaded)
    computed, saved = 0, []
    for n in steps + [prompt_len]:  # the last step finishes the prompt
        computed = min(computed + n, prompt_len + 10)
        span = chunks_to_save(st_, computed, chunk)
        if span is not None:
            first, stop = span
            assert first < stop and stop * chunk <= min(computed, prompt_len)
            saved.extend(range(first, stop))
    assert saved == list(range(loaded, whole))
    assert st_.saved == max(whole, loaded)


# -- slots ----------------------------------------------------------------------------------

@given(data=st.data(), block_size=st.sampled_from([1, 2, 16, 32]), n_blocks=st.integers(1, 20))
def test_slots_are_block_times_block_size_plus_offset(data, block_size, n_blocks):
    block_ids = data.draw(st.lists(st.integers(0, 10_000), min_size=n_blocks, max_size=n_blocks, unique=True))
    stop = data.draw(st.integers(0, n_blocks * block_size))
    start = data.draw(st.integers(0, stop))
    got = slots(block_ids, block_size, start, stop)
    want = [block_ids[t // block_size] * block_size + t % block_size for t in range(start, stop)]
    assert got.dtype == np.int64 and got.tolist() == want
    assert len(set(got.tolist())) == stop - start  # distinct blocks: distinct slots


def test_slots_refuse_a_range_beyond_the_requests_blocks():
    assert slots([7, 3], 16, 0, 32).tolist()[-1] == 3 * 16 + 15
    with pytest.raises(ValueError, match="need 3 blocks, the request has 2"):
        slots([7, 3], 16, 0, 33)
    with pytest.raises(ValueError, match="blocks"):
        slots([], 16, 0, 1)


# -- kvwire.layouts.gather_slots / scatter_slots, as the connector calls them ---------------

@pytest.mark.parametrize("form", ["torch", "numpy"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@given(data=st.data())
def test_scatter_then_gather_is_bit_exact(form, dtype, data):
    """Random K/V into random non-contiguous slots of a random paged view: the view then
    holds exactly the hand-built expectation (K first half, V second, every other slot as
    it was), and gathering the slots gives the arrays back bit for bit."""
    block_size = data.draw(st.sampled_from([1, 4, 16]), "block_size")
    num_blocks = data.draw(st.integers(1, 10), "num_blocks")
    heads = data.draw(st.integers(1, 4), "heads")
    head_dim = data.draw(st.sampled_from([1, 8, 64]), "head_dim")
    physical = data.draw(st.sampled_from(["BHNC", "BNHC"]), "physical")
    perm = data.draw(st.permutations(range(num_blocks * block_size)), "slots")
    slot_ids = np.asarray(perm[:data.draw(st.integers(1, len(perm)), "tokens")], dtype=np.int64)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31), "seed"))
    buf = paged_buffer(num_blocks, heads, block_size, 2 * head_dim, dtype, gen, physical)
    k = random_bits((heads, len(slot_ids), head_dim), dtype, gen)
    v = random_bits((heads, len(slot_ids), head_dim), dtype, gen)
    want = hand_scatter(buf, slot_ids, {"k": k, "v": v})
    scatter_slots(buf, slot_ids, {"k": as_form(k, form), "v": as_form(v, form)}, head_dim)
    assert torch.equal(bits(buf), bits(want))
    got = gather_slots(buf, slot_ids, head_dim)
    assert set(got) == {"k", "v"}
    for comp, x in (("k", k), ("v", v)):
        assert got[comp].dtype == dtype and got[comp].is_contiguous()
        assert tuple(got[comp].shape) == (heads, len(slot_ids), head_dim)
        assert torch.equal(bits(got[comp]), bits(x)), comp


def test_k_and_v_halves_by_hand():
    """One head, head_dim 2, block size 2: tokens 0, 1 into slots 3 (block 1, offset 1) and 0."""
    buf = torch.zeros(2, 1, 2, 4, dtype=torch.float16)
    k = torch.tensor([[[1, 2], [3, 4]]], dtype=torch.float16)
    v = torch.tensor([[[5, 6], [7, 8]]], dtype=torch.float16)
    scatter_slots(buf, np.array([3, 0]), {"k": k.numpy(), "v": v}, 2)
    want = torch.zeros(2, 1, 2, 4, dtype=torch.float16)
    want[1, 0, 1] = torch.tensor([1, 2, 5, 6])
    want[0, 0, 0] = torch.tensor([3, 4, 7, 8])
    assert torch.equal(buf, want)


@pytest.mark.parametrize("form", ["torch", "numpy"])
def test_mla_view_scatter_gather(form):
    """MLA: one head whose last axis is the whole latent (576)."""
    gen = torch.Generator().manual_seed(5)
    buf = paged_buffer(9, 1, 16, LATENT, torch.bfloat16, gen)
    slot_ids = np.asarray(slots([8, 2, 5], 16, 3, 41))
    lat = random_bits((1, len(slot_ids), LATENT), torch.bfloat16, gen)
    want = hand_scatter(buf, slot_ids, {"latent": lat})
    scatter_slots(buf, slot_ids, {"latent": as_form(lat, form)}, LATENT, "latent")
    assert torch.equal(bits(buf), bits(want))
    got = gather_slots(buf, slot_ids, LATENT, "latent")
    assert list(got) == ["latent"] and torch.equal(bits(got["latent"]), bits(lat))


def test_gather_returns_copies_and_scatter_takes_non_contiguous_arrays():
    """The gathered arrays outlive the blocks (vLLM reuses them); a slice of a loaded cache
    (a non-contiguous view) scatters like a contiguous one."""
    gen = torch.Generator().manual_seed(2)
    buf = paged_buffer(6, 2, 4, 16, torch.bfloat16, gen)
    slot_ids = slots([4, 0, 2], 4, 1, 11)
    full = random_bits((2, 20, 8), torch.bfloat16, gen)
    k, v = full[:, 3:13], full[:, 5:15]
    assert not k.is_contiguous()
    scatter_slots(buf, slot_ids, {"k": k, "v": as_numpy(v)}, 8)
    got = gather_slots(buf, slot_ids, 8)
    buf.zero_()
    assert torch.equal(bits(got["k"]), bits(k)) and torch.equal(bits(got["v"]), bits(v))


# -- chunk_cache + KVStore ------------------------------------------------------------------

@pytest.fixture(scope="module")
def fidelity():
    """(arch, config.json) of the repository's trained Llama (4 layers, 2 KV heads, head_dim 64)."""
    with open(f"{MODEL_DIR}/config.json") as f:
        cfg = json.load(f)
    arch = arch_from_config(transformers.AutoConfig.from_pretrained(MODEL_DIR))
    assert arch == arch_from_config(transformers.LlamaConfig(**cfg))
    return arch, cfg


@pytest.fixture(scope="module")
def fidelity_key(fidelity):
    arch, cfg = fidelity
    return ModelKey.of(arch, "bf16", MODEL_DIR, chunk_tokens=32, config=cfg)


@pytest.mark.slow
@given(data=st.data())
def test_chunk_cache_of_a_step_stores_the_objects_of_a_whole_cache_put(fidelity_key, data):
    """KVW-STORE-11, 13: tokens [f*C, s*C) gathered from paged buffers, keyed with the
    prompt from 0, are the same objects, under the same keys, as chunks f..s-1 of a put
    of the whole cache [0, s*C); saving [0, f*C) later completes a prefix that loads back."""
    key, C = fidelity_key, 32
    arch = key.arch
    block_size = data.draw(st.sampled_from([8, 16, 32]), "block_size")
    s = data.draw(st.integers(1, 4), "s")
    f = data.draw(st.integers(0, s - 1), "f")
    prompt_len = s * C + data.draw(st.integers(0, C - 1), "tail")
    n_blocks = -(-prompt_len // block_size)
    block_ids = data.draw(st.permutations(range(2 * n_blocks)), "blocks")[:n_blocks]
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31), "seed"))
    prompt = torch.randint(0, 256, (prompt_len,), generator=gen).tolist()
    specs = arch.layers
    ks = [random_bits((sp.num_kv_heads, prompt_len, sp.head_dim_k), torch.bfloat16, gen) for sp in specs]
    vs = [random_bits((sp.num_kv_heads, prompt_len, sp.head_dim_v), torch.bfloat16, gen) for sp in specs]
    bufs = [paged_buffer(2 * n_blocks, sp.num_kv_heads, block_size, 2 * sp.head_dim_k, torch.bfloat16, gen)
            for sp in specs]
    for buf, k, v, sp in zip(bufs, ks, vs, specs):  # the prefill wrote the prompt's K/V
        scatter_slots(buf, slots(block_ids, block_size, 0, prompt_len), {"k": k, "v": v}, sp.head_dim_k)

    whole = KVStore(MemoryStore())
    T = s * C
    h = Header(arch=arch, token_count=T, dtype="bf16", chunk_tokens=C, model=key.identity)
    whole_res = whole.put_cache(KVCache(h, [{"k": as_numpy(k[:, :T]), "v": as_numpy(v[:, :T])}
                                            for k, v in zip(ks, vs)]), prompt[:T])
    assert whole_res.keys == key.space.keys(prompt[:T])

    def step(store, a, b):
        ids = slots(block_ids, block_size, a * C, b * C)
        layers = [gather_slots(buf, ids, sp.head_dim_k) for buf, sp in zip(bufs, specs)]
        return store.put_cache(chunk_cache(key, layers, a * C, (b - a) * C), prompt[:b * C])

    stepped = KVStore(MemoryStore())
    res = step(stepped, f, s)
    assert res.written == s - f and res.keys == whole_res.keys[f:]
    assert sorted(stepped.store.list()) == sorted(whole_res.keys[f:])
    for k in whole_res.keys[f:]:
        assert stepped.store.get(k) == whole.store.get(k), k
    assert stepped.lookup(prompt, key.space).chunks == (0 if f else s)  # the hits end at the first miss
    if f:
        assert step(stepped, 0, f).written == f
    got = stepped.get_cache(prompt, key.space)
    assert got.tokens == T
    for layer, k, v in zip(got.cache.layers, ks, vs):
        assert np.array_equal(as_numpy(layer["k"]).view(np.uint16), as_numpy(k[:, :T]).view(np.uint16))
        assert np.array_equal(as_numpy(layer["v"]).view(np.uint16), as_numpy(v[:, :T]).view(np.uint16))


def test_mla_chunk_cache_round_trips_through_the_store(tmp_path):
    """An MLA model (no weights on disk: model_fingerprint given) saves gathered latents and
    loads them back into other blocks bit for bit."""
    spec = LayerSpec("mla_latent", 1, LATENT, 0, kv_lora_rank=512, qk_rope_head_dim=64)
    arch = Architecture((spec, spec))
    key = ModelKey.of(arch, "bf16", str(tmp_path), chunk_tokens=16, fingerprint="5a" * 32)
    gen = torch.Generator().manual_seed(9)
    bufs = [paged_buffer(8, 1, 16, LATENT, torch.bfloat16, gen) for _ in arch.layers]
    prompt = list(range(40))
    ids = slots([6, 1, 3], 16, 0, 32)
    layers = [gather_slots(b, ids, LATENT, "latent") for b in bufs]
    kv = KVStore(MemoryStore())
    assert kv.put_cache(chunk_cache(key, layers, 0, 32), prompt[:32]).written == 2
    got = kv.get_cache(prompt, key.space)
    assert got.tokens == 32
    dst = [paged_buffer(8, 1, 16, LATENT, torch.bfloat16, gen) for _ in arch.layers]
    to = slots([0, 7], 16, 0, 32)
    for d, layer in zip(dst, got.cache.layers):
        scatter_slots(d, to, layer, LATENT, "latent")
    for src, d in zip(bufs, dst):
        assert torch.equal(bits(gather_slots(d, to, LATENT, "latent")["latent"]),
                           bits(gather_slots(src, ids, LATENT, "latent")["latent"]))


# -- ModelKey -------------------------------------------------------------------------------

def copy_model(src: str, dst, change: str | None = None, shards: int = 1):
    """A copy of the model directory whose weights are re-saved with safetensors (new file
    bytes); ``change``: flip the low bit of that tensor's first element; ``shards``: split."""
    dst.mkdir()
    shutil.copy(f"{src}/config.json", dst / "config.json")
    tensors = load_file(f"{src}/model.safetensors")
    if change is not None:
        t = tensors[change].clone()
        t.view(torch.int16).view(-1)[0] ^= 1
        tensors[change] = t
    names = sorted(tensors)
    for i in range(shards):
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, str(dst / f"model-{i + 1:05d}-of-{shards:05d}.safetensors"),
                  metadata={"format": "pt", "copy": "kvwire test"})
    return str(dst)


def test_model_key_is_stable_and_binds_the_weights(fidelity, tmp_path):
    """KVW-STORE-12, 13: the same directory keys the same; re-saved (or sharded) identical
    weights key the same (the named tensors are hashed, not the file bytes); one changed
    tensor element gives another compat fingerprint, so other keys and no hit in the store."""
    arch, cfg = fidelity

    def of(d):
        return ModelKey.of(arch, "bf16", d, chunk_tokens=32, config=cfg)

    a, b = of(MODEL_DIR), of(MODEL_DIR)
    assert a.identity.compat_fingerprint == b.identity.compat_fingerprint and a.space == b.space
    assert a.identity.weights_fingerprint == model_weights_fingerprint(MODEL_DIR)
    assert a.identity.config_fingerprint == config_fingerprint(cfg)
    assert a.space.root.startswith(f"kvw1/{a.identity.compat_fingerprint.hex()}/bf16/tp0of1/l0-4/lossless/c32/")

    same = copy_model(MODEL_DIR, tmp_path / "same", shards=3)
    with open(f"{MODEL_DIR}/model.safetensors", "rb") as f, open(f"{same}/model-00001-of-00003.safetensors", "rb") as g:
        assert f.read() != g.read()
    assert of(same).identity.compat_fingerprint == a.identity.compat_fingerprint

    changed = of(copy_model(MODEL_DIR, tmp_path / "changed", change="model.layers.2.self_attn.k_proj.weight"))
    assert changed.identity.weights_fingerprint != a.identity.weights_fingerprint
    assert changed.identity.compat_fingerprint != a.identity.compat_fingerprint
    prompt = list(range(100))
    assert not set(a.space.keys(prompt)) & set(changed.space.keys(prompt))

    kv = KVStore(MemoryStore())
    gen = torch.Generator().manual_seed(1)
    layers = [{"k": random_bits((2, 64, 64), torch.bfloat16, gen), "v": random_bits((2, 64, 64), torch.bfloat16, gen)}
              for _ in arch.layers]
    assert kv.put_cache(chunk_cache(a, layers, 0, 64), prompt[:64]).written == 2
    assert kv.lookup(prompt, a.space).chunks == 2
    assert kv.lookup(prompt, changed.space).chunks == 0


def test_model_fingerprint_override_is_used_as_given(fidelity, tmp_path):
    arch, cfg = fidelity
    hashed = ModelKey.of(arch, "bf16", MODEL_DIR, chunk_tokens=32, config=cfg)
    given_ = ModelKey.of(arch, "bf16", MODEL_DIR, chunk_tokens=32, config=cfg, fingerprint="ab" * 32)
    other = ModelKey.of(arch, "bf16", MODEL_DIR, chunk_tokens=32, config=cfg, fingerprint="cd" * 32)
    assert given_.identity.weights_fingerprint == bytes.fromhex("ab" * 32)
    assert len({k.identity.compat_fingerprint for k in (hashed, given_, other)}) == 3
    bare = tmp_path / "bare"  # config only, no weights: the override is all the key needs
    bare.mkdir()
    shutil.copy(f"{MODEL_DIR}/config.json", bare / "config.json")
    assert (ModelKey.of(arch, "bf16", str(bare), chunk_tokens=32, config=cfg, fingerprint="ab" * 32).identity
            == given_.identity)


def test_model_without_safetensors_names_the_override(fidelity, tmp_path):
    arch, cfg = fidelity
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match=r"no \*\.safetensors.*kv_connector_extra_config\['model_fingerprint'\]"):
        ModelKey.of(arch, "bf16", str(tmp_path), chunk_tokens=32, config=cfg)


def test_tokenizer_files_bind_the_key(fidelity, tmp_path):
    """The tokenizer digest covers the tokenizer files' names and bytes (none: 32 zero bytes),
    so a model directory with another tokenizer keys apart."""
    arch, cfg = fidelity
    assert files_digest(MODEL_DIR, ("tokenizer.json", "vocab.json")) == bytes(32)
    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenizer.json").write_bytes(b'{"model": {"vocab": {"a": 0}}}')
    one = files_digest(str(d), ("tokenizer.json", "vocab.json"))
    (d / "tokenizer.json").rename(d / "vocab.json")
    renamed = files_digest(str(d), ("tokenizer.json", "vocab.json"))
    assert len({one, renamed, bytes(32)}) == 3
    keys = [ModelKey.of(arch, "bf16", str(p), chunk_tokens=32, config=cfg, fingerprint="ab" * 32)
            for p in (tmp_path, d)]
    assert keys[0].identity.tokenizer_fingerprint == bytes(32) and keys[1].identity.tokenizer_fingerprint == renamed
    assert keys[0].identity.compat_fingerprint != keys[1].identity.compat_fingerprint


def test_tensor_in_two_shards_is_a_value_error(tmp_path):
    """A malformed checkpoint naming one tensor in two shards: a ValueError naming it (it
    was a TypeError comparing safetensors handles)."""
    save_file({"w": torch.zeros(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"w": torch.ones(2)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    with pytest.raises(ValueError, match="'w' appears twice"):
        model_weights_fingerprint(str(tmp_path))


# -- layer_index, dtype_of ------------------------------------------------------------------

@pytest.mark.parametrize("name, want", [
    ("model.layers.12.self_attn.attn", 12), ("model.layers.0.self_attn.attn", 0),
    ("layers.3.attn", 3), ("language_model.model.layers.40.self_attn.attn", 40),
])
def test_layer_index(name, want):
    assert layer_index(name) == want


@pytest.mark.parametrize("name", ["model.self_attn.attn", "model.layers.x.self_attn.attn", "model.layers.12",
                                  "model.sublayers.3.attn", ""])
def test_layer_index_refuses_names_without_a_layer_number(name):
    with pytest.raises(ValueError, match="cannot tell the model layer"):
        layer_index(name)


def test_dtype_of():
    assert [dtype_of(t) for t in (torch.bfloat16, torch.float16, torch.float32)] == ["bf16", "f16", "f32"]
    for t in (torch.float8_e4m3fn, torch.float8_e5m2):
        with pytest.raises(ValueError, match=r"bf16, f16, f32 KV caches \(and fp8 ones, kv_cache_dtype 'fp8'\)"):
            dtype_of(t)
    with pytest.raises(ValueError, match="not torch.int8"):
        dtype_of(torch.int8)
