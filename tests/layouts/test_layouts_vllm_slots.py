"""kvwire.layouts.gather_slots / scatter_slots: one vLLM layer's K and V by token slot ids,
for every packing a connector copies (spec/layouts.md 3.4, KVW-BIND-4, KVW-BIND-5).

Each packing is checked against where vLLM keeps token t's channel d, written out here
element by element from the spec's tables (not from the code under test): ``channels``
K = C[:D], V = C[D:] of the token's row; ``latent`` the whole row; ``tokens`` with the
vector ISAs K transposed ([D, block_size]) then V ([block_size, D]) per block and head;
``tokens`` with ``amx`` the tile formulas of KVW-BIND-5. Both copy paths (index kernels,
and strided copies per run of slots) are run on the CPU, for any slot ids: random
permutations and the runs of shuffled blocks a request has, starting anywhere in a block.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire import layouts
from kvwire.codecs import native, native_slots
from kvwire.layouts import LayoutMismatchError, check_slot_packing, gather_slots, scatter_slots

# (packing, cpu_isa): every copy gather_slots / scatter_slots make
KINDS = [("channels", None), ("latent", None), ("tokens", "vec"), ("tokens", "vec16"), ("tokens", "amx")]
DTYPES = {"bf16": (torch.bfloat16, torch.int16), "f16": (torch.float16, torch.int16),
          "fp8": (torch.uint8, torch.uint8), "f32": (torch.float32, torch.int32)}


def positions(kind, nb: int, h: int, n: int, d: int, slot_ids: np.ndarray) -> dict:
    """{component: flat element index into the layer [nb, h, n, C] (C = 2d, latent: d) of
    every (head, token, channel)}, as [h, tokens, d] arrays: where vLLM keeps them."""
    packing, isa = kind
    c = d if packing == "latent" else 2 * d
    b, o = slot_ids // n, slot_ids % n
    hh, oo, dd = np.arange(h)[:, None, None], o[None, :, None], np.arange(d)[None, None, :]
    bb = b[None, :, None]
    row = ((bb * h + hh) * n) * c  # the start of the block and head: [nb, h] * (n * c)
    if packing == "latent":
        return {"latent": row + oo * c + dd}
    if packing == "channels":
        return {"k": row + oo * c + dd, "v": row + oo * c + d + dd}
    half = n * d  # per block and head: K's half, then V's
    if isa == "amx":
        k = ((oo // 16) * (d // 2) + dd // 2) * 32 + (oo % 16) * 2 + dd % 2
        v = ((dd // 16) * (n // 2) + oo // 2) * 32 + (dd % 16) * 2 + oo % 2
    else:
        k, v = dd * n + oo, oo * d + dd
    return {"k": row + k, "v": row + half + v}


@st.composite
def geometries(draw):
    kind = draw(st.sampled_from(KINDS), "kind")
    amx = kind[1] == "amx"
    n = draw(st.sampled_from([16, 32] if amx else [1, 2, 4, 16]), "block_size")
    d = draw(st.sampled_from([16, 32] if amx else [1, 8, 16]), "head_dim")
    h = 1 if kind[0] == "latent" else draw(st.integers(1, 3), "heads")
    nb = draw(st.integers(1, 6), "num_blocks")
    if draw(st.booleans(), "request"):  # a request's tokens: shuffled blocks, from any offset in the first
        blocks = draw(st.permutations(range(nb)), "blocks")
        start = draw(st.integers(0, n - 1), "start")
        stop = draw(st.integers(start, nb * n), "stop")
        ids = np.asarray(layouts.slots_from_blocks(blocks, n, stop))[start:]
    else:
        perm = draw(st.permutations(range(nb * n)), "slots")
        ids = np.asarray(perm[: draw(st.integers(0, len(perm)), "tokens")], dtype=np.int64)
    return kind, nb, h, n, d, ids


@settings(max_examples=200, deadline=None)
@given(geo=geometries(), dtype=st.sampled_from(sorted(DTYPES)), indexed=st.booleans(),
       seed=st.integers(0, 2**31 - 1), c_copies=st.booleans())
def test_every_packing_scatters_and_gathers_bit_exactly(lib, geo, dtype, indexed, seed, c_copies):
    """Random bit patterns (NaN payloads, fp8 bytes) scattered to the slots land exactly
    where vLLM keeps them, nothing else changes, and gathering gives them back bit for bit:
    with libkvwire's slot copies (``c_copies``: kvw_scatter_slots / kvw_gather_slots, rows
    and 8 x 8 transposed tiles) and with numpy's."""
    native.enable(lib) if c_copies else native.disable()
    (packing, isa), nb, h, n, d, ids = geo
    tdt, bits = DTYPES[dtype]
    gen = torch.Generator().manual_seed(seed)
    c = d if packing == "latent" else 2 * d
    info = torch.iinfo(bits)

    def rand(shape):
        return torch.randint(info.min, info.max, shape, dtype=torch.int64, generator=gen).to(bits)

    buf = rand((nb, h, n, c))
    before = buf.clone()
    comps = ("latent",) if packing == "latent" else ("k", "v")
    arrays = {comp: rand((h, len(ids), d)) for comp in comps}
    scatter_slots(buf.view(tdt), ids, {k: x.view(tdt) for k, x in arrays.items()}, d, packing, isa, indexed=indexed)
    want = before.reshape(-1).clone()
    for comp, pos in positions((packing, isa), nb, h, n, d, ids).items():
        want[torch.from_numpy(pos.reshape(-1))] = arrays[comp].reshape(-1)
    assert torch.equal(buf.reshape(-1), want)
    for path in (indexed, not indexed):
        got = gather_slots(buf.view(tdt), ids, d, packing, isa, indexed=path)
        assert set(got) == set(comps)
        for comp in comps:
            assert got[comp].dtype == tdt and got[comp].is_contiguous() and got[comp].shape == (h, len(ids), d)
            assert torch.equal(got[comp].view(bits), arrays[comp]), (comp, path)


