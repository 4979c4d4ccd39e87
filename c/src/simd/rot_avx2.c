/*
 * The row transform of KVW-ROT-6 compiled for AVX2 (chosen at run time by codecs_rot.c's
 * kvwc_rot_row when the CPU has it). Same operations as kvwc_rot_row_portable, value for
 * value: each butterfly is one IEEE addition and one subtraction of the same two inputs,
 * the stages run in the spec's order, and the scale and sign are one multiplication and an
 * xor, so the bytes agree with the portable path (c/tests/test_unit.c compares the two).
 * Eight channels per register: stages h = 1, 2, 4 are lane shuffles inside a register
 * (a + b in the lower position, a - b in the upper, from the same pair), stages h >= 8 add
 * and subtract whole registers; a 128-channel block is sixteen registers. Only the target
 * attribute differs from the portable build (no -march), so any x86-64 runs the library.
 * Also here: the fused row decoder (codes -> levels -> butterflies -> bf16 with
 * the row in registers) and the encoder's kernels (load + rotate, group sums of squares a
 * lane per row, gaussian codes), each the portable loops' operations in their order.
 */
#include "common/fp_exact.h" /* first: no FMA contraction, fp32 evaluation (KVW-LOSSY-3) */

#include "simd/simd.h"

#if KVW_BUILD_AVX2_ATTR
#include <immintrin.h>

#define AVX2 __attribute__((target("avx2")))

#include "simd/rot_simd.h" /* stages_in, tr8 */

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

/* ---- the fused row decoder: codes -> levels * scale (+ zero) -> butterflies -> bf16 ------ */
/* Eight codes of b bits (b = 2, 3, 4: b bytes, a byte boundary at the start) as lanes; p may
 * be read 4 bytes on (the callers' row copies have the room). */
AVX2 static inline __attribute__((always_inline)) __m256i codes8(const uint8_t *p, __m256i sh, __m256i msk) {
    uint32_t v;
    memcpy(&v, p, 4);
    return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)v), sh), msk);
}
/* x = lv[u] * s (+ z) of register k: two roundings, as the portable loop. grp: register ->
 * its channel group's scale (groups along channels, G a multiple of 8); NULL: s and z per
 * channel (groups along tokens). */
AVX2 static inline __attribute__((always_inline)) __m256 level8(__m256i idx, unsigned b, __m256 lo, __m256 hi,
                                                                const float *s, const float *z,
                                                                const uint16_t *grp, unsigned k) {
    __m256 l = _mm256_permutevar8x32_ps(lo, idx);
    if (b == 4)
        l = _mm256_blendv_ps(l, _mm256_permutevar8x32_ps(hi, idx),
                             _mm256_castsi256_ps(_mm256_cmpgt_epi32(idx, _mm256_set1_epi32(7))));
    __m256 v = _mm256_mul_ps(l, grp ? _mm256_set1_ps(s[grp[k]]) : _mm256_loadu_ps(s + 8 * k));
    if (z) v = _mm256_add_ps(v, grp ? _mm256_set1_ps(z[grp[k]]) : _mm256_loadu_ps(z + 8 * k));
    return v;
}
/* fp32 -> bf16 bits of one register, stored as eight little-endian 16-bit values at dst. */
AVX2 static inline __attribute__((always_inline)) void bf16_8(__m256 x, uint8_t *dst) {
    __m256i u = _mm256_castps_si256(x);
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)),
                                     _mm256_set1_epi32(0x7F800000));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)),
                                 _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)));
    r = _mm256_blendv_epi8(_mm256_srli_epi32(r, 16), _mm256_set1_epi32(0x7FC0), nan);
    _mm_storeu_si128((__m128i *)(void *)dst,
                     _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

/* One row of D = 8 * NV channels (D a power of two up to 128: one block, B = D) held in
 * registers from the codes to the bf16 bytes; mask NULL: no rotation. */
AVX2 static inline __attribute__((always_inline)) void dec_nv(const kvwc_rot_drow *q, const uint8_t *codes,
                                                              const float *s, const float *z, uint8_t *dst,
                                                              unsigned NV) {
    unsigned b = q->b;
    uint8_t buf[16 * 4 + 4];
    memcpy(buf, codes, NV * b); /* the row's codes, with room for 4-byte loads */
    __m256 lo = _mm256_loadu_ps(q->lv), hi = _mm256_loadu_ps(q->lv + 8), r[16];
    __m256i sh = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)b));
    __m256i msk = _mm256_set1_epi32((int)((1u << b) - 1u));
