/*
 * Between codecs_qenc_fast.c (the fused lossy encoders) and codecs_qenc_avx2.c (its AVX2
 * kernels for int_affine groups along channels, issue #18). Why a file of its own: the
 * kernels are compiled for AVX2 by a target pragma while the library runs on any
 * x86-64, so they live in their own translation unit and are chosen at run time.
 *
 * Both kernels take nr consecutive rows of D elements of header dtype dt (D and G
 * multiples of 8, D <= KVWC_QCH_MAXD), groups of G channels, the last one shorter when G
 * does not divide D, gd = ceil(D / G) groups a row, numbered row-major.
 */
#ifndef KVW_CODECS_QENC_SIMD_H
#define KVW_CODECS_QENC_SIMD_H

#include <stddef.h>
#include <stdint.h>

#define KVWC_QCH_MAXD 1024

/* 1 when this build has the kernels (then they need a CPU with AVX2). The group
 * parameters' kernel, kvwc_qch_params_avx2, is declared in codecs_qenc_prm.h. */
int kvwc_qch_avx2_built(void);
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

#endif /* KVW_CODECS_QENC_SIMD_H */
