/*
 * Chunk body decoding (spec section 13, spec/codecs.md): the dispatch of a record to its
 * codec and codec spec, the zstd frame checks of KVW-CODEC-2/3 (made on the frame header
 * before libzstd decodes anything, so a bomb or a size disagreement never costs a block),
 * byte planes (KVW-BPZ-*), the lossless stage of a lossy spec (KVW-CSPEC-7) and the
 * POSITIONS varints of sparse containers (spec/sparse.md SPARSE-10/11). The lossy
 * arithmetic lives in codecs_lossy.c, the encoders in codecs_enc.c.
 *
 * No global state: every call makes its own ZSTD_DCtx. Every buffer allocated here is
 * bounded by raw_length (KVW-LIM-4, checked by the reader) or the stored length.
 */
#include "decode/decode.h"

#include <stdio.h>
#include <stdlib.h>

#define ZSTD_MAGIC 0xFD2FB528u
#define ZSTD_SKIP_MAGIC 0x184D2A50u /* 0x184D2A50 .. 0x184D2A5F */
#define ZSTD_MAX_WINDOW_LOG (sizeof(size_t) == 4 ? 30u : 31u)

/* ---- zstd (KVW-CODEC-2, KVW-CODEC-3) ------------------------------------------------ */

kvw_code kvwc_zstd_decode(ZSTD_DCtx *dctx, const uint8_t *src, size_t n, uint8_t *dst,
                          size_t dst_len, int need_checksum, const char *what, kvw_error *err) {
    if (n < 4)
        return kvw_fail(err, KVW_DECODE_FAILED, "KVW-CODEC-2",
                        "%s: zstd frame header invalid: %zu bytes, no magic number", what, n);
    uint32_t magic = kvw_ld32(src);
    if ((magic & 0xFFFFFFF0u) == ZSTD_SKIP_MAGIC) {
        if (n < 8)
            return kvw_fail(err, KVW_DECODE_FAILED, "KVW-CODEC-2",
                            "%s: skippable zstd frame header truncated (%zu bytes)", what, n);
        return kvw_fail(err, KVW_DECODED_SIZE_MISMATCH, "KVW-CODEC-2",
                        "%s starts with a skippable frame, which declares no content size; "
                        "%zu bytes expected", what, dst_len);
    }
    if (magic != ZSTD_MAGIC)
        return kvw_fail(err, KVW_DECODE_FAILED, "KVW-CODEC-2",
                        "%s: not a zstd frame (magic 0x%08X)", what, (unsigned)magic);
    if (n < 5)
        return kvw_fail(err, KVW_DECODE_FAILED, "KVW-CODEC-2",
                        "%s: zstd frame header truncated (%zu bytes)", what, n);
    unsigned fhd = src[4];
    unsigned fcs_flag = fhd >> 6, single = (fhd >> 5) & 1u, dict_flag = fhd & 3u;
    if (fhd & 0x08u)
        return kvw_fail(err, KVW_DECODE_FAILED, "KVW-CODEC-2",
                        "%s: zstd frame header descriptor 0x%02X has the reserved bit set", what,
                        fhd);
    size_t at = 5;
    if (!single) {
        if (n < 6)
            return kvw_fail(err, KVW_DECODE_FAILED, "KVW-CODEC-2",
                            "%s: zstd frame header ends before its window descriptor", what);
        unsigned wlog = (unsigned)(src[5] >> 3) + 10u;
        if (wlog > ZSTD_MAX_WINDOW_LOG)
            return kvw_fail(err, KVW_DECODE_FAILED, "KVW-CODEC-2",
                            "%s: zstd frame header invalid: window log %u", what, wlog);
        at = 6;
    }
    static const unsigned did_size[4] = {0, 1, 2, 4};
    unsigned fcs_size = fcs_flag == 0 ? single : (1u << fcs_flag); /* 0/1, 2, 4, 8 */
    size_t hdr = at + did_size[dict_flag] + fcs_size;
    if (n < hdr)
        return kvw_fail(err, KVW_DECODE_FAILED, "KVW-CODEC-2",
                        "%s: zstd frame header of %zu bytes truncated at %zu", what, hdr, n);
    uint32_t dict_id = 0;
    for (unsigned k = 0; k < did_size[dict_flag]; k++) dict_id |= (uint32_t)src[at + k] << (8 * k);
    at += did_size[dict_flag];
    if (fcs_size == 0)
        return kvw_fail(err, KVW_DECODED_SIZE_MISMATCH, "KVW-CODEC-2",
                        "%s: zstd frame does not declare its content size; %zu bytes expected",
                        what, dst_len);
    uint64_t fcs = 0;
    for (unsigned k = 0; k < fcs_size; k++) fcs |= (uint64_t)src[at + k] << (8 * k);
    if (fcs_size == 2) fcs += 256;
    if (fcs != (uint64_t)dst_len)
        return kvw_fail(err, KVW_DECODED_SIZE_MISMATCH, "KVW-CODEC-2",
                        "%s: zstd frame declares %llu bytes, %zu expected", what,
                        (unsigned long long)fcs, dst_len);
    if (dict_id != 0)
        return kvw_fail(err, KVW_DECODE_FAILED, "KVW-CODEC-3",
                        "%s: zstd frame needs dictionary %u", what, (unsigned)dict_id);
    if (need_checksum && !(fhd & 0x04u)) /* Content_Checksum_Flag */
        return kvw_fail(err, KVW_ZSTD_CHECKSUM_MISSING, "KVW-CODEC-5",
                        "%s: zstd frame without a content checksum in a container of format 1.%u "
                        "or later", what, KVWC_CHECKSUM_MINOR);
    size_t fsize = ZSTD_findFrameCompressedSize(src, n);
    if (ZSTD_isError(fsize))
        return kvw_fail(err, KVW_DECODE_FAILED, "KVW-CODEC-2", "%s: zstd: %s", what,
                        ZSTD_getErrorName(fsize));
    if (fsize != n)
        return kvw_fail(err, KVW_DECODE_FAILED, "KVW-CODEC-2",
                        "%s: %zu bytes after the zstd frame of %zu bytes", what, n - fsize, fsize);
    size_t got = ZSTD_decompressDCtx(dctx, dst, dst_len, src, n);
    if (ZSTD_isError(got))
        return kvw_fail(err, KVW_DECODE_FAILED, "KVW-CODEC-2", "%s: zstd: %s", what,
                        ZSTD_getErrorName(got));
    if (got != dst_len)
        return kvw_fail(err, KVW_DECODE_FAILED, "KVW-CODEC-2",
                        "%s: zstd produced %zu bytes, %zu declared", what, got, dst_len);
    return KVW_OK;
}

