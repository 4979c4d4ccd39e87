/*
 * Random-access reader, opening (spec 14.1 steps 1-12): preamble, header, version
 * agreement, chunk grid, form, records (index or frame walk), record checks rule by rule
 * over all records, layout chain, end frame, trailing bytes and the decoded size limit.
 * No body is read here; chunk reads and full validation are in tensor.c.
 */
#define _POSIX_C_SOURCE 200809L
#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include "decode/reader.h"

#include <xxhash.h>

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static const uint8_t CHUNK_MARKER[4] = {'K', 'W', 'C', 'H'};

/* Stream form (step 7): walk the frames, never reading a body. */
static kvw_code walk_frames(kvw_reader *r, kvw_error *err) {
    uint64_t A = r->h.alignment, n = r->n, p;
    if (kvw_next_frame_offset(KVW_PREAMBLE_SIZE + (uint64_t)r->hlen, A, &p))
        return kvw_fail(err, KVW_BAD_OFFSET, "KVW-LAYOUT-1", "frame position overflows");
    size_t cap = 0;
    for (;;) {
        if (p > n || n - p < KVW_FRAME_SIZE) return kvw_fail_truncated(err, "KVW-LAYOUT-3", p + 64);
        const uint8_t *f = r->buf + p;
        int is_end;
        kvw_code c = kvw_frame_check(f, p, &is_end, err);
        if (c) return c;
        if (is_end) break;
        if (r->count >= KVW_MAX_CHUNKS)
            return kvw_fail(err, KVW_LIMIT_EXCEEDED, "KVW-LIM-1", "more than %u chunk frames",
                            (unsigned)KVW_MAX_CHUNKS);
        uint64_t off = kvw_ld64(f + 8), len = kvw_ld64(f + 16);
        if (off != p + KVW_FRAME_SIZE)
            return kvw_fail(err, KVW_BAD_OFFSET, "KVW-LAYOUT-1",
                            "frame at %llu records body offset %llu, expected %llu",
                            (unsigned long long)p, (unsigned long long)off,
                            (unsigned long long)(p + KVW_FRAME_SIZE));
        if (len > n - off) {
            uint64_t need;
            if (kvw_add_ovf(off, len, &need)) need = 0;
            return kvw_fail_truncated(err, "KVW-LAYOUT-5", need);
        }
        if (r->count == cap) { /* grows with the frames present in the input */
            size_t nc = cap ? 2 * cap : 64;
            uint8_t *w = realloc(r->wire_owned, nc * KVW_RECORD_SIZE);
            if (!w) return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "out of memory");
            r->wire_owned = w;
            cap = nc;
        }
        memcpy(r->wire_owned + r->count * KVW_RECORD_SIZE, f + 8, KVW_RECORD_SIZE);
        r->count++;
        if (kvw_next_frame_offset(off + len, A, &p))
            return kvw_fail(err, KVW_BAD_OFFSET, "KVW-LAYOUT-1", "frame position overflows");
    }
    r->wire = r->wire_owned;
    r->end_frame_at = p;
    return KVW_OK;
}

/* File form (step 7): trailer, index. */
static kvw_code read_index(kvw_reader *r, kvw_error *err) {
    uint64_t off;
    uint32_t len;
    kvw_code c = kvw_trailer_check(r->buf, r->n, 0, 0, &off, &len, err);
    if (c) return c;
    const uint8_t *recs;
    uint32_t count;
    c = kvw_index_parse(r->buf + off, len, &recs, &count, err);
    if (c) return c;
    if (count > KVW_MAX_CHUNKS)
        return kvw_fail(err, KVW_LIMIT_EXCEEDED, "KVW-LIM-1", "index of %u records", count);
    r->wire = recs;
    r->count = count;
    r->end_frame_at = off - KVW_FRAME_SIZE;
    return KVW_OK;
}

