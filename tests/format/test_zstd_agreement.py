"""One meaning for every valid container (spec section 19, revision 1.4: KVW-CODEC-4,
KVW-CODEC-5, KVW-EVOL-13).

The same container, every checksum valid, decoded to different tensors with libkvwire (the
system libzstd) and the numpy path (python-zstandard's libzstd): the two read some corrupt
zstd frames differently and the record checksum covers only the compressed bytes. Writers
now put zstd's content checksum in every frame; readers verify it, and from format_minor 4
require it. The differential test runs the campaign of conformance/fuzz/zstd_agreement.py
over 100,000 mutated bodies (about 15 s).
"""

from __future__ import annotations

import struct
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import zstandard

import dualpath
import forge
import kvwire
from kvwire.codecs import native
from kvwire.format.errors import CodecError

ROOT = Path(__file__).resolve().parents[2]
LIB = ROOT / "build" / "c" / "libkvwire.so"
sys.path.insert(0, str(ROOT / "conformance" / "fuzz"))
import zstd_agreement as ZA

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def frames_of(data: bytes) -> list[bytes]:
    """Every zstd frame in the bodies of a container (zstd bodies, byteplane planes, stages)."""
    out = []
    with kvwire.open(data) as r:
        width = r.header.itemsize
        for i in range(r.chunk_count):
            c, stored = r.stored(i)
            b = bytes(stored)
            if b[:4] == ZSTD_MAGIC:
                out.append(b)
            elif c.codec == "byteplane_zstd":
                lens = struct.unpack_from(f"<{width}I", b)
                at = 4 * width
                for ln in lens:
                    if b[at : at + 4] == ZSTD_MAGIC:
                        out.append(b[at : at + ln])
                    at += ln
    return out


def tensors(got) -> bytes:
    """A decoded cache's tensors (or a decoded body) as bytes, to compare the two paths."""
    if isinstance(got, kvwire.KVCache):
        return b"".join(np.ascontiguousarray(t).tobytes() for layer in got.layers for t in layer.values())
    return dualpath.as_bytes(got)


def both(fn):
    """(numpy outcome, native outcome) of ``fn()`` (tests/dualpath.py)."""
    return dualpath.both(fn, LIB, tensors)


def _kv_cache(dtype="bf16", tokens=96, dim=64, seed=3):
    return ZA._cache(kvwire.Header(kvwire.Architecture((kvwire.LayerSpec("full_attention", 2, dim, dim),)),
                                   token_count=tokens, dtype=dtype, chunk_tokens=64), seed, False)


CODECS = {"zstd": "zstd", "byteplane": "byteplane", "int4-zstd-stage": "int4-g32-zstd"}


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_writer_checksums_every_zstd_frame(codec):
    """KVW-CODEC-4: every zstd frame the reference writer and libkvwire write carries a content checksum
    (zstd bodies, byteplane planes, lossless stages); format_minor stays the features' (EVOL-12)."""
    data = kvwire.encode(_kv_cache(), codec=CODECS[codec], form="stream")
    native.enable(LIB)  # libkvwire's encoders write the same frames (its writer, KVW-CODEC-4 too)
    try:
        assert kvwire.encode(_kv_cache(), codec=CODECS[codec], form="stream") == data
    finally:
        native.disable()
    frames = frames_of(data)
    assert frames, "the cache must compress, or there is nothing to check"
    for f in frames:
        p = zstandard.get_frame_parameters(f)
        assert p.has_checksum and f[4] & 0x04
    assert kvwire.probe(data).format_minor == 0


