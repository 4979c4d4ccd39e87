/*
 * FlatBuffers builder (spec 5.2) and the chunk index (root ChunkIndex, identifier "KVWI",
 * spec 11.1). Written here instead of generated code so that the library needs no
 * FlatBuffers runtime; the header's tables (root Header, identifier "KVWH", spec section 5)
 * are fbbuild_header.c, the shared declarations fbbuild_impl.h.
 *
 * The builder works back to front, like the standard FlatBuffers builders: children are
 * written first, at the end of the buffer, so every uoffset points forward (5.2). Objects
 * are named by their "end offset" (bytes from the end of the buffer to their start), which
 * does not move when the buffer grows. The finished buffer's length is a multiple of 8, so
 * the alignment of an end offset is the alignment of the position (KVW-HDR-4).
 */
#include "encode/fbbuild_impl.h"

#include <stdlib.h>

#define FB_MAX_SIZE (UINT64_C(1) << 30) /* bound of one vector's bytes before the limit test */

/* Pointer to the byte at end offset `off` (the start of an object written at that size). */
static uint8_t *at(fbb *b, size_t off) { return b->buf + b->cap - off; }

static int reserve(fbb *b, size_t n) {
    if (b->failed) return 1;
    if (n > b->limit || b->used + n > b->limit) { b->failed = 2; return 1; }
    if (b->buf && b->cap - b->used >= n) return 0;
    size_t ncap = b->cap ? b->cap : 1024;
    while (ncap - b->used < n) ncap *= 2;
    uint8_t *nb = malloc(ncap);
    if (!nb) { b->failed = 1; return 1; }
    if (b->used) memcpy(nb + ncap - b->used, b->buf + b->cap - b->used, b->used);
    free(b->buf);
    b->buf = nb;
    b->cap = ncap;
    return 0;
}

/* Room for n more bytes; returns where they start (lowest address), zeroed. */
static uint8_t *grow(fbb *b, size_t n) {
    if (reserve(b, n)) return NULL;
    b->used += n;
    uint8_t *p = at(b, b->used);
    memset(p, 0, n);
    return p;
}

/* Zero padding so that after `extra` more bytes the used size is a multiple of `align`. */
static void prep(fbb *b, size_t align, size_t extra) {
    size_t pad = (size_t)(-(b->used + extra)) & (align - 1);
    if (pad) grow(b, pad);
    reserve(b, extra);
}

static void push32(fbb *b, uint32_t v) {
    uint8_t *p = grow(b, 4);
    if (p) kvw_st32(p, v);
}

/* ---- vectors and strings -------------------------------------------------------------- */

/* Reserve a vector of n elements of `esize` bytes aligned to `ealign`; returns the element
 * area (filled front to back by the caller, zeroed) and then the count is pushed by
 * vec_end. Element position q + 4 is aligned even for n = 0 (KVW-HDR-4). */
uint8_t *kvw_fbb_vec_begin(fbb *b, size_t esize, size_t ealign, uint32_t n) {
    uint64_t total;
    if (kvw_mul_ovf(esize, n, &total) || total > FB_MAX_SIZE) { b->failed = 2; return NULL; }
    prep(b, ealign < 4 ? 4 : ealign, (size_t)total);
    return grow(b, (size_t)total);
}
uint32_t kvw_fbb_vec_end(fbb *b, uint32_t n) {
    push32(b, n);
    return (uint32_t)b->used;
}

/* A vector of bytes ([ubyte]) or, with nul set, a string (terminator not counted). */
uint32_t kvw_fbb_bytes_vec(fbb *b, const uint8_t *p, uint32_t n, int nul) {
    prep(b, 4, (size_t)n + (nul ? 1 : 0));
    if (nul) grow(b, 1);
    uint8_t *d = grow(b, n);
    if (d && n) memcpy(d, p, n);
    return kvw_fbb_vec_end(b, n);
}
uint32_t kvw_fbb_str_opt(fbb *b, kvw_bytes s) { return s.len ? kvw_fbb_bytes_vec(b, s.ptr, s.len, 1) : 0; }
uint32_t kvw_fbb_bytes_opt(fbb *b, kvw_bytes s) { return s.len ? kvw_fbb_bytes_vec(b, s.ptr, s.len, 0) : 0; }

/* A kvw_vec of little-endian scalars of esize bytes (stored as they are). */
uint32_t kvw_fbb_scalar_vec_opt(fbb *b, kvw_vec v, size_t esize) {
    if (!v.count) return 0;
    uint8_t *d = kvw_fbb_vec_begin(b, esize, esize, v.count);
    if (d) memcpy(d, v.ptr, esize * v.count);
    return kvw_fbb_vec_end(b, v.count);
}

/* A vector of tables given by their end offsets. */
uint32_t kvw_fbb_table_vec(fbb *b, const uint32_t *offs, uint32_t n) {
    prep(b, 4, (size_t)4 * n);
    for (uint32_t i = n; i-- > 0;) {
        uint8_t *p = grow(b, 4);
        if (p) kvw_st32(p, (uint32_t)(b->used - offs[i]));
    }
    return kvw_fbb_vec_end(b, n);
}

/* ---- tables ------------------------------------------------------------------------------ */


