/*
 * The decode layer's contract (src/decode): the codec decoders (codecs.c: dispatch, zstd
 * frames, byte planes, positions; codecs_lossy.c: fp8 and int_affine; codecs_rot.c:
 * revision 1.2; codecs_tq.c: revision 1.3) and what the readers share. Includes only
 * format, simd and common: nothing here may reach the encoders (src/encode).
 */
#ifndef KVW_DECODE_H
#define KVW_DECODE_H

#include "format/codec.h"
#include "simd/simd.h"

#include <zstd.h>

/* KVW-CODEC-2/3: check the frame header of src (n bytes), then decompress exactly one
 * frame into dst (exactly dst_len bytes). `what` names the body in messages. need_checksum:
 * the container's format_minor is 4 or more, so a frame without a content checksum is
 * ZSTD_CHECKSUM_MISSING (KVW-CODEC-5); a checksum present is always verified (libzstd). */
kvw_code kvwc_zstd_decode(ZSTD_DCtx *dctx, const uint8_t *src, size_t n, uint8_t *dst,
                          size_t dst_len, int need_checksum, const char *what, kvw_error *err);
/* KVW-BPZ-1..3: decode a byteplane body (n bytes) of L decoded bytes and element width w
 * into dst. `rule` is the rule reported for the body's layout (BPZ-3, or CSPEC-7 for a
 * lossless stage). */
kvw_code kvwc_byteplane_decode(ZSTD_DCtx *dctx, const uint8_t *src, size_t n, uint8_t *dst,
                               size_t L, unsigned w, int need_checksum, const char *rule,
                               kvw_error *err);

/* Decode a lossy body of exactly g->Lb bytes into out (raw_length bytes). */
kvw_code kvwc_lossy_decode(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                           const uint8_t *body, uint8_t *out, kvw_error *err);

/* kvwc_byteplane_decode with the caller's scratch of at least L bytes (NULL: allocate one);
 * ffi.c passes its decode context's buffer. */
kvw_code kvwc_byteplane_decode_scratch(ZSTD_DCtx *dctx, const uint8_t *src, size_t n, uint8_t *dst,
                                       size_t L, unsigned w, int need_checksum, const char *rule,
                                       uint8_t *scratch_buf, kvw_error *err);
/* ---- int_affine parameters and revision 1.2 (codecs_rot.c, spec/codecs.md section 8) ---- */
/* The body's scales (and zeros after them, g->nparams each) as fp32 in a malloc'ed array
 * (*out, the caller frees), checked (KVW-INT-3), and the code padding bits (INT-4, ROT-3). */
kvw_code kvwc_int_params(const kvw_codec_spec *s, const kvwc_geom *g, const uint8_t *params,
                         const uint8_t *codes, float **out, kvw_error *err);
/* Decode the quantized part of an int_affine body whose spec uses rotation, the gaussian
 * codebook or 3-bit codes (KVW-ROT-3..6), row by row, into out; also any 2-4 bit int_affine
 * body that kvwc_rot_fused_fits (AVX2, D % 8 == 0, scales per channel or per whole register:
 * the fused AVX2 rows, the decode goal for the unrotated values of its presets). */
int kvwc_rot_fused_fits(const kvw_codec_spec *s, const kvwc_geom *g);
kvw_code kvwc_rot_decode(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                         const uint8_t *params, const uint8_t *codes, uint8_t *out,
                         kvw_error *err);
/* c_B = fp32(1 / sqrt(B)) rounded to nearest (section 8.4). */
float kvwc_rot_cb(uint64_t B);
/* The sign vector of KVW-ROT-5 as D sign-bit masks (0 or 0x80000000). */
void kvwc_rot_signs(uint64_t seed, uint64_t D, uint32_t *mask);
/* The butterflies of KVW-ROT-6 on one row (blocks of B), in place; then, with post, every
 * y[d] = (y[d] * cb) ^ mask[d] (the decoder's order; the encoder's is signs first). The
 * AVX2 build (simd/rot_avx2.c) is chosen at run time; kvwc_rot_row_portable is the other. */
void kvwc_rot_row(float *y, uint64_t D, uint64_t B, float cb, const uint32_t *mask);
void kvwc_rot_row_portable(float *y, uint64_t D, uint64_t B, float cb, const uint32_t *mask);
/* The 2^b fp32 levels C_b of the gaussian codebook into lv (b = 2, 3 or 4; KVW-ROT-4). */
void kvwc_codebook_levels(unsigned b, float *lv);

/* ---- revision 1.3 (codecs_tq.c, spec/codecs.md section 9) ------------------------ */
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

/* ---- sparse positions (codecs.c) ------------------------------------------------- */
/* POSITIONS body of one cell (spec/sparse.md): token_count minimal LEB128 varints
 * (SPARSE-10, POSITIONS_ENCODING, checked over the whole body first), then the positions
 * p_0 = first_position + v_0, p_j = p_(j-1) + 1 + v_j into out[token_count], each below
 * next_position (SPARSE-11, POSITIONS_ORDER). prev_last / next_first: the last position of
 * the previous cell / the first of the next cell of the same (layer, head) when the caller
 * holds them (UINT64_MAX when not): out[0] > prev_last and out[token_count-1] < next_first
 * are checked too (POSITIONS_ORDER). out may be written even when the call fails. */
kvw_code kvw_positions_decode(const uint8_t *body, size_t len, uint32_t token_count,
                              uint64_t first_position, uint64_t next_position,
                              uint64_t prev_last, uint64_t next_first, int64_t *out,
                              kvw_error *err);

/* ---- the stream decoder (decoder.c) ----------------------------------------------- */
/* The current container's header FlatBuffer as it arrived (valid while ev.header is):
 * segment reassembly keeps a private copy of the first segment's header from it. */
const uint8_t *kvw_decoder_header_fb(const kvw_decoder *d, size_t *len);

#endif /* KVW_DECODE_H */
