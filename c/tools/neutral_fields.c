/*
 * The typed field readers behind neutral_header_from_json (neutral_parse.c): the arena
 * that owns what a parsed header points to, registry names to codes, and one reader per
 * JSON shape (unsigned, i32, f64, bool, string, hex bytes, enum, array, packed vector),
 * each leaving the default in place when its key is absent or null. Kept apart so the
 * header mapping reads as the schema it follows.
 */
#include "neutral_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- JSON -> header: arena and field readers ---------------------------------------- */

void neutral_arena_free(neutral_arena *a) {
    size_t i;
    for (i = 0; i < a->n; i++) free(a->blocks[i]);
    free(a->blocks);
    memset(a, 0, sizeof *a);
}

void *kvw_nj_alloc(neutral_arena *a, size_t n) {
    void *p;
    if (a->n == a->cap) {
        size_t nc = a->cap ? a->cap * 2 : 32;
        void **nb = realloc(a->blocks, nc * sizeof *nb);
        if (!nb) return NULL;
        a->blocks = nb;
        a->cap = nc;
    }
    p = calloc(1, n ? n : 1);
    if (p) a->blocks[a->n++] = p;
    return p;
}

int neutral_enum(const char *(*name_of)(int), int count, const char *name) {
    int i;
    if (!name) return -1;
    for (i = 0; i < count; i++) {
        const char *n = name_of(i);
        if (n && strcmp(n, name) == 0) return i;
    }
    return -1;
}

int kvw_nj_fail(nctx *c, const char *what) {
    if (!c->failed) snprintf(c->msg, c->msglen, "encode spec header: %s", what);
    c->failed = 1;
    return -1;
}

/* Each reader leaves the default in *out when the key is absent (or null). */
int kvw_nj_get_u64(nctx *c, const jv *o, const char *k, uint64_t max, uint64_t *out) {
    const jv *v = json_get(o, k);
    uint64_t x;
    if (!v || v->type == JV_NULL) return 0;
    if (json_u64(v, &x) || x > max) return kvw_nj_fail(c, k);
    *out = x;
    return 0;
}
int kvw_nj_get_i32(nctx *c, const jv *o, const char *k, int32_t *out) {
    const jv *v = json_get(o, k);
    int64_t x;
    if (!v || v->type == JV_NULL) return 0;
    if (json_i64(v, &x) || x < INT32_MIN || x > INT32_MAX) return kvw_nj_fail(c, k);
    *out = (int32_t)x;
    return 0;
}

int kvw_nj_get_f64(nctx *c, const jv *o, const char *k, double *out) {
    const jv *v = json_get(o, k);
    if (!v || v->type == JV_NULL) return 0;
    if (json_f64(v, out)) return kvw_nj_fail(c, k);
    return 0;
}

int kvw_nj_get_bool(nctx *c, const jv *o, const char *k, uint8_t *out) {
    const jv *v = json_get(o, k);
    int x;
    if (!v || v->type == JV_NULL) return 0;
    if (json_bool(v, &x)) return kvw_nj_fail(c, k);
    *out = (uint8_t)x;
    return 0;
}

int kvw_nj_get_str(nctx *c, const jv *o, const char *k, kvw_bytes *out) {
    const jv *v = json_get(o, k);
    if (!v || v->type == JV_NULL) return 0;
    if (v->type != JV_STRING || v->len > UINT32_MAX) return kvw_nj_fail(c, k);
    out->ptr = (const uint8_t *)v->s;
    out->len = (uint32_t)v->len;
    return 0;
}

static int hexval(char ch) {
    if (ch >= '0' && ch <= '9') return ch - '0';
    if (ch >= 'a' && ch <= 'f') return ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F') return ch - 'A' + 10;
    return -1;
}

int kvw_nj_hex_to_bytes(nctx *c, const jv *v, const char *k, kvw_bytes *out) {
    size_t i, n;
    uint8_t *p;
    if (!v || v->type == JV_NULL) return 0;
    if (v->type != JV_STRING || v->len % 2 || v->len / 2 > UINT32_MAX) return kvw_nj_fail(c, k);
    n = v->len / 2;
    p = kvw_nj_alloc(c->a, n);
    if (!p) return kvw_nj_fail(c, "out of memory");
    for (i = 0; i < n; i++) {
        int hi = hexval(v->s[2 * i]), lo = hexval(v->s[2 * i + 1]);
        if (hi < 0 || lo < 0) return kvw_nj_fail(c, k);
        p[i] = (uint8_t)(hi << 4 | lo);
    }
    out->ptr = n ? p : NULL;
    out->len = (uint32_t)n;
    return 0;
}

int kvw_nj_get_hex(nctx *c, const jv *o, const char *k, kvw_bytes *out) {
    return kvw_nj_hex_to_bytes(c, json_get(o, k), k, out);
}

int kvw_nj_get_enum(nctx *c, const jv *o, const char *k, const char *(*name_of)(int), int count, uint8_t *out) {
    const jv *v = json_get(o, k);
    int code;
    uint64_t x;
    if (!v || v->type == JV_NULL) return 0;
    if (v->type == JV_STRING) code = neutral_enum(name_of, count, v->s);
    else code = json_u64(v, &x) || x > 255 ? -1 : (int)x;
    if (code < 0) return kvw_nj_fail(c, k);
    *out = (uint8_t)code;
    return 0;
}

const jv *kvw_nj_get_array(nctx *c, const jv *o, const char *k, uint32_t max) {
    const jv *v = json_get(o, k);
    if (!v || v->type == JV_NULL) return NULL;
    if (v->type != JV_ARRAY || v->len > max) { kvw_nj_fail(c, k); return NULL; }
    return v;
}

/* A vector of f64 (is_f64) or u32 as little-endian bytes in the arena. */
int kvw_nj_get_vec(nctx *c, const jv *o, const char *k, int is_f64, kvw_vec *out) {
    const jv *arr = kvw_nj_get_array(c, o, k, 1u << 24);
    uint8_t *p;
    size_t i, w = is_f64 ? 8 : 4;
    if (c->failed) return -1;
    if (!arr) return 0;
    p = kvw_nj_alloc(c->a, arr->len * w);
    if (!p) return kvw_nj_fail(c, "out of memory");
    for (i = 0; i < arr->len; i++) {
        if (is_f64) {
            double d;
            uint64_t u;
            if (json_f64(&arr->items[i], &d)) return kvw_nj_fail(c, k);
            memcpy(&u, &d, 8);
            for (size_t j = 0; j < 8; j++) p[8 * i + j] = (uint8_t)(u >> (8 * j));
        } else {
            uint64_t u;
            if (json_u64(&arr->items[i], &u) || u > UINT32_MAX) return kvw_nj_fail(c, k);
            for (size_t j = 0; j < 4; j++) p[4 * i + j] = (uint8_t)(u >> (8 * j));
        }
    }
    out->ptr = p;
    out->count = (uint32_t)arr->len;
    return 0;
}
