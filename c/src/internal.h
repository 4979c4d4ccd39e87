/*
 * Internal contract between libkvwire's modules. Not installed; nothing here is API.
 *
 * Modules (c/README.md "Layout" has the full table; *_impl.h are private to a module):
 *   common.c                     error codes, registry names, LE and checked arithmetic helpers
 *   fb.c                         verifying FlatBuffers access (KVW-HDR-3..8, HDR-21, LIM-1, LIM-7)
 *   header.c, header_fields.c    Header decoding in the order of 14.1 step 2; index (FILE-5)
 *   rules.c, rules_arch.c, rules2.c  header rules of 14.1 step 3 (+ the companion specs)
 *   grid.c, grid_check.c         chunk grid, slots and the record checks of section 8
 *   layout.c, reader.c, tensor.c random-access reader (14.1), chunk reads, full validation
 *   decoder.c                    sans-IO sequential decoder (14.2)
 *   segments.c, segments_check.c segment reassembly (10.2-10.3)
 *   codecs*.c                    zstd frame checks, byteplane, fp8, int_affine, positions
 *   fbbuild.c, fbbuild_header.c  FlatBuffers builder (header and index)
 *   writer.c, writer_check.c, filesink.c   writer and the atomic file sink
 */
#ifndef KVW_INTERNAL_H
#define KVW_INTERNAL_H

#include "kvwire.h"

#include <stdarg.h>
#include <stdint.h>
#include <string.h>

/* ---- errors ----------------------------------------------------------------------- */
/* Fill err (when not NULL) and return code. fmt is printf-style. */
kvw_code kvw_fail(kvw_error *err, kvw_code code, const char *rule, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 4, 5)))
#endif
    ;
/* TRUNCATED with the number of bytes needed from offset 0 (KVW-ERR-3). */
kvw_code kvw_fail_truncated(kvw_error *err, const char *rule, uint64_t needed);
void kvw_error_clear(kvw_error *err);

/* ---- little-endian loads and stores (unaligned) ------------------------------------ */
static inline uint16_t kvw_ld16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline uint32_t kvw_ld32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) |
           ((uint32_t)p[3] << 24);
}
static inline uint64_t kvw_ld64(const uint8_t *p) {
    return (uint64_t)kvw_ld32(p) | ((uint64_t)kvw_ld32(p + 4) << 32);
}
static inline void kvw_st16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }
static inline void kvw_st32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); p[2] = (uint8_t)(v >> 16); p[3] = (uint8_t)(v >> 24);
}
static inline void kvw_st64(uint8_t *p, uint64_t v) {
    kvw_st32(p, (uint32_t)v); kvw_st32(p + 4, (uint32_t)(v >> 32));
}
static inline double kvw_ldf64(const uint8_t *p) { uint64_t u = kvw_ld64(p); double d; memcpy(&d, &u, 8); return d; }
static inline float kvw_ldf32(const uint8_t *p) { uint32_t u = kvw_ld32(p); float f; memcpy(&f, &u, 4); return f; }

/* ---- checked arithmetic (KVW-CONV-4): return 1 on overflow ------------------------- */
static inline int kvw_add_ovf(uint64_t a, uint64_t b, uint64_t *out) { return __builtin_add_overflow(a, b, out); }
static inline int kvw_mul_ovf(uint64_t a, uint64_t b, uint64_t *out) { return __builtin_mul_overflow(a, b, out); }
/* align_up(x, a) for a power of two a; 1 on overflow. */
static inline int kvw_align_up(uint64_t x, uint64_t a, uint64_t *out) {
    uint64_t t;
    if (kvw_add_ovf(x, a - 1, &t)) return 1;
    *out = t & ~(a - 1);
    return 0;
}
/* next_frame_offset(prev_end, A) = align_up(prev_end + 64, A) - 64 (9.3); 1 on overflow. */
static inline int kvw_next_frame_offset(uint64_t prev_end, uint64_t a, uint64_t *out) {
    uint64_t t;
    if (kvw_add_ovf(prev_end, 64, &t) || kvw_align_up(t, a, &t)) return 1;
    *out = t - 64;
    return 0;
}

/* ---- checksums (KVW-CONV-3) --------------------------------------------------------- */
uint64_t kvw_xxh3(const void *p, size_t n);
/* Streaming XXH3-64 over an XXH3_state_t of xxhash.h (XXH_STATIC_LINKING_ONLY), passed as
 * void *: hash.c compiles xxhash.h inline, whose struct tag differs (same layout). */
void kvw_xxh3_reset(void *st);
void kvw_xxh3_update(void *st, const void *p, size_t n);
uint64_t kvw_xxh3_digest(const void *st);
uint32_t kvw_check32(const void *p, size_t n); /* low 32 bits of XXH3-64 */

/* ---- constants (spec section 17 and magic numbers) ---------------------------------- */
#define KVW_PREAMBLE_SIZE 32
#define KVW_FRAME_SIZE 64
#define KVW_TRAILER_SIZE 32
#define KVW_MAX_HEADER_LENGTH (UINT32_C(16) << 20)
#define KVW_MAX_INDEX_LENGTH (UINT32_C(64) << 20)
#define KVW_MAX_LAYERS 4096
#define KVW_MAX_CHUNKS (UINT32_C(1) << 20)
#define KVW_DEFAULT_MAX_DECODED (UINT64_C(1) << 36)
extern const uint8_t KVW_MAGIC[8];      /* 89 4B 56 57 0D 0A 1A 0A */
extern const uint8_t KVW_TRAILER_MAGIC[8]; /* "KVWINDEX" */