def _strip(data: bytes, minor: int) -> bytes:
    """``data`` with its frames re-encoded without content checksums, declaring ``minor``."""
    p = forge.split(data)
    hp = kvwire.probe(data)
    with kvwire.open(data) as r:
        infos = [r.info(i) for i in range(r.chunk_count)]
    p.bodies = [b if ci.codec == "raw" else ZA._strip_checksums(bytes(b), ci.codec, hp.itemsize)
                for ci, b in zip(infos, p.bodies)]
    p.header = forge.header_of(replace(hp, format_minor=minor))
    return forge.patch_preamble(forge.assemble(p), minor=minor)


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_minor_4_requires_content_checksums(codec):
    """KVW-CODEC-5, KVW-EVOL-13: from format_minor 4 a zstd frame without a content checksum is
    ZSTD_CHECKSUM_MISSING, on both paths; below 4 the same container is read, the same tensors
    both ways (the frozen vectors and 1.0-1.3 writers write such frames)."""
    cache = _kv_cache()
    data = kvwire.encode(cache, codec=CODECS[codec], form="stream")
    for minor in (4, 5, 0xFFFF):
        a, b = both(lambda: forge.read_all(_strip(data, minor)))
        assert a == b and (a[0], a[1], a[3]) == ("err", "ZSTD_CHECKSUM_MISSING", "KVW-CODEC-5"), (minor, a, b)
    old = _strip(data, 3)
    assert not any(zstandard.get_frame_parameters(f).has_checksum for f in frames_of(old))
    a, b = both(lambda: forge.read_all(old))
    assert a == b and a[0] == "ok"
    # with checksums, every minor reads (a later writer's container)
    p = forge.split(data)
    p.header = forge.header_of(replace(kvwire.probe(data), format_minor=4))
    a, b = both(lambda: forge.read_all(forge.patch_preamble(forge.assemble(p), minor=4)))
    assert a == b and a[0] == "ok"


@pytest.mark.parametrize("codec", sorted(CODECS))
@pytest.mark.parametrize("minor", [0, 4])
def test_wrong_content_checksum_is_decode_failed(codec, minor):
    """KVW-CODEC-5: a content checksum that does not match the decoded bytes is DECODE_FAILED on
    both paths, whatever the minor, through every reader entry (whole load, chunk into a buffer)."""
    data = kvwire.encode(_kv_cache(), codec=CODECS[codec], form="stream")
    p = forge.split(data)
    body = bytearray(p.bodies[0])
    frame = frames_of(data)[0]
    at = bytes(body).find(frame)
    assert at >= 0
    body[at + len(frame) - 1] ^= 0x40  # the frame's last byte: its content checksum
    p.bodies[0] = bytes(body)
    if minor:
        p.header = forge.header_of(replace(kvwire.probe(data), format_minor=minor))
    bad = forge.patch_preamble(forge.assemble(p), minor=minor)
    a, b = both(lambda: forge.read_all(bad))
    assert a[:2] == b[:2] == ("err", "DECODE_FAILED"), (a, b)

    def into_buffer():
        with kvwire.open(bad) as r:
            c, stored = r.stored(0)
            return r.decode_stored(0, c, stored, out=np.empty(c.raw_length, np.uint8))
    a, b = both(into_buffer)
    assert a[:2] == b[:2] == ("err", "DECODE_FAILED"), (a, b)


def test_zstd_checksum_missing_is_a_codec_error():
    """KVW-CODEC-5: the new code's category is CodecError (spec section 18)."""
    frame = zstandard.ZstdCompressor(write_content_size=True).compress(bytes(100))
    with pytest.raises(CodecError) as e:
        kvwire.codecs.decode_body("zstd", frame, 100, checksum_required=True)
    assert (e.value.code, e.value.rule) == ("ZSTD_CHECKSUM_MISSING", "KVW-CODEC-5")
    assert bytes(kvwire.codecs.decode_body("zstd", frame, 100)) == bytes(100)


@pytest.mark.slow
def test_differential_100k_mutated_bodies():
    """Section 19 (one meaning), KVW-CODEC-4/5: 100,000 mutated bodies of raw, zstd, byteplane
    (bf16, f16, f32) and int_affine+zstd containers, every 200th also read as a whole container
    (tests/forge.py recomputes every checksum): no container is accepted by both paths with
    different tensors, and none by one path only. Without content checksums the same campaign
    finds hundreds (``zstd_agreement.py --minor 0``: 884 of 100,000 with libzstd 1.5.4 and 1.5.7)."""
    native.enable(LIB)
    native.disable()
    counts = ZA.run(100_000, seed=30, containers=200, lib=str(LIB))
    o = counts.outcomes
    assert o["both_differ"] == 0, counts.examples[:5]
    assert o["numpy_only"] == o["native_only"] == 0, counts.examples[:5]
    assert counts.containers == 500 and sum(o.values()) == 100_500
    assert o["both_reject"] > 50_000 and o["both_same"] > 10_000  # the mutations reach the decoders
