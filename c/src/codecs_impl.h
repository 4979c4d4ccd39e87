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
 * frame into dst (exactly dst_len bytes). `what` names the body in messages. need_checksum:
 * the container's format_minor is 4 or more, so a frame without a content checksum is
 * ZSTD_CHECKSUM_MISSING (KVW-CODEC-5); a checksum present is always verified (libzstd). */
kvw_code kvwc_zstd_decode(ZSTD_DCtx *dctx, const uint8_t *src, size_t n, uint8_t *dst,
                          size_t dst_len, int need_checksum, const char *what, kvw_error *err);
/* KVW-CODEC-5: the format_minor from which every zstd frame carries a content checksum. */
#define KVWC_CHECKSUM_MINOR 4u
#define KVWC_NEED_CHECKSUM(h) ((h)->format_minor >= KVWC_CHECKSUM_MINOR)

/* KVW-BPZ-1..3: decode a byteplane body (n bytes) of L decoded bytes and element width w
 * into dst. `rule` is the rule reported for the body's layout (BPZ-3, or CSPEC-7 for a
 * lossless stage). */
kvw_code kvwc_byteplane_decode(ZSTD_DCtx *dctx, const uint8_t *src, size_t n, uint8_t *dst,
                               size_t L, unsigned w, int need_checksum, const char *rule,
                               kvw_error *err);

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
/* Round-to-nearest-even fp32 -> the bits of dtype dt (f32, f16, bf16), and back: scales and
 * zeros are stored as these bits (shared by the encoders and their AVX2 kernels). */
static inline uint32_t kvwc_nearest_bits(float v, unsigned dt) {
    return dt == KVW_DTYPE_F32 ? kvwc_f32_bits(v)
         : dt == KVW_DTYPE_F16 ? kvwc_to_f16(v) : kvwc_to_bf16(v);
}
static inline float kvwc_bits_value(uint32_t b, unsigned dt) {
    return dt == KVW_DTYPE_F32 ? kvwc_bits_f32(b)
         : dt == KVW_DTYPE_F16 ? kvwc_from_f16((uint16_t)b) : kvwc_from_bf16((uint16_t)b);
}

/* kvwc_byteplane_decode with the caller's scratch of at least L bytes (NULL: allocate one);
 * ffi.c passes its decode context's buffer. */
kvw_code kvwc_byteplane_decode_scratch(ZSTD_DCtx *dctx, const uint8_t *src, size_t n, uint8_t *dst,
                                       size_t L, unsigned w, int need_checksum, const char *rule,
                                       uint8_t *scratch_buf, kvw_error *err);
/* The lossy body (no lossless stage) into body (g->Lb bytes, any contents), codecs_qenc.c. */
kvw_code kvwc_lossy_encode_into(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                                const kvw_iovec *parts, int nparts, uint8_t *body, kvw_error *err);
/* codecs_qenc_fast.c: the common case from one contiguous chunk in fused passes; 0 when the
 * careful path of codecs_qenc.c must encode it (groups near the dtype extremes, NaN, ...). */
int kvwc_qenc_fast(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                   const uint8_t *raw, uint8_t *body);


/* ---- int_affine parameters and revision 1.2 (codecs_rot.c, spec/codecs.md section 8) ---- */
/* The body's scales (and zeros after them, g->nparams each) as fp32 in a malloc'ed array
 * (*out, the caller frees), checked (KVW-INT-3), and the code padding bits (INT-4, ROT-3). */
kvw_code kvwc_int_params(const kvw_codec_spec *s, const kvwc_geom *g, const uint8_t *params,
                         const uint8_t *codes, float **out, kvw_error *err);
/* Decode the quantized part of an int_affine body whose spec uses rotation, the gaussian
 * codebook or 3-bit codes (KVW-ROT-3..6), row by row, into out; also any 2-4 bit int_affine
 * body that kvwc_rot_fused_fits (AVX2, D % 8 == 0, scales per channel or per whole register:
 * the fused AVX2 rows, issue #19's decode goal for the unrotated values of its presets). */
int kvwc_rot_fused_fits(const kvw_codec_spec *s, const kvwc_geom *g);
kvw_code kvwc_rot_decode(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                         const uint8_t *params, const uint8_t *codes, uint8_t *out,
                         kvw_error *err);
/* The Hadamard block of a row of D channels: the largest power of two dividing D (D > 0). */
static inline uint64_t kvwc_rot_block(uint64_t D) { return D & (~D + 1); }
/* c_B = fp32(1 / sqrt(B)) rounded to nearest (section 8.4). */
float kvwc_rot_cb(uint64_t B);
/* The sign vector of KVW-ROT-5 as D sign-bit masks (0 or 0x80000000). */
void kvwc_rot_signs(uint64_t seed, uint64_t D, uint32_t *mask);
/* The butterflies of KVW-ROT-6 on one row (blocks of B), in place; then, with post, every
 * y[d] = (y[d] * cb) ^ mask[d] (the decoder's order; the encoder's is signs first). The
 * AVX2 build (codecs_rot_avx2.c) is chosen at run time; kvwc_rot_row_portable is the other. */
void kvwc_rot_row(float *y, uint64_t D, uint64_t B, float cb, const uint32_t *mask);
void kvwc_rot_row_portable(float *y, uint64_t D, uint64_t B, float cb, const uint32_t *mask);
int kvwc_rot_avx2_built(void);
void kvwc_rot_row_avx2(float *y, uint64_t D, uint64_t B, float cb, const uint32_t *mask);
/* The decoder's other row steps in AVX2 (n a multiple of 8; the same values as the portable
 * loops of codecs_rot.c): x = lv[u] * s (+ z) for codes below 16, and fp32 -> bf16 bits. */