#pragma GCC unroll 16
    for (unsigned k = 0; k < NV; k++) {
        __m256 v = level8(codes8(buf + k * b, sh, msk), b, lo, hi, s, z, q->grp, k);
        r[k] = q->mask ? stages_in(v) : v;
    }
    if (q->mask) {
#pragma GCC unroll 4
        for (unsigned hv = 1; hv < NV; hv *= 2)
#pragma GCC unroll 16
            for (unsigned k = 0; k < NV / 2; k++) {
                unsigned i = (k / hv) * 2 * hv + k % hv;
                __m256 a = r[i], c = r[i + hv];
                r[i] = _mm256_add_ps(a, c);
                r[i + hv] = _mm256_sub_ps(a, c);
            }
        __m256 cb = _mm256_set1_ps(q->cb);
#pragma GCC unroll 16
        for (unsigned k = 0; k < NV; k++)
            r[k] = _mm256_xor_ps(_mm256_mul_ps(r[k], cb),
                                 _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)(const void *)(q->mask + 8 * k))));
    }
#pragma GCC unroll 16
    for (unsigned k = 0; k < NV; k++) bf16_8(r[k], dst + 16 * k);
}
AVX2 static void dec1(const kvwc_rot_drow *q, const uint8_t *c, const float *s, const float *z, uint8_t *d) { dec_nv(q, c, s, z, d, 1); }
AVX2 static void dec2(const kvwc_rot_drow *q, const uint8_t *c, const float *s, const float *z, uint8_t *d) { dec_nv(q, c, s, z, d, 2); }
AVX2 static void dec4(const kvwc_rot_drow *q, const uint8_t *c, const float *s, const float *z, uint8_t *d) { dec_nv(q, c, s, z, d, 4); }
AVX2 static void dec8(const kvwc_rot_drow *q, const uint8_t *c, const float *s, const float *z, uint8_t *d) { dec_nv(q, c, s, z, d, 8); }
AVX2 static void dec16(const kvwc_rot_drow *q, const uint8_t *c, const float *s, const float *z, uint8_t *d) { dec_nv(q, c, s, z, d, 16); }

int kvwc_rot_dec_bf16_fits(uint64_t D) { return D >= 8 && D <= 128 && (D & (D - 1)) == 0; }

AVX2 void kvwc_rot_dec_bf16_avx2(const kvwc_rot_drow *q, const uint8_t *codes, const float *s,
                                 const float *z, uint8_t *dst) {
    uint64_t D = q->D;
    (D == 8 ? dec1 : D == 16 ? dec2 : D == 32 ? dec4 : D == 64 ? dec8 : dec16)(q, codes, s, z, dst);
}

/* Any D (a multiple of 8): the levels times the scales into x, straight from the codes. */
AVX2 void kvwc_rot_dequant_codes_avx2(const kvwc_rot_drow *q, const uint8_t *codes, const float *s,
                                      const float *z, float *x) {
    unsigned b = q->b;
    uint64_t nv = q->D / 8;
    __m256 lo = _mm256_loadu_ps(q->lv), hi = _mm256_loadu_ps(q->lv + 8);
    __m256i sh = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)b));
    __m256i msk = _mm256_set1_epi32((int)((1u << b) - 1u));
    for (uint64_t k = 0; k < nv; k++) {
        uint8_t buf[8] = {0};
        const uint8_t *p = codes + k * b;
        if (k + 1 == nv) { /* the row's last b bytes: no 4-byte load past the codes */
            memcpy(buf, p, b);
            p = buf;
        }
        _mm256_storeu_ps(x + 8 * k, level8(codes8(p, sh, msk), b, lo, hi, s, z, q->grp, (unsigned)k));
    }
}

/* ---- encoder kernels (codecs_rot_enc.c) ----------------------------------------------- */
/* One row of the header dtype (bf16 or f32) -> fp32, its largest magnitude as bits (>= the
 * infinity bits: not finite) in *amax, and with mask the forward rotation of the encoder
 * (sign xor, butterflies in KVW-ROT-6's order, then * cb) into y. */
