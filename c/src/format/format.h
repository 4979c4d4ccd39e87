/*
 * The format layer's contract (src/format): Header and index decoding (header.c,
 * header_fields.c), the header rules of 14.1 step 3 (rules*.c), the chunk grid and the
 * record checks of section 8 (grid.c, grid_check.c; format/grid.h for the readers), the
 * frame and layout checks (layout.c) and the lossy codecs' geometry (format/codec.h).
 * Used by decode and encode alike; includes only common.
 */
#ifndef KVW_FORMAT_H
#define KVW_FORMAT_H

#include "common/common.h"

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

/* ---- header rules, second part (rules2.c) -------------------------------------------- */
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
#endif /* KVW_FORMAT_H */
