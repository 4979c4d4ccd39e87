/*
 * AVX2 kernels of the fused int_affine encoder for groups along channels: the
 * group extremes, parameters and codes of codecs_qenc_fast.c eight elements at a time,
 * selected at run time (simd/simd.h: kvw_simd_qch) so that the library still runs on any x86-64.
 * The values are the portable path's exactly: every conversion to fp32 is exact, the
 * quotient is one IEEE division (vdivps rounds as divss does), the clamps and min / max
 * select among exact values, vcvtps2dq rounds to nearest even as rint does (the default
 * MXCSR mode, which the portable 2^23 rounding and numpy's rint assume as well), and the
 * parameters are simd/qenc_prm.h's source compiled for AVX2. The only lane-order
 * effect, which zero a group's extreme keeps, is settled by taking such a group again in
 * sequence. Why GCC only: as in hash_avx2.c, its target pragma covers the whole file
 * (other compilers build the stubs at the end, and the portable path runs).
 */
#include "common/fp_exact.h" /* first: no FMA contraction, fp32 evaluation (KVW-LOSSY-3) */

#include "common/cpu.h" /* KVW_BUILD_AVX2_PRAGMA: macros only, before the pragma */

#if KVW_BUILD_AVX2_PRAGMA
#pragma GCC target("avx2")
#endif

#include "simd/simd.h"
#include "simd/qenc_prm.h"

#if KVW_BUILD_AVX2_PRAGMA
#include <immintrin.h>

/* Eight elements as 32-bit lanes: the fp32 bits (f32) or the 16-bit pattern. */
INL __m256i load_raw(const uint8_t *p, unsigned dt) {
    if (dt == KVW_DTYPE_F32) return _mm256_loadu_si256((const __m256i *)(const void *)p);
    return _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(const void *)p));
}
/* Their magnitude bits (the dtype's bits without sign; >= inf_raw: not finite). */
INL __m256i abs_raw(__m256i u, unsigned dt) {
    return _mm256_and_si256(u, _mm256_set1_epi32(dt == KVW_DTYPE_F32 ? 0x7FFFFFFF : 0x7FFF));
}
/* Their fp32 values, exact (kvwc_from_bf16 / kvwc_from_f16 for finite halves). */
INL __m256 to_f32(__m256i u, unsigned dt) {
    if (dt == KVW_DTYPE_F32) return _mm256_castsi256_ps(u);
    if (dt == KVW_DTYPE_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
    __m256i a = abs_raw(u, dt), sign = _mm256_slli_epi32(_mm256_xor_si256(u, a), 16);
    __m256 nrm = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(a, 13), _mm256_set1_epi32(112 << 23)));
    __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(a), _mm256_set1_ps(5.9604644775390625e-8f)); /* m * 2^-24 */
    __m256 low = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(0x400), a)); /* exponent 0 */
    return _mm256_or_ps(_mm256_blendv_ps(nrm, sub, low), _mm256_castsi256_ps(sign));
}
INL float ld1(const uint8_t *p, size_t i, unsigned dt) {
    if (dt == KVW_DTYPE_F32) { float f; memcpy(&f, p + 4 * i, 4); return f; }
    uint16_t u;
    memcpy(&u, p + 2 * i, 2);
    return dt == KVW_DTYPE_BF16 ? kvwc_from_bf16(u) : kvwc_from_f16(u);
}
INL float hmin(__m256 v) {
    __m128 m = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_min_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_min_ss(m, _mm_shuffle_ps(m, m, 1)));
}
INL float hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}
INL uint32_t hmax_u32(__m256i v) {
    __m128i m = _mm_max_epu32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4E));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0xB1));
    return (uint32_t)_mm_cvtsi128_si32(m);
}

