/*
 * Byte layout checks shared by the random-access reader and the sequential decoder:
 * preamble (spec section 4), chunk and end frames (9.1, 9.2), padding (LAYOUT-2), the
 * file-form trailer (11.2). Pure functions over the
 * bytes they are given, so both readers report the same codes in the same order.
 */
#include "format/grid.h"

static const uint8_t CHUNK_MARKER[4] = {'K', 'W', 'C', 'H'};
static const uint8_t END_MARKER[4] = {'K', 'W', 'E', 'N'};

int kvw_magic_undecided(const uint8_t *b, size_t n) {
    static const uint8_t stripped[4] = {0x09, 'K', 'V', 'W'};
    size_t m = n < 4 ? n : 4;
    return n < 8 && (m == 0 || memcmp(b, KVW_MAGIC, m) == 0 || memcmp(b, stripped, m) == 0);
}

/* KVW-PRE-1's diagnosis on the available bytes (a condition on a missing byte is false). */
static kvw_code bad_magic(const uint8_t *b, size_t n, kvw_error *err) {
    if (n >= 6 && memcmp(b, KVW_MAGIC, 4) == 0 && b[4] == 0x0A && b[5] == 0x1A)
        return kvw_fail(err, KVW_TEXT_MODE_MANGLED, "KVW-PRE-1",
                        "CR LF became LF: the input went through a text-mode transfer");
    if (n >= 4 && b[0] == 0x09 && memcmp(b + 1, "KVW", 3) == 0)
        return kvw_fail(err, KVW_TEXT_MODE_MANGLED, "KVW-PRE-1",
                        "high bit stripped: the input went through a 7-bit channel");
    if (n >= 6 && memcmp(b + 1, "KVW", 3) == 0 && b[4] == 0x0D && b[5] == 0x0D)
        return kvw_fail(err, KVW_TEXT_MODE_MANGLED, "KVW-PRE-1",
                        "LF became CR LF: the input went through a text-mode transfer");
    char hex[3 * 8 + 1] = "";
    for (size_t i = 0; i < n && i < 8; i++) {
        static const char d[] = "0123456789abcdef";
        hex[3 * i] = d[b[i] >> 4];
        hex[3 * i + 1] = d[b[i] & 15];
        hex[3 * i + 2] = i + 1 < n && i < 7 ? ' ' : 0;
    }
    return kvw_fail(err, KVW_BAD_MAGIC, "KVW-PRE-1",
                    "not a kvwire container (starts with %s)", n ? hex : "nothing");
}

kvw_code kvw_preamble_check(const uint8_t *b, size_t n, uint16_t *minor, uint32_t *hlen,
                            uint64_t *hsum, kvw_error *err) {
    size_t m = n < 8 ? n : 8;
    if (m && memcmp(b, KVW_MAGIC, m) != 0) return bad_magic(b, m, err);
    if (n < KVW_PREAMBLE_SIZE) return kvw_fail_truncated(err, "KVW-PRE-1", KVW_PREAMBLE_SIZE);
    if (kvw_check32(b, 28) != kvw_ld32(b + 28))
        return kvw_fail(err, KVW_PREAMBLE_CHECKSUM, "KVW-PRE-4",
                        "preamble_check 0x%08x, bytes [0, 28) give 0x%08x", kvw_ld32(b + 28),
                        kvw_check32(b, 28));
    uint16_t major = kvw_ld16(b + 8);
    if (major != KVW_FORMAT_MAJOR)
        return kvw_fail(err, KVW_UNSUPPORTED_VERSION, "KVW-PRE-2",
                        "format %u.%u; this reader implements major 1", major, kvw_ld16(b + 10));
    if (kvw_ld32(b + 24) != 0)
        return kvw_fail(err, KVW_RESERVED_NONZERO, "KVW-PRE-3",
                        "preamble reserved field is 0x%08x, must be 0", kvw_ld32(b + 24));
    uint32_t len = kvw_ld32(b + 12);
    if (len > KVW_MAX_HEADER_LENGTH)
        return kvw_fail(err, KVW_HEADER_TOO_LARGE, "KVW-PRE-5",
                        "header_length %u exceeds %u", len, (unsigned)KVW_MAX_HEADER_LENGTH);
    if (minor) *minor = kvw_ld16(b + 10);
    if (hlen) *hlen = len;
    if (hsum) *hsum = kvw_ld64(b + 16);
    return KVW_OK;
}