/* Step 8: the rules of 8.3's note over all records, rule by rule; then CHUNK-8. */
static kvw_code check_records(kvw_reader *r, kvw_error *err) {
    size_t n = r->count;
    r->rec = malloc((n ? n : 1) * sizeof *r->rec);
    if (!r->rec) return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "out of memory");
    for (size_t i = 0; i < n; i++) kvw_record_decode(r->wire + i * KVW_RECORD_SIZE, &r->rec[i]);
    for (int s = 0; s < KVW_RS_COUNT; s++)
        for (size_t i = 0; i < n; i++) {
            kvw_code c = kvw_record_check_step(&r->h, &r->g, &r->rec[i], (kvw_record_step)s, err);
            if (c) {
                if (err) { /* name the record: "chunk record i: ..." */
                    char m[sizeof err->message];
                    int k = snprintf(m, sizeof m, "chunk record %zu: ", i);
                    if (k > 0 && (size_t)k < sizeof m) {
                        size_t room = sizeof m - (size_t)k - 1, len = strlen(err->message);
                        memcpy(m + k, err->message, len < room ? len : room);
                        m[(size_t)k + (len < room ? len : room)] = 0;
                        memcpy(err->message, m, sizeof m);
                    }
                }
                return c;
            }
        }
    if (n != r->g.total)
        return kvw_fail(err, n < r->g.total ? KVW_CHUNK_MISSING : KVW_CHUNK_DUPLICATE,
                        "KVW-CHUNK-8", "%zu chunk records, the header implies %llu", n,
                        (unsigned long long)r->g.total);
    r->lookup = malloc((n ? n : 1) * sizeof *r->lookup);
    if (!r->lookup) return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "out of memory");
    memset(r->lookup, 0xFF, (n ? n : 1) * sizeof *r->lookup);
    for (size_t i = 0; i < n; i++) {
        uint64_t slot = kvw_grid_slot(&r->g, &r->rec[i]);
        if (slot >= n || r->lookup[slot] != UINT32_MAX)
            return kvw_fail(err, KVW_CHUNK_DUPLICATE, "KVW-CHUNK-8",
                            "chunk records %u and %zu describe the same chunk (slot %llu)",
                            slot < n ? r->lookup[slot] : 0, i, (unsigned long long)slot);
        r->lookup[slot] = (uint32_t)i;
    }
    return KVW_OK;
}

/* Step 9: every body inside the container (LAYOUT-5), then the layout chain (LAYOUT-1). */
static kvw_code check_layout(kvw_reader *r, uint64_t *last_end, kvw_error *err) {
    uint64_t n = r->n, A = r->h.alignment;
    for (size_t i = 0; i < r->count; i++) {
        const kvw_record *x = &r->rec[i];
        if (x->offset > n || x->stored_length > n - x->offset)
            return kvw_fail(err, KVW_BODY_OUT_OF_BOUNDS, "KVW-LAYOUT-5",
                            "chunk record %zu: body %llu+%llu outside the container of %llu "
                            "bytes", i, (unsigned long long)x->offset,
                            (unsigned long long)x->stored_length, (unsigned long long)n);
    }
    uint64_t end = KVW_PREAMBLE_SIZE + (uint64_t)r->hlen;
    for (size_t i = 0; i < r->count; i++) {
        const kvw_record *x = &r->rec[i];
        uint64_t want = 0;
        if (kvw_next_frame_offset(end, A, &want) || x->offset != want + KVW_FRAME_SIZE)
            return kvw_fail(err, KVW_BAD_OFFSET, "KVW-LAYOUT-1",
                            "chunk record %zu: body offset %llu, the layout rule gives %llu "
                            "(misaligned, overlapping or leaving a hole)", i,
                            (unsigned long long)x->offset,
                            (unsigned long long)(want + KVW_FRAME_SIZE));
        end = x->offset + x->stored_length;
    }
    *last_end = end;
    return KVW_OK;
}

/* Step 10: the end frame. */
static kvw_code check_end(kvw_reader *r, uint64_t last_end, kvw_error *err) {
    uint64_t e = 0;
    if (kvw_next_frame_offset(last_end, r->h.alignment, &e) || e != r->end_frame_at)
        return kvw_fail(err, KVW_BAD_OFFSET, "KVW-LAYOUT-1",
                        "end frame at %llu, the layout rule gives %llu",
                        (unsigned long long)r->end_frame_at, (unsigned long long)e);
    if (e > r->n || r->n - e < KVW_FRAME_SIZE)
        return kvw_fail_truncated(err, "KVW-LAYOUT-3", e + KVW_FRAME_SIZE);
    const uint8_t *f = r->buf + e;
    int is_end;
    kvw_code c = kvw_frame_check(f, e, &is_end, err);
    if (c) return c;
    if (!is_end)
        return kvw_fail(err, KVW_MISSING_END, "KVW-LAYOUT-3",
                        "a chunk frame at %llu where the end frame must be",
                        (unsigned long long)e);
    return kvw_end_frame_check(f, r->count,
                               kvw_xxh3(r->wire, r->count * (size_t)KVW_RECORD_SIZE), err);
}