INL int extremes_dt(const uint8_t *rows, size_t nr, size_t D, size_t G, unsigned dt, float *mn, float *mx) {
    size_t w = dt == KVW_DTYPE_F32 ? 4 : 2, gd = (D + G - 1) / G;
    __m256i am = _mm256_setzero_si256();
    for (size_t r = 0; r < nr; r++) {
        const uint8_t *row = rows + r * D * w;
        for (size_t c = 0; c < gd; c++) {
            size_t d0 = c * G, n = D - d0 < G ? D - d0 : G;
            const uint8_t *p = row + d0 * w;
            __m256i u = load_raw(p, dt);
            am = _mm256_max_epu32(am, abs_raw(u, dt));
            __m256 lo = to_f32(u, dt), hi = lo;
            for (size_t i = 8; i < n; i += 8) {
                u = load_raw(p + i * w, dt);
                am = _mm256_max_epu32(am, abs_raw(u, dt));
                __m256 v = to_f32(u, dt);
                lo = _mm256_min_ps(lo, v);
                hi = _mm256_max_ps(hi, v);
            }
            float a = hmin(lo), b = hmax(hi);
            if (a == 0 || b == 0) { /* which zero: the last one, as in one sequential pass */
                a = b = ld1(p, 0, dt);
                for (size_t i = 1; i < n; i++) {
                    float v = ld1(p, i, dt);
                    if (v <= a) a = v;
                    if (v >= b) b = v;
                }
            }
            mn[r * gd + c] = a, mx[r * gd + c] = b;
        }
    }
    uint32_t inf = dt == KVW_DTYPE_F32 ? 0x7F800000u : dt == KVW_DTYPE_F16 ? 0x7C00u : 0x7F80u;
    return hmax_u32(am) < inf;
}
int kvwc_qch_extremes_avx2(const uint8_t *rows, size_t nr, size_t D, size_t G, unsigned dt,
                           float *mn, float *mx) {
    return dt == KVW_DTYPE_BF16  ? extremes_dt(rows, nr, D, G, KVW_DTYPE_BF16, mn, mx)
           : dt == KVW_DTYPE_F16 ? extremes_dt(rows, nr, D, G, KVW_DTYPE_F16, mn, mx)
                                 : extremes_dt(rows, nr, D, G, KVW_DTYPE_F32, mn, mx);
}

/* The low byte of each of eight 32-bit lanes, as eight bytes at dst. */
INL void store_bytes8(uint8_t *dst, __m256i q) {
    const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                          0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    __m256i s = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(q, pick), _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1));
    _mm_storel_epi64((__m128i *)(void *)dst, _mm256_castsi256_si128(s));
}
/* n codes of b = 4 or 2 bits (one a byte at c, n a multiple of 8) packed at out, least
 * significant bits first: a multiply-add joins neighbours ((c0 + c1 << b) ...). */
INL void pack_bits(const uint8_t *c, size_t n, unsigned b, uint8_t *out) {
    size_t j = 0;
    if (b == 4) {
        for (; j + 32 <= n; j += 32) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(const void *)(c + j));
            __m256i m = _mm256_maddubs_epi16(v, _mm256_set1_epi16(0x1001)); /* c0 + 16 c1 <= 255 */
            __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi16(m, m), 0x08);
            _mm_storeu_si128((__m128i *)(void *)(out + j / 2), _mm256_castsi256_si128(p));
        }
        for (; j < n; j += 2) out[j / 2] = (uint8_t)(c[j] | (c[j + 1] << 4));
        return;
    }
    for (; j + 32 <= n; j += 32) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(const void *)(c + j));
        __m256i m = _mm256_maddubs_epi16(v, _mm256_set1_epi16(0x0401));  /* c0 + 4 c1 <= 15 */
        m = _mm256_madd_epi16(m, _mm256_set1_epi32(0x00100001));          /* + 16 (c2 + 4 c3) */
        store_bytes8(out + j / 4, m);
    }
    for (; j < n; j += 4)
        out[j / 4] = (uint8_t)(c[j] | (c[j + 1] << 2) | (c[j + 2] << 4) | (c[j + 3] << 6));
}

