"""Conformance vectors of revision 1.4: zstd content checksums (spec/kvwire-v1.md KVW-CODEC-4,
KVW-CODEC-5, KVW-EVOL-13; section 19 "one meaning for every valid container"), appended to
the major-1 folder with ``generate.py --add zstd_checksums``.

Valid vectors: a 1.4 writer's zstd, byteplane_zstd and int_affine + zstd stage containers
(every frame with a content checksum, format_minor as the features say: 0), and the same
bodies in containers that declare minor 4. Invalid vectors: a frame without a content
checksum in a minor-4 container, one per place a zstd frame lives (a zstd body, a byteplane
plane, a lossless stage), with ZSTD_CHECKSUM_MISSING; a content checksum that does not match
the decoded bytes, with DECODE_FAILED, at minor 0 and minor 4.
"""

from __future__ import annotations

import struct
from dataclasses import replace

import numpy as np
import zstandard

import forge
import kvwire
from add_codecs import PRODUCER, expected
from kvwire.format import registry as R
from kvwire.format.header import Architecture, Header, LayerSpec

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
RULES = ["KVW-CODEC-4", "KVW-CODEC-5"]


def _cache(h: Header, seed: int) -> kvwire.KVCache:
    """Gaussian K/V: exponent bytes zstd shrinks, mantissas it codes as Huffman literals."""
    rng = np.random.default_rng(seed)
    return kvwire.KVCache(h, [{c: (rng.standard_normal(s.shape(c, r.count)) * 0.5).astype(R.DTYPES[h.dtype][2])
                               for c in s.components} for s, r in zip(h.arch.layers, h.layer_tokens)])


def _frames(body: bytes, codec: str, width: int) -> list[tuple[int, int]]:
    """(offset, length) of each zstd frame in a body."""
    if body[:4] == ZSTD_MAGIC:
        return [(0, len(body))]
    if codec != "byteplane_zstd":
        return []
    out, at = [], 4 * width
    for ln in struct.unpack_from(f"<{width}I", body):
        if body[at : at + 4] == ZSTD_MAGIC:
            out.append((at, ln))
        at += ln
    return out


def _recode(body: bytes, codec: str, width: int, fn) -> bytes:
    """``body`` with each zstd frame replaced by ``fn(frame)`` (byteplane lengths fixed)."""
    frames = _frames(body, codec, width)
    if body[:4] == ZSTD_MAGIC:
        return fn(body)
    lens = list(struct.unpack_from(f"<{width}I", body))
    pieces, at = [], 4 * width
    for j, ln in enumerate(lens):
        piece = body[at : at + ln]
        if (at, ln) in frames:
            piece = fn(piece)
            lens[j] = len(piece)
        pieces.append(piece)
        at += ln
    return struct.pack(f"<{width}I", *lens) + b"".join(pieces) + body[at:]


def _no_checksum(frame: bytes) -> bytes:
    raw = zstandard.ZstdDecompressor().decompress(frame)
    return zstandard.ZstdCompressor(level=3, write_content_size=True, write_checksum=False).compress(raw)


def _wrong_checksum(frame: bytes) -> bytes:
    assert zstandard.get_frame_parameters(frame).has_checksum
    return frame[:-4] + bytes(b ^ 0x5A for b in frame[-4:])


def _edit(data: bytes, fn, *, minor: int | None = None, first_only: bool = True) -> bytes:
    """``data`` with the zstd frames of its first compressed body (all bodies when not
    ``first_only``) recoded by ``fn``, declaring ``minor`` when given; every checksum fixed."""
    p = forge.split(data)
    hp = kvwire.probe(data)
    with kvwire.open(data) as r:
        infos = [r.info(i) for i in range(r.chunk_count)]
    done = False
    for i, (ci, b) in enumerate(zip(infos, p.bodies)):
        if ci.codec == "raw" or not _frames(bytes(b), ci.codec, hp.itemsize) or (first_only and done):
            continue
        p.bodies[i] = _recode(bytes(b), ci.codec, hp.itemsize, fn)
        done = True
    assert done
    if minor is not None:
        p.header = forge.header_of(replace(hp, format_minor=minor))
    return forge.patch_preamble(forge.assemble(p), minor=hp.format_minor if minor is None else minor)


