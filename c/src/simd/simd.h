/*
 * The AVX2 kernels of the codecs (src/simd), both directions: the channel-group and token
 * int_affine encoders (qenc_avx2.c), the revision 1.2 rotation's rows, fused row decoder
 * and encoder kernels (rot_avx2.c), and revision 1.3's TurboQuant rows (tq_avx2.c). Why a
 * folder: the kernels are compiled for AVX2 by a target attribute or pragma while the
 * library runs on any x86-64, so they live in their own translation units and the callers
 * choose them at run time with kvw_simd_rot() / kvw_simd_qch() (the build has them and
 * common/cpu.c's probe says the CPU runs AVX2). Each kernel gives the values of the
 * portable loop it replaces, bit for bit (c/tests/test_unit.c compares them).
 */
#ifndef KVW_SIMD_H
#define KVW_SIMD_H

#include "format/codec.h"

#include <stddef.h>
#include <stdint.h>

/* The rotation and TurboQuant kernels (target attribute: GCC or clang on x86-64). */
static inline int kvw_simd_rot(void) { return KVW_BUILD_AVX2_ATTR && kvw_cpu_has_avx2(); }
/* The int_affine encoders' kernels (GCC's target pragma: GCC on x86-64). */
static inline int kvw_simd_qch(void) { return KVW_BUILD_AVX2_PRAGMA && kvw_cpu_has_avx2(); }

/* ---- int_affine encoders (qenc_avx2.c) ----------------------------------------------
 * Both kernels take nr consecutive rows of D elements of header dtype dt (D and G
 * multiples of 8, D <= KVWC_QCH_MAXD), groups of G channels, the last one shorter when G
 * does not divide D, gd = ceil(D / G) groups a row, numbered row-major. */
#define KVWC_QCH_MAXD 1024

/* The group parameters' kernel, kvwc_qch_params_avx2, is declared in simd/qenc_prm.h. */
/* Each group's min (mn) and max (mx), the last of equal values kept as numpy's minimum /
 * maximum do; 0 when an element is NaN or infinite (mn, mx then unspecified). */
int kvwc_qch_extremes_avx2(const uint8_t *rows, size_t nr, size_t D, size_t G, unsigned dt,
                           float *mn, float *mx);
/* The packed codes of the rows (nr * D * b / 8 bytes at out): clamp(rint((x - zv) / den))
 * of each element with its group's zero (ignored when sym) and divisor, offset by 2^(b-1)
 * when sym; the arithmetic of codecs_qenc_fast.c's icode, eight lanes at a time. */
void kvwc_qch_codes_avx2(const uint8_t *rows, size_t nr, size_t D, size_t G, unsigned dt,
                         const float *zv, const float *den, int sym, unsigned b, uint8_t *out);

/* Groups along tokens (D a multiple of 8, rows rowb bytes apart): each channel's min and
 * max over nr rows (int_tokens' compares: the later of equal values; 0 when an element is
 * NaN or infinite), and
 * the rows' packed codes (b = 2, 3, 4 or 8; D * b / 8 bytes a row at out) with each
 * channel's zero and divisor, the arithmetic of kvwc_qch_codes_avx2. */
int kvwc_qtok_extremes_avx2(const uint8_t *rows, size_t nr, size_t rowb, size_t D, unsigned dt, float *mn,
                            float *mx);
void kvwc_qtok_codes_avx2(const uint8_t *rows, size_t nr, size_t rowb, size_t D, unsigned dt, const float *zv,
                          const float *den, int sym, unsigned b, uint8_t *out);


/* ---- revision 1.2 rotation (rot_avx2.c) ---------------------------------------------- */
/* The butterflies of KVW-ROT-6 on one row, the values of kvwc_rot_row_portable. */
void kvwc_rot_row_avx2(float *y, uint64_t D, uint64_t B, float cb, const uint32_t *mask);
/* The decoder's other row steps in AVX2 (n a multiple of 8; the same values as the portable
 * loops of codecs_rot.c): x = lv[u] * s (+ z) for codes below 16, and fp32 -> bf16 bits. */
void kvwc_rot_dequant_avx2(const uint8_t *u, const float *lv, const float *s, const float *z,
                           float *x, uint64_t n);
void kvwc_rot_to_bf16_avx2(const float *x, uint16_t *out, uint64_t n);
/* The fused AVX2 row decoder (rot_avx2.c; only when kvw_simd_rot()): codes of b = 2, 3 or 4 bits (D * b / 8 bytes of one row) -> lv[u] * s (+ z) ->
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
/* The encoder's AVX2 kernels (simd/rot_avx2.c; the values of codecs_rot_enc.c's portable
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

/* ---- revision 1.3 TurboQuant (tq_avx2.c) --------------------------------------------- */
/* tq_avx2.c (only when kvw_simd_rot(); D a power of two >= 8):
 * one row of the writer, the portable loop's values: y = y / den, with mask the signs, the
 * butterflies and y * cb (mask NULL: no rotation), then its D * b / 8 code bytes (b = 3, 4)
 * against the 2^b - 1 midpoints mid, written (not or-ed) at out. */
void kvwc_tq_enc_row_avx2(float *y, uint64_t D, float den, const uint32_t *mask, float cb,
                          const float *mid, unsigned b, uint8_t *out);
/* KVW-TQ-4 and the rotation of 8 rows r0.. of a bf16 chunk (codes of row r0 on; D a power of
 * two 8..128), written to out, in AVX2 (only when the CPU has it; little-endian): the portable
 * tq_rows' values. The squares of the levels added in channel order a lane per row, inv = 1 /
 * sqrt(n); then each row's 16 levels times inv (the roundings of v * inv lane by lane) times
 * its scale, the butterflies and bf16 through simd/rot_avx2.c's fused row decoder. */
void kvwc_tq_rows8_bf16(const kvwc_geom *g, const uint8_t *codes, const float *lv, const float *s,
                        const uint32_t *mask, float cb, uint64_t r0, uint8_t *out);
/* The decoder's sums of squares of 8 rows of codes (D * b / 8 bytes each, contiguous; D a
 * power of two 8..128): n[r] = the squares lv[u] * lv[u] added in channel order from 0. */
void kvwc_tq_sumsq8_avx2(const uint8_t *codes, unsigned b, const float *lv, uint64_t D, float *n);
/* The largest magnitude of D fp32 values (D % 8 == 0) as bits. */
uint32_t kvwc_tq_amax_avx2(const float *x, uint64_t D);

#endif /* KVW_SIMD_H */
