/*
 * Verifying FlatBuffers access (spec 5.2, 5.3): every table, vtable, field, vector and
 * string is checked (KVW-HDR-3..8, in the order of KVW-HDR-21) before a value is read
 * through it, the count limits of KVW-LIM-1 are applied by the caller's max_count, and
 * every visit and decoded byte is charged to the parse budget of KVW-LIM-7. Used by the
 * header and index decoders (header.c); no generated code, no allocation.
 */
#ifndef KVW_FB_H
#define KVW_FB_H

#include "common/common.h"

#define KVW_MAX_FB_TABLES 65536
#define KVW_PARSE_TABLE_COST 32
#define KVW_PARSE_BUDGET_PER_BYTE 8
#define KVW_PARSE_BUDGET_BASE 65536
#define KVW_FB_MAX_FIELD_ID 31 /* no kvwire table has more fields */

/* One FlatBuffer being verified. Positions are offsets from data (64-bit: a position may
 * be a reference past the end, which is then rejected). */
typedef struct kvw_fb {
    const uint8_t *data;
    uint64_t n;
    int64_t tables_left; /* KVW-HDR-8 */
    int64_t budget;      /* KVW-LIM-7: 8 x n + 65,536 */
    int64_t budget_left;
} kvw_fb;

/* A verified table. */
typedef struct kvw_fbt {
    kvw_fb *fb;
    uint64_t pos;
    uint64_t vt;
    uint32_t nfields;     /* field entries in the vtable */
    uint32_t inline_size;
} kvw_fbt;

/* A verified vector: its elements at data + start (count elements). */
typedef struct kvw_fbvec {
    int present;
    uint64_t start;
    uint32_t count;
} kvw_fbvec;

/* Length at least 8 (FB_BOUNDS) and identifier at bytes 4..7 (FB_IDENTIFIER); `rule` names
 * the rule of those two checks (KVW-HDR-1 for the header, KVW-FILE-5 for the index). */
kvw_code kvw_fb_begin(kvw_fb *fb, const uint8_t *data, size_t n, const char ident[4],
                      const char *rule, kvw_error *err);
/* The root table (visited: counted and charged). */
kvw_code kvw_fb_root(kvw_fb *fb, kvw_fbt *root, kvw_error *err);
/* Visit the table at pos (HDR-21 table order: count, charge, bounds, vtable). */
kvw_code kvw_fb_visit(kvw_fb *fb, uint64_t pos, kvw_fbt *t, kvw_error *err);
/* Re-open a table that kvw_fb_visit already accepted, without counting it again. */
void kvw_fb_reopen(kvw_fb *fb, uint64_t pos, kvw_fbt *t);
/* Position of the table that element j of a verified vector of tables refers to. */
uint64_t kvw_fb_elem_pos(const kvw_fb *fb, const kvw_fbvec *v, uint32_t j);
/* Charge units of the parse budget (FB_TOO_COMPLEX once it is spent, KVW-LIM-7). */
kvw_code kvw_fb_charge(kvw_fb *fb, uint64_t units, const char *what, kvw_error *err);

/* Field fid of size bytes: *pos is its position, 0 when absent (HDR-5 then HDR-4). */
kvw_code kvw_fbt_field(const kvw_fbt *t, unsigned fid, unsigned size, uint64_t *pos,
                       kvw_error *err);
kvw_code kvw_fbt_u8(const kvw_fbt *t, unsigned fid, uint8_t def, uint8_t *out, kvw_error *err);
kvw_code kvw_fbt_u16(const kvw_fbt *t, unsigned fid, uint16_t def, uint16_t *out, kvw_error *err);
kvw_code kvw_fbt_u32(const kvw_fbt *t, unsigned fid, uint32_t def, uint32_t *out, kvw_error *err);
kvw_code kvw_fbt_i32(const kvw_fbt *t, unsigned fid, int32_t def, int32_t *out, kvw_error *err);
kvw_code kvw_fbt_u64(const kvw_fbt *t, unsigned fid, uint64_t def, uint64_t *out, kvw_error *err);
kvw_code kvw_fbt_f64(const kvw_fbt *t, unsigned fid, double def, double *out, kvw_error *err);
/* A bool: 0 or 1, anything else ENUM_OUT_OF_RANGE (KVW-HDR-10). */
kvw_code kvw_fbt_bool(const kvw_fbt *t, unsigned fid, uint8_t def, uint8_t *out,
                      const char *what, kvw_error *err);
/* A u8 enum whose registry holds the codes 0 .. ncodes-1 (ENUM_OUT_OF_RANGE, HDR-10). */
kvw_code kvw_fbt_enum(const kvw_fbt *t, unsigned fid, uint8_t def, unsigned ncodes,
                      uint8_t *out, const char *what, kvw_error *err);
/* A table field: *present 0 when absent (FB_REQUIRED when required). */
kvw_code kvw_fbt_table(const kvw_fbt *t, unsigned fid, int required, const char *what,
                       kvw_fbt *out, int *present, kvw_error *err);
/* A vector field (HDR-21 vector order, LIM-1 against max_count, then the charge). */
kvw_code kvw_fbt_vector(const kvw_fbt *t, unsigned fid, unsigned elem_size,
                        unsigned elem_align, uint32_t max_count, int required,
                        const char *what, kvw_fbvec *out, kvw_error *err);
/* A string field (vector of bytes, then terminator, no NUL, UTF-8: HDR-7). Absent:
 * out->ptr NULL, out->len 0. */
kvw_code kvw_fbt_string(const kvw_fbt *t, unsigned fid, uint32_t max_len, int required,
                        const char *what, kvw_bytes *out, kvw_error *err);
/* A [ubyte] field as bytes. Absent: ptr NULL, len 0. */
kvw_code kvw_fbt_bytes(const kvw_fbt *t, unsigned fid, uint32_t max_len, const char *what,
                       kvw_bytes *out, kvw_error *err);

/* 1 when p[0..n) is valid UTF-8 (RFC 3629). */
int kvw_utf8_valid(const uint8_t *p, size_t n);

#endif /* KVW_FB_H */