def gen_zstd_checksums(g) -> None:
    """spec/kvwire-v1.md revision 1.4: KVW-CODEC-4, KVW-CODEC-5, KVW-EVOL-13."""
    arch = Architecture((LayerSpec("full_attention", 2, 64, 64), LayerSpec("full_attention", 1, 32, 32)))
    cases = (("zstd", "zstd", "f16", "file", 7401), ("byteplane", "byteplane", "bf16", "stream", 7402),
             ("int4-zstd-stage", "int4-g32-zstd", "bf16", "file", 7403))
    made = {}
    for name, codec, dtype, form, seed in cases:
        h = Header(arch, token_count=80, dtype=dtype, chunk_tokens=64, producer=PRODUCER)
        c = _cache(h, seed)
        data = kvwire.encode(c, codec=codec, form=form)
        hp = kvwire.probe(data)
        assert hp.format_minor == 0 and all(
            zstandard.get_frame_parameters(bytes(b)[o : o + n]).has_checksum
            for ci, b in zip([kvwire.open(data).info(i) for i in range(len(forge.split(data).bodies))],
                             forge.split(data).bodies)
            for o, n in _frames(bytes(b), ci.codec, hp.itemsize)), name
        c = expected(data)  # the decoded values (the int4 body is lossy), by the spec's literal decoder
        made[name] = (data, c, hp)
        g.valid(f"zstd-checksums-{name}", data, c, rules=RULES, expect_header=hp,
                description=f"{dtype} cache ({form} form), codec {codec}: a 1.4 writer's container, every zstd "
                            "frame with a content checksum (Content_Checksum_Flag set, XXH64 of the decoded bytes); "
                            "format_minor 0 (revision 1.4 defines no feature, KVW-EVOL-12)")
        m4 = _edit(data, lambda f: f, minor=4)
        g.valid(f"zstd-checksums-{name}-minor4", m4, c, rules=[*RULES, "KVW-EVOL-13"],
                expect_header=replace(hp, format_minor=4),
                description=f"the same {codec} container declaring format_minor 4: every zstd frame carries a "
                            "content checksum, as minor 4 requires")

    where = {"zstd": "a zstd body", "byteplane": "a byteplane_zstd plane", "int4-zstd-stage": "a zstd lossless stage"}
    for name, (data, _c, _hp) in made.items():
        g.invalid(f"zstd-checksum-missing-minor4-{name}", _edit(data, _no_checksum, minor=4),
                  rule="KVW-CODEC-5", code="ZSTD_CHECKSUM_MISSING", rules=["KVW-EVOL-13"],
                  description=f"format_minor 4, and {where[name]} is a zstd frame without a content checksum "
                              "(otherwise valid: size, blocks and every container checksum correct)")
    for minor in (0, 4):
        for name in ("zstd", "byteplane"):
            data = made[name][0]
            g.invalid(f"zstd-content-checksum-wrong-{name}-minor{minor}",
                      _edit(data, _wrong_checksum, minor=minor if minor else None),
                      rule="KVW-CODEC-2", code="DECODE_FAILED", rules=["KVW-CODEC-5"],
                      description=f"format_minor {minor}: {where[name]} whose content checksum does not match its "
                                  "decoded bytes (the 4 checksum bytes changed; the record checksum recomputed)")
    # what a 1.0-1.3 writer wrote: frames without a checksum, minor 3, still valid (EVOL-13 (c))
    data, c, hp = made["zstd"]
    old = _edit(data, _no_checksum, minor=3, first_only=False)
    g.valid("zstd-checksums-absent-minor3", old, c, rules=["KVW-CODEC-3", "KVW-EVOL-13"],
            expect_header=replace(hp, format_minor=3),
            description="format_minor 3, zstd frames without a content checksum (as writers of 1.0 to 1.3 wrote "
                        "them): valid; KVW-CODEC-5 applies from minor 4 only")


ADDITION = {
    "make": gen_zstd_checksums,
    "spec": "spec/kvwire-v1.md revision 1.4: zstd content checksums (KVW-CODEC-4, KVW-CODEC-5, KVW-EVOL-13), "
            "error code ZSTD_CHECKSUM_MISSING",
    "rules_without_vector": {
        "KVW-CODEC-4": "Writer-only: every frame a writer writes carries a content checksum; the valid vectors of "
                       "this set show it, and tests/format/test_zstd_agreement.py checks both writers.",
        "Section 19 (one meaning)": "A property of two readers, not of one container: "
                                    "conformance/fuzz/zstd_agreement.py and tests/format/test_zstd_agreement.py decode "
                                    "100,000 mutated bodies with libkvwire and the numpy path.",
    },
}
