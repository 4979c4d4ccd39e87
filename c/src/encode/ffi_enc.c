/*
 * kvw_lossy_encode_wire: the FFI entry point of the lossy encoders (python/kvwire/codecs/
 * native.py's encode_lossy), the counterpart of decode/ffi.c's kvw_decode_wire: a header
 * from kvw_header_new, a chunk as its 56-byte wire record, the body into the caller's buffer.
 */
#include "encode/encode.h"

/* ---- lossy encoding ------------------------------------------------------------------- */

/* The lossy body of one chunk (no lossless stage) into the caller's dst: the fused path
 * allocates nothing; the careful path (a chunk near the extremes) allocates its scratch. */
kvw_code kvw_lossy_encode_wire(const kvw_header *h, const uint8_t record[KVW_RECORD_SIZE],
                               const uint8_t *raw, size_t raw_len, uint8_t *dst, size_t dst_len,
                               size_t *written, kvw_error *err) {
    if (!h || !record || !written || (!raw && raw_len))
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "",
                        "kvw_lossy_encode_wire needs a header, a 56-byte record, the raw chunk "
                        "and an output length");
    *written = 0;
    kvw_record rec;
    kvw_record_decode(record, &rec);
    if ((uint64_t)raw_len != rec.raw_length)
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "",
                        "raw_len %zu, the record's raw_length is %llu", raw_len,
                        (unsigned long long)rec.raw_length);
    if (!rec.reserved0 || rec.reserved0 > h->codec_spec_count ||
        (rec.codec != KVW_CODEC_FP8 && rec.codec != KVW_CODEC_INT_AFFINE) ||
        h->codec_specs[rec.reserved0 - 1].codec != rec.codec)
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "",
                        "kvw_lossy_encode_wire: codec %u with codec spec %u is not a lossy "
                        "codec of this header", (unsigned)rec.codec, (unsigned)rec.reserved0);
    const kvw_codec_spec *spec = &h->codec_specs[rec.reserved0 - 1];
    kvwc_geom g;
    kvw_code rc = kvwc_lossy_geometry(h, &rec, spec, &g, err);
    if (rc) return rc;
    if (g.Lb > (uint64_t)dst_len || (g.Lb && !dst)) {
        rc = kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "",
                      "dst_len %zu, the lossy body needs %llu bytes", dst_len,
                      (unsigned long long)g.Lb);
        if (err) err->needed = g.Lb; /* so that a caller may size dst with one call */
        return rc;
    }
    kvw_iovec one = {raw, raw_len};
    rc = kvwc_lossy_encode_into(h, spec, &g, &one, 1, dst, err);
    if (!rc) *written = (size_t)g.Lb;
    return rc;
}