kvw_code kvw_frame_check(const uint8_t *f, uint64_t pos, int *is_end, kvw_error *err) {
    int end = memcmp(f, END_MARKER, 4) == 0;
    if (!end && memcmp(f, CHUNK_MARKER, 4) != 0)
        return kvw_fail(err, KVW_BAD_FRAME_MARKER, "KVW-FRAME-1",
                        "no frame marker at %llu (found %02x %02x %02x %02x)",
                        (unsigned long long)pos, f[0], f[1], f[2], f[3]);
    if (kvw_check32(f + 8, 56) != kvw_ld32(f + 4))
        return kvw_fail(err, KVW_FRAME_CHECKSUM, "KVW-FRAME-2",
                        "frame at %llu fails its self-check (0x%08x, bytes give 0x%08x)",
                        (unsigned long long)pos, kvw_ld32(f + 4), kvw_check32(f + 8, 56));
    *is_end = end;
    return KVW_OK;
}

kvw_code kvw_end_frame_check(const uint8_t *f, uint64_t count, uint64_t digest,
                             kvw_error *err) {
    for (int i = 24; i < 64; i++)
        if (f[i])
            return kvw_fail(err, KVW_RESERVED_NONZERO, "KVW-STREAM-1",
                            "end frame reserved byte %d is 0x%02x, must be 0", i, f[i]);
    if (kvw_ld64(f + 8) != count)
        return kvw_fail(err, KVW_INDEX_MISMATCH, "KVW-STREAM-1",
                        "end frame chunk_count %llu, the container has %llu chunk records",
                        (unsigned long long)kvw_ld64(f + 8), (unsigned long long)count);
    if (kvw_ld64(f + 16) != digest)
        return kvw_fail(err, KVW_INDEX_MISMATCH, "KVW-STREAM-1",
                        "end frame records_digest 0x%016llx, the records give 0x%016llx",
                        (unsigned long long)kvw_ld64(f + 16), (unsigned long long)digest);
    return KVW_OK;
}

kvw_code kvw_zero_check(const uint8_t *p, size_t n, uint64_t start, kvw_error *err) {
    for (size_t i = 0; i < n; i++)
        if (p[i])
            return kvw_fail(err, KVW_NONZERO_PADDING, "KVW-LAYOUT-2",
                            "padding byte at %llu is 0x%02x (padding [%llu, %llu) must be zero)",
                            (unsigned long long)(start + i), p[i], (unsigned long long)start,
                            (unsigned long long)(start + n));
    return KVW_OK;
}

kvw_code kvw_trailer_check(const uint8_t *t, size_t n, uint64_t base, int seq,
                           uint64_t *index_offset, uint32_t *index_length, kvw_error *err) {
    const uint8_t *tr = t + n - KVW_TRAILER_SIZE;
    uint64_t off = kvw_ld64(tr);
    uint32_t len = kvw_ld32(tr + 8);
    if (kvw_ld32(tr + 12) != 0)
        return kvw_fail(err, KVW_RESERVED_NONZERO, "KVW-FILE-1",
                        "trailer reserved field is 0x%08x, must be 0", kvw_ld32(tr + 12));
    if (len > KVW_MAX_INDEX_LENGTH)
        return kvw_fail(err, KVW_INDEX_TOO_LARGE, "KVW-FILE-2", "index_length %u exceeds %u",
                        len, (unsigned)KVW_MAX_INDEX_LENGTH);
    uint64_t stop, total;
    int bad = kvw_add_ovf(off, len, &stop) || kvw_align_up(stop, 8, &stop) ||
              kvw_add_ovf(stop, KVW_TRAILER_SIZE, &stop) || kvw_add_ovf(base, n, &total) ||
              stop != total || off < base || off < KVW_PREAMBLE_SIZE + KVW_FRAME_SIZE ||
              (seq && off != base);
    if (bad)
        return kvw_fail(err, KVW_INDEX_POSITION, "KVW-FILE-2",
                        "index at %llu, %u bytes, does not end at the trailer of a container "
                        "of %llu bytes%s", (unsigned long long)off, len,
                        (unsigned long long)(base + n),
                        seq ? " (or does not start at the end of the end frame)" : "");
    const uint8_t *index = t + (off - base);
    if (kvw_xxh3(index, len) != kvw_ld64(tr + 16))
        return kvw_fail(err, KVW_INDEX_CHECKSUM, "KVW-FILE-3",
                        "index_checksum 0x%016llx, the index bytes give 0x%016llx",
                        (unsigned long long)kvw_ld64(tr + 16),
                        (unsigned long long)kvw_xxh3(index, len));
    uint64_t pad_at = off - base + len;
    kvw_code c = kvw_zero_check(t + pad_at, (size_t)(n - KVW_TRAILER_SIZE - pad_at), off + len, err);
    if (c) return c;
    *index_offset = off;
    *index_length = len;
    return KVW_OK;
}