/* ---- byte planes (KVW-BPZ-1..3) ------------------------------------------------------ */

/* Planes back into elements. Full blocks of IB elements have a constant trip count, so
 * that compilers vectorize them at -O2. */
#define IB 1024
static void interleave(uint8_t *dst, const uint8_t *const *pl, size_t N, unsigned w) {
    size_t e0 = 0;
    if (w == 2) {
        const uint8_t *p0 = pl[0], *p1 = pl[1];
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        for (; e0 + 4 <= N; e0 += 4) { /* 4 elements: spread the bytes of two words */
            uint32_t hi32, lo32;
            memcpy(&hi32, p0 + e0, 4);
            memcpy(&lo32, p1 + e0, 4);
            uint64_t a = hi32, b = lo32;
            a = (a | a << 16) & UINT64_C(0x0000FFFF0000FFFF);
            a = (a | a << 8) & UINT64_C(0x00FF00FF00FF00FF);
            b = (b | b << 16) & UINT64_C(0x0000FFFF0000FFFF);
            b = (b | b << 8) & UINT64_C(0x00FF00FF00FF00FF);
            uint64_t v = b | a << 8;
            memcpy(dst + 2 * e0, &v, 8);
        }
#else
        for (; e0 + IB <= N; e0 += IB) {
            uint8_t *restrict d = dst + 2 * e0;
            const uint8_t *restrict a = p0 + e0, *restrict b = p1 + e0;
            for (size_t k = 0; k < IB; k++) {
                d[2 * k] = b[k];
                d[2 * k + 1] = a[k];
            }
        }
#endif
    } else if (w == 4) {
        const uint8_t *p0 = pl[0], *p1 = pl[1], *p2 = pl[2], *p3 = pl[3];
        for (; e0 + IB <= N; e0 += IB) {
            uint8_t *restrict d = dst + 4 * e0;
            const uint8_t *restrict a = p0 + e0, *restrict b = p1 + e0, *restrict c = p2 + e0,
                          *restrict f = p3 + e0;
            for (size_t k = 0; k < IB; k++) {
                d[4 * k] = f[k];
                d[4 * k + 1] = c[k];
                d[4 * k + 2] = b[k];
                d[4 * k + 3] = a[k];
            }
        }
    }
    for (size_t e = e0; e < N; e++) { /* element by element: all reads before the writes */
        uint8_t v[8];
        for (unsigned j = 0; j < w; j++) v[j] = pl[j][e];
        for (unsigned j = 0; j < w; j++) dst[e * w + (w - 1 - j)] = v[j];
    }
}