/* ---- header module (header.c) ------------------------------------------------------ */
/* Verify the index FlatBuffer (KVW-FILE-5, HDR-3..8, LIM-1, LIM-7) and return its records
 * vector: *records points at count 56-byte wire records inside fb. */
kvw_code kvw_index_parse(const uint8_t *fb, size_t len, const uint8_t **records,
                         uint32_t *count, kvw_error *err);

/* Header rules of 14.1 step 3 (rules.c), applied by kvw_header_parse after decoding. */
kvw_code kvw_header_rules(const kvw_header *h, kvw_error *err);

/* ---- chunk grid (grid.c) ------------------------------------------------------------ */
/* Slots (8.2; sparse.md for sparse containers; crossmodel.md for state layers). */
typedef struct kvw_grid {
    uint64_t total;       /* chunks the header implies */
    /* base slot and cell count per (layer, component code, head) as the grid needs;
     * opaque to other modules: use kvw_grid_slot. */
    void *impl_;
} kvw_grid;
/* Build the grid (14.1 step 5: total <= 2^20 checked before any per-chunk allocation). */
kvw_code kvw_grid_build(const kvw_header *h, kvw_grid *g, kvw_error *err);
void kvw_grid_free(kvw_grid *g);
/* The record's slot, after its record checks passed (kvw_record_check). */
uint64_t kvw_grid_slot(const kvw_grid *g, const kvw_record *r);

/* The per-record checks of 8.3's note (everything but CHUNK-8), for one record, in order,
 * from rule `first` on (0 = all). Random-access readers call them rule by rule over all
 * records; sequential readers call them once per record. */
typedef enum kvw_record_rule {
    KVW_RR_LAYER = 0, KVW_RR_COMPONENT_CODE, KVW_RR_COMPONENT_KIND, KVW_RR_RESERVED,
    KVW_RR_FLAGS, KVW_RR_CODEC, KVW_RR_BOUNDARY, KVW_RR_HEADS, KVW_RR_RAW_LENGTH,
    KVW_RR_STORED_LENGTH, KVW_RR_RAW_STORED, KVW_RR_EXTRA, /* sparse/state/cspec checks */
    KVW_RR_COUNT
} kvw_record_rule;
kvw_code kvw_record_check_rule(const kvw_header *h, const kvw_grid *g, const kvw_record *r,
                               kvw_record_rule rule, kvw_error *err);

/* ---- codecs (codecs.c) -------------------------------------------------------------- */
/* Encode raw bytes given as parts into a malloc'ed body (*out, *out_len) with codec
 * RAW/ZSTD/BYTEPLANE_ZSTD (spec: the codec spec, needed for byteplane_zstd). */
kvw_code kvw_encode_body(const kvw_header *h, int codec, const kvw_codec_spec *spec,
                         const kvw_record *shape, const kvw_iovec *parts, int nparts,
                         int zstd_level, uint8_t **out, size_t *out_len, kvw_error *err);

/* ---- FlatBuffers builder (fbbuild.c, fbbuild_header.c) ------------------------------ */
/* Encode a header struct as a FlatBuffer (malloc'ed). Does not check rules. */
kvw_code kvw_header_encode(const kvw_header *h, uint8_t **out, size_t *out_len,
                           kvw_error *err);
/* Encode the index FlatBuffer of count wire records (malloc'ed). */
kvw_code kvw_index_encode(const uint8_t *records, uint32_t count, uint8_t **out,
                          size_t *out_len, kvw_error *err);

/* ==== rules additions ==== */
/* Second part of the header rules (rules2.c), called by kvw_header_rules in this order. */
kvw_code kvw_rules_prefix(const kvw_header *h, kvw_error *err);       /* PREFIX-1..5 */
kvw_code kvw_rules_fingerprints(const kvw_header *h, kvw_error *err); /* ID-10 */
kvw_code kvw_rules_metadata(const kvw_header *h, kvw_error *err);     /* META-1 */
kvw_code kvw_rules_codec_specs(const kvw_header *h, kvw_error *err);  /* CSPEC-10..INT-2 */
kvw_code kvw_rules_kv_scales(const kvw_header *h, kvw_error *err);    /* SCALE-1..5 */
/* SHA-256 (FIPS 180-4) of n bytes. */
void kvw_sha256(const void *p, size_t n, uint8_t out[32]);
/* The model root R0 of crossmodel.md KVW-PREFIX-2 for compat fingerprint F and C. */
void kvw_prefix_root(const uint8_t *fingerprint, uint32_t len, uint32_t chunk_tokens,
                     uint8_t out[32]);
/* ==== end rules ==== */

/* ==== codecs additions ==== */
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
/* The POSITIONS body of n strictly increasing positions >= first_position (malloc'ed;
 * at most 9 bytes each). KVW_ERR_INVALID_ARGUMENT for positions out of order. */
kvw_code kvw_positions_encode(const int64_t *pos, uint32_t n, uint64_t first_position,
                              uint8_t **out, size_t *out_len, kvw_error *err);
/* ==== end codecs ==== */

#endif /* KVW_INTERNAL_H */
