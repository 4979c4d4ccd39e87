/*
 * Private interface between the codec files (codecs.c: dispatch, zstd frames, byte planes,
 * positions; codecs_lossy.c: fp8 and int_affine decoding; codecs_enc.c: encoders). Not
 * part of the module contract (internal.h): nothing outside the codec files includes it.
 */
#ifndef KVW_CODECS_IMPL_H
#define KVW_CODECS_IMPL_H

#include "internal.h"

#include <zstd.h>

/* KVW-CODEC-2/3: check the frame header of src (n bytes), then decompress exactly one
 * frame into dst (exactly dst_len bytes). `what` names the body in messages. */
kvw_code kvwc_zstd_decode(ZSTD_DCtx *dctx, const uint8_t *src, size_t n, uint8_t *dst,
                          size_t dst_len, const char *what, kvw_error *err);

/* KVW-BPZ-1..3: decode a byteplane body (n bytes) of L decoded bytes and element width w
 * into dst. `rule` is the rule reported for the body's layout (BPZ-3, or CSPEC-7 for a
 * lossless stage). */
kvw_code kvwc_byteplane_decode(ZSTD_DCtx *dctx, const uint8_t *src, size_t n, uint8_t *dst,
                               size_t L, unsigned w, const char *rule, kvw_error *err);

/* Geometry of one lossy body (KVW-LOSSY-1, LOSSY-2, FP8-2, INT-2). */
typedef struct kvwc_geom {
    uint64_t H, T, D, w;   /* chunk tensor [H, T, D], header dtype size */
    uint64_t P, Q, M;      /* kept sink tokens, kept residual tokens, quantized tokens */
    uint64_t nparams;      /* scales (and as many zeros when `zeros`); 0 when M = 0 */
    uint64_t gm, gd;       /* int_affine: groups along tokens (gm) and channels (gd) */
    unsigned psize;        /* bytes per scale / zero */
    int zeros;             /* int_affine asymmetric */
    unsigned bits;         /* 8 for fp8 */
    uint64_t fp_bytes, param_bytes, code_bytes, Lb;
} kvwc_geom;

/* Spec checks a decoder relies on (CSPEC-4..6, FP8-1, INT-1, INT-2; the header rules
 * already made them for a parsed header) and the geometry of the record's lossy body. */
kvw_code kvwc_lossy_geometry(const kvw_header *h, const kvw_record *rec,
                             const kvw_codec_spec *s, kvwc_geom *g, kvw_error *err);

/* Decode a lossy body of exactly g->Lb bytes into out (raw_length bytes). */
kvw_code kvwc_lossy_decode(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                           const uint8_t *body, uint8_t *out, kvw_error *err);

/* Lossy encoders (codecs_qenc.c): the lossy body of a chunk given as parts (the reference
 * writer's choices). KVW_ERR_UNSUPPORTED when the chunk cannot be encoded faithfully
 * (KVW-LOSSY-5, LOSSY-6: non-finite values, ranges beyond the dtypes): store it losslessly. */
kvw_code kvwc_lossy_encode(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                           const kvw_iovec *parts, int nparts, uint8_t **out, size_t *out_len,
                           kvw_error *err);

/* Bytes [from, from + n) of the concatenation of parts. */
void kvwc_copy_range(const kvw_iovec *parts, int nparts, size_t from, uint8_t *dst, size_t n);

/* fp32 -> header dtype (KVW-LOSSY-4): round to nearest even, canonical NaN. */
static inline uint32_t kvwc_f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float kvwc_bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline uint16_t kvwc_to_bf16(float f) {
    uint32_t u = kvwc_f32_bits(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline uint16_t kvwc_to_f16(float f) {
    uint32_t u = kvwc_f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return 0x7E00;                 /* NaN: canonical, sign 0 */
    if (a >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u); /* >= 65520: infinity */
    if (a >= 0x38800000u) {                             /* normal f16 (>= 2^-14) */
        uint32_t r = a - 0x38000000u;
        r += 0xFFFu + ((r >> 13) & 1u);
        return (uint16_t)(sign | (r >> 13));
    }
    if (a <= 0x33000000u) return sign;                  /* <= 2^-25: rounds to zero */
    uint32_t mant = (a & 0x7FFFFFu) | 0x800000u;
    unsigned shift = 126u - (a >> 23);                  /* 14 .. 24 */
    uint32_t r = mant >> shift, rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (r & 1u))) r++;
    return (uint16_t)(sign | r);
}

static inline uint32_t kvwc_to_f32(float f) {
    uint32_t u = kvwc_f32_bits(f);
    return ((u & 0x7FFFFFFFu) > 0x7F800000u) ? 0x7FC00000u : u;
}

/* f16 / bf16 / f32 bits -> fp32 (exact). */
static inline float kvwc_from_f16(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0x1F) return kvwc_bits_f32(sign | 0x7F800000u | (m << 13));
    if (e == 0) { /* zero or subnormal: m * 2^-24, exact in fp32 */
        float v = (float)m * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    return kvwc_bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}
static inline float kvwc_from_bf16(uint16_t b) { return kvwc_bits_f32((uint32_t)b << 16); }

/* kvwc_byteplane_decode with the caller's scratch of at least L bytes (NULL: allocate one);
 * ffi.c passes its decode context's buffer. */
kvw_code kvwc_byteplane_decode_scratch(ZSTD_DCtx *dctx, const uint8_t *src, size_t n, uint8_t *dst,
                                       size_t L, unsigned w, const char *rule, uint8_t *scratch_buf,
                                       kvw_error *err);
/* The lossy body (no lossless stage) into body (g->Lb bytes, any contents), codecs_qenc.c. */
kvw_code kvwc_lossy_encode_into(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                                const kvw_iovec *parts, int nparts, uint8_t *body, kvw_error *err);
/* codecs_qenc_fast.c: the common case from one contiguous chunk in fused passes; 0 when the
 * careful path of codecs_qenc.c must encode it (groups near the dtype extremes, NaN, ...). */
int kvwc_qenc_fast(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                   const uint8_t *raw, uint8_t *body);

#endif /* KVW_CODECS_IMPL_H */