/* kvwc_byteplane_decode with the caller's scratch (decode/decode.h). */
kvw_code kvwc_byteplane_decode_scratch(ZSTD_DCtx *dctx, const uint8_t *src, size_t n, uint8_t *dst,
                                       size_t L, unsigned w, int need_checksum, const char *rule,
                                       uint8_t *scratch_buf, kvw_error *err) {
    if (w == 0 || w > 8)
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "byteplane element width %u", w);
    size_t N = L / w, r = L - N * w, head = 4u * w;
    if (n < head)
        return kvw_fail(err, KVW_DECODE_FAILED, rule,
                        "byteplane body of %zu bytes, shorter than its %u plane lengths", n, w);
    uint64_t lens[8], sum = head + (uint64_t)r;
    for (unsigned j = 0; j < w; j++) {
        lens[j] = kvw_ld32(src + 4 * j);
        sum += lens[j];
    }
    if (sum != (uint64_t)n)
        return kvw_fail(err, KVW_DECODE_FAILED, rule,
                        "byteplane body of %zu bytes; its plane lengths and a %zu-byte tail "
                        "need %llu", n, r, (unsigned long long)sum);
    unsigned packed = 0;
    for (unsigned j = 0; j < w; j++) {
        if (lens[j] > N)
            return kvw_fail(err, KVW_DECODE_FAILED, rule,
                            "byteplane plane %u: %llu stored bytes for %zu elements", j,
                            (unsigned long long)lens[j], N);
        packed += lens[j] != N;
    }
    const uint8_t *planes[8];
    uint8_t *scratch = NULL;
    /* bf16/f16 on a little-endian host: the first zstd plane is decoded into the upper half
     * of dst and interleaved in place (element e reads dst[N + e] before it writes
     * dst[2e], dst[2e + 1] <= N + e), so the common case needs no scratch buffer. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    int upper = w == 2 && packed > 0;
#else
    int upper = 0;
#endif
    size_t extra = (size_t)(packed - (unsigned)upper);
    if (extra && w > 1) { /* the caller's (>= L bytes) or extra * N < L: justified by raw_length */
        scratch = scratch_buf ? scratch_buf : (uint8_t *)malloc(extra * N);
        if (!scratch) return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "byteplane: %zu bytes", extra * N);
    }
    size_t at = head;
    unsigned k = 0;
    kvw_code rc = KVW_OK;
    for (unsigned j = 0; j < w; j++) {
        const uint8_t *piece = src + at;
        at += (size_t)lens[j];
        if (lens[j] == N) {
            planes[j] = piece;
            continue;
        }
        uint8_t *target = w == 1 ? dst : upper ? dst + N : scratch + (size_t)k++ * N;
        upper = 0;
        char what[48];
        snprintf(what, sizeof what, "byteplane plane %u", j);
        rc = kvwc_zstd_decode(dctx, piece, (size_t)lens[j], target, N, need_checksum, what, err);
        if (rc) break;
        planes[j] = target;
    }
    if (!rc) {
        if (w == 1) {
            if (planes[0] != dst && N) memcpy(dst, planes[0], N);
        } else {
            interleave(dst, planes, N, w);
        }
        if (r) memcpy(dst + N * w, src + at, r);
    }
    if (scratch != scratch_buf) free(scratch);
    return rc;
}

kvw_code kvwc_byteplane_decode(ZSTD_DCtx *dctx, const uint8_t *src, size_t n, uint8_t *dst,
                               size_t L, unsigned w, int need_checksum, const char *rule,
                               kvw_error *err) {
    return kvwc_byteplane_decode_scratch(dctx, src, n, dst, L, w, need_checksum, rule, NULL, err);
}

/* ---- dispatch -------------------------------------------------------------------------- */

