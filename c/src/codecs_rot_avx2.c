/*
 * The row transform of KVW-ROT-6 compiled for AVX2 (chosen at run time by codecs_rot.c's
 * kvwc_rot_row when the CPU has it). Same operations as kvwc_rot_row_portable, value for
 * value: each butterfly is one IEEE addition and one subtraction of the same two inputs,
 * the stages run in the spec's order, and the scale and sign are one multiplication and an
 * xor, so the bytes agree with the portable path (tests/test_unit.c compares the two).
 * Eight channels per register: stages h = 1, 2, 4 are lane shuffles inside a register
 * (a + b in the lower position, a - b in the upper, from the same pair), stages h >= 8 add
 * and subtract whole registers; a 128-channel block is sixteen registers. Only the target
 * attribute differs from the portable build (no -march), so any x86-64 runs the library.
 */
#include "fp_exact.h" /* first: no FMA contraction, fp32 evaluation (KVW-LOSSY-3) */

#include "codecs_impl.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#define KVW_ROT_AVX2 1
#define AVX2 __attribute__((target("avx2")))

/* Stages h = 1, 2, 4 of one register of eight channels. s holds each element's partner;
 * lower positions take v + s (= a + b), upper ones s - v (= a - b, a the lower element). */
AVX2 static inline __attribute__((always_inline)) __m256 stages_in(__m256 v) {
    __m256 s = _mm256_permute_ps(v, 0xB1); /* partners at distance 1 */
    v = _mm256_blend_ps(_mm256_add_ps(v, s), _mm256_sub_ps(s, v), 0xAA);
    s = _mm256_permute_ps(v, 0x4E); /* distance 2 */
    v = _mm256_blend_ps(_mm256_add_ps(v, s), _mm256_sub_ps(s, v), 0xCC);
    s = _mm256_permute2f128_ps(v, v, 0x01); /* distance 4 */
    return _mm256_blend_ps(_mm256_add_ps(v, s), _mm256_sub_ps(s, v), 0xF0);
}

/* One block of NV registers (NV a power of two), all stages, in registers when NV is a
 * constant the compiler unrolls. */
AVX2 static inline __attribute__((always_inline)) void block_nv(float *y, unsigned NV) {
    __m256 r[16];
#pragma GCC unroll 16
    for (unsigned k = 0; k < NV; k++) r[k] = stages_in(_mm256_loadu_ps(y + 8 * k));
#pragma GCC unroll 4
    for (unsigned hv = 1; hv < NV; hv *= 2)
#pragma GCC unroll 16
        for (unsigned k = 0; k < NV / 2; k++) { /* pair k: i = (k / hv) * 2hv + k % hv */
            unsigned i = (k / hv) * 2 * hv + k % hv;
            __m256 a = r[i], b = r[i + hv];
            r[i] = _mm256_add_ps(a, b);
            r[i + hv] = _mm256_sub_ps(a, b);
        }
#pragma GCC unroll 16
    for (unsigned k = 0; k < NV; k++) _mm256_storeu_ps(y + 8 * k, r[k]);
}
AVX2 static void block1(float *y) { block_nv(y, 1); }
AVX2 static void block2(float *y) { block_nv(y, 2); }
AVX2 static void block4(float *y) { block_nv(y, 4); }
AVX2 static void block8(float *y) { block_nv(y, 8); }
AVX2 static void block16(float *y) { block_nv(y, 16); }

/* Longer blocks through memory: the in-register stages, then stage by stage. */
AVX2 static void block_mem(float *y, uint64_t B) {
    for (uint64_t k = 0; k < B; k += 8) _mm256_storeu_ps(y + k, stages_in(_mm256_loadu_ps(y + k)));
    for (uint64_t hh = 8; hh < B; hh *= 2)
        for (uint64_t i0 = 0; i0 < B; i0 += 2 * hh)
            for (uint64_t i = i0; i < i0 + hh; i += 8) {
                __m256 a = _mm256_loadu_ps(y + i), b = _mm256_loadu_ps(y + i + hh);
                _mm256_storeu_ps(y + i, _mm256_add_ps(a, b));
                _mm256_storeu_ps(y + i + hh, _mm256_sub_ps(a, b));
            }
}