def test_host_arrays_and_non_contiguous_tensors_scatter_like_tensors():
    """numpy arrays (ml_dtypes bfloat16) and sliced tensors are written like contiguous ones;
    gathered tensors are copies that outlive the engine's blocks."""
    from kvwire.cache.tensors import as_numpy

    gen = torch.Generator().manual_seed(3)
    buf = torch.randint(-2**15, 2**15 - 1, (5, 2, 16, 64), dtype=torch.int16, generator=gen).view(torch.bfloat16)
    ids = layouts.slots_from_blocks([3, 0, 4], 16, 40)[5:]
    full = torch.randint(-2**15, 2**15 - 1, (2, 60, 32), dtype=torch.int16, generator=gen).view(torch.bfloat16)
    k, v = full[:, 2:37], full[:, 20:55]
    assert not k.is_contiguous()
    for packing, isa in (("channels", None), ("tokens", "vec"), ("tokens", "amx")):
        scatter_slots(buf, ids, {"k": k, "v": as_numpy(v)}, 32, packing, isa)
        got = gather_slots(buf, ids, 32, packing, isa)
        buf.zero_()
        assert torch.equal(got["k"].view(torch.int16), k.view(torch.int16))
        assert torch.equal(got["v"].view(torch.int16), v.view(torch.int16))


@pytest.mark.parametrize(("args", "error", "match"), [
    (("heads",), LayoutMismatchError, r"packing 'heads'.*copied: channels, latent, tokens"),
    (("quantised",), LayoutMismatchError, r"packing 'quantised'.*copied: channels, latent, tokens"),
    (("rows",), LayoutMismatchError, r"packing must be one of \('channels', 'latent', 'tokens'\)"),
    (("tokens",), LayoutMismatchError, r"pass cpu_isa=.*registered: vec, vec16"),
    (("tokens", "sve"), LayoutMismatchError, r"ISA 'sve': not known here; known: vec"),
    (("tokens", "neon", "bfloat16"), LayoutMismatchError, "BFMMLA"),
    (("channels", "vec"), ValueError, "cpu_isa= is for packing 'tokens'"),
])
def test_packings_without_a_slot_copy_are_refused_by_name(args, error, match):
    """KVW-BIND-4: a packing, ISA or dtype the copies do not cover is an error naming the
    valid choices, never a guess."""
    with pytest.raises(error, match=match):
        check_slot_packing(*args)
    with pytest.raises(error, match=match):
        gather_slots(torch.zeros((2, 1, 16, 32), dtype=torch.bfloat16), np.arange(3), 16, *args[:2])


def test_every_known_backend_maps_to_a_copy_or_a_refusal():
    """Each backend of the packing table either has a slot copy (its packing is one of
    SLOT_PACKINGS) or is refused by check_slot_packing; the slot packings are packings."""
    assert set(layouts.SLOT_PACKINGS) <= set(layouts.KV_PACKINGS)
    for backend, (packing, _) in layouts.VLLM_BACKENDS.items():
        isa = "vec" if packing == "tokens" else None
        if packing in layouts.SLOT_PACKINGS:
            assert check_slot_packing(layouts.vllm_kv_packing(backend), isa) in ("channels", "latent", "vec"), backend
        else:
            with pytest.raises(LayoutMismatchError):
                check_slot_packing(packing, isa)


def test_other_element_widths_are_refused():
    """Arrays of another element width are never reinterpreted into the cache."""
    buf = torch.zeros((2, 1, 4, 16), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="convert explicitly"):
        scatter_slots(buf, np.arange(3), {"k": torch.zeros((1, 3, 8)), "v": torch.zeros((1, 3, 8))}, 8)


