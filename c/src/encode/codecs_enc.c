/*
 * Body encoders for the writer (spec section 13, spec/codecs.md): raw, zstd (one frame
 * with its content size and no checksum, KVW-CODEC-2/3), byteplane_zstd (KVW-BPZ-1/2) and
 * the lossy codecs with their lossless stage (KVW-CSPEC-7). A chunk arrives as a list of
 * parts (for example one per head) and is never concatenated for zstd: the parts are
 * streamed into one frame. Kept apart from the decoders, which readers need alone.
 */
#include "encode/encode.h"

#include <stdlib.h>

#define PLANE_SAMPLE (16u << 10) /* a plane whose first 16 KiB do not shrink is stored as is */

static kvw_code zstd_error(kvw_error *err, const char *what, size_t r) {
    return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "%s: zstd: %s", what,
                    ZSTD_getErrorName(r));
}

/* One zstd frame of the concatenation of parts (total bytes), content size declared. */
static kvw_code zstd_encode_parts(const kvw_iovec *parts, int nparts, size_t total, int level,
                                  uint8_t **out, size_t *out_len, kvw_error *err) {
    ZSTD_CCtx *c = ZSTD_createCCtx();
    size_t cap = ZSTD_compressBound(total);
    uint8_t *buf = (uint8_t *)malloc(cap ? cap : 1);
    kvw_code rc = KVW_OK;
    if (!c || !buf) {
        rc = kvw_fail(err, KVW_ERR_NO_MEMORY, "", "zstd: %zu bytes", cap);
        goto done;
    }
    size_t r;
    if (ZSTD_isError(r = ZSTD_CCtx_setParameter(c, ZSTD_c_compressionLevel, level ? level : 3)) ||
        ZSTD_isError(r = ZSTD_CCtx_setParameter(c, ZSTD_c_contentSizeFlag, 1)) ||
        ZSTD_isError(r = ZSTD_CCtx_setParameter(c, ZSTD_c_checksumFlag, 1)) ||
        ZSTD_isError(r = ZSTD_CCtx_setPledgedSrcSize(c, total))) {
        rc = zstd_error(err, "zstd parameters", r);
        goto done;
    }
    ZSTD_outBuffer ob = {buf, cap, 0};
    for (int i = 0; i < nparts; i++) {
        ZSTD_inBuffer ib = {parts[i].base, parts[i].len, 0};
        while (ib.pos < ib.size) {
            r = ZSTD_compressStream2(c, &ob, &ib, ZSTD_e_continue);
            if (ZSTD_isError(r)) {
                rc = zstd_error(err, "zstd", r);
                goto done;
            }
        }
    }
    for (;;) {
        ZSTD_inBuffer none = {NULL, 0, 0};
        r = ZSTD_compressStream2(c, &ob, &none, ZSTD_e_end);
        if (ZSTD_isError(r)) {
            rc = zstd_error(err, "zstd", r);
            goto done;
        }
        if (r == 0) break;
        if (ob.pos == ob.size) { /* cannot happen with compressBound */
            rc = kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "zstd: output bound exceeded");
            goto done;
        }
    }
    *out = buf, *out_len = ob.pos;
    buf = NULL;
done:
    free(buf);
    ZSTD_freeCCtx(c);
    return rc;
}

/* Byte bi of every element (width w) of the parts' concatenation, elements [0, N). */
static void gather(const kvw_iovec *parts, int nparts, unsigned w, unsigned bi, uint8_t *dst,
                   size_t N) {
    size_t g0 = 0;
    for (int i = 0; i < nparts; i++) {
        const uint8_t *p = (const uint8_t *)parts[i].base;
        size_t len = parts[i].len, e = g0 > bi ? (g0 - bi + w - 1) / w : 0;
        if (w == 2 && bi < 2) { /* the common case, no division in the loop */
            for (size_t pos = e * 2 + bi; e < N && pos < g0 + len; e++, pos += 2)
                dst[e] = p[pos - g0];
        } else {
            for (size_t pos = e * w + bi; e < N && pos < g0 + len; e++, pos += w)
                dst[e] = p[pos - g0];
        }
        g0 += len;
    }
}

