/*
 * Verifying FlatBuffers access (spec 5.2, 5.3). kvwire never trusts an offset or a length
 * of a FlatBuffer: this file checks bounds (KVW-HDR-3), alignment (HDR-4), vtables
 * (HDR-5), required fields (HDR-6), strings (HDR-7), the table-visit count (HDR-8) and
 * the parse budget (KVW-LIM-7), in the check order of KVW-HDR-21, so that the first
 * defect reported is the one every conforming reader reports.
 */
#include "common/fb.h"

/* HDR-3 then HDR-4 for size bytes at pos (pos may be negative). */
static kvw_code fb_check(const kvw_fb *fb, int64_t pos, uint64_t size, unsigned align,
                         const char *what, kvw_error *err) {
    if (pos < 0 || (uint64_t)pos > fb->n || size > fb->n - (uint64_t)pos)
        return kvw_fail(err, KVW_FB_BOUNDS, "KVW-HDR-3",
                        "%s at %lld+%llu outside the FlatBuffer of %llu bytes", what,
                        (long long)pos, (unsigned long long)size, (unsigned long long)fb->n);
    if (align > 1 && (uint64_t)pos % align)
        return kvw_fail(err, KVW_FB_ALIGNMENT, "KVW-HDR-4", "%s at %lld not aligned to %u",
                        what, (long long)pos, align);
    return KVW_OK;
}

kvw_code kvw_fb_begin(kvw_fb *fb, const uint8_t *data, size_t n, const char ident[4],
                      const char *rule, kvw_error *err) {
    fb->data = data;
    fb->n = (uint64_t)n;
    fb->tables_left = KVW_MAX_FB_TABLES;
    /* 8 x n + 65,536 (saturated for lengths no caller can have: headers are <= 16 MiB) */
    fb->budget = (uint64_t)n > (uint64_t)(INT64_MAX - KVW_PARSE_BUDGET_BASE) / KVW_PARSE_BUDGET_PER_BYTE
                     ? INT64_MAX
                     : (int64_t)KVW_PARSE_BUDGET_PER_BYTE * (int64_t)n + KVW_PARSE_BUDGET_BASE;
    fb->budget_left = fb->budget;
    if (n < 8 || !data)
        return kvw_fail(err, KVW_FB_BOUNDS, rule,
                        "FlatBuffer of %zu bytes is shorter than its root offset and identifier",
                        n);
    if (memcmp(data + 4, ident, 4) != 0)
        return kvw_fail(err, KVW_FB_IDENTIFIER, rule,
                        "file identifier %02x %02x %02x %02x, expected \"%.4s\"", data[4],
                        data[5], data[6], data[7], ident);
    return KVW_OK;
}

kvw_code kvw_fb_charge(kvw_fb *fb, uint64_t units, const char *what, kvw_error *err) {
    /* units never exceed 2^32 x 56 here, far below INT64_MAX */
    fb->budget_left -= (int64_t)units;
    if (fb->budget_left < 0)
        return kvw_fail(err, KVW_FB_TOO_COMPLEX, "KVW-LIM-7",
                        "%s: decoding this FlatBuffer of %llu bytes costs more than its parse "
                        "budget of %lld units",
                        what, (unsigned long long)fb->n, (long long)fb->budget);
    return KVW_OK;
}

kvw_code kvw_fb_visit(kvw_fb *fb, uint64_t pos, kvw_fbt *t, kvw_error *err) {
    kvw_code c;
    fb->tables_left--;
    if (fb->tables_left < 0)
        return kvw_fail(err, KVW_FB_TOO_COMPLEX, "KVW-HDR-8",
                        "more than %d table visits in one FlatBuffer", KVW_MAX_FB_TABLES);
    if ((c = kvw_fb_charge(fb, KVW_PARSE_TABLE_COST, "table visit", err))) return c;
    if (pos > fb->n) /* keeps the int64 conversion below exact */
        return kvw_fail(err, KVW_FB_BOUNDS, "KVW-HDR-3",
                        "table at %llu outside the FlatBuffer of %llu bytes",
                        (unsigned long long)pos, (unsigned long long)fb->n);
    if ((c = fb_check(fb, (int64_t)pos, 4, 4, "table", err))) return c;
    int32_t so = (int32_t)kvw_ld32(fb->data + pos);
    int64_t vt = (int64_t)pos - (int64_t)so;
    if ((c = fb_check(fb, vt, 4, 2, "vtable", err))) return c;
    uint16_t vtsize = kvw_ld16(fb->data + vt), inl = kvw_ld16(fb->data + vt + 2);
    if (vtsize < 4 || vtsize % 2)
        return kvw_fail(err, KVW_FB_VTABLE, "KVW-HDR-5", "vtable at %lld: size %u invalid",
                        (long long)vt, vtsize);
    if (inl < 4)
        return kvw_fail(err, KVW_FB_VTABLE, "KVW-HDR-5",
                        "table at %llu: inline size %u below 4", (unsigned long long)pos, inl);
    if ((c = fb_check(fb, vt, vtsize, 2, "vtable", err))) return c;
    if ((c = fb_check(fb, (int64_t)pos, inl, 4, "table inline part", err))) return c;
    t->fb = fb;
    t->pos = pos;
    t->vt = (uint64_t)vt;
    t->nfields = (uint32_t)(vtsize - 4) / 2;
    t->inline_size = inl;
    return KVW_OK;
}

