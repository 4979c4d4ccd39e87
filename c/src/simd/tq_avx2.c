/*
 * The turboquant writer's row step (codecs_tq.c, spec/codecs.md section 9) compiled for AVX2,
 * chosen at run time by codecs_tq.c when the CPU has it (the scalar loops ran the
 * encoder at a fifth of the 1 GB/s goal). The same fp32 operations as the portable loop, value
 * for value: y / den lane by lane, the sign xor, KVW-ROT-6's butterflies (kvwc_rot_row_avx2),
 * y * cb, then u = #{ j : y >= M_j } from ordered compares against the positive midpoints
 * (code8: the same counts by a binary search), packed as KVW-ROT-3's little-endian bit string. Only the target attribute
 * differs from the portable build (no -march), so any x86-64 runs the library.
 */
#include "common/fp_exact.h" /* first: no FMA contraction, fp32 evaluation (KVW-LOSSY-3) */

#include "simd/simd.h"

#include <math.h>

#if KVW_BUILD_AVX2_ATTR
#include <immintrin.h>

#define AVX2 __attribute__((target("avx2")))

#include "simd/rot_simd.h" /* stages_in, tr8 */

/* Register k's codes, lane i's shifted to bit b * i (the lanes' bits are disjoint). The
 * midpoints are symmetric (M_{h-1} = 0, M_{h-1-i} = -M_{h-1+i} exactly: fp32 sums and halves
 * keep signs), so #{ j : y >= M_j } is h + #{ i : m_i <= y } for y >= 0 (also -0) over the h - 1
 * positive ones m, and h - 1 - #{ i : m_i < |y| } = h + ~#{ ... } for y < 0, where m < |y| is
 * m <= the float below |y| (|y| > 0: its bits minus 1). The count of the sorted m_i <= a is a
 * binary search over the compares a sequential count would make (m[0]: m_0.. then +inf a lane
 * each, m[1] the same from m_1, m[2]: the middle one in every lane): 4 is counted when a >= m_3,
 * then 2 when a >= m_{c+1}, then 1 when a >= m_c (b = 4; b = 3: the last two steps from m_1).
 * y is never NaN: the rows are finite, den >= 1e-8 and |y / den| <= 1 (norm >= every |y|, up
 * to its rounding), so the rotated values are finite too. */
AVX2 static inline __attribute__((always_inline)) __m256i code8(__m256 y, __m256 c, const __m256 *m,
                                                                unsigned b, __m256i sh) {
    unsigned h = 1u << (b - 1);
    __m256 v = _mm256_mul_ps(y, c);
    __m256i neg = _mm256_castps_si256(_mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_LT_OQ));
    __m256i ab = _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x7FFFFFFF));
    __m256 a = _mm256_castsi256_ps(_mm256_add_epi32(ab, neg)); /* neg lanes: -1 */
    __m256i n = _mm256_castps_si256(_mm256_cmp_ps(a, m[2], _CMP_GE_OQ));
    if (b == 4) {
        n = _mm256_and_si256(n, _mm256_set1_epi32(4)); /* m[2] = m_3 */
        __m256 p = _mm256_permutevar8x32_ps(m[1], n); /* m_{n+1} */
        n = _mm256_add_epi32(n, _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(a, p, _CMP_GE_OQ)),
                                                 _mm256_set1_epi32(2)));
    } else {
        n = _mm256_and_si256(n, _mm256_set1_epi32(2)); /* m[2] = m_1 */
    }
    n = _mm256_sub_epi32(n, _mm256_castps_si256(_mm256_cmp_ps(a, _mm256_permutevar8x32_ps(m[0], n), _CMP_GE_OQ)));
    __m256i j = _mm256_add_epi32(_mm256_xor_si256(n, neg), _mm256_set1_epi32((int)h));
    return _mm256_sllv_epi32(j, sh);
}

/* The row for a constant b (3 or 4): the compare loops unrolled. NV: D / 8 registers held in
 * registers (D <= 128, all of KVW-ROT-6's stages there, in their order); 0: through y. */