/* Bytes [from, from + n) of the parts' concatenation. */
void kvwc_copy_range(const kvw_iovec *parts, int nparts, size_t from, uint8_t *dst, size_t n) {
    size_t g0 = 0;
    for (int i = 0; i < nparts && n; i++) {
        size_t len = parts[i].len;
        if (from < g0 + len) {
            size_t off = from - g0, k = len - off < n ? len - off : n;
            memcpy(dst, (const uint8_t *)parts[i].base + off, k);
            dst += k, from += k, n -= k;
        }
        g0 += len;
    }
}

static kvw_code byteplane_encode(const kvw_iovec *parts, int nparts, size_t L, unsigned w,
                                 int level, uint8_t **out, size_t *out_len, kvw_error *err) {
    size_t N = L / w, r = L - N * w, head = 4u * w;
    uint8_t *buf = (uint8_t *)malloc(head + L), *plane = (uint8_t *)malloc(N ? N : 1);
    size_t scap = ZSTD_compressBound(PLANE_SAMPLE);
    uint8_t *sample = (uint8_t *)malloc(scap);
    ZSTD_CCtx *c = ZSTD_createCCtx();
    kvw_code rc = KVW_OK;
    if (!buf || !plane || !sample || !c) {
        rc = kvw_fail(err, KVW_ERR_NO_MEMORY, "", "byteplane: %zu bytes", head + L);
        goto done;
    }
    /* Exponent planes: zstd's fast strategy with 7-byte matches (spec note to KVW-BPZ-2). */
    size_t e;
    if (ZSTD_isError(e = ZSTD_CCtx_setParameter(c, ZSTD_c_compressionLevel, level > 0 && level < 3 ? level : 1)) ||
        ZSTD_isError(e = ZSTD_CCtx_setParameter(c, ZSTD_c_strategy, ZSTD_fast)) ||
        ZSTD_isError(e = ZSTD_CCtx_setParameter(c, ZSTD_c_minMatch, 7)) ||
        ZSTD_isError(e = ZSTD_CCtx_setParameter(c, ZSTD_c_searchLog, 1)) ||
        ZSTD_isError(e = ZSTD_CCtx_setParameter(c, ZSTD_c_hashLog, 6)) ||
        ZSTD_isError(e = ZSTD_CCtx_setParameter(c, ZSTD_c_targetLength, 0)) ||
        ZSTD_isError(e = ZSTD_CCtx_setParameter(c, ZSTD_c_contentSizeFlag, 1)) ||
        ZSTD_isError(e = ZSTD_CCtx_setParameter(c, ZSTD_c_checksumFlag, 1))) {
        rc = zstd_error(err, "byteplane parameters", e);
        goto done;
    }
    size_t at = head;
    for (unsigned j = 0; j < w; j++) {
        gather(parts, nparts, w, w - 1 - j, plane, N);
        size_t len = N;
        int try_it = N > 1;
        if (try_it && N > PLANE_SAMPLE) {
            size_t t = ZSTD_compress2(c, sample, scap, plane, PLANE_SAMPLE);
            try_it = !ZSTD_isError(t) && t < PLANE_SAMPLE * 97 / 100;
        }
        if (try_it) {
            size_t t = ZSTD_compress2(c, buf + at, N - 1, plane, N); /* KVW-BPZ-2: shorter only */
            if (!ZSTD_isError(t) && t > 0 && t < N) len = t;
        }
        if (len == N && N) memcpy(buf + at, plane, N);
        kvw_st32(buf + 4 * j, (uint32_t)len);
        at += len;
    }
    kvwc_copy_range(parts, nparts, N * w, buf + at, r);
    at += r;
    *out = buf, *out_len = at;
    buf = NULL;
done:
    free(buf);
    free(plane);
    free(sample);
    ZSTD_freeCCtx(c);
    return rc;
}

