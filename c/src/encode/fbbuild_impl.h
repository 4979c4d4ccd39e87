/*
 * Private to the FlatBuffers builder (fbbuild.c, fbbuild_header.c): the builder state, the
 * table under construction and the primitives the header encoder uses. Split out so that
 * the back-to-front builder (fbbuild.c) and the header's tables (fbbuild_header.c) are
 * separate modules; nothing here is API and no other module includes it.
 */
#ifndef KVW_FBBUILD_IMPL_H
#define KVW_FBBUILD_IMPL_H

#include "encode/encode.h"

#define FB_MAX_FIELDS 24

typedef struct fbb {
    uint8_t *buf;
    size_t cap, used; /* data lives in buf[cap - used, cap) */
    size_t limit;     /* largest valid FlatBuffer: 16 MiB header (PRE-5), 64 MiB index (FILE-2) */
    int failed;       /* sticky: 1 no memory, 2 over the limit */
} fbb;

typedef struct fb_field { uint16_t id; uint8_t size, ref; uint64_t val; } fb_field;
typedef struct fb_table { fb_field f[FB_MAX_FIELDS]; int n; } fb_table;

/* Reserve a vector of n elements of `esize` bytes aligned to `ealign`; returns the element
 * area (filled front to back by the caller, zeroed) and then the count is pushed by
 * vec_end. Element position q + 4 is aligned even for n = 0 (KVW-HDR-4). */
uint8_t *kvw_fbb_vec_begin(fbb *b, size_t esize, size_t ealign, uint32_t n);
uint32_t kvw_fbb_vec_end(fbb *b, uint32_t n);
/* A vector of bytes ([ubyte]) or, with nul set, a string (terminator not counted). */
uint32_t kvw_fbb_bytes_vec(fbb *b, const uint8_t *p, uint32_t n, int nul);
/* An optional string / [ubyte]: 0 (field omitted) when empty. */
uint32_t kvw_fbb_str_opt(fbb *b, kvw_bytes s);
uint32_t kvw_fbb_bytes_opt(fbb *b, kvw_bytes s);
/* A kvw_vec of little-endian scalars of esize bytes (stored as they are). */
uint32_t kvw_fbb_scalar_vec_opt(fbb *b, kvw_vec v, size_t esize);
/* A vector of tables given by their end offsets. */
uint32_t kvw_fbb_table_vec(fbb *b, const uint32_t *offs, uint32_t n);

/* Fields of the table under construction: a scalar omitted at its default, one always
 * written, an f64 compared by bits, a reference (end offset; 0 = absent). */
void kvw_fbb_t_scalar(fb_table *t, uint16_t id, uint8_t size, uint64_t val, uint64_t dflt);
void kvw_fbb_t_force(fb_table *t, uint16_t id, uint8_t size, uint64_t val);
void kvw_fbb_t_f64(fb_table *t, uint16_t id, double v, double dflt);
void kvw_fbb_t_ref(fb_table *t, uint16_t id, uint32_t off);
/* Write the table (inline part, then its vtable just before it); returns its end offset. */
uint32_t kvw_fbb_table_end(fbb *b, const fb_table *t);

/* Root offset and file identifier; hands the finished buffer over (malloc'ed, exact). */
kvw_code kvw_fbb_finish(fbb *b, uint32_t root, const char ident[4], uint8_t **out,
                        size_t *out_len, kvw_error *err);

#endif /* KVW_FBBUILD_IMPL_H */