#define VAL(k) (NV ? r[k] : _mm256_loadu_ps(y + 8 * (k)))
AVX2 static inline __attribute__((always_inline)) void enc_row(float *y, uint64_t D, float den,
                                                               const uint32_t *mask, float cb,
                                                               const float *mid, unsigned b,
                                                               uint8_t *out, unsigned NV) {
    uint64_t nv = NV ? NV : D / 8, k = 0; /* NV = D / 8 when nonzero */
    __m256 dv = _mm256_set1_ps(den), m[3], r[16];
#pragma GCC unroll 16
    for (uint64_t q = 0; q < nv; q++) {
        __m256 v = _mm256_div_ps(_mm256_loadu_ps(y + 8 * q), dv);
        if (mask)
            v = _mm256_xor_ps(v, _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)(const void *)(mask + 8 * q))));
        if (NV) r[q] = mask ? stages_in(v) : v;
        else _mm256_storeu_ps(y + 8 * q, v);
    }
    if (mask && NV) {
#pragma GCC unroll 4
        for (unsigned hv = 1; hv < NV; hv *= 2)
#pragma GCC unroll 16
            for (unsigned q = 0; q < NV / 2; q++) { /* pair q: i = (q / hv) * 2hv + q % hv */
                unsigned i = (q / hv) * 2 * hv + q % hv;
                __m256 a = r[i], e = r[i + hv];
                r[i] = _mm256_add_ps(a, e);
                r[i + hv] = _mm256_sub_ps(a, e);
            }
    } else if (mask) {
        kvwc_rot_row_avx2(y, D, D, cb, NULL); /* the butterflies only */
    }
    __m256 c = _mm256_set1_ps(mask ? cb : 1.0f); /* y * 1: exact, the unrotated row as it is */
    float tab[9];
    for (unsigned i = 0; i < 9; i++) tab[i] = i + 1 < (1u << (b - 1)) ? mid[(1u << (b - 1)) + i] : INFINITY;
    m[0] = _mm256_loadu_ps(tab), m[1] = _mm256_loadu_ps(tab + 1), m[2] = _mm256_set1_ps(tab[b == 4 ? 3 : 1]);
    __m256i sh = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)b));
    const __m128i take3 = _mm_setr_epi8(0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1);
#pragma GCC unroll 4
    for (; k + 4 <= nv; k += 4) { /* four registers: lane sums (the bits are disjoint) */
        __m256i v0 = code8(VAL(k), c, m, b, sh), v1 = code8(VAL(k + 1), c, m, b, sh);
        __m256i v2 = code8(VAL(k + 2), c, m, b, sh), v3 = code8(VAL(k + 3), c, m, b, sh);
        __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(v0, v1), _mm256_hadd_epi32(v2, v3));
        __m128i w = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
        uint8_t *o = out + k * b; /* 4 b bytes */
        if (b == 4) {
            _mm_storeu_si128((__m128i *)(void *)o, w);
        } else {
            uint8_t t[16];
            _mm_storeu_si128((__m128i *)(void *)t, _mm_shuffle_epi8(w, take3));
            memcpy(o, t, 12);
        }
    }
#pragma GCC unroll 4
    for (; k < nv; k++) {
        __m256i v = code8(VAL(k), c, m, b, sh);
        __m128i o = _mm_or_si128(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        o = _mm_or_si128(o, _mm_shuffle_epi32(o, 0x4E));
        o = _mm_or_si128(o, _mm_shuffle_epi32(o, 0xB1));
        uint32_t w = (uint32_t)_mm_cvtsi128_si32(o);
        for (unsigned q = 0; q < b; q++) out[k * b + q] = (uint8_t)(w >> (8 * q));
    }
}
#undef VAL
typedef void (*enc_fn)(float *, uint64_t, float, const uint32_t *, float, const float *, uint8_t *);
#define ENC(B, NV) \
    AVX2 static void enc##B##_##NV(float *y, uint64_t D, float den, const uint32_t *mask, float cb, \
                                   const float *mid, uint8_t *out) { enc_row(y, D, den, mask, cb, mid, B, out, NV); }
ENC(3, 0) ENC(3, 1) ENC(3, 2) ENC(3, 4) ENC(3, 8) ENC(3, 16)
ENC(4, 0) ENC(4, 1) ENC(4, 2) ENC(4, 4) ENC(4, 8) ENC(4, 16)
static const enc_fn ENC_FN[2][6] = {{enc3_0, enc3_1, enc3_2, enc3_4, enc3_8, enc3_16},
                                    {enc4_0, enc4_1, enc4_2, enc4_4, enc4_8, enc4_16}};
AVX2 void kvwc_tq_enc_row_avx2(float *y, uint64_t D, float den, const uint32_t *mask, float cb,
                               const float *mid, unsigned b, uint8_t *out) {
    unsigned i = D == 8 ? 1 : D == 16 ? 2 : D == 32 ? 3 : D == 64 ? 4 : D == 128 ? 5 : 0;
    ENC_FN[b == 4][i](y, D, den, mask, cb, mid, out);
}

