/*
 * FFI entry points (kvw_header_new, kvw_header_delete, kvw_decode_wire, kvw_error_size,
 * kvw_version);
 * kvw_lossy_encode_wire, the encoding one, is encode/ffi_enc.c.
 *
 * Why: a foreign caller (python/kvwire/codecs/native.py over ctypes) holds neither a
 * kvw_header it can fill nor a kvw_record in host layout. These take the header as its
 * FlatBuffer bytes (copied, so the caller's buffer may go away) and a chunk as its 56-byte
 * wire record, and decode one stored body with the same code the reader uses
 * (kvw_decode_body). Distinct calls may run on distinct threads over the same header,
 * which is only read.
 *
 * Speed: kvw_decode_body makes a ZSTD_DCtx and (lossy codecs with a lossless stage) a
 * body buffer per call; at ~0.5 MiB chunks that is an mmap, page faults and an munmap per
 * chunk, which also serializes threads on the address space. kvw_decode_wire takes a
 * caller's kvw_decode_ctx (one context and one growing buffer, one per thread) instead and
 * decodes the valid path with the same codec functions; every path that fails a check is
 * handed to kvw_decode_body, so codes and rules are the reader's exactly.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "decode/decode.h"
#include "kvwire.h"

typedef struct ffi_header {
    kvw_header h; /* first: a kvw_header * from kvw_header_new points at the whole */
    size_t len;
    uint8_t bytes[];
} ffi_header;

size_t kvw_error_size(void) { return sizeof(kvw_error); }

const char *kvw_version(void) { return KVW_VERSION_STRING; }

kvw_code kvw_header_new(const uint8_t *fb, size_t len, kvw_header **out, kvw_error *err) {
    if (!out || (!fb && len))
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "",
                        "kvw_header_new needs the header bytes and an output pointer");
    *out = NULL;
    ffi_header *f = (ffi_header *)malloc(sizeof *f + (len ? len : 1));
    if (!f) return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "header copy of %zu bytes", len);
    f->len = len;
    if (len) memcpy(f->bytes, fb, len);
    kvw_header_init(&f->h);
    kvw_code rc = kvw_header_parse(f->bytes, len, &f->h, err);
    if (rc != KVW_OK) {
        kvw_header_free(&f->h);
        free(f);
        return rc;
    }
    *out = &f->h;
    return KVW_OK;
}

void kvw_header_delete(kvw_header *h) {
    if (!h) return;
    kvw_header_free(h);
    free((ffi_header *)(void *)h);
}

/* ---- decode contexts ------------------------------------------------------------------ */
/* A caller's reusable scratch: one zstd context and one growing body buffer. One context per
 * thread (the caller keeps it: the library holds no state of its own). */
struct kvw_decode_ctx {
    ZSTD_DCtx *dctx;
    uint8_t *buf, *obuf; /* a body's planes or lossless stage; a decoded body copied out by heads */
    size_t cap, ocap;
};
#define CTX_KEEP ((size_t)256 << 20) /* a larger body buffer is freed after its call */

kvw_code kvw_decode_ctx_new(kvw_decode_ctx **out, kvw_error *err) {
    if (!out) return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "kvw_decode_ctx_new: NULL out");
    kvw_decode_ctx *s = (kvw_decode_ctx *)calloc(1, sizeof *s);
    if (s) s->dctx = ZSTD_createDCtx();
    if (!s || !s->dctx) {
        free(s);
        *out = NULL;
        return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "decode context");
    }
    *out = s;
    return KVW_OK;
}

void kvw_decode_ctx_free(kvw_decode_ctx *s) {
    if (!s) return;
    ZSTD_freeDCtx(s->dctx);
    free(s->buf);
    free(s->obuf);
    free(s);
}