void kvw_fb_reopen(kvw_fb *fb, uint64_t pos, kvw_fbt *t) {
    int32_t so = (int32_t)kvw_ld32(fb->data + pos);
    uint64_t vt = (uint64_t)((int64_t)pos - (int64_t)so);
    t->fb = fb;
    t->pos = pos;
    t->vt = vt;
    t->nfields = (uint32_t)(kvw_ld16(fb->data + vt) - 4) / 2;
    t->inline_size = kvw_ld16(fb->data + vt + 2);
}

kvw_code kvw_fb_root(kvw_fb *fb, kvw_fbt *root, kvw_error *err) {
    /* n >= 8 was checked by kvw_fb_begin: the root offset lies in the buffer, aligned */
    return kvw_fb_visit(fb, kvw_ld32(fb->data), root, err);
}

uint64_t kvw_fb_elem_pos(const kvw_fb *fb, const kvw_fbvec *v, uint32_t j) {
    uint64_t p = v->start + 4u * (uint64_t)j;
    return p + kvw_ld32(fb->data + p);
}

kvw_code kvw_fbt_field(const kvw_fbt *t, unsigned fid, unsigned size, uint64_t *pos,
                       kvw_error *err) {
    *pos = 0;
    if (fid >= t->nfields || fid > KVW_FB_MAX_FIELD_ID) return KVW_OK;
    uint16_t off = kvw_ld16(t->fb->data + t->vt + 4 + 2u * fid);
    if (off == 0) return KVW_OK;
    if (off < 4 || (uint32_t)off + size > t->inline_size)
        return kvw_fail(err, KVW_FB_VTABLE, "KVW-HDR-5",
                        "field %u offset %u outside the table of %u inline bytes at %llu", fid,
                        off, t->inline_size, (unsigned long long)t->pos);
    uint64_t p = t->pos + off;
    unsigned a = size < 8 ? size : 8;
    if (a > 1 && p % a)
        return kvw_fail(err, KVW_FB_ALIGNMENT, "KVW-HDR-4", "field %u at %llu not aligned to %u",
                        fid, (unsigned long long)p, a);
    *pos = p;
    return KVW_OK;
}

#define FBT_SCALAR(name, type, size, load)                                                  \
    kvw_code name(const kvw_fbt *t, unsigned fid, type def, type *out, kvw_error *err) {    \
        uint64_t p;                                                                          \
        kvw_code c = kvw_fbt_field(t, fid, size, &p, err);                                   \
        if (c) return c;                                                                     \
        *out = p ? (type)(load) : def;                                                       \
        return KVW_OK;                                                                       \
    }
FBT_SCALAR(kvw_fbt_u8, uint8_t, 1, t->fb->data[p])
FBT_SCALAR(kvw_fbt_u16, uint16_t, 2, kvw_ld16(t->fb->data + p))
FBT_SCALAR(kvw_fbt_u32, uint32_t, 4, kvw_ld32(t->fb->data + p))
FBT_SCALAR(kvw_fbt_i32, int32_t, 4, (int32_t)kvw_ld32(t->fb->data + p))
FBT_SCALAR(kvw_fbt_u64, uint64_t, 8, kvw_ld64(t->fb->data + p))
FBT_SCALAR(kvw_fbt_f64, double, 8, kvw_ldf64(t->fb->data + p))

kvw_code kvw_fbt_bool(const kvw_fbt *t, unsigned fid, uint8_t def, uint8_t *out,
                      const char *what, kvw_error *err) {
    uint8_t v;
    kvw_code c = kvw_fbt_u8(t, fid, def, &v, err);
    if (c) return c;
    if (v > 1)
        return kvw_fail(err, KVW_ENUM_OUT_OF_RANGE, "KVW-HDR-10",
                        "bool field %s holds %u, not 0 or 1", what, v);
    *out = v;
    return KVW_OK;
}

kvw_code kvw_fbt_enum(const kvw_fbt *t, unsigned fid, uint8_t def, unsigned ncodes,
                      uint8_t *out, const char *what, kvw_error *err) {
    uint8_t v;
    kvw_code c = kvw_fbt_u8(t, fid, def, &v, err);
    if (c) return c;
    if (v >= ncodes)
        return kvw_fail(err, KVW_ENUM_OUT_OF_RANGE, "KVW-HDR-10",
                        "%s code %u is not in the registry (codes 0..%u)", what, v, ncodes - 1);
    *out = v;
    return KVW_OK;
}

/* The target of a reference field, 0 when absent (FB_REQUIRED when required). */
static kvw_code fbt_ref(const kvw_fbt *t, unsigned fid, int required, const char *what,
                        uint64_t *target, kvw_error *err) {
    uint64_t p;
    kvw_code c = kvw_fbt_field(t, fid, 4, &p, err);
    if (c) return c;
    if (!p) {
        *target = 0;
        if (required)
            return kvw_fail(err, KVW_FB_REQUIRED, "KVW-HDR-6",
                            "required %s (field %u) missing", what, fid);
        return KVW_OK;
    }
    *target = p + kvw_ld32(t->fb->data + p); /* p > 0, so a target is never 0 */
    return KVW_OK;
}