AVX2 void kvwc_tq_sumsq8_avx2(const uint8_t *codes, unsigned b, const float *lv, uint64_t D, float *n) {
    uint8_t buf[8 * 128 * 4 / 8 + 4] = {0}; /* 4-byte loads past the last row's codes */
    size_t rb = (size_t)D * b / 8;
    memcpy(buf, codes, 8 * rb);
    float q[16] = {0};
    for (unsigned j = 0; j < (1u << b); j++) q[j] = lv[j] * lv[j]; /* v * v of every level */
    __m256 lo = _mm256_loadu_ps(q), hi = _mm256_loadu_ps(q + 8), a = _mm256_setzero_ps();
    __m256i sh = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)b));
    __m256i msk = _mm256_set1_epi32((int)((1u << b) - 1u)), seven = _mm256_set1_epi32(7);
    for (uint64_t k = 0; k < D / 8; k++) {
        __m256 t[8];
        for (unsigned r = 0; r < 8; r++) {
            uint32_t v;
            memcpy(&v, buf + r * rb + k * b, 4);
            __m256i idx = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)v), sh), msk);
            t[r] = _mm256_permutevar8x32_ps(lo, idx);
            if (b == 4)
                t[r] = _mm256_blendv_ps(t[r], _mm256_permutevar8x32_ps(hi, idx),
                                        _mm256_castsi256_ps(_mm256_cmpgt_epi32(idx, seven)));
        }
        tr8(t);
        for (unsigned j = 0; j < 8; j++) a = _mm256_add_ps(a, t[j]); /* channel order */
    }
    _mm256_storeu_ps(n, a);
}

AVX2 uint32_t kvwc_tq_amax_avx2(const float *x, uint64_t D) {
    __m256i mx = _mm256_setzero_si256(), ab = _mm256_set1_epi32(0x7FFFFFFF);
    for (uint64_t d = 0; d < D; d += 8) /* magnitudes below 2^31: signed max is unsigned max */
        mx = _mm256_max_epi32(mx, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(const void *)(x + d)), ab));
    __m128i m4 = _mm_max_epi32(_mm256_castsi256_si128(mx), _mm256_extracti128_si256(mx, 1));
    m4 = _mm_max_epi32(m4, _mm_shuffle_epi32(m4, 0x4E));
    m4 = _mm_max_epi32(m4, _mm_shuffle_epi32(m4, 0xB1));
    return (uint32_t)_mm_cvtsi128_si32(m4);
}
#else
void kvwc_tq_sumsq8_avx2(const uint8_t *codes, unsigned b, const float *lv, uint64_t D, float *n) {
    (void)codes, (void)b, (void)lv, (void)D, (void)n;
}
uint32_t kvwc_tq_amax_avx2(const float *x, uint64_t D) {
    (void)x, (void)D;
    return 0;
}
void kvwc_tq_enc_row_avx2(float *y, uint64_t D, float den, const uint32_t *mask, float cb,
                          const float *mid, unsigned b, uint8_t *out) {
    (void)y, (void)D, (void)den, (void)mask, (void)cb, (void)mid, (void)b, (void)out;
}
#endif

/* Outside the AVX2 build: only kernels (simd/rot_avx2.c's, the ones above) run here. */
void kvwc_tq_rows8_bf16(const kvwc_geom *g, const uint8_t *codes, const float *lv, const float *s,
                        const uint32_t *mask, float cb, uint64_t r0, uint8_t *out) {
    static const uint16_t grp0[16] = {0}; /* every register (D <= 128): the row's one scale */
    uint64_t D = g->D, M = g->M;
    unsigned b = g->bits;
    float n[8], lr[16];
    size_t rb = (size_t)D * b / 8; /* one row's code bytes */
    kvwc_tq_sumsq8_avx2(codes, b, lv, D, n);
    for (uint64_t r = 0; r < 8; r++) {
        float inv = 1.0f / sqrtf(n[r]);
        for (unsigned j = 0; j < 16; j++) lr[j] = lv[j] * inv; /* v * inv, then * s */
        kvwc_rot_drow q = {b, lr, grp0, mask, cb, D};
        uint64_t rr = r0 + r;
        kvwc_rot_dec_bf16_avx2(&q, codes + r * rb, s + r, NULL, out + (rr / M) * g->ohs + (g->P + rr % M) * D * 2);
    }
}
