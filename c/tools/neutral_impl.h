/*
 * Private interface between neutral_fields.c (arena and typed field readers) and
 * neutral_parse.c (the header mapping built on them). Only those two files include it;
 * the tool's interface stays neutral.h. The kvw_nj_ prefix ("neutral JSON") keeps these
 * names apart from the library's internal kvw_ functions linked into the same binary.
 */
#ifndef KVW_TOOLS_NEUTRAL_IMPL_H
#define KVW_TOOLS_NEUTRAL_IMPL_H

#include "neutral.h"

#include <stdint.h>

/* One header parse: its arena and the first failure's message. */
typedef struct nctx {
    neutral_arena *a;
    char *msg;
    size_t msglen;
    int failed;
} nctx;

/* An allocation of n zeroed bytes owned by the arena; NULL when out of memory. */
void *kvw_nj_alloc(neutral_arena *a, size_t n);
/* Record the first failure ("encode spec header: what") and return -1. */
int kvw_nj_fail(nctx *c, const char *what);

/* Each reader leaves the default in *out when the key is absent (or null); 0 on success,
 * -1 after kvw_nj_fail. */
int kvw_nj_get_u64(nctx *c, const jv *o, const char *k, uint64_t max, uint64_t *out);
#define GET_UINT(c, o, k, max, field)                                                       \
    do {                                                                                      \
        uint64_t t_ = (field);                                                                \
        if (kvw_nj_get_u64(c, o, k, max, &t_)) return -1;                                     \
        (field) = t_;                                                                         \
    } while (0)
int kvw_nj_get_i32(nctx *c, const jv *o, const char *k, int32_t *out);
int kvw_nj_get_f64(nctx *c, const jv *o, const char *k, double *out);
int kvw_nj_get_bool(nctx *c, const jv *o, const char *k, uint8_t *out);
int kvw_nj_get_str(nctx *c, const jv *o, const char *k, kvw_bytes *out);
/* A hex string value v (named k in messages) decoded into the arena. */
int kvw_nj_hex_to_bytes(nctx *c, const jv *v, const char *k, kvw_bytes *out);
int kvw_nj_get_hex(nctx *c, const jv *o, const char *k, kvw_bytes *out);
int kvw_nj_get_enum(nctx *c, const jv *o, const char *k, const char *(*name_of)(int), int count, uint8_t *out);
/* The array at k (NULL when absent or null; NULL after a failure when longer than max). */
const jv *kvw_nj_get_array(nctx *c, const jv *o, const char *k, uint32_t max);
/* A vector of f64 (is_f64) or u32 as little-endian bytes in the arena. */
int kvw_nj_get_vec(nctx *c, const jv *o, const char *k, int is_f64, kvw_vec *out);

#endif