/* The context's buffer grown to at least n bytes (0 when out of memory). */
static int grow(kvw_decode_ctx *s, size_t n) {
    if (s->cap >= n) return 1;
    uint8_t *b = (uint8_t *)realloc(s->buf, n ? n : 1);
    if (!b) return 0;
    s->buf = b;
    s->cap = n;
    return 1;
}

static kvw_code decode_fast(kvw_decode_ctx *s, const kvw_header *h, const kvw_record *rec,
                            const uint8_t *stored, uint8_t *dst, size_t ohs, kvw_error *err);

/* A body decoded whole into the context's second buffer, then its heads copied ohs bytes
 * apart: the codecs whose decoders write the whole body at once (raw, zstd, byteplane) and
 * every fallback to kvw_decode_body. */
static kvw_code via_heads(kvw_decode_ctx *s, const kvw_header *h, const kvw_record *rec,
                          const uint8_t *stored, uint8_t *dst, size_t ohs, kvw_error *err) {
    size_t raw = (size_t)rec->raw_length, run = raw / rec->head_count;
    if (s->ocap < raw) {
        uint8_t *b = (uint8_t *)realloc(s->obuf, raw ? raw : 1);
        if (!b) return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "decoded body of %zu bytes", raw);
        s->obuf = b;
        s->ocap = raw;
    }
    kvw_code rc = decode_fast(s, h, rec, stored, s->obuf, 0, err);
    for (uint64_t r = 0; !rc && r < rec->head_count; r++) memcpy(dst + r * ohs, s->obuf + r * run, run);
    if (s->ocap > CTX_KEEP) {
        free(s->obuf);
        s->obuf = NULL;
        s->ocap = 0;
    }
    return rc;
}

/* The valid path of kvw_decode_body with the thread's context and buffer; anything else
 * (a failing check, no scratch, raw bodies) goes to kvw_decode_body itself. ohs: 0, or the
 * bytes from one head of the output to the next (kvw_decode_wire_heads; the lossy decoders
 * write there directly, everything else goes through via_heads). */
#define BODY() (ohs ? via_heads(s, h, rec, stored, dst, ohs, err) : kvw_decode_body(h, rec, stored, dst, err))
static kvw_code decode_fast(kvw_decode_ctx *s, const kvw_header *h, const kvw_record *rec,
                            const uint8_t *stored, uint8_t *dst, size_t ohs, kvw_error *err) {
    if (!s || rec->codec == KVW_CODEC_RAW || rec->codec >= KVW_CODEC_COUNT || !stored || !dst ||
        rec->raw_length > SIZE_MAX || rec->stored_length > SIZE_MAX)
        return BODY();
    const kvw_codec_spec *spec = NULL;
    if (rec->reserved0) {
        if (rec->reserved0 > h->codec_spec_count ||
            h->codec_specs[rec->reserved0 - 1].codec != rec->codec)
            return BODY();
        spec = &h->codec_specs[rec->reserved0 - 1];
    } else if (rec->codec > KVW_CODEC_ZSTD) {
        return BODY();
    }
    if (ohs && (rec->codec == KVW_CODEC_ZSTD || rec->codec == KVW_CODEC_BYTEPLANE_ZSTD))
        return via_heads(s, h, rec, stored, dst, ohs, err);
    size_t raw = (size_t)rec->raw_length, n = (size_t)rec->stored_length;
    unsigned w = kvw_dtype_size(h->dtype);
    if (rec->codec == KVW_CODEC_ZSTD)
        return kvwc_zstd_decode(s->dctx, stored, n, dst, raw, KVWC_NEED_CHECKSUM(h), "zstd body", err);
    if (rec->codec == KVW_CODEC_BYTEPLANE_ZSTD) { /* the planes' scratch: the context's buffer */
        if (!w) return BODY();
        if (raw > CTX_KEEP || !grow(s, raw))
            return kvwc_byteplane_decode(s->dctx, stored, n, dst, raw, w, KVWC_NEED_CHECKSUM(h), "KVW-BPZ-3",
                                         err);
        return kvwc_byteplane_decode_scratch(s->dctx, stored, n, dst, raw, w, KVWC_NEED_CHECKSUM(h),
                                             "KVW-BPZ-3", s->buf, err);
    }
    kvwc_geom g;
    kvw_code rc = kvwc_lossy_geometry(h, rec, spec, &g, err);
    if (rc) return rc;
    if (ohs) g.ohs = ohs;
    if (g.Lb > SIZE_MAX) return BODY();
    if (n == g.Lb) return kvwc_lossy_decode(h, spec, &g, stored, dst, err);
    if (spec->lossless == KVW_CODEC_RAW || n > g.Lb) return BODY();
    size_t lb = (size_t)g.Lb;
    if (s->cap < lb) {
        uint8_t *b = (uint8_t *)realloc(s->buf, lb ? lb : 1);
        if (!b) return BODY();
        s->buf = b;
        s->cap = lb;
    }
    if (spec->lossless == KVW_CODEC_ZSTD)
        rc = kvwc_zstd_decode(s->dctx, stored, n, s->buf, lb, KVWC_NEED_CHECKSUM(h), "lossless stage", err);
    else
        rc = kvwc_byteplane_decode(s->dctx, stored, n, s->buf, lb, w, KVWC_NEED_CHECKSUM(h), "KVW-CSPEC-7", err);
    if (!rc) rc = kvwc_lossy_decode(h, spec, &g, s->buf, dst, err);
    if (s->cap > CTX_KEEP) {
        free(s->buf);
        s->buf = NULL;
        s->cap = 0;
    }
    return rc;
}