static kvw_code open_steps(kvw_reader *r, kvw_error *err) {
    const uint8_t *b = r->buf;
    uint16_t minor;
    uint32_t hlen;
    uint64_t hsum;
    kvw_code c = kvw_preamble_check(b, r->n, &minor, &hlen, &hsum, err);
    if (c) return c;
    if (r->n - KVW_PREAMBLE_SIZE < hlen)
        return kvw_fail_truncated(err, "KVW-PRE-5", KVW_PREAMBLE_SIZE + (uint64_t)hlen);
    if (kvw_xxh3(b + KVW_PREAMBLE_SIZE, hlen) != hsum)
        return kvw_fail(err, KVW_HEADER_CHECKSUM, "KVW-PRE-6",
                        "header bytes do not match the preamble's header_checksum");
    r->hlen = hlen;
    c = kvw_header_parse(b + KVW_PREAMBLE_SIZE, hlen, &r->h, err);
    if (c) return c;
    r->have_header = 1;
    if (r->h.format_major != KVW_FORMAT_MAJOR || r->h.format_minor != minor)
        return kvw_fail(err, KVW_VERSION_MISMATCH, "KVW-HDR-9",
                        "header says format %u.%u, the preamble %u.%u", r->h.format_major,
                        r->h.format_minor, KVW_FORMAT_MAJOR, minor);
    c = kvw_grid_build(&r->h, &r->g, err);
    if (c) return c;
    int file = r->n >= 64 && memcmp(b + r->n - 8, KVW_TRAILER_MAGIC, 8) == 0; /* FILE-7 */
    r->form = file ? KVW_FORM_FILE : KVW_FORM_STREAM;
    c = file ? read_index(r, err) : walk_frames(r, err);
    if (c) return c;
    c = check_records(r, err);
    if (c) return c;
    uint64_t last_end = 0;
    c = check_layout(r, &last_end, err);
    if (c) return c;
    c = check_end(r, last_end, err);
    if (c) return c;
    if (!file && r->end_frame_at + KVW_FRAME_SIZE != r->n)
        return kvw_fail(err, KVW_TRAILING_BYTES, "KVW-LAYOUT-4",
                        "%llu bytes after the end frame",
                        (unsigned long long)(r->n - r->end_frame_at - KVW_FRAME_SIZE));
    uint64_t sum = 0;
    for (size_t i = 0; i < r->count; i++)
        if (kvw_add_ovf(sum, r->rec[i].raw_length, &sum)) sum = UINT64_MAX;
    if (sum > r->max_decoded)
        return kvw_fail(err, KVW_DECODED_SIZE_LIMIT, "KVW-LIM-5",
                        "the container decodes to %llu bytes, the limit is %llu",
                        (unsigned long long)sum, (unsigned long long)r->max_decoded);
    r->decoded = sum;
    if (file) {
        r->frame_checked = calloc(r->count ? r->count : 1, 1);
        if (!r->frame_checked) return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "out of memory");
    }
    return KVW_OK;
}

kvw_code kvw_open(const void *buf, size_t len, const kvw_options *opt, kvw_reader **out,
                  kvw_error *err) {
    kvw_error_clear(err);
    if (!out || (!buf && len))
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "kvw_open needs a buffer and out");
    *out = NULL;
    kvw_reader *r = calloc(1, sizeof *r);
    if (!r) return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "out of memory");
    static const uint8_t empty[1] = {0};
    r->buf = buf ? buf : empty;
    r->n = len;
    if (opt) r->opt = *opt;
    r->max_decoded = r->opt.max_decoded_bytes ? r->opt.max_decoded_bytes : KVW_DEFAULT_MAX_DECODED;
    kvw_header_init(&r->h);
    kvw_code c = open_steps(r, err);
    if (c) {
        kvw_close(r);
        return c;
    }
    *out = r;
    return KVW_OK;
}