kvw_code kvw_fbt_table(const kvw_fbt *t, unsigned fid, int required, const char *what,
                       kvw_fbt *out, int *present, kvw_error *err) {
    uint64_t target;
    kvw_code c = fbt_ref(t, fid, required, what, &target, err);
    *present = 0;
    if (c || !target) return c;
    if ((c = kvw_fb_visit(t->fb, target, out, err))) return c;
    *present = 1;
    return KVW_OK;
}

kvw_code kvw_fbt_vector(const kvw_fbt *t, unsigned fid, unsigned elem_size,
                        unsigned elem_align, uint32_t max_count, int required,
                        const char *what, kvw_fbvec *out, kvw_error *err) {
    uint64_t q;
    kvw_fb *fb = t->fb;
    kvw_code c = fbt_ref(t, fid, required, what, &q, err);
    out->present = 0;
    out->start = 0;
    out->count = 0;
    if (c || !q) return c;
    if (q > fb->n)
        return kvw_fail(err, KVW_FB_BOUNDS, "KVW-HDR-3",
                        "%s length at %llu outside the FlatBuffer of %llu bytes", what,
                        (unsigned long long)q, (unsigned long long)fb->n);
    if ((c = fb_check(fb, (int64_t)q, 4, 4, what, err))) return c;
    uint32_t n = kvw_ld32(fb->data + q);
    if (n > max_count)
        return kvw_fail(err, KVW_LIMIT_EXCEEDED, "KVW-LIM-1",
                        "%s of %u elements exceeds its limit of %u", what, n, max_count);
    uint64_t bytes = (uint64_t)n * elem_size; /* n <= 2^32, elem_size <= 56: no overflow */
    if ((c = fb_check(fb, (int64_t)(q + 4), bytes, elem_align, what, err))) return c;
    if ((c = kvw_fb_charge(fb, bytes, what, err))) return c;
    out->present = 1;
    out->start = q + 4;
    out->count = n;
    return KVW_OK;
}

int kvw_utf8_valid(const uint8_t *p, size_t n) {
    size_t i = 0;
    while (i < n) {
        uint8_t b = p[i];
        if (b < 0x80) { i++; continue; }
        size_t len;
        uint32_t cp, min;
        if (b >= 0xC2 && b <= 0xDF) { len = 2; cp = b & 0x1F; min = 0x80; }
        else if (b >= 0xE0 && b <= 0xEF) { len = 3; cp = b & 0x0F; min = 0x800; }
        else if (b >= 0xF0 && b <= 0xF4) { len = 4; cp = b & 0x07; min = 0x10000; }
        else return 0;
        if (n - i < len) return 0;
        for (size_t k = 1; k < len; k++) {
            uint8_t cb = p[i + k];
            if ((cb & 0xC0) != 0x80) return 0;
            cp = (cp << 6) | (cb & 0x3F);
        }
        if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
        i += len;
    }
    return 1;
}

kvw_code kvw_fbt_string(const kvw_fbt *t, unsigned fid, uint32_t max_len, int required,
                        const char *what, kvw_bytes *out, kvw_error *err) {
    kvw_fbvec v;
    kvw_fb *fb = t->fb;
    kvw_code c = kvw_fbt_vector(t, fid, 1, 1, max_len, required, what, &v, err);
    out->ptr = NULL;
    out->len = 0;
    if (c || !v.present) return c;
    uint64_t end = v.start + v.count;
    if ((c = fb_check(fb, (int64_t)end, 1, 1, "string terminator", err))) return c;
    const uint8_t *s = fb->data + v.start;
    if (fb->data[end] != 0)
        return kvw_fail(err, KVW_FB_STRING, "KVW-HDR-7", "%s at %llu is not NUL-terminated",
                        what, (unsigned long long)v.start);
    if (v.count && memchr(s, 0, v.count))
        return kvw_fail(err, KVW_FB_STRING, "KVW-HDR-7", "%s at %llu contains a NUL byte",
                        what, (unsigned long long)v.start);
    if (!kvw_utf8_valid(s, v.count))
        return kvw_fail(err, KVW_FB_STRING, "KVW-HDR-7", "%s at %llu is not valid UTF-8", what,
                        (unsigned long long)v.start);
    out->ptr = s;
    out->len = v.count;
    return KVW_OK;
}

kvw_code kvw_fbt_bytes(const kvw_fbt *t, unsigned fid, uint32_t max_len, const char *what,
                       kvw_bytes *out, kvw_error *err) {
    kvw_fbvec v;
    kvw_code c = kvw_fbt_vector(t, fid, 1, 1, max_len, 0, what, &v, err);
    out->ptr = NULL;
    out->len = 0;
    if (c || !v.present) return c;
    out->ptr = t->fb->data + v.start;
    out->len = v.count;
    return KVW_OK;
}
