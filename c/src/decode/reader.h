/*
 * Private to the random-access reader (reader.c: opening; tensor.c: chunk reads, canonical
 * tensors and full validation): the reader's state.
 */
#ifndef KVW_READER_H
#define KVW_READER_H

#include "format/grid.h"
#include "decode/decode.h"

struct kvw_reader {
    const uint8_t *buf;
    size_t n;
    kvw_options opt;
    uint64_t max_decoded;
    kvw_header h;
    int have_header;
    kvw_grid g;
    kvw_form form;
    uint32_t hlen;
    const uint8_t *wire;   /* count 56-byte records, contiguous (index or own copy) */
    uint8_t *wire_owned;   /* stream form: the frames' records copied */
    kvw_record *rec;       /* host copies, container order */
    size_t count;
    uint32_t *lookup;      /* slot -> record index */
    uint8_t *frame_checked; /* file form: FILE-4 done for record i */
    uint64_t decoded;
    uint64_t end_frame_at;
    void *map;             /* kvw_open_file's mapping */
    size_t map_len;
};

/* FILE-4 on first access, then CSUM-1 unless skipped: the stored bytes of record i. */
kvw_code kvw_reader_stored(kvw_reader *r, size_t i, const uint8_t **stored, kvw_error *err);

/* FILE-4 on first access, then a raw body copied as `heads` pieces of `piece` bytes to
 * out + h * dst_stride with CSUM-1 computed in the same pass. */
kvw_code kvw_reader_scatter_raw(kvw_reader *r, size_t i, uint8_t *out, uint64_t heads,
                                uint64_t piece, uint64_t dst_stride, kvw_error *err);

#endif /* KVW_READER_H */