/* 8 codes of 3 bits (low bits of the lanes) as the 3 bytes at o, least significant first (ROT-3). */
INL void store3(uint8_t *o, __m256i q) {
    __m256i v = _mm256_sllv_epi32(q, _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21));
    __m128i t = _mm_or_si128(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    t = _mm_or_si128(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_or_si128(t, _mm_shuffle_epi32(t, 0xB1));
    uint32_t u = (uint32_t)_mm_cvtsi128_si32(t);
    o[0] = (uint8_t)u, o[1] = (uint8_t)(u >> 8), o[2] = (uint8_t)(u >> 16);
}

INL void codes_dt(const uint8_t *rows, size_t nr, size_t D, size_t G, unsigned dt, const float *zv,
                  const float *den, int sym, unsigned b, uint8_t *out) {
    size_t w = dt == KVW_DTYPE_F32 ? 4 : 2, gd = (D + G - 1) / G;
    float qm = (float)(sym ? (1u << (b - 1)) - 1u : (1u << b) - 1u);
    const __m256 qmax = _mm256_set1_ps(qm), loc = _mm256_set1_ps(sym ? -qm : 0.0f);
    const __m256i half = _mm256_set1_epi32(sym ? 1 << (b - 1) : 0);
    uint8_t cb[KVWC_QCH_MAXD];
    for (size_t r = 0; r < nr; r++) {
        const uint8_t *row = rows + r * D * w;
        uint8_t *o = out + r * D * b / 8, *dst = b == 8 ? o : cb;
        for (size_t c = 0; c < gd; c++) {
            size_t d0 = c * G, n = D - d0 < G ? D - d0 : G;
            const uint8_t *p = row + d0 * w;
            const __m256 z = _mm256_set1_ps(zv[r * gd + c]), dv = _mm256_set1_ps(den[r * gd + c]);
            for (size_t i = 0; i < n; i += 8) {
                __m256 x = to_f32(load_raw(p + i * w, dt), dt);
                __m256 y = _mm256_div_ps(sym ? x : _mm256_sub_ps(x, z), dv);
                y = _mm256_max_ps(_mm256_min_ps(y, qmax), loc);
                __m256i q = _mm256_add_epi32(_mm256_cvtps_epi32(y), half);
                if (b == 3) store3(o + 3 * (d0 + i) / 8, q); /* d0 + i: a multiple of 8 (G % 8 == 0) */
                else store_bytes8(dst + d0 + i, q);
            }
        }
        if (b == 4 || b == 2) pack_bits(cb, D, b, o);
    }
}
void kvwc_qch_codes_avx2(const uint8_t *rows, size_t nr, size_t D, size_t G, unsigned dt,
                         const float *zv, const float *den, int sym, unsigned b, uint8_t *out) {
#define CD(DT, SYM) codes_dt(rows, nr, D, G, DT, zv, den, SYM, b, out)
    if (sym) {
        if (dt == KVW_DTYPE_BF16) CD(KVW_DTYPE_BF16, 1);
        else if (dt == KVW_DTYPE_F16) CD(KVW_DTYPE_F16, 1);
        else CD(KVW_DTYPE_F32, 1);
    } else {
        if (dt == KVW_DTYPE_BF16) CD(KVW_DTYPE_BF16, 0);
        else if (dt == KVW_DTYPE_F16) CD(KVW_DTYPE_F16, 0);
        else CD(KVW_DTYPE_F32, 0);
    }
#undef CD
}

int kvwc_qch_params_avx2(const iprm *q, size_t n, const float *mn, const float *mx, float *sv, float *zv,
                         float *den, uint8_t *params, uint64_t k) {
    return row_params(q, n, mn, mx, sv, zv, den, params, k);
}

/* ---- groups along tokens: the same steps per channel, eight channels a register ---- */
INL int tok_extremes_dt(const uint8_t *rows, size_t nr, size_t rowb, size_t D, unsigned dt, float *mn,
                        float *mx) {
    size_t w = dt == KVW_DTYPE_F32 ? 4 : 2;
    __m256i am = _mm256_setzero_si256();
    for (size_t d = 0; d < D; d += 8) { /* mn < v ? mn : v is minps (the later of equal values) */
        __m256i u = load_raw(rows + d * w, dt);
        am = _mm256_max_epu32(am, abs_raw(u, dt));
        __m256 lo = to_f32(u, dt), hi = lo;
        for (size_t r = 1; r < nr; r++) {
            u = load_raw(rows + r * rowb + d * w, dt);
            am = _mm256_max_epu32(am, abs_raw(u, dt));
            __m256 v = to_f32(u, dt);
            lo = _mm256_min_ps(lo, v);
            hi = _mm256_max_ps(hi, v);
        }
        _mm256_storeu_ps(mn + d, lo);
        _mm256_storeu_ps(mx + d, hi);
    }
    uint32_t inf = dt == KVW_DTYPE_F32 ? 0x7F800000u : dt == KVW_DTYPE_F16 ? 0x7C00u : 0x7F80u;
    return hmax_u32(am) < inf;
}
int kvwc_qtok_extremes_avx2(const uint8_t *rows, size_t nr, size_t rowb, size_t D, unsigned dt, float *mn,
                            float *mx) {
    return dt == KVW_DTYPE_BF16  ? tok_extremes_dt(rows, nr, rowb, D, KVW_DTYPE_BF16, mn, mx)
           : dt == KVW_DTYPE_F16 ? tok_extremes_dt(rows, nr, rowb, D, KVW_DTYPE_F16, mn, mx)
                                 : tok_extremes_dt(rows, nr, rowb, D, KVW_DTYPE_F32, mn, mx);
}
INL void tok_codes_dt(const uint8_t *rows, size_t nr, size_t rowb, size_t D, unsigned dt, const float *zv,
                      const float *den, int sym, unsigned b, uint8_t *out) {
    size_t w = dt == KVW_DTYPE_F32 ? 4 : 2;
    float qm = (float)(sym ? (1u << (b - 1)) - 1u : (1u << b) - 1u);
    const __m256 qmax = _mm256_set1_ps(qm), loc = _mm256_set1_ps(sym ? -qm : 0.0f);
    const __m256i half = _mm256_set1_epi32(sym ? 1 << (b - 1) : 0);
    uint8_t cb[KVWC_QCH_MAXD];
    for (size_t r = 0; r < nr; r++) {
        const uint8_t *p = rows + r * rowb;
        uint8_t *o = out + r * D * b / 8, *dst = b == 8 ? o : cb;
        for (size_t d = 0; d < D; d += 8) {
            __m256 x = to_f32(load_raw(p + d * w, dt), dt);
            __m256 y = _mm256_div_ps(sym ? x : _mm256_sub_ps(x, _mm256_loadu_ps(zv + d)), _mm256_loadu_ps(den + d));
            y = _mm256_max_ps(_mm256_min_ps(y, qmax), loc);
            __m256i q = _mm256_add_epi32(_mm256_cvtps_epi32(y), half);
            if (b == 3) store3(o + 3 * d / 8, q);
            else store_bytes8(dst + d, q);
        }
        if (b == 4 || b == 2) pack_bits(cb, D, b, o);
    }
}
void kvwc_qtok_codes_avx2(const uint8_t *rows, size_t nr, size_t rowb, size_t D, unsigned dt, const float *zv,
                          const float *den, int sym, unsigned b, uint8_t *out) {
#define CD(DT, SYM) tok_codes_dt(rows, nr, rowb, D, DT, zv, den, SYM, b, out)
    if (sym) {
        if (dt == KVW_DTYPE_BF16) CD(KVW_DTYPE_BF16, 1);
        else if (dt == KVW_DTYPE_F16) CD(KVW_DTYPE_F16, 1);
        else CD(KVW_DTYPE_F32, 1);
    } else {
        if (dt == KVW_DTYPE_BF16) CD(KVW_DTYPE_BF16, 0);
        else if (dt == KVW_DTYPE_F16) CD(KVW_DTYPE_F16, 0);
        else CD(KVW_DTYPE_F32, 0);
    }
#undef CD
}

#else /* not x86-64 GCC: never selected (kvw_simd_qch) */
int kvwc_qch_params_avx2(const iprm *q, size_t n, const float *mn, const float *mx, float *sv, float *zv,
                         float *den, uint8_t *params, uint64_t k) {
    (void)q, (void)n, (void)mn, (void)mx, (void)sv, (void)zv, (void)den, (void)params, (void)k;
    return 0;
}
int kvwc_qch_extremes_avx2(const uint8_t *rows, size_t nr, size_t D, size_t G, unsigned dt,
                           float *mn, float *mx) {
    (void)rows, (void)nr, (void)D, (void)G, (void)dt, (void)mn, (void)mx;
    return 0;
}
void kvwc_qch_codes_avx2(const uint8_t *rows, size_t nr, size_t D, size_t G, unsigned dt,
                         const float *zv, const float *den, int sym, unsigned b, uint8_t *out) {
    (void)rows, (void)nr, (void)D, (void)G, (void)dt, (void)zv, (void)den, (void)sym, (void)b, (void)out;
}
int kvwc_qtok_extremes_avx2(const uint8_t *rows, size_t nr, size_t rowb, size_t D, unsigned dt, float *mn,
                            float *mx) {
    (void)rows, (void)nr, (void)rowb, (void)D, (void)dt, (void)mn, (void)mx;
    return 0;
}
void kvwc_qtok_codes_avx2(const uint8_t *rows, size_t nr, size_t rowb, size_t D, unsigned dt, const float *zv,
                          const float *den, int sym, unsigned b, uint8_t *out) {
    (void)rows, (void)nr, (void)rowb, (void)D, (void)dt, (void)zv, (void)den, (void)sym, (void)b, (void)out;
}
#endif