AVX2 void kvwc_rot_row_avx2(float *y, uint64_t D, uint64_t B, float cb, const uint32_t *mask) {
    void (*blk)(float *) = B == 8 ? block1 : B == 16 ? block2 : B == 32 ? block4
                         : B == 64 ? block8 : B == 128 ? block16 : NULL;
    for (uint64_t j = 0; j < D; j += B) {
        if (blk) blk(y + j);
        else block_mem(y + j, B);
    }
    if (!mask) return;
    __m256 c = _mm256_set1_ps(cb);
    uint64_t d = 0;
    for (; d + 8 <= D; d += 8) {
        __m256 v = _mm256_mul_ps(_mm256_loadu_ps(y + d), c);
        __m256 m = _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)(const void *)(mask + d)));
        _mm256_storeu_ps(y + d, _mm256_xor_ps(v, m));
    }
    for (; d < D; d++) y[d] = kvwc_bits_f32(kvwc_f32_bits(y[d] * cb) ^ mask[d]);
}
/* x[d] = lv[u[d]] * s[d] (+ z[d]): two roundings, as the portable loop; n a multiple of 8,
 * codes below 16 (b <= 4: the levels in two registers). */
AVX2 void kvwc_rot_dequant_avx2(const uint8_t *u, const float *lv, const float *s, const float *z,
                                float *x, uint64_t n) {
    __m256 lo = _mm256_loadu_ps(lv), hi = _mm256_loadu_ps(lv + 8);
    __m256i seven = _mm256_set1_epi32(7);
    for (uint64_t d = 0; d + 8 <= n; d += 8) {
        __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(u + d)));
        __m256 l = _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, idx), _mm256_permutevar8x32_ps(hi, idx),
                                    _mm256_castsi256_ps(_mm256_cmpgt_epi32(idx, seven)));
        __m256 v = _mm256_mul_ps(l, _mm256_loadu_ps(s + d));
        if (z) v = _mm256_add_ps(v, _mm256_loadu_ps(z + d));
        _mm256_storeu_ps(x + d, v);
    }
}

/* n fp32 values (n a multiple of 8) -> bf16 bits, round to nearest even, canonical NaN
 * (kvwc_to_bf16 lane by lane). */
AVX2 void kvwc_rot_to_bf16_avx2(const float *x, uint16_t *out, uint64_t n) {
    __m256i abs = _mm256_set1_epi32(0x7FFFFFFF), inf = _mm256_set1_epi32(0x7F800000);
    __m256i r7 = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1), qnan = _mm256_set1_epi32(0x7FC0);
    for (uint64_t d = 0; d + 8 <= n; d += 8) {
        __m256i u = _mm256_castps_si256(_mm256_loadu_ps(x + d));
        __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs), inf); /* both below 2^31 */
        __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, r7), _mm256_and_si256(_mm256_srli_epi32(u, 16), one));
        r = _mm256_blendv_epi8(_mm256_srli_epi32(r, 16), qnan, nan);
        __m128i p = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
        _mm_storeu_si128((__m128i *)(void *)(out + d), p);
    }
}
#else
#define KVW_ROT_AVX2 0
void kvwc_rot_dequant_avx2(const uint8_t *u, const float *lv, const float *s, const float *z,
                           float *x, uint64_t n) {
    for (uint64_t d = 0; d < n; d++) {
        float p = lv[u[d]] * s[d];
        x[d] = z ? p + z[d] : p;
    }
}
void kvwc_rot_to_bf16_avx2(const float *x, uint16_t *out, uint64_t n) {
    for (uint64_t d = 0; d < n; d++) out[d] = kvwc_to_bf16(x[d]);
}
void kvwc_rot_row_avx2(float *y, uint64_t D, uint64_t B, float cb, const uint32_t *mask) {
    kvwc_rot_row_portable(y, D, B, cb, mask);
}
#endif

int kvwc_rot_avx2_built(void) { return KVW_ROT_AVX2; }
