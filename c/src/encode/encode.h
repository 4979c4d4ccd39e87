/*
 * The encode layer's contract (src/encode): the FlatBuffers builder (fbbuild*.c), the
 * lossless body encoders (codecs_enc.c), the lossy encoders (codecs_qenc*.c,
 * codecs_rot_enc.c, codecs_tq_enc.c) and kvw_lossy_encode_wire (ffi_enc.c). Encoders may
 * use the decoders (the KVW-ROT-7 check decodes what it wrote); never the other way round.
 */
#ifndef KVW_ENCODE_H
#define KVW_ENCODE_H

#include "decode/decode.h"

/* Lossy encoders (codecs_qenc.c): the lossy body of a chunk given as parts (the reference
 * writer's choices). KVW_ERR_UNSUPPORTED when the chunk cannot be encoded faithfully
 * (KVW-LOSSY-5, LOSSY-6: non-finite values, ranges beyond the dtypes): store it losslessly. */
kvw_code kvwc_lossy_encode(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                           const kvw_iovec *parts, int nparts, uint8_t **out, size_t *out_len,
                           kvw_error *err);

/* Bytes [from, from + n) of the concatenation of parts. */
void kvwc_copy_range(const kvw_iovec *parts, int nparts, size_t from, uint8_t *dst, size_t n);

/* The lossy body (no lossless stage) into body (g->Lb bytes, any contents), codecs_qenc.c. */
kvw_code kvwc_lossy_encode_into(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                                const kvw_iovec *parts, int nparts, uint8_t *body, kvw_error *err);
/* codecs_qenc_fast.c: the common case from one contiguous chunk in fused passes; 0 when the
 * careful path of codecs_qenc.c must encode it (groups near the dtype extremes, NaN, ...). */
int kvwc_qenc_fast(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                   const uint8_t *raw, uint8_t *body);

/* codecs_qenc.c's int_affine encoder of the quantized part x (fp32, [H, M, D]) with the
 * reference writer's scales (KVW-INT-6, section 3.1); codes are or-ed into zeroed bytes. */
kvw_code kvwc_encode_int(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                         const float *x, uint8_t *params, uint8_t *codes, kvw_error *err);
/* Revision 1.2 encoders (codecs_rot_enc.c): the quantized part x (fp32, rotated in place when
 * the spec rotates) into the lossy body `body` (kept tokens already there, the parameters
 * and codes zeroed), then KVW-ROT-7 / LOSSY-5 checked on the decoded result
 * (KVW_ERR_UNSUPPORTED: store losslessly). kvwc_rot_qenc_fast: the same from one
 * contiguous chunk; 0 when the careful path must encode it. */
kvw_code kvwc_rot_encode(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                         float *x, uint8_t *body, kvw_error *err);
int kvwc_rot_qenc_fast(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                       const uint8_t *raw, uint8_t *body);
/* codecs_qenc_fast.c's uniform int_affine fast path over the fp32 quantized part x ([H, M,
 * D]; the header dtype's bands, as kvwc_encode_int): 0 when the careful path must encode. */
int kvwc_qenc_int_f32(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                      const float *x, uint8_t *params, uint8_t *codes);

/* codecs_rot_enc.c, shared with codecs_tq.c: the KVW-ROT-7 band of a spec and chunk (rows
 * whose largest magnitude is inside meet the rule by construction) and the check on the
 * decoded chunk for the others. */
void kvwc_rot_band(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g, double *lo, float *hi);
int kvwc_rot_in_band(uint32_t a, double lo, float hi);
kvw_code kvwc_rot_check_decoded(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                                const float *x0, const uint8_t *body, kvw_error *err);

/* ---- revision 1.3 writer (codecs_tq_enc.c) ---------------------------------------- */
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


/* ---- lossless bodies (codecs_enc.c) and the FlatBuffers builder (fbbuild*.c) ------- */
/* Encode raw bytes given as parts into a malloc'ed body (*out, *out_len) with codec
 * RAW/ZSTD/BYTEPLANE_ZSTD (spec: the codec spec, needed for byteplane_zstd). */
kvw_code kvw_encode_body(const kvw_header *h, int codec, const kvw_codec_spec *spec,
                         const kvw_record *shape, const kvw_iovec *parts, int nparts,
                         int zstd_level, uint8_t **out, size_t *out_len, kvw_error *err);
/* The POSITIONS body of n strictly increasing positions >= first_position (malloc'ed;
 * at most 9 bytes each). KVW_ERR_INVALID_ARGUMENT for positions out of order. */
kvw_code kvw_positions_encode(const int64_t *pos, uint32_t n, uint64_t first_position,
                              uint8_t **out, size_t *out_len, kvw_error *err);
/* Encode a header struct as a FlatBuffer (malloc'ed). Does not check rules. */
kvw_code kvw_header_encode(const kvw_header *h, uint8_t **out, size_t *out_len,
                           kvw_error *err);
/* Encode the index FlatBuffer of count wire records (malloc'ed). */
kvw_code kvw_index_encode(const uint8_t *records, uint32_t count, uint8_t **out,
                          size_t *out_len, kvw_error *err);

#endif /* KVW_ENCODE_H */