AVX2 static inline __attribute__((always_inline)) __m256 ld8(const uint8_t *src, unsigned dt, uint64_t k) {
    if (dt == KVW_DTYPE_F32) return _mm256_loadu_ps((const float *)(const void *)src + 8 * k);
    __m128i h = _mm_loadu_si128((const __m128i *)(const void *)(src + 16 * k));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
AVX2 static inline __attribute__((always_inline)) void enc_nv(const uint8_t *src, unsigned dt, float cb,
                                                              const uint32_t *mask, float *y,
                                                              uint32_t *amax, unsigned NV) {
    __m256 r[16];
    __m256i mx = _mm256_setzero_si256(), ab = _mm256_set1_epi32(0x7FFFFFFF);
#pragma GCC unroll 16
    for (unsigned k = 0; k < NV; k++) {
        __m256 v = ld8(src, dt, k);
        mx = _mm256_max_epu32(mx, _mm256_and_si256(_mm256_castps_si256(v), ab));
        v = _mm256_xor_ps(v, _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)(const void *)(mask + 8 * k))));
        r[k] = stages_in(v);
    }
#pragma GCC unroll 4
    for (unsigned hv = 1; hv < NV; hv *= 2)
#pragma GCC unroll 16
        for (unsigned k = 0; k < NV / 2; k++) {
            unsigned i = (k / hv) * 2 * hv + k % hv;
            __m256 a = r[i], c = r[i + hv];
            r[i] = _mm256_add_ps(a, c);
            r[i + hv] = _mm256_sub_ps(a, c);
        }
    __m256 c = _mm256_set1_ps(cb);
#pragma GCC unroll 16
    for (unsigned k = 0; k < NV; k++) _mm256_storeu_ps(y + 8 * k, _mm256_mul_ps(r[k], c));
    __m128i m4 = _mm_max_epu32(_mm256_castsi256_si128(mx), _mm256_extracti128_si256(mx, 1));
    m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, 0x4E));
    m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, 0xB1));
    *amax = (uint32_t)_mm_cvtsi128_si32(m4);
}
#define ENC_W(NV) \
    AVX2 static void enc##NV(const uint8_t *s, unsigned dt, float cb, const uint32_t *m, float *y, uint32_t *a) { \
        enc_nv(s, dt, cb, m, y, a, NV); }
ENC_W(1) ENC_W(2) ENC_W(4) ENC_W(8) ENC_W(16)

AVX2 void kvwc_rot_enc_row_avx2(const uint8_t *src, unsigned dt, uint64_t D, uint64_t B, float cb,
                                const uint32_t *mask, float *y, uint32_t *amax) {
    if (mask && D == B && kvwc_rot_dec_bf16_fits(D)) {
        (D == 8 ? enc1 : D == 16 ? enc2 : D == 32 ? enc4 : D == 64 ? enc8 : enc16)(src, dt, cb, mask, y, amax);
        return;
    }
    __m256i mx = _mm256_setzero_si256(), ab = _mm256_set1_epi32(0x7FFFFFFF);
    for (uint64_t k = 0; k < D / 8; k++) {
        __m256 v = ld8(src, dt, k);
        mx = _mm256_max_epu32(mx, _mm256_and_si256(_mm256_castps_si256(v), ab));
        if (mask) v = _mm256_xor_ps(v, _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)(const void *)(mask + 8 * k))));
        _mm256_storeu_ps(y + 8 * k, v);
    }
    uint32_t t[8];
    _mm256_storeu_si256((__m256i *)(void *)t, mx);
    *amax = 0;
    for (unsigned i = 0; i < 8; i++) *amax = t[i] > *amax ? t[i] : *amax;
    if (!mask) return;
    kvwc_rot_row_avx2(y, D, B, cb, NULL);
    __m256 c = _mm256_set1_ps(cb);
    for (uint64_t k = 0; k < D / 8; k++) _mm256_storeu_ps(y + 8 * k, _mm256_mul_ps(_mm256_loadu_ps(y + 8 * k), c));
}

/* Sums of squares of 8 consecutive rows' channel groups (G % 8 == 0, D % 8 == 0), each a
 * = a + x * x in element order from 0 (a lane per row), and the groups' nonzero flags; the
 * group (row r, c) at acc[r * gd + c]. */
