/*
 * The codecs' shared definitions (src/format, spec/codecs.md): the geometry of a lossy
 * body (codec_geom.c: KVW-LOSSY-1, LOSSY-2, FP8-2, INT-2), the exact fp32 <-> dtype
 * conversions (KVW-LOSSY-4) and the revision 1.2 rotation block. Shared by the decoders
 * (src/decode), the encoders (src/encode) and their AVX2 kernels (src/simd).
 */
#ifndef KVW_FORMAT_CODEC_H
#define KVW_FORMAT_CODEC_H

#include "format/format.h"

/* KVW-CODEC-5: the format_minor from which every zstd frame carries a content checksum. */
#define KVWC_CHECKSUM_MINOR 4u
#define KVWC_NEED_CHECKSUM(h) ((h)->format_minor >= KVWC_CHECKSUM_MINOR)

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
    uint64_t ohs;          /* output bytes from one head to the next: T * D * w (a chunk tensor), or
                            * more (a token slice of a layer tensor: kvw_decode_wire_heads) */
} kvwc_geom;

/* Spec checks a decoder relies on (CSPEC-4..6, FP8-1, INT-1, INT-2; the header rules
 * already made them for a parsed header) and the geometry of the record's lossy body. */
kvw_code kvwc_lossy_geometry(const kvw_header *h, const kvw_record *rec,
                             const kvw_codec_spec *s, kvwc_geom *g, kvw_error *err);

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

/* The Hadamard block of a row of D channels: the largest power of two dividing D (D > 0). */
static inline uint64_t kvwc_rot_block(uint64_t D) { return D & (~D + 1); }
/* D is a power of two (D > 0); floor(log2(D)) for D >= 1. */
static inline int kvwc_pow2(uint64_t D) { return D && !(D & (D - 1)); }
static inline unsigned kvwc_log2_floor(uint64_t D) {
    unsigned k = 0;
    while (k < 63 && (UINT64_C(1) << (k + 1)) <= D) k++;
    return k;
}

#endif /* KVW_FORMAT_CODEC_H */