kvw_code kvw_open_file(const char *path, const kvw_options *opt, kvw_reader **out,
                       kvw_error *err) {
    kvw_error_clear(err);
    if (!path || !out)
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "kvw_open_file needs a path and out");
    *out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return kvw_fail(err, KVW_ERR_IO, "", "open %s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return kvw_fail(err, KVW_ERR_IO, "", "stat %s: %s", path, strerror(e));
    }
    size_t len = (size_t)st.st_size;
    void *map = NULL;
    if (len) {
        map = mmap(NULL, len, PROT_READ, MAP_PRIVATE, fd, 0);
        if (map == MAP_FAILED) {
            int e = errno;
            close(fd);
            return kvw_fail(err, KVW_ERR_IO, "", "mmap %s: %s", path, strerror(e));
        }
    }
    close(fd);
    kvw_code c = kvw_open(map, len, opt, out, err);
    if (c) {
        if (map) munmap(map, len);
        return c;
    }
    (*out)->map = map;
    (*out)->map_len = len;
    return KVW_OK;
}

void kvw_close(kvw_reader *r) {
    if (!r) return;
    if (r->have_header) kvw_header_free(&r->h);
    kvw_grid_free(&r->g);
    free(r->wire_owned);
    free(r->rec);
    free(r->lookup);
    free(r->frame_checked);
    if (r->map) munmap(r->map, r->map_len);
    free(r);
}

const kvw_header *kvw_reader_header(const kvw_reader *r) { return r ? &r->h : NULL; }
kvw_form kvw_reader_form(const kvw_reader *r) { return r ? r->form : KVW_FORM_STREAM; }
size_t kvw_reader_size(const kvw_reader *r) { return r ? r->n : 0; }
uint64_t kvw_reader_decoded_size(const kvw_reader *r) { return r ? r->decoded : 0; }
size_t kvw_chunk_count(const kvw_reader *r) { return r ? r->count : 0; }

const kvw_record *kvw_chunk_record(const kvw_reader *r, size_t i) {
    return r && i < r->count ? &r->rec[i] : NULL;
}

kvw_code kvw_find_chunk(const kvw_reader *r, uint32_t layer, int component, uint32_t cell,
                        size_t *index, kvw_error *err) {
    if (!r || !index) return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "NULL argument");
    if (layer >= r->h.arch.num_layers)
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "layer %u: the header has %u layers",
                        layer, r->h.arch.num_layers);
    uint64_t cells = kvw_grid_cells(&r->g, layer, component);
    if (cells == 0)
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "",
                        "layer %u stores no chunks of component %d", layer, component);
    if (cell >= cells)
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "",
                        "cell %u: layer %u component %d has %llu chunks (0 to %llu)", cell,
                        layer, component, (unsigned long long)cells,
                        (unsigned long long)(cells - 1));
    *index = r->lookup[kvw_grid_base(&r->g, layer, component) + cell];
    return KVW_OK;
}

/* FILE-4 on the first access to chunk i (file form), after FRAME-1 and FRAME-2. */
static kvw_code frame_once(kvw_reader *r, size_t i, kvw_error *err) {
    const kvw_record *x = &r->rec[i];
    if (r->frame_checked && !r->frame_checked[i]) {
        uint64_t at = x->offset - KVW_FRAME_SIZE;
        const uint8_t *f = r->buf + at;
        int is_end;
        kvw_code c = kvw_frame_check(f, at, &is_end, err);
        if (c) return c;
        if (memcmp(f, CHUNK_MARKER, 4) != 0 ||
            memcmp(f + 8, r->wire + i * KVW_RECORD_SIZE, KVW_RECORD_SIZE) != 0)
            return kvw_fail(err, KVW_INDEX_MISMATCH, "KVW-FILE-4",
                            "the frame before body %zu (at %llu) disagrees with its index record",
                            i, (unsigned long long)at);
        r->frame_checked[i] = 1;
    }
    return KVW_OK;
}

static kvw_code checksum_error(const kvw_record *x, size_t i, uint64_t got, kvw_error *err) {
    return kvw_fail(err, KVW_BODY_CHECKSUM, "KVW-CSUM-1",
                    "chunk %zu (layer %u component %u tokens %u+%u): body checksum "
                    "0x%016llx, the record says 0x%016llx", i, x->layer, x->component,
                    x->token_start, x->token_count, (unsigned long long)got,
                    (unsigned long long)x->checksum);
}

