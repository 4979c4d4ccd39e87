/*
 * AVX2 building blocks of KVW-ROT-6's rotation shared by simd/rot_avx2.c (section 8) and
 * simd/tq_avx2.c (section 9): the in-register butterfly stages and the 8x8 transpose that
 * puts one row in each lane. Why a header of static inline functions: both files are
 * compiled with the avx2 target attribute only (no -march), and the kernels that call these
 * must inline them to keep the row in registers. Include inside the x86-64 block of an AVX2
 * translation unit, after immintrin.h, with AVX2 defined as its target attribute.
 */
#ifndef KVW_CODECS_ROT_SIMD_H
#define KVW_CODECS_ROT_SIMD_H

/* Stages h = 1, 2, 4 of one register of eight channels. s holds each element's partner;
 * lower positions take s + v (= b + a, the same IEEE sum as a + b), upper ones s + (-v)
 * (= a - b, a the lower element: IEEE subtraction is the sum with the negated operand, signed
 * zeros included), the negation an xor of the sign bit: three operations a stage, not four. */
AVX2 static inline __attribute__((always_inline)) __m256 stages_in(__m256 v) {
    const __m256 n1 = _mm256_castsi256_ps(_mm256_setr_epi32(0, INT32_MIN, 0, INT32_MIN, 0, INT32_MIN, 0, INT32_MIN));
    const __m256 n2 = _mm256_castsi256_ps(_mm256_setr_epi32(0, 0, INT32_MIN, INT32_MIN, 0, 0, INT32_MIN, INT32_MIN));
    const __m256 n4 = _mm256_castsi256_ps(_mm256_setr_epi32(0, 0, 0, 0, INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN));
    v = _mm256_add_ps(_mm256_permute_ps(v, 0xB1), _mm256_xor_ps(v, n1)); /* partners at distance 1 */
    v = _mm256_add_ps(_mm256_permute_ps(v, 0x4E), _mm256_xor_ps(v, n2)); /* distance 2 */
    return _mm256_add_ps(_mm256_permute2f128_ps(v, v, 0x01), _mm256_xor_ps(v, n4)); /* distance 4 */
}

/* 8x8 transpose: t[j] lane i = row i's element j. */
AVX2 static inline __attribute__((always_inline)) void tr8(__m256 *t) {
    __m256 a0 = _mm256_unpacklo_ps(t[0], t[1]), a1 = _mm256_unpackhi_ps(t[0], t[1]);
    __m256 a2 = _mm256_unpacklo_ps(t[2], t[3]), a3 = _mm256_unpackhi_ps(t[2], t[3]);
    __m256 a4 = _mm256_unpacklo_ps(t[4], t[5]), a5 = _mm256_unpackhi_ps(t[4], t[5]);
    __m256 a6 = _mm256_unpacklo_ps(t[6], t[7]), a7 = _mm256_unpackhi_ps(t[6], t[7]);
    __m256 b0 = _mm256_shuffle_ps(a0, a2, 0x44), b1 = _mm256_shuffle_ps(a0, a2, 0xEE);
    __m256 b2 = _mm256_shuffle_ps(a1, a3, 0x44), b3 = _mm256_shuffle_ps(a1, a3, 0xEE);
    __m256 b4 = _mm256_shuffle_ps(a4, a6, 0x44), b5 = _mm256_shuffle_ps(a4, a6, 0xEE);
    __m256 b6 = _mm256_shuffle_ps(a5, a7, 0x44), b7 = _mm256_shuffle_ps(a5, a7, 0xEE);
    t[0] = _mm256_permute2f128_ps(b0, b4, 0x20), t[4] = _mm256_permute2f128_ps(b0, b4, 0x31);
    t[1] = _mm256_permute2f128_ps(b1, b5, 0x20), t[5] = _mm256_permute2f128_ps(b1, b5, 0x31);
    t[2] = _mm256_permute2f128_ps(b2, b6, 0x20), t[6] = _mm256_permute2f128_ps(b2, b6, 0x31);
    t[3] = _mm256_permute2f128_ps(b3, b7, 0x20), t[7] = _mm256_permute2f128_ps(b3, b7, 0x31);
}

#endif /* KVW_CODECS_ROT_SIMD_H */