AVX2 void kvwc_rot_sumsq8_avx2(const float *x, uint64_t D, uint64_t G, float *acc, uint8_t *live) {
    uint64_t gd = (D + G - 1) / G;
    for (uint64_t c = 0, d0 = 0; d0 < D; c++, d0 += G) {
        uint64_t d1 = D - d0 < G ? D : d0 + G;
        __m256 a = _mm256_setzero_ps(), nz = _mm256_setzero_ps(), zero = _mm256_setzero_ps();
        for (uint64_t d = d0; d < d1; d += 8) {
            __m256 t[8];
            for (unsigned i = 0; i < 8; i++) t[i] = _mm256_loadu_ps(x + i * D + d);
            tr8(t);
            for (unsigned j = 0; j < 8; j++) {
                a = _mm256_add_ps(a, _mm256_mul_ps(t[j], t[j]));
                nz = _mm256_or_ps(nz, _mm256_cmp_ps(t[j], zero, _CMP_NEQ_UQ));
            }
        }
        float av[8];
        _mm256_storeu_ps(av, a);
        int fl = _mm256_movemask_ps(nz);
        for (unsigned i = 0; i < 8; i++) acc[i * gd + c] = av[i], live[i * gd + c] = (uint8_t)((fl >> i) & 1);
    }
}

/* One row's gaussian codes (b = 2, 3, 4; D % 8 == 0) as fresh bytes at out: y = x / s (s > 0,
 * else 1), j = the number of midpoints at or below |y| (clamped to 2^(b-1) - 1; 0 when s is
 * not > 0), code 2^(b-1) - 1 - j for y < 0 (s > 0), else 2^(b-1) + j: encode_gauss's loop.
 * Only the 2^(b-1) - 1 finite midpoints are compared: the infinite ones encode_gauss adds
 * count only for |y| = inf, which its clamp maps to the same top level (so no clamp here). */
typedef struct gq {
    __m256 m[7], one, zero, ab;
    __m256i hv, flip, sh;
    unsigned nm;
} gq;
/* Register k's codes, shifted to bit b * i of lane i, with its scales sc (pos: sc > 0, den: sc
 * where positive, else 1). Below 2^(b-1) - 1 midpoints j cannot pass the clamp; the code of
 * a negative y, 2^(b-1) - 1 - j, is 2^(b-1) + j with its b bits flipped. */