def test_a_paged_layer_and_a_slot_plan_serve_every_layer_like_scatter_slots():
    """``PagedLayer`` works the views out once and a ``SlotPlan`` the copies once: used
    layer after layer (read-only numpy views of bytes included, as a store's reply gives
    them), they write what ``scatter_slots`` writes and gather it back; a plan made for
    another block size is refused."""
    import numpy as np

    gen = torch.Generator().manual_seed(5)
    ids = layouts.slots_from_blocks([6, 1, 3, 4], 32, 100)[7:]
    for (packing, isa), indexed in itertools.product((("channels", None), ("tokens", "vec"), ("tokens", "amx")),
                                                     (None, True)):  # strided copies, or a device's index kernels
        bufs = [torch.randint(-2**15, 2**15 - 1, (8, 2, 32, 64), dtype=torch.int16, generator=gen).view(torch.bfloat16)
                for _ in range(3)]
        want = [b.clone() for b in bufs]
        plan = layouts.SlotPlan(ids, 32)
        for buf, ref in zip(bufs, want):
            raw = torch.randint(-2**15, 2**15 - 1, (2, 2, len(ids), 32), dtype=torch.int16, generator=gen)
            blob = raw.numpy().tobytes()  # read-only, like a store's reply
            k, v = (np.frombuffer(blob, np.uint16, len(ids) * 64, x * len(ids) * 64 * 2).reshape(2, len(ids), 32)
                    for x in (0, 1))
            layer = layouts.PagedLayer(buf, 32, packing, isa, indexed=indexed)
            layer.scatter(plan, {"k": k, "v": v})
            layouts.scatter_slots(ref, ids, {"k": k, "v": v}, 32, packing, isa)
            assert torch.equal(buf.view(torch.int16), ref.view(torch.int16)), (packing, isa, indexed)
            got = layer.gather(plan)
            assert np.array_equal(got["k"].view(torch.int16).numpy().view(np.uint16), k)
            assert np.array_equal(got["v"].view(torch.int16).numpy().view(np.uint16), v)
        with pytest.raises(ValueError, match="blocks of 16 tokens"):
            layouts.PagedLayer(bufs[0], 32, packing, isa).scatter(layouts.SlotPlan(ids, 16), {"k": k, "v": v})


def test_c_slot_copies_take_the_cpu_views_and_refuse_slots_outside_them(lib):
    """libkvwire copies vLLM's CPU views itself (K transposed per block and head, V rows: the
    C path is taken, not numpy's) and checks every slot id before writing: one outside the
    view is a ValueError and the buffer is unchanged."""
    native.enable(lib)
    gen = torch.Generator().manual_seed(5)
    buf = torch.randint(-2**15, 2**15 - 1, (4, 2, 32, 256), dtype=torch.int16, generator=gen)
    paged = layouts.PagedLayer(buf.view(torch.bfloat16), 128, "tokens", "vec")
    ids = np.asarray(layouts.slots_from_blocks([2, 0], 32, 64), dtype=np.int64)
    std = torch.randint(-2**15, 2**15 - 1, (2, 64, 128), dtype=torch.int16, generator=gen).numpy()
    for comp in ("k", "v"):
        assert native_slots.scatter_slots(std, ids, paged.host_views[comp])
        back = np.empty_like(std)
        assert native_slots.gather_slots(paged.host_views[comp], ids, back)
        assert np.array_equal(back, std)
    before = buf.clone()
    bad = ids.copy()
    bad[-1] = 4 * 32  # one past the view's last slot
    with pytest.raises(ValueError, match="outside the view's 128 slots"):
        native_slots.scatter_slots(std, bad, paged.host_views["k"])
    assert torch.equal(buf, before)
    native.disable()
    assert not native_slots.scatter_slots(std, ids, paged.host_views["k"])  # numpy's copies then


@pytest.mark.parametrize(("n", "d"), [(16, 8), (16, 12), (32, 20), (32, 128), (8, 7)])
@pytest.mark.parametrize("dtype", ["bf16", "fp8", "f32"])
def test_c_slot_copies_equal_numpys_for_every_run_and_tile_edge(lib, n, d, dtype):
    """libkvwire's copies give the buffer numpy's copies give, for runs that start and end
    anywhere in a block (8 x 8 tiles and the tokens and channels past them) and every
    element width, in both directions."""
    tdt, bits = DTYPES[dtype]
    info = torch.iinfo(bits)
    gen = torch.Generator().manual_seed(n * 1000 + d)
    nb, h = 5, 2
    for start, stop in ((0, nb * n), (3, 3 * n + 5), (n - 1, 2 * n + 9), (5, 5 + 13)):
        ids = np.asarray(layouts.slots_from_blocks([4, 1, 3, 0, 2], n, stop), dtype=np.int64)[start:]
        base = torch.randint(info.min, info.max, (nb, h, n, 2 * d), dtype=torch.int64, generator=gen).to(bits)
        arrays = {c: torch.randint(info.min, info.max, (h, len(ids), d), dtype=torch.int64, generator=gen).to(bits)
                  for c in ("k", "v")}
        got = {}
        for c_copies in (True, False):
            native.enable(lib) if c_copies else native.disable()
            buf = base.clone()
            scatter_slots(buf.view(tdt), ids, {c: x.view(tdt) for c, x in arrays.items()}, d, "tokens", "vec",
                          indexed=False)
            got[c_copies] = buf
            back = gather_slots(buf.view(tdt), ids, d, "tokens", "vec", indexed=False)
            assert all(torch.equal(back[c].view(bits), arrays[c]) for c in arrays), (start, stop, c_copies)
        assert torch.equal(got[True], got[False]), (start, stop)
