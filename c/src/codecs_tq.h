/*
 * Revision 1.3 of int_affine, codecs_tq.c (spec/codecs.md section 9, KVW-TQ-1..5):
 * vLLM's TurboQuant key codebook (codebook = turboquant) and the unsigned rotation
 * (rotation = sylvester). A header apart from codecs_impl.h so that the 1.2 files need only
 * one-line hooks to reach it. Private to the codec files, like codecs_impl.h.
 */
#ifndef KVW_CODECS_TQ_H
#define KVW_CODECS_TQ_H

#include "codecs_impl.h"

/* The sign masks of a rotated spec's rows (D of them, 0 or 0x80000000): KVW-ROT-5's for
 * rotation = hadamard, all 0 (every sign +1, KVW-TQ-3) for rotation = sylvester. */
void kvwc_rot_mask(const kvw_codec_spec *s, uint64_t D, uint32_t *mask);

/* KVW-TQ-4's 2^b levels L (b = 3 or 4, the table of the parity of log2(D)) into lv. */
void kvwc_tq_levels(unsigned b, uint64_t D, float *lv);

/* Decode the quantized part of an int_affine body with codebook = turboquant (KVW-TQ-2 at
 * the chunk, TQ-4, then the spec's rotation), row by row, into out. */
kvw_code kvwc_tq_decode(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                        const uint8_t *params, const uint8_t *codes, uint8_t *out,
                        kvw_error *err);

/* The writer: KVW_ERR_INVALID_ARGUMENT when a turboquant spec names a layer whose head_dim
 * is not a power of two or whose rows are longer than group_size (the reference writer's
 * ValueError: the spec does not fit the layer); KVW_OK otherwise and for other specs. */
kvw_code kvwc_tq_writer_fits(const kvw_codec_spec *s, const kvwc_geom *g, kvw_error *err);

/* The reference writer's turboquant body (section 9, informative) of the quantized part x
 * (fp32 [H, M, D], overwritten) into body (kept tokens already there): norms, unit rows,
 * the forward rotation, codes against the midpoints of vLLM's table; KVW_ERR_UNSUPPORTED
 * (store losslessly) by KVW-TQ-5 and KVW-ROT-7. kvwc_tq_qenc_fast: the same from one
 * contiguous chunk, 1 when it wrote the body, 0 when the careful path must (it then
 * refuses or reports). */
kvw_code kvwc_tq_encode(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                        float *x, uint8_t *body, kvw_error *err);
int kvwc_tq_qenc_fast(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                      const uint8_t *raw, uint8_t *body);

/* codecs_tq_avx2.c (only when kvwc_rot_avx2_built and the CPU has AVX2; D a power of two >= 8):
 * one row of the writer, the portable loop's values: y = y / den, with mask the signs, the
 * butterflies and y * cb (mask NULL: no rotation), then its D * b / 8 code bytes (b = 3, 4)
 * against the 2^b - 1 midpoints mid, written (not or-ed) at out. */
void kvwc_tq_enc_row_avx2(float *y, uint64_t D, float den, const uint32_t *mask, float cb,
                          const float *mid, unsigned b, uint8_t *out);
/* KVW-TQ-4 and the rotation of 8 rows r0.. of a bf16 chunk (codes of row r0 on; D a power of
 * two 8..128), written to out, in AVX2 (only when the CPU has it; little-endian): the portable
 * tq_rows' values. The squares of the levels added in channel order a lane per row, inv = 1 /
 * sqrt(n); then each row's 16 levels times inv (the roundings of v * inv lane by lane) times
 * its scale, the butterflies and bf16 through codecs_rot_avx2.c's fused row decoder. */
void kvwc_tq_rows8_bf16(const kvwc_geom *g, const uint8_t *codes, const float *lv, const float *s,
                        const uint32_t *mask, float cb, uint64_t r0, uint8_t *out);
/* The decoder's sums of squares of 8 rows of codes (D * b / 8 bytes each, contiguous; D a
 * power of two 8..128): n[r] = the squares lv[u] * lv[u] added in channel order from 0. */
void kvwc_tq_sumsq8_avx2(const uint8_t *codes, unsigned b, const float *lv, uint64_t D, float *n);
/* The largest magnitude of D fp32 values (D % 8 == 0) as bits. */
uint32_t kvwc_tq_amax_avx2(const float *x, uint64_t D);

#endif /* KVW_CODECS_TQ_H */