AVX2 static inline __attribute__((always_inline)) __m256i gcode8(const gq *c, const float *x, __m256 pos,
                                                                 __m256 den, uint64_t k) {
    __m256 y = _mm256_div_ps(_mm256_loadu_ps(x + 8 * k), den);
    __m256 a = _mm256_and_ps(y, c->ab);
    __m256i j = _mm256_setzero_si256();
    for (unsigned i = 0; i < c->nm; i++) /* each compare is -1 or 0 */
        j = _mm256_sub_epi32(j, _mm256_castps_si256(_mm256_cmp_ps(a, c->m[i], _CMP_GE_OQ)));
    j = _mm256_and_si256(j, _mm256_castps_si256(pos));
    __m256i neg = _mm256_castps_si256(_mm256_and_ps(_mm256_cmp_ps(y, c->zero, _CMP_LT_OQ), pos));
    __m256i u = _mm256_xor_si256(_mm256_add_epi32(c->hv, j), _mm256_and_si256(neg, c->flip));
    return _mm256_sllv_epi32(u, c->sh); /* lane i's code at bit b * i */
}
AVX2 static inline __attribute__((always_inline)) void gscale(const gq *c, const float *sv, const uint16_t *grp,
                                                              uint64_t k, __m256 *pos, __m256 *den) {
    __m256 sc = grp ? _mm256_set1_ps(sv[grp[k]]) : _mm256_loadu_ps(sv + 8 * k);
    *pos = _mm256_cmp_ps(sc, c->zero, _CMP_GT_OQ);
    *den = _mm256_blendv_ps(c->one, sc, *pos);
}
AVX2 void kvwc_rot_gauss_codes_avx2(const float *x, const float *sv, const uint16_t *grp, uint64_t D,
                                    unsigned b, const float *mid, uint8_t *out) {
    unsigned half = 1u << (b - 1);
    gq c;
    c.one = _mm256_set1_ps(1.0f), c.zero = _mm256_setzero_ps();
    c.ab = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    c.nm = half - 1;
    for (unsigned i = 0; i < 7; i++) c.m[i] = _mm256_set1_ps(mid[i]);
    c.hv = _mm256_set1_epi32((int)half), c.flip = _mm256_set1_epi32((int)(2 * half - 1));
    c.sh = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)b));
    uint64_t nv = D / 8, k = 0;
    const __m128i take3 = _mm_setr_epi8(0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1);
    __m256 p0, d0, p1, d1, p2, d2, p3, d3;
    for (; k + 4 <= nv; k += 4) { /* four registers: lane sums (the bits are disjoint) */
        if (grp && grp[k] == grp[k + 3]) { /* one channel group: its scale once */
            gscale(&c, sv, grp, k, &p0, &d0);
            p1 = p2 = p3 = p0, d1 = d2 = d3 = d0;
        } else {
            gscale(&c, sv, grp, k, &p0, &d0), gscale(&c, sv, grp, k + 1, &p1, &d1);
            gscale(&c, sv, grp, k + 2, &p2, &d2), gscale(&c, sv, grp, k + 3, &p3, &d3);
        }
        __m256i v0 = gcode8(&c, x, p0, d0, k), v1 = gcode8(&c, x, p1, d1, k + 1);
        __m256i v2 = gcode8(&c, x, p2, d2, k + 2), v3 = gcode8(&c, x, p3, d3, k + 3);
        __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(v0, v1), _mm256_hadd_epi32(v2, v3));
        __m128i w = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
        uint8_t *o = out + k * b; /* 4 b bytes */
        if (b == 4) {
            _mm_storeu_si128((__m128i *)(void *)o, w);
        } else if (b == 2) {
            _mm_storel_epi64((__m128i *)(void *)o, _mm_packus_epi32(w, w));
        } else {
            uint8_t t[16];
            _mm_storeu_si128((__m128i *)(void *)t, _mm_shuffle_epi8(w, take3));
            memcpy(o, t, 12);
        }
    }
    for (; k < nv; k++) {
        gscale(&c, sv, grp, k, &p0, &d0);
        __m256i v = gcode8(&c, x, p0, d0, k);
        __m128i o = _mm_or_si128(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        o = _mm_or_si128(o, _mm_shuffle_epi32(o, 0x4E));
        o = _mm_or_si128(o, _mm_shuffle_epi32(o, 0xB1));
        uint32_t w = (uint32_t)_mm_cvtsi128_si32(o);
        for (unsigned q = 0; q < b; q++) out[k * b + q] = (uint8_t)(w >> (8 * q));
    }
}
#else /* not x86-64 GCC or clang: stubs, never selected (kvw_simd_rot) */
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
    (void)y, (void)D, (void)B, (void)cb, (void)mask;
}
int kvwc_rot_dec_bf16_fits(uint64_t D) { (void)D; return 0; }
void kvwc_rot_enc_row_avx2(const uint8_t *src, unsigned dt, uint64_t D, uint64_t B, float cb,
                           const uint32_t *mask, float *y, uint32_t *amax) {
    (void)src, (void)dt, (void)D, (void)B, (void)cb, (void)mask, (void)y, (void)amax;
}
void kvwc_rot_sumsq8_avx2(const float *x, uint64_t D, uint64_t G, float *acc, uint8_t *live) {
    (void)x, (void)D, (void)G, (void)acc, (void)live;
}
void kvwc_rot_gauss_codes_avx2(const float *x, const float *sv, const uint16_t *grp, uint64_t D,
                               unsigned b, const float *mid, uint8_t *out) {
    (void)x, (void)sv, (void)grp, (void)D, (void)b, (void)mid, (void)out;
}
void kvwc_rot_dec_bf16_avx2(const kvwc_rot_drow *q, const uint8_t *codes, const float *s,
                            const float *z, uint8_t *dst) {
    (void)q, (void)codes, (void)s, (void)z, (void)dst;
}
void kvwc_rot_dequant_codes_avx2(const kvwc_rot_drow *q, const uint8_t *codes, const float *s,
                                 const float *z, float *x) {
    (void)q, (void)codes, (void)s, (void)z, (void)x;
}
#endif
