/*
 * Private to the writer (writer.c, writer_check.c): the writer's state and the checks that
 * writer.c calls before it emits anything. Split out so that the emitting code (writer.c)
 * and what the writer refuses (writer_check.c) stay separate modules; nothing here is API
 * and no other module includes it.
 */
#ifndef KVW_WRITER_IMPL_H
#define KVW_WRITER_IMPL_H

#include "encode/encode.h"

#include <xxhash.h>

struct kvw_writer {
    kvw_header h;      /* parsed back from hdr (zero copy into it): resolved values */
    uint8_t *hdr;      /* the header FlatBuffer */
    size_t hdr_len;
    kvw_grid grid;
    int have_grid;
    kvw_form form;
    int zstd_level;
    kvw_sink_fn sink;
    void *ctx;
    uint64_t pos;      /* bytes emitted */
    uint8_t *filled;   /* [grid.total] */
    uint64_t nfilled;
    uint8_t *records;  /* wire records in container order */
    size_t nrec, rec_cap;
    uint8_t *zeros;    /* A zero bytes for padding */
    kvw_iovec *iov;    /* scratch for one sink call */
    size_t iov_cap;
    XXH3_state_t *xs;
    int state;
};

/* Writer-only header rules (what readers tolerate but writers must not emit). */
kvw_code kvw_writer_only_rules(const kvw_header *h, kvw_error *err);
/* Check one chunk against the header and fill its record (all but offset, stored length,
 * checksum and codec) and slot. */
kvw_code kvw_writer_chunk_check(kvw_writer *w, uint32_t layer, int comp, int head, uint32_t t0,
                                uint32_t n, int codec, uint16_t cs, uint64_t raw, kvw_record *rec,
                                uint64_t *slot, const kvw_codec_spec **spec, kvw_error *err);
/* The readers' record checks (grid.c), run on the finished record as a safety net. */
kvw_code kvw_writer_grid_recheck(kvw_writer *w, const kvw_record *rec, kvw_error *err);
/* Name the first chunk not yet written, in canonical order. */
void kvw_writer_describe_slot(kvw_writer *w, uint64_t s, char *buf, size_t n);

#endif /* KVW_WRITER_IMPL_H */