kvw_code kvw_reader_stored(kvw_reader *r, size_t i, const uint8_t **stored, kvw_error *err) {
    if (!r || i >= r->count)
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "chunk %zu: the container has %zu",
                        i, r ? r->count : 0);
    const kvw_record *x = &r->rec[i];
    kvw_code c = frame_once(r, i, err);
    if (c) return c;
    const uint8_t *body = r->buf + x->offset;
    if (!r->opt.skip_body_checksums) {
        uint64_t got = kvw_xxh3(body, (size_t)x->stored_length);
        if (got != x->checksum) return checksum_error(x, i, got, err);
    }
    *stored = body;
    return KVW_OK;
}

/* A raw body into the caller's buffer with its checksum in the same pass: each block is
 * hashed right after it is copied, while it is in cache, so reading costs about one pass
 * over memory instead of a hash pass plus a copy pass. The body [heads, tokens, dim] goes
 * as `heads` pieces of `piece` bytes to out + h * dst_stride (a token slice of a layer
 * tensor; dst_stride = piece for a contiguous copy). The caller learns of a mismatch
 * before it may use the bytes (KVW-CSUM-3). */
#define COPY_BLOCK ((size_t)64 << 10)
kvw_code kvw_reader_scatter_raw(kvw_reader *r, size_t i, uint8_t *out, uint64_t heads,
                                uint64_t piece, uint64_t dst_stride, kvw_error *err) {
    const kvw_record *x = &r->rec[i];
    kvw_code c = frame_once(r, i, err);
    if (c) return c;
    const uint8_t *body = r->buf + x->offset;
    int verify = !r->opt.skip_body_checksums;
    XXH3_state_t st;
    if (verify) kvw_xxh3_reset(&st);
    for (uint64_t h = 0; h < heads; h++) {
        const uint8_t *src = body + h * piece;
        uint8_t *dst = out + h * dst_stride;
        for (size_t o = 0; o < piece; o += COPY_BLOCK) {
            size_t k = piece - o < COPY_BLOCK ? (size_t)piece - o : COPY_BLOCK;
            memcpy(dst + o, src + o, k);
            if (verify) kvw_xxh3_update(&st, src + o, k);
        }
    }
    if (!verify) return KVW_OK;
    uint64_t got = kvw_xxh3_digest(&st);
    return got == x->checksum ? KVW_OK : checksum_error(x, i, got, err);
}

kvw_code kvw_read_chunk(kvw_reader *r, size_t i, void *out, size_t out_len, kvw_error *err) {
    kvw_error_clear(err);
    if (!r || i >= r->count || (!out && out_len))
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "chunk %zu: the container has %zu",
                        i, r ? r->count : 0);
    const kvw_record *x = &r->rec[i];
    if (out_len < x->raw_length)
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "",
                        "out_len %zu, chunk %zu decodes to %llu bytes", out_len, i,
                        (unsigned long long)x->raw_length);
    if (x->codec == KVW_CODEC_RAW)
        return kvw_reader_scatter_raw(r, i, (uint8_t *)out, 1, x->raw_length, x->raw_length, err);
    const uint8_t *stored;
    kvw_code c = kvw_reader_stored(r, i, &stored, err);
    if (c) return c;
    return kvw_decode_body(&r->h, x, stored, out, err);
}

kvw_code kvw_chunk_view(kvw_reader *r, size_t i, const uint8_t **ptr, size_t *len,
                        kvw_error *err) {
    kvw_error_clear(err);
    if (!r || i >= r->count || !ptr || !len)
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "chunk %zu: the container has %zu",
                        i, r ? r->count : 0);
    if (r->rec[i].codec != KVW_CODEC_RAW)
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "",
                        "chunk %zu has codec %s: a view needs raw (use kvw_read_chunk)", i,
                        kvw_codec_name(r->rec[i].codec));
    const uint8_t *stored;
    kvw_code c = kvw_reader_stored(r, i, &stored, err);
    if (c) return c;
    *ptr = stored;
    *len = (size_t)r->rec[i].stored_length;
    return KVW_OK;
}
