/*
 * The private contract of segment reassembly between segments.c (the driver, the chain
 * join and the tensors) and segments_check.c (the per-segment checks of KVW-STREAM-5, 6
 * and 9): the reassembly state and the three shared helpers.
 */
#ifndef KVW_SEGMENTS_IMPL_H
#define KVW_SEGMENTS_IMPL_H

#include "decode/decode.h"

#define SEG_HASH_SIZE 32
#define SEG_PREFIX_SCHEME 1

typedef struct seg_tensor {   /* one (layer, K/V/LATENT) of the sequence */
    uint8_t *buf;             /* heads x cap rows, head-major (compacted to heads x n at the end) */
    uint64_t cap;             /* rows per head */
    uint32_t heads;
    uint64_t row;             /* bytes per token row */
    int present;
} seg_tensor;

typedef struct seg_state { uint8_t *data; size_t len; int present; } seg_state;

struct kvw_reassembly {
    uint8_t *base_fb;         /* the first segment's header bytes (a copy): `base` points into it */
    kvw_header base;
    int have_base;
    kvw_header out;
    kvw_token_range *ranges;
    uint64_t start, end, last_start;
    int partial;
    size_t segments;
    int chain;                /* -1: no prefix; else the first segment's scheme */
    uint8_t *hashes;          /* joined chain entries (scheme 1) */
    size_t hash_count, hash_cap;
    seg_tensor *tensors;      /* num_layers x 3 (K, V, LATENT) */
    seg_state **states;       /* per layer: state_tensor_count entries (state layers) */
    uint64_t stored;          /* bytes held, against max_decoded_bytes */
    uint64_t limit;
};

/* The prefix scheme of h, -1 without a prefix. */
int kvw_seg_chain_kind(const kvw_header *h);
kvw_code kvw_seg_mismatch(kvw_error *err, const char *rule, const char *what, uint64_t s);
/* The checks of KVW-STREAM-5 after the sparse one, in its order, for segment h. On
 * success the chain entries before the segment are kept (*keep) for the join. */
kvw_code kvw_seg_check(const kvw_reassembly *ra, const kvw_header *h, size_t *keep, kvw_error *err);

#endif