kvw_code kvw_decode_body(const kvw_header *h, const kvw_record *rec, const uint8_t *stored,
                         void *out, kvw_error *err) {
    if (!h || !rec || (!stored && rec->stored_length) || (!out && rec->raw_length))
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "",
                        "kvw_decode_body needs a header, a record, the stored bytes and an "
                        "output buffer");
    if (rec->raw_length > SIZE_MAX || rec->stored_length > SIZE_MAX)
        return kvw_fail(err, KVW_ERR_UNSUPPORTED, "",
                        "a chunk of %llu bytes does not fit this platform's address space",
                        (unsigned long long)rec->raw_length);
    size_t raw = (size_t)rec->raw_length, n = (size_t)rec->stored_length;
    uint8_t *dst = (uint8_t *)out;
    const kvw_codec_spec *spec = NULL;
    if (rec->codec >= KVW_CODEC_COUNT)
        return kvw_fail(err, KVW_UNKNOWN_CODEC, "KVW-CHUNK-5", "codec %u is not in the registry",
                        rec->codec);
    if (rec->reserved0) {
        if (h->codec_spec_count == 0)
            return kvw_fail(err, KVW_RESERVED_NONZERO, "KVW-CHUNK-7",
                            "reserved0 = %u in a container without codec specs", rec->reserved0);
        if (rec->reserved0 > h->codec_spec_count)
            return kvw_fail(err, KVW_CODEC_SPEC_MISMATCH, "KVW-CSPEC-9",
                            "codec_spec %u, but the header has %u codec specs", rec->reserved0,
                            h->codec_spec_count);
        spec = &h->codec_specs[rec->reserved0 - 1];
        if (spec->codec != rec->codec)
            return kvw_fail(err, KVW_CODEC_SPEC_MISMATCH, "KVW-CSPEC-9",
                            "record codec %u, its codec_spec %u names codec %u", rec->codec,
                            rec->reserved0, spec->codec);
    } else if (rec->codec > KVW_CODEC_ZSTD) {
        if (h->codec_spec_count == 0)
            return kvw_fail(err, KVW_UNKNOWN_CODEC, "KVW-EVOL-9",
                            "codec %u needs the codec_specs feature", rec->codec);
        return kvw_fail(err, KVW_CODEC_SPEC_MISMATCH, "KVW-CSPEC-9",
                        "codec %u with codec_spec 0", rec->codec);
    }
    if (rec->codec == KVW_CODEC_RAW) {
        if (n != raw)
            return kvw_fail(err, KVW_RAW_LENGTH_MISMATCH, "KVW-CHUNK-6",
                            "raw body: stored_length %zu, raw_length %zu", n, raw);
        if (raw) memmove(dst, stored, raw);
        return KVW_OK;
    }
    kvwc_geom g;
    kvw_code rc = KVW_OK;
    if (rec->codec == KVW_CODEC_FP8 || rec->codec == KVW_CODEC_INT_AFFINE) {
        rc = kvwc_lossy_geometry(h, rec, spec, &g, err);
        if (rc) return rc;
        if (g.Lb > SIZE_MAX)
            return kvw_fail(err, KVW_ERR_UNSUPPORTED, "", "lossy body of %llu bytes",
                            (unsigned long long)g.Lb);
        /* KVW-CSPEC-7: the stored length decides whether the lossless stage was applied. */
        if (n == g.Lb) return kvwc_lossy_decode(h, spec, &g, stored, dst, err);
        if (spec->lossless == KVW_CODEC_RAW)
            return kvw_fail(err, KVW_DECODE_FAILED, "KVW-LOSSY-2",
                            "%s body of %zu bytes; its geometry needs %llu",
                            kvw_codec_name(rec->codec), n, (unsigned long long)g.Lb);
        if (n > g.Lb)
            return kvw_fail(err, KVW_DECODE_FAILED, "KVW-CSPEC-7",
                            "%s body of %zu bytes; its geometry needs %llu (or fewer through "
                            "its lossless stage)",
                            kvw_codec_name(rec->codec), n, (unsigned long long)g.Lb);
    }
    ZSTD_DCtx *dctx = ZSTD_createDCtx();
    if (!dctx) return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "ZSTD_createDCtx failed");
    unsigned w = kvw_dtype_size(h->dtype);
    if (rec->codec == KVW_CODEC_ZSTD) {
        rc = kvwc_zstd_decode(dctx, stored, n, dst, raw, KVWC_NEED_CHECKSUM(h), "zstd body", err);
    } else if (rec->codec == KVW_CODEC_BYTEPLANE_ZSTD) {
        if (!w)
            rc = kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "header dtype %u", h->dtype);
        else
            rc = kvwc_byteplane_decode(dctx, stored, n, dst, raw, w, KVWC_NEED_CHECKSUM(h), "KVW-BPZ-3",
                                           err);
    } else {
        uint8_t *body = (uint8_t *)malloc(g.Lb ? (size_t)g.Lb : 1); /* Lb: a few x raw_length */
        if (!body) {
            rc = kvw_fail(err, KVW_ERR_NO_MEMORY, "", "lossy body of %llu bytes",
                          (unsigned long long)g.Lb);
        } else {
            if (spec->lossless == KVW_CODEC_ZSTD)
                rc = kvwc_zstd_decode(dctx, stored, n, body, (size_t)g.Lb, KVWC_NEED_CHECKSUM(h),
                                      "lossless stage", err);
            else
                rc = kvwc_byteplane_decode(dctx, stored, n, body, (size_t)g.Lb, w, KVWC_NEED_CHECKSUM(h),
                                           "KVW-CSPEC-7", err);
            if (!rc) rc = kvwc_lossy_decode(h, spec, &g, body, dst, err);
            free(body);
        }
    }
    ZSTD_freeDCtx(dctx);
    return rc;
}