void kvwc_rot_dequant_avx2(const uint8_t *u, const float *lv, const float *s, const float *z,
                           float *x, uint64_t n);
void kvwc_rot_to_bf16_avx2(const float *x, uint16_t *out, uint64_t n);
/* The fused AVX2 row decoder (codecs_rot_avx2.c; only when kvwc_rot_avx2_built and the CPU
 * has AVX2): codes of b = 2, 3 or 4 bits (D * b / 8 bytes of one row) -> lv[u] * s (+ z) ->
 * (with mask) the butterflies and (y * cb) ^ mask -> bf16, the same operations in the same
 * order as the portable steps. s, z: per channel (grp NULL) or per channel group with grp
 * giving each register's group (G a multiple of 8). kvwc_rot_dec_bf16_avx2 writes the row's
 * bf16 bytes (little-endian) when kvwc_rot_dec_bf16_fits(D) (D a power of two, 8..128: the
 * row in registers); kvwc_rot_dequant_codes_avx2 writes x = lv[u] * s (+ z) for any D % 8 == 0. */
typedef struct kvwc_rot_drow {
    unsigned b;
    const float *lv;     /* 16 levels (codes of b <= 4 bits) */
    const uint16_t *grp; /* D / 8 group indices, or NULL */
    const uint32_t *mask; /* the sign masks, or NULL: no rotation */
    float cb;
    uint64_t D;
} kvwc_rot_drow;
int kvwc_rot_dec_bf16_fits(uint64_t D);
void kvwc_rot_dec_bf16_avx2(const kvwc_rot_drow *q, const uint8_t *codes, const float *s,
                            const float *z, uint8_t *dst);
void kvwc_rot_dequant_codes_avx2(const kvwc_rot_drow *q, const uint8_t *codes, const float *s,
                                 const float *z, float *x);
/* The encoder's AVX2 kernels (codecs_rot_avx2.c; the values of codecs_rot_enc.c's portable
 * loops): kvwc_rot_enc_row_avx2: a bf16 / f32 row (D % 8 == 0) -> fp32 y, rotated when mask
 * (signs, butterflies, * cb), its largest magnitude bits in *amax; kvwc_rot_sumsq8_avx2: the
 * channel groups' (G % 8 == 0) sums of squares, in element order, and nonzero flags of 8
 * consecutive rows, at acc / live [r * gd + c]; kvwc_rot_gauss_codes_avx2: one row's gaussian
 * codes (b = 2..4) as D * b / 8 fresh bytes, scales sv per channel (grp NULL) or per group. */
void kvwc_rot_enc_row_avx2(const uint8_t *src, unsigned dt, uint64_t D, uint64_t B, float cb,
                           const uint32_t *mask, float *y, uint32_t *amax);
void kvwc_rot_sumsq8_avx2(const float *x, uint64_t D, uint64_t G, float *acc, uint8_t *live);
void kvwc_rot_gauss_codes_avx2(const float *x, const float *sv, const uint16_t *grp, uint64_t D,
                               unsigned b, const float *mid, uint8_t *out);
/* The 2^b fp32 levels C_b of the gaussian codebook into lv (b = 2, 3 or 4; KVW-ROT-4). */
void kvwc_codebook_levels(unsigned b, float *lv);
/* codecs_qenc.c's int_affine encoder of the quantized part x (fp32, [H, M, D]) with the
 * reference writer's scales (KVW-INT-6, section 3.1); codes are or-ed into zeroed bytes. */
kvw_code kvwc_encode_int(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                         const float *x, uint8_t *params, uint8_t *codes, kvw_error *err);
/* Revision 1.2 encoders (codecs_rot_enc.c): the quantized part x (fp32, rotated in place when
 * the spec rotates) into the lossy body `body` (kept tokens already there, the parameters
 * and codes zeroed), then KVW-ROT-7 / LOSSY-5 checked on the decoded result
 * (KVW_ERR_UNSUPPORTED: store losslessly). kvwc_rot_qenc_fast: the same from one
 * contiguous chunk; 0 when the careful path must encode it. */
kvw_code kvwc_rot_encode(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                         float *x, uint8_t *body, kvw_error *err);
int kvwc_rot_qenc_fast(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                       const uint8_t *raw, uint8_t *body);
/* codecs_qenc_fast.c's uniform int_affine fast path over the fp32 quantized part x ([H, M,
 * D]; the header dtype's bands, as kvwc_encode_int): 0 when the careful path must encode. */
int kvwc_qenc_int_f32(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                      const float *x, uint8_t *params, uint8_t *codes);

/* codecs_rot.c: are the AVX2 rotation kernels built and does the CPU have AVX2 (run time)? */
int kvwc_rot_use_avx2(void);

/* codecs_rot_enc.c, shared with codecs_tq.c: the KVW-ROT-7 band of a spec and chunk (rows
 * whose largest magnitude is inside meet the rule by construction) and the check on the
 * decoded chunk for the others. */
void kvwc_rot_band(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g, double *lo, float *hi);
int kvwc_rot_in_band(uint32_t a, double lo, float hi);
kvw_code kvwc_rot_check_decoded(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                                const float *x0, const uint8_t *body, kvw_error *err);

#endif /* KVW_CODECS_IMPL_H */