void kvw_fbb_t_scalar(fb_table *t, uint16_t id, uint8_t size, uint64_t val, uint64_t dflt) {
    if (val == dflt || t->n >= FB_MAX_FIELDS) return;
    t->f[t->n++] = (fb_field){id, size, 0, val};
}
void kvw_fbb_t_force(fb_table *t, uint16_t id, uint8_t size, uint64_t val) {
    if (t->n < FB_MAX_FIELDS) t->f[t->n++] = (fb_field){id, size, 0, val};
}
void kvw_fbb_t_f64(fb_table *t, uint16_t id, double v, double dflt) {
    uint64_t a, d;
    memcpy(&a, &v, 8);
    memcpy(&d, &dflt, 8);
    kvw_fbb_t_scalar(t, id, 8, a, d); /* by bits: -0.0 and NaN payloads survive */
}
void kvw_fbb_t_ref(fb_table *t, uint16_t id, uint32_t off) {
    if (off && t->n < FB_MAX_FIELDS) t->f[t->n++] = (fb_field){id, 4, 1, off};
}

/* Write the table (inline part, then its vtable just before it); returns its end offset. */
uint32_t kvw_fbb_table_end(fbb *b, const fb_table *t) {
    uint16_t offs[FB_MAX_FIELDS];
    int has8 = 0, maxid = -1;
    for (int i = 0; i < t->n; i++) {
        if (t->f[i].size == 8) has8 = 1;
        if (t->f[i].id > maxid) maxid = t->f[i].id;
    }
    /* layout: soffset, (pad to 8), fields by decreasing size: each naturally aligned */
    size_t pos = has8 ? 8 : 4;
    for (unsigned sz = 8; sz >= 1; sz /= 2)
        for (int i = 0; i < t->n; i++)
            if (t->f[i].size == sz) { offs[i] = (uint16_t)pos; pos += sz; }
    size_t inline_size = pos;
    prep(b, has8 ? 8 : 4, inline_size);
    uint8_t *p = grow(b, inline_size);
    if (!p) return 0;
    size_t tend = b->used;
    for (int i = 0; i < t->n; i++) {
        const fb_field *f = &t->f[i];
        uint8_t *q = p + offs[i];
        if (f->ref) { kvw_st32(q, (uint32_t)(tend - offs[i] - f->val)); continue; }
        switch (f->size) {
        case 1: q[0] = (uint8_t)f->val; break;
        case 2: kvw_st16(q, (uint16_t)f->val); break;
        case 4: kvw_st32(q, (uint32_t)f->val); break;
        default: kvw_st64(q, f->val); break;
        }
    }
    size_t nent = (size_t)(maxid + 1), vsize = 4 + 2 * nent;
    prep(b, 2, vsize);
    uint8_t *v = grow(b, vsize);
    if (!v) return 0;
    kvw_st16(v, (uint16_t)vsize);
    kvw_st16(v + 2, (uint16_t)inline_size);
    for (int i = 0; i < t->n; i++) kvw_st16(v + 4 + 2 * t->f[i].id, offs[i]);
    kvw_st32(at(b, tend), (uint32_t)(b->used - tend)); /* soffset: vtable before the table */
    return (uint32_t)tend;
}

/* Root offset and file identifier; hands the finished buffer over (malloc'ed, exact). */
kvw_code kvw_fbb_finish(fbb *b, uint32_t root, const char ident[4], uint8_t **out,
                        size_t *out_len, kvw_error *err) {
    prep(b, 8, 8);
    uint8_t *p = grow(b, 8);
    if (b->failed || !p || !root) {
        free(b->buf);
        if (b->failed == 2)
            return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, ident[3] == 'H' ? "KVW-PRE-5" : "KVW-FILE-2",
                            "the %s FlatBuffer would exceed %zu bytes", ident[3] == 'H' ? "header" : "index",
                            b->limit);
        return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "FlatBuffer builder: out of memory");
    }
    kvw_st32(p, (uint32_t)(b->used - root));
    memcpy(p + 4, ident, 4);
    uint8_t *res = malloc(b->used);
    if (!res) {
        free(b->buf);
        return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "FlatBuffer builder: out of memory");
    }
    memcpy(res, p, b->used);
    *out = res;
    *out_len = b->used;
    free(b->buf);
    return KVW_OK;
}

kvw_code kvw_index_encode(const uint8_t *records, uint32_t count, uint8_t **out,
                          size_t *out_len, kvw_error *err) {
    if ((!records && count) || !out || !out_len)
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "kvw_index_encode: NULL argument");
    if (count > KVW_MAX_CHUNKS)
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "KVW-LIM-1",
                        "index of %u records: at most %u chunks", count, (unsigned)KVW_MAX_CHUNKS);
    fbb b = {0};
    b.limit = KVW_MAX_INDEX_LENGTH;
    uint8_t *d = kvw_fbb_vec_begin(&b, KVW_RECORD_SIZE, 8, count); /* elements 8-aligned (FILE-5) */
    if (d && count) memcpy(d, records, (size_t)KVW_RECORD_SIZE * count);
    uint32_t recs = kvw_fbb_vec_end(&b, count);
    fb_table t = {.n = 0};
    kvw_fbb_t_ref(&t, 0, recs);
    uint32_t root = kvw_fbb_table_end(&b, &t);
    return kvw_fbb_finish(&b, root, "KVWI", out, out_len, err);
}