/* ---- POSITIONS (spec/sparse.md SPARSE-10, SPARSE-11) -------------------------------- */

kvw_code kvw_positions_decode(const uint8_t *body, size_t len, uint32_t token_count,
                              uint64_t first_position, uint64_t next_position,
                              uint64_t prev_last, uint64_t next_first, int64_t *out,
                              kvw_error *err) {
    if ((!body && len) || (!out && token_count))
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "kvw_positions_decode: NULL buffer");
    /* SPARSE-10 first, over the whole body: exactly token_count minimal varints. */
    size_t ends = 0;
    for (size_t i = 0; i < len; i++) ends += body[i] < 0x80;
    if (ends != token_count || (len && body[len - 1] >= 0x80))
        return kvw_fail(err, KVW_POSITIONS_ENCODING, "KVW-SPARSE-10",
                        "POSITIONS body of %zu bytes holds %zu complete varints (and must end "
                        "with one), the record says %u", len, ends, token_count);
    uint64_t *v = (uint64_t *)out;
    size_t at = 0;
    for (uint32_t j = 0; j < token_count; j++) {
        uint64_t x = 0;
        unsigned k = 0;
        for (;;) {
            uint8_t b = body[at + k];
            if (k == 9)
                return kvw_fail(err, KVW_POSITIONS_ENCODING, "KVW-SPARSE-10",
                                "varint %u at byte %zu is longer than 9 bytes", j, at);
            x |= (uint64_t)(b & 0x7F) << (7 * k);
            k++;
            if (b < 0x80) {
                if (k > 1 && b == 0)
                    return kvw_fail(err, KVW_POSITIONS_ENCODING, "KVW-SPARSE-10",
                                    "varint %u at byte %zu is not minimal", j, at);
                break;
            }
        }
        v[j] = x;
        at += k;
    }
    /* SPARSE-11: strictly increasing, within [first_position, next_position). */
    uint64_t span = next_position > first_position ? next_position - first_position : 0;
    uint64_t rel = 0;
    for (uint32_t j = 0; j < token_count; j++) {
        uint64_t x = v[j];
        if (x >= span || (j && rel + 1 + x >= span)) /* rel < span, x < span: no wrap */
            return kvw_fail(err, KVW_POSITIONS_ORDER, "KVW-SPARSE-11",
                            "position %u leaves [first_position, next_position) = [%llu, %llu)",
                            j, (unsigned long long)first_position,
                            (unsigned long long)next_position);
        rel = j ? rel + 1 + x : x;
        out[j] = (int64_t)(first_position + rel);
    }
    if (token_count && prev_last != UINT64_MAX && (uint64_t)out[0] <= prev_last)
        return kvw_fail(err, KVW_POSITIONS_ORDER, "KVW-SPARSE-11",
                        "first position %lld of the cell is not above %llu, the last of the "
                        "previous cell", (long long)out[0], (unsigned long long)prev_last);
    if (token_count && next_first != UINT64_MAX && (uint64_t)out[token_count - 1] >= next_first)
        return kvw_fail(err, KVW_POSITIONS_ORDER, "KVW-SPARSE-11",
                        "last position %lld of the cell is not below %llu, the first of the "
                        "next cell", (long long)out[token_count - 1],
                        (unsigned long long)next_first);
    return KVW_OK;
}
