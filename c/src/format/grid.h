/*
 * Private to the container-reading module (grid.c, layout.c, reader.c, tensor.c,
 * decoder.c): the chunk grid's tables, the fine-grained record check steps and the byte
 * layout helpers (preamble, frames, end frame, trailer, padding, POSITIONS varints) that
 * the random-access reader and the sequential decoder share.
 */
#ifndef KVW_GRID_H
#define KVW_GRID_H

#include "format/format.h"

#define KVW_NCOMP 5

/* What kvw_grid.impl_ points at. */
typedef struct kvw_grid_impl {
    uint32_t nlayers;
    int sparse;
    uint64_t *base;   /* [nlayers * 5]: first slot of (layer, component) */
    uint64_t *cells;  /* [nlayers * 5]: chunks of (layer, component), 0 when not stored */
    uint32_t *heads;  /* [nlayers * 5]: heads of the component (0: not stored) */
    uint32_t *dims;   /* [nlayers * 5]: row width in elements */
    uint64_t chunk;   /* C */
    uint64_t *lo_cell; /* [nlayers]: floor(lo / C) of the layer's token range */
    /* sparse containers only */
    uint64_t *entry;     /* [nlayers + 1]: index of (layer, head 0) in retained_counts */
    uint64_t *head_base; /* [entries]: first cell of each head within its (layer, component) */
} kvw_grid_impl;

static inline const kvw_grid_impl *kvw_gi(const kvw_grid *g) {
    return (const kvw_grid_impl *)g->impl_;
}
/* Chunks of (layer, component); 0 when the layer does not store it or out of range. */
uint64_t kvw_grid_cells(const kvw_grid *g, uint32_t layer, int comp);
uint64_t kvw_grid_base(const kvw_grid *g, uint32_t layer, int comp);
/* Sparse: heads of the layer, retained count and first cell of (layer, head). */
uint32_t kvw_grid_sparse_heads(const kvw_grid *g, uint32_t layer);
uint32_t kvw_grid_retained(const kvw_header *h, const kvw_grid *g, uint32_t layer, uint32_t head);
uint64_t kvw_grid_head_base(const kvw_grid *g, uint32_t layer, uint32_t head);

/* Record checks in the exact order of the note of 8.3 with the companions' insertions:
 * CSPEC-9 and STATE-8 / SPARSE-9 right after CHUNK-5; sparse containers check the head
 * range before the grid (SPARSE-7), dense ones the grid (CHUNK-2) before the heads. */
typedef enum kvw_record_step {
    KVW_RS_LAYER = 0,      /* CHUNK-1 layer */
    KVW_RS_COMPONENT_CODE, /* CHUNK-1 code (EVOL-9 gates) */
    KVW_RS_COMPONENT_KIND, /* CHUNK-1 kind, SPARSE-6 */
    KVW_RS_RESERVED,       /* CHUNK-7 */
    KVW_RS_FLAGS,          /* EVOL-4 */
    KVW_RS_CODEC,          /* CHUNK-5 */
    KVW_RS_CSPEC,          /* CSPEC-9 */
    KVW_RS_KIND_CODEC,     /* STATE-8 (dense) or SPARSE-9 (sparse) */
    KVW_RS_GRID_A,         /* CHUNK-2 / STATE-7 (dense), SPARSE-7 heads (sparse) */
    KVW_RS_GRID_B,         /* CHUNK-3 / STATE-7 (dense), SPARSE-7 grid (sparse) */
    KVW_RS_RAW_LENGTH,     /* CHUNK-4 / STATE-7 / SPARSE-8 */
    KVW_RS_STORED_LENGTH,  /* CHUNK-4 stored_length >= 1 */
    KVW_RS_RAW_STORED,     /* CHUNK-6 */
    KVW_RS_COUNT
} kvw_record_step;
kvw_code kvw_record_check_step(const kvw_header *h, const kvw_grid *g, const kvw_record *r,
                               kvw_record_step step, kvw_error *err);

/* ---- layout helpers (layout.c) ---- */
/* Preamble checks on the first n bytes (n may be < 32: then the magic is judged on what is
 * there and TRUNCATED(32) follows), in the order of the note after KVW-PRE-7, up to the
 * header_length limit. */
kvw_code kvw_preamble_check(const uint8_t *b, size_t n, uint16_t *minor, uint32_t *hlen,
                            uint64_t *hsum, kvw_error *err);
/* May the first n (< 8) bytes still be the start of a (mangled) magic? */
int kvw_magic_undecided(const uint8_t *b, size_t n);
/* Frame at absolute position pos (64 bytes at f): marker (FRAME-1), frame_check (FRAME-2).
 * *is_end is set for "KWEN". */
kvw_code kvw_frame_check(const uint8_t *f, uint64_t pos, int *is_end, kvw_error *err);
/* End frame body checks (STREAM-1): reserved bytes, chunk_count, records_digest. */
kvw_code kvw_end_frame_check(const uint8_t *f, uint64_t count, uint64_t digest,
                             kvw_error *err);
/* All bytes [0, n) of p zero (LAYOUT-2); start is the absolute offset for the message. */
kvw_code kvw_zero_check(const uint8_t *p, size_t n, uint64_t start, kvw_error *err);
/* Trailer of a file-form container whose bytes [base, base + n) are at t (the trailer is
 * the last 32 of them): FILE-1, FILE-2 (size, position), FILE-3, LAYOUT-2 before the
 * trailer. Returns index offset (absolute) and length. `seq`: sequential reader, which
 * also checks index_offset == base (INDEX_POSITION). */
kvw_code kvw_trailer_check(const uint8_t *t, size_t n, uint64_t base, int seq,
                           uint64_t *index_offset, uint32_t *index_length, kvw_error *err);
#endif /* KVW_GRID_H */