kvw_code kvw_decode_wire(kvw_decode_ctx *ctx, const kvw_header *h,
                         const uint8_t record[KVW_RECORD_SIZE],
                         const uint8_t *stored, size_t stored_len, void *out, size_t out_len,
                         kvw_error *err) {
    if (!h || !record)
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "",
                        "kvw_decode_wire needs a header and a 56-byte record");
    kvw_record rec;
    kvw_record_decode(record, &rec);
    if ((uint64_t)stored_len != rec.stored_length)
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "",
                        "stored_len %zu, the record's stored_length is %llu", stored_len,
                        (unsigned long long)rec.stored_length);
    if ((uint64_t)out_len < rec.raw_length)
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "",
                        "out_len %zu, the record's raw_length is %llu", out_len,
                        (unsigned long long)rec.raw_length);
    return decode_fast(ctx, h, &rec, stored, (uint8_t *)out, 0, err);
}

kvw_code kvw_decode_wire_heads(kvw_decode_ctx *ctx, const kvw_header *h,
                               const uint8_t record[KVW_RECORD_SIZE], const uint8_t *stored,
                               size_t stored_len, void *out, size_t out_len, size_t head_stride,
                               kvw_error *err) {
    if (!ctx || !h || !record || !out)
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "",
                        "kvw_decode_wire_heads needs a context, a header, a 56-byte record and an output");
    kvw_record rec;
    kvw_record_decode(record, &rec);
    uint64_t H = rec.head_count, run = H ? rec.raw_length / H : 0;
    if ((uint64_t)stored_len != rec.stored_length || !H || rec.raw_length % H || head_stride < run ||
        (H - 1) > (SIZE_MAX - run) / (head_stride ? head_stride : 1) ||
        (uint64_t)out_len < (H - 1) * head_stride + run)
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "",
                        "kvw_decode_wire_heads: stored_len %zu (record %llu), %llu heads of %llu raw bytes, "
                        "head_stride %zu, out_len %zu", stored_len, (unsigned long long)rec.stored_length,
                        (unsigned long long)H, (unsigned long long)rec.raw_length, head_stride, out_len);
    return decode_fast(ctx, h, &rec, stored, (uint8_t *)out, head_stride == run ? 0 : head_stride, err);
}
