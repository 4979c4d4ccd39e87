/*
 * The int_affine group parameters of the fused lossy encoder (codecs_qenc_fast.c) and the
 * rounding helpers they share with its fp8 encoder, included by codecs_qenc_fast.c and by
 * simd/qenc_avx2.c. Why a header: the AVX2 translation unit compiles the very same
 * source for eight lanes (vectorised by the compiler, exact fp32 operations in the same
 * order), so both builds give the same scales and zeros by construction. Include after
 * common/fp_exact.h and simd/simd.h.
 */
#ifndef KVW_CODECS_QENC_PRM_H
#define KVW_CODECS_QENC_PRM_H

#include "simd/simd.h"

#define INL static inline __attribute__((always_inline))

/* rint(|y|) for 0 <= |y| < 2^23, as an integer. */
INL uint32_t rint_abs(float ay) { return kvwc_f32_bits(ay + 8388608.0f) & 0x7FFFFFu; }
/* kvwc_to_f16 / kvwc_from_f16 without branches (so that loops over groups vectorise), for
 * finite fp32 (the fast path sees no other): below 2^-14 the f16 subnormal code is
 * rint(|v| * 2^24), the product exact and |v| * 2^24 < 2^10; the rest is the same integer
 * rounding as kvwc_to_f16. */
INL uint32_t to_f16(float v) {
    uint32_t u = kvwc_f32_bits(v), sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
    uint32_t r = a - 0x38000000u;
    uint32_t nrm = (r + 0xFFFu + ((r >> 13) & 1u)) >> 13;
    uint32_t sub = rint_abs(kvwc_bits_f32(a) * 0x1p24f);
    uint32_t m = a >= 0x477FF000u ? 0x7C00u : a >= 0x38800000u ? nrm : sub;
    return sign | m;
}
INL float from_f16(uint32_t h) {
    uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    float sub = kvwc_bits_f32(sign | kvwc_f32_bits((float)m * 5.9604644775390625e-8f));
    float big = kvwc_bits_f32(sign | (e == 0x1F ? 0x7F800000u : (e + 112u) << 23) | (m << 13));
    return e == 0 ? sub : big;
}
/* kvwc_nearest_bits / kvwc_bits_value for finite fp32 (all the group parameters see),
 * without the branches for NaN and f16 subnormals: the same bits, and with dt a constant
 * (row_params_sd) the loops over groups vectorise. */
INL uint32_t near_bits(float v, unsigned dt) {
    uint32_t u = kvwc_f32_bits(v);
    return dt == KVW_DTYPE_F32 ? u : dt == KVW_DTYPE_F16 ? to_f16(v) : (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}
INL float bits_val(uint32_t b, unsigned dt) {
    return dt == KVW_DTYPE_F32 ? kvwc_bits_f32(b) : dt == KVW_DTYPE_F16 ? from_f16(b) : kvwc_bits_f32(b << 16);
}
INL uint32_t round_up_f(float v, unsigned dt) {
    uint32_t r = near_bits(v, dt);
    if (dt != KVW_DTYPE_F32 && bits_val(r, dt) < v) r++;
    return r;
}

typedef struct { float qmax, lo, hi, half; unsigned sd, b, ps; int sym; uint64_t np; } iprm;

/* Scale and zero of a group with extremes a <= c (codecs_qenc.c's first pass), scale dtype
 * sd; 0 when the group is near the extremes (the careful path then encodes the chunk). */
INL int gparams(const iprm *q, unsigned sd, int sym, float a, float c, float *sv, float *zv,
                float *den, uint32_t *sbits, uint32_t *zbits) {
    float amax = (-a > c ? -a : c) + 0.0f; /* +0, never -0 (kernels.amax_of) */
    uint32_t sb, zb = 0;
    if (sym) {
        sb = round_up_f(amax / q->qmax, sd);
    } else {
        zb = near_bits(a, sd);
        float z = bits_val(zb, sd), fit = (c - z) / q->qmax;
        sb = round_up_f(fit > 0 ? fit : 0.0f, sd);
    }
    *sv = bits_val(sb, sd), *zv = bits_val(zb, sd), *sbits = sb, *zbits = zb;
    /* sv == 0 only for an asymmetric group with c <= z: every x - z <= 0 clamps to code 0,
     * as the careful path's y = 0 does; dividing by 1 keeps the lanes finite. */
    *den = *sv > 0 ? *sv : 1.0f;
    return (amax >= q->lo) & (amax <= q->hi);
}
/* n groups' parameters at once (tokens axis: a row of channels; channels axis: a row's
 * groups), stored from index k; 0 when one is near the extremes. The stored bits are the
 * ones rounded (nearest_bits of their value gives them back: one conversion, not two). */
INL int row_params_sd(const iprm *q, unsigned sd, int sym, size_t n, const float *mn, const float *mx,
                      float *sv, float *zv, float *den, uint8_t *params, uint64_t k) {
    int ok = 1;
    const iprm lq = *q; /* a local copy: the stores below cannot alias it */
    uint32_t sb[KVWC_QCH_MAXD], zb[KVWC_QCH_MAXD];
    for (size_t d = 0; d < n; d++) {
        float s1, z1, d1;
        uint32_t b1, b2;
        ok &= gparams(&lq, sd, sym, mn[d], mx[d], &s1, &z1, &d1, &b1, &b2);
        sv[d] = s1, zv[d] = z1, den[d] = d1, sb[d] = b1, zb[d] = b2;
    }
    if (!ok) return 0;
    if (sd == KVW_DTYPE_F32) {
        for (size_t d = 0; d < n; d++) kvw_st32(params + 4 * (k + d), sb[d]);
        for (size_t d = 0; !sym && d < n; d++) kvw_st32(params + 4 * (q->np + k + d), zb[d]);
    } else {
        for (size_t d = 0; d < n; d++) kvw_st16(params + 2 * (k + d), (uint16_t)sb[d]);
        for (size_t d = 0; !sym && d < n; d++) kvw_st16(params + 2 * (q->np + k + d), (uint16_t)zb[d]);
    }
    return 1;
}
static inline int row_params(const iprm *q, size_t n, const float *mn, const float *mx, float *sv,
                      float *zv, float *den, uint8_t *params, uint64_t k) {
#define RP(SD, SYM) row_params_sd(q, SD, SYM, n, mn, mx, sv, zv, den, params, k)
    if (q->sym)
        return q->sd == KVW_DTYPE_BF16 ? RP(KVW_DTYPE_BF16, 1) : q->sd == KVW_DTYPE_F16 ? RP(KVW_DTYPE_F16, 1)
                                                              : RP(KVW_DTYPE_F32, 1);
    return q->sd == KVW_DTYPE_BF16 ? RP(KVW_DTYPE_BF16, 0) : q->sd == KVW_DTYPE_F16 ? RP(KVW_DTYPE_F16, 0)
                                                          : RP(KVW_DTYPE_F32, 0);
#undef RP
}

/* row_params compiled for AVX2 (simd/qenc_avx2.c; only where kvw_simd_qch). */
int kvwc_qch_params_avx2(const iprm *q, size_t n, const float *mn, const float *mx, float *sv, float *zv,
                         float *den, uint8_t *params, uint64_t k);

#endif /* KVW_CODECS_QENC_PRM_H */