kvw_code kvw_encode_body(const kvw_header *h, int codec, const kvw_codec_spec *spec,
                         const kvw_record *shape, const kvw_iovec *parts, int nparts,
                         int zstd_level, uint8_t **out, size_t *out_len, kvw_error *err) {
    if (!h || !out || !out_len || nparts < 0 || (nparts && !parts))
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "kvw_encode_body: NULL argument");
    *out = NULL, *out_len = 0;
    uint64_t total = 0;
    for (int i = 0; i < nparts; i++)
        if ((parts[i].len && !parts[i].base) || kvw_add_ovf(total, parts[i].len, &total))
            return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "part %d: NULL or too long", i);
    if (total > SIZE_MAX / 2)
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "chunk of %llu bytes",
                        (unsigned long long)total);
    size_t L = (size_t)total;
    unsigned w = kvw_dtype_size(h->dtype);
    switch (codec) {
    case KVW_CODEC_RAW: {
        uint8_t *buf = (uint8_t *)malloc(L ? L : 1);
        if (!buf) return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "raw body of %zu bytes", L);
        kvwc_copy_range(parts, nparts, 0, buf, L);
        *out = buf, *out_len = L;
        return KVW_OK;
    }
    case KVW_CODEC_ZSTD: return zstd_encode_parts(parts, nparts, L, zstd_level, out, out_len, err);
    case KVW_CODEC_BYTEPLANE_ZSTD:
        if (!w) return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "header dtype %u", h->dtype);
        return byteplane_encode(parts, nparts, L, w, 1, out, out_len, err);
    case KVW_CODEC_FP8:
    case KVW_CODEC_INT_AFFINE: break;
    default:
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "",
                        "codec %d: choose raw, zstd, byteplane_zstd, fp8 or int_affine", codec);
    }
    if (!spec || !shape || spec->codec != codec)
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "",
                        "codec %d needs its codec spec and the chunk's record", codec);
    kvw_record rec = *shape;
    rec.raw_length = total;
    kvwc_geom g;
    kvw_code rc = kvwc_lossy_geometry(h, &rec, spec, &g, err);
    if (rc) return rc == KVW_LENGTH_MISMATCH ? kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "",
                                                        "%s", err ? err->message : "chunk shape")
                                             : rc;
    uint8_t *body;
    size_t blen;
    rc = kvwc_lossy_encode(h, spec, &g, parts, nparts, &body, &blen, err);
    if (rc) return rc;
    if (spec->lossless == KVW_CODEC_RAW || blen == 0) {
        *out = body, *out_len = blen;
        return KVW_OK;
    }
    kvw_iovec one = {body, blen};
    uint8_t *st = NULL;
    size_t slen = 0;
    rc = spec->lossless == KVW_CODEC_ZSTD
             ? zstd_encode_parts(&one, 1, blen, zstd_level, &st, &slen, err)
             : byteplane_encode(&one, 1, blen, w, 1, &st, &slen, err);
    if (rc) {
        free(body);
        return rc;
    }
    if (slen < blen) { /* KVW-CSPEC-7: the stage only when it makes the body shorter */
        free(body);
        *out = st, *out_len = slen;
    } else {
        free(st);
        *out = body, *out_len = blen;
    }
    return KVW_OK;
}

/* The inverse of decode/codecs.c's kvw_positions_decode (spec/sparse.md, SPARSE-10). */
kvw_code kvw_positions_encode(const int64_t *pos, uint32_t n, uint64_t first_position,
                              uint8_t **out, size_t *out_len, kvw_error *err) {
    if (!out || !out_len || (!pos && n))
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "kvw_positions_encode: NULL pointer");
    *out = NULL;
    *out_len = 0;
    uint8_t *buf = (uint8_t *)malloc(n ? (size_t)n * 9u : 1u);
    if (!buf) return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "positions: %u varints", n);
    size_t at = 0;
    for (uint32_t j = 0; j < n; j++) {
        uint64_t base = j ? (uint64_t)pos[j - 1] + 1 : first_position;
        if (pos[j] < 0 || (uint64_t)pos[j] < base || (uint64_t)pos[j] - base >= (UINT64_C(1) << 63)) {
            free(buf);
            return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "",
                            "position %u (%lld) is not above the previous one and at least "
                            "first_position %llu", j, (long long)pos[j],
                            (unsigned long long)first_position);
        }
        uint64_t x = (uint64_t)pos[j] - base;
        do {
            uint8_t b = (uint8_t)(x & 0x7F);
            x >>= 7;
            buf[at++] = (uint8_t)(b | (x ? 0x80 : 0));
        } while (x);
    }
    *out = buf;
    *out_len = at;
    return KVW_OK;
}
