/*
 * The writer (spec section 15): checks the header by encoding it and parsing it back
 * (KVW-WRITE-1), then emits the container as buffer lists to a caller's sink: preamble and
 * header; per chunk its zero padding, frame and body in one sink call, raw bodies passed
 * through as the caller's parts (never concatenated); the end frame; in file form the
 * index and trailer. Each chunk is checked against the header's chunk grid before
 * anything of it is emitted, so misuse is KVW_ERR_INVALID_ARGUMENT and leaves the writer
 * usable; a sink failure ends the container without an end frame (KVW-WRITE-2).
 * The atomic file sink is filesink.c; the checks (writer-only header rules, each chunk
 * against the grid) are writer_check.c; the writer's state is in writer_impl.h.
 */
#include "encode/writer_impl.h"

#include <stdio.h>
#include <stdlib.h>

#define FRAME_CHUNK "KWCH"
#define FRAME_END "KWEN"

enum { W_OPEN = 0, W_DONE, W_FAILED };

/* ---- emitting --------------------------------------------------------------------------- */

static kvw_code emit(kvw_writer *w, const kvw_iovec *parts, int n, kvw_error *err) {
    uint64_t total = 0;
    for (int i = 0; i < n; i++) total += parts[i].len;
    if (w->sink(w->ctx, parts, n) != 0) {
        w->state = W_FAILED;
        return kvw_fail(err, KVW_ERR_IO, "KVW-WRITE-2",
                        "the sink refused %llu bytes at offset %llu: container abandoned, no end frame",
                        (unsigned long long)total, (unsigned long long)w->pos);
    }
    w->pos += total;
    return KVW_OK;
}

static int iov_reserve(kvw_writer *w, size_t n) {
    if (n <= w->iov_cap) return 0;
    kvw_iovec *p = realloc(w->iov, n * sizeof *p);
    if (!p) return 1;
    w->iov = p;
    w->iov_cap = n;
    return 0;
}

static void write_preamble(uint8_t p[KVW_PREAMBLE_SIZE], uint16_t minor, const uint8_t *hdr,
                           uint32_t hlen) {
    memcpy(p, KVW_MAGIC, 8);
    kvw_st16(p + 8, 1);
    kvw_st16(p + 10, minor);
    kvw_st32(p + 12, hlen);
    kvw_st64(p + 16, kvw_xxh3(hdr, hlen));
    kvw_st32(p + 24, 0);
    kvw_st32(p + 28, kvw_check32(p, 28));
}

void kvw_writer_free(kvw_writer *w) {
    if (!w) return;
    if (w->have_grid) kvw_grid_free(&w->grid);
    kvw_header_free(&w->h);
    free(w->hdr);
    free(w->filled);
    free(w->records);
    free(w->zeros);
    free(w->iov);
    if (w->xs) XXH3_freeState(w->xs);
    free(w);
}

kvw_code kvw_writer_new(const kvw_header *hin, const kvw_writer_options *opt, kvw_sink_fn sink,
                        void *ctx, kvw_writer **out, kvw_error *err) {
    if (out) *out = NULL;
    if (!hin || !sink || !out)
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "kvw_writer_new: header, sink and out are required");
    kvw_form form = opt ? opt->form : KVW_FORM_FILE;
    int level = opt ? opt->zstd_level : 0;
    if (form != KVW_FORM_FILE && form != KVW_FORM_STREAM)
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "form %d: KVW_FORM_STREAM (0) or KVW_FORM_FILE (1)",
                        (int)form);
    if (level < -131072 || level > 22)
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "zstd_level %d: 0 (default 3), 1..22 or a negative "
                        "fast level", level);

    /* The header as this writer writes it: version, producer, implied feature bits. */
    kvw_header h = *hin;
    h.owned_ = NULL;
    h.format_major = KVW_FORMAT_MAJOR;
    h.has_producer = 1;
    h.producer_library = (kvw_bytes){(const uint8_t *)"kvwire-c", 8};
    h.producer_version = (kvw_bytes){(const uint8_t *)KVW_VERSION_STRING, (uint32_t)strlen(KVW_VERSION_STRING)};
    uint64_t rf = h.required_features & ~(KVW_FEATURE_CODEC_SPECS | KVW_FEATURE_SPARSE |
                                          KVW_FEATURE_STATE_LAYERS | KVW_FEATURE_KV_SCALES |
                                          KVW_FEATURE_ROTATION | KVW_FEATURE_TURBOQUANT);
    if (h.codec_specs && h.codec_spec_count) rf |= KVW_FEATURE_CODEC_SPECS; /* CSPEC-10 */
    else h.codec_spec_count = 0;
    for (uint32_t i = 0; i < h.codec_spec_count; i++)
        if (kvw_codec_spec_uses_rotation(&h.codec_specs[i])) rf |= KVW_FEATURE_ROTATION; /* ROT-1 */
    for (uint32_t i = 0; i < h.codec_spec_count; i++) /* TQ-1: bit 5 with bit 4 */
        if (kvw_codec_spec_uses_turboquant(&h.codec_specs[i])) rf |= KVW_FEATURE_TURBOQUANT;
    if (h.has_sparse) rf |= KVW_FEATURE_SPARSE;                             /* SPARSE-1 */
    for (uint32_t i = 0; h.arch.layer_specs && i < h.arch.layer_spec_count; i++)
        if (h.arch.layer_specs[i].kind == KVW_KIND_STATE) rf |= KVW_FEATURE_STATE_LAYERS; /* STATE-1 */
    if (h.has_kv_scales) rf |= KVW_FEATURE_KV_SCALES;                       /* SCALE-1 */
    h.required_features = rf;
    h.format_minor = (rf & KVW_FEATURE_TURBOQUANT) ? 3 : (rf & KVW_FEATURE_ROTATION) ? 2
                   : (rf & KVW_FEATURE_KV_SCALES) ? 1 : 0; /* EVOL-12 */

    kvw_code c = kvw_writer_only_rules(&h, err);
    if (c) return c;

    kvw_writer *w = calloc(1, sizeof *w);
    if (!w) return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "writer: out of memory");
    kvw_header_init(&w->h);
    w->form = form;
    w->zstd_level = level ? level : 3;
    w->sink = sink;
    w->ctx = ctx;

    c = kvw_header_encode(&h, &w->hdr, &w->hdr_len, err);
    if (c) { kvw_writer_free(w); return c; }
    if (w->hdr_len > KVW_MAX_HEADER_LENGTH) {
        c = kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "KVW-PRE-5", "the header encodes to %zu bytes, at most %u",
                     w->hdr_len, (unsigned)KVW_MAX_HEADER_LENGTH);
        kvw_writer_free(w);
        return c;
    }
    kvw_error perr;
    kvw_error_clear(&perr);
    c = kvw_header_parse(w->hdr, w->hdr_len, &w->h, &perr);
    if (c == KVW_OK) c = kvw_grid_build(&w->h, &w->grid, &perr), w->have_grid = (c == KVW_OK);
    if (c) {
        kvw_code r = kvw_code_is_format_error(c) ? KVW_ERR_INVALID_ARGUMENT : c;
        kvw_fail(err, r, perr.rule, "readers would reject this header: %s (%s): %s", kvw_code_name(c),
                 perr.rule, perr.message);
        kvw_writer_free(w);
        return r;
    }
    if (w->grid.total > KVW_MAX_CHUNKS) { /* grid_build checks it; kept for the allocation */
        c = kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "KVW-LIM-1", "the header implies %llu chunks, at most %u",
                     (unsigned long long)w->grid.total, (unsigned)KVW_MAX_CHUNKS);
        kvw_writer_free(w);
        return c;
    }
    w->filled = calloc(w->grid.total ? (size_t)w->grid.total : 1, 1);
    w->zeros = calloc(w->h.alignment, 1);
    w->xs = XXH3_createState();
    if (!w->filled || !w->zeros || !w->xs || iov_reserve(w, 8)) {
        kvw_writer_free(w);
        return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "writer: out of memory");
    }

    uint8_t pre[KVW_PREAMBLE_SIZE];
    write_preamble(pre, w->h.format_minor, w->hdr, (uint32_t)w->hdr_len);
    kvw_iovec v[2] = {{pre, sizeof pre}, {w->hdr, w->hdr_len}};
    c = emit(w, v, 2, err);
    if (c) { kvw_writer_free(w); return c; }
    *out = w;
    return KVW_OK;
}

kvw_code kvw_writer_add(kvw_writer *w, uint32_t layer, int component, uint32_t token_start,
                        uint32_t token_count, int codec, uint16_t codec_spec,
                        const kvw_iovec *parts, int nparts, kvw_error *err) {
    return kvw_writer_add_head(w, layer, component, -1, token_start, token_count, codec, codec_spec,
                               parts, nparts, err);
}

kvw_code kvw_writer_add_head(kvw_writer *w, uint32_t layer, int component, int head,
                             uint32_t token_start, uint32_t token_count, int codec,
                             uint16_t codec_spec, const kvw_iovec *parts, int nparts,
                             kvw_error *err) {
    if (!w) return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "kvw_writer_add: NULL writer");
    if (w->state != W_OPEN)
        return kvw_fail(err, KVW_ERR_STATE, "", "kvw_writer_add: the writer is %s",
                        w->state == W_DONE ? "finished" : "failed (sink error): start a new container");
    if (nparts < 0 || (nparts > 0 && !parts))
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "kvw_writer_add: %d parts at %p", nparts,
                        (const void *)parts);
    uint64_t raw = 0;
    for (int i = 0; i < nparts; i++) {
        if (parts[i].len && !parts[i].base)
            return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "part %d: NULL base with %zu bytes", i, parts[i].len);
        if (kvw_add_ovf(raw, parts[i].len, &raw))
            return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "parts: total length overflows");
    }
    kvw_record rec;
    uint64_t slot = 0;
    const kvw_codec_spec *spec = NULL;
    kvw_code c = kvw_writer_chunk_check(w, layer, component, head, token_start, token_count, codec,
                                        codec_spec, raw, &rec, &slot, &spec, err);
    if (c) return c;

    /* Body: raw parts as given, or the codec's encoding when it is smaller (KVW-CHUNK-6). */
    uint8_t *enc = NULL;
    size_t enc_len = 0;
    if (codec != KVW_CODEC_RAW) {
        c = kvw_encode_body(&w->h, codec, spec, &rec, parts, nparts, w->zstd_level, &enc, &enc_len, err);
        if (c == KVW_ERR_UNSUPPORTED && codec >= KVW_CODEC_FP8) {
            /* A chunk the lossy codec cannot store faithfully (NaN or infinity, KVW-LOSSY-6; a
             * range its dtypes cannot hold, LOSSY-5) is stored losslessly with codec_spec 0,
             * as the reference writer does: zstd, or raw when that is not smaller. */
            codec = KVW_CODEC_ZSTD;
            codec_spec = 0;
            c = kvw_encode_body(&w->h, codec, NULL, &rec, parts, nparts, w->zstd_level, &enc, &enc_len, err);
        }
        if (c) return c;
        if (enc_len >= raw) { free(enc); enc = NULL; }
    }
    if (enc) {
        rec.codec = (uint8_t)codec;
        rec.reserved0 = codec_spec;
        rec.stored_length = enc_len;
        rec.checksum = kvw_xxh3(enc, enc_len);
    } else {
        rec.codec = KVW_CODEC_RAW;
        rec.reserved0 = 0;
        rec.stored_length = raw;
        kvw_xxh3_reset(w->xs);
        for (int i = 0; i < nparts; i++)
            if (parts[i].len) kvw_xxh3_update(w->xs, parts[i].base, parts[i].len);
        rec.checksum = kvw_xxh3_digest(w->xs);
    }
    /* the grid's own record checks, exactly as readers run them */
    c = kvw_writer_grid_recheck(w, &rec, err);
    if (c) { free(enc); return c; }

    uint64_t frame_at, A = w->h.alignment;
    if (kvw_next_frame_offset(w->pos, A, &frame_at) ||
        kvw_add_ovf(frame_at, KVW_FRAME_SIZE, &rec.offset)) {
        free(enc);
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "container offset overflows");
    }
    if (w->nrec == w->rec_cap) {
        size_t ncap = w->rec_cap ? w->rec_cap * 2 : 64;
        uint8_t *p = realloc(w->records, ncap * KVW_RECORD_SIZE);
        if (!p) { free(enc); return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "writer: out of memory"); }
        w->records = p;
        w->rec_cap = ncap;
    }
    if (iov_reserve(w, (size_t)nparts + 2)) {
        free(enc);
        return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "writer: out of memory");
    }
    uint8_t frame[KVW_FRAME_SIZE];
    memcpy(frame, FRAME_CHUNK, 4);
    kvw_record_encode(&rec, frame + 8);
    kvw_st32(frame + 4, kvw_check32(frame + 8, KVW_RECORD_SIZE));
    int n = 0;
    if (frame_at > w->pos) w->iov[n++] = (kvw_iovec){w->zeros, (size_t)(frame_at - w->pos)};
    w->iov[n++] = (kvw_iovec){frame, sizeof frame};
    if (enc) {
        w->iov[n++] = (kvw_iovec){enc, enc_len};
    } else {
        for (int i = 0; i < nparts; i++)
            if (parts[i].len) w->iov[n++] = parts[i];
    }
    c = emit(w, w->iov, n, err);
    free(enc);
    if (c) return c;
    memcpy(w->records + w->nrec * KVW_RECORD_SIZE, frame + 8, KVW_RECORD_SIZE);
    w->nrec++;
    w->filled[slot] = 1;
    w->nfilled++;
    return KVW_OK;
}

kvw_code kvw_writer_finish(kvw_writer *w, kvw_error *err) {
    if (!w) return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "kvw_writer_finish: NULL writer");
    if (w->state != W_OPEN)
        return kvw_fail(err, KVW_ERR_STATE, "", "kvw_writer_finish: the writer is %s",
                        w->state == W_DONE ? "already finished" : "failed (sink error)");
    if (w->nfilled != w->grid.total) {
        uint64_t s = 0;
        while (s < w->grid.total && w->filled[s]) s++;
        char what[160];
        kvw_writer_describe_slot(w, s, what, sizeof what);
        return kvw_fail(err, KVW_ERR_STATE, "KVW-CHUNK-8",
                        "%llu of %llu chunks written; missing: %s (no end frame written, KVW-WRITE-2)",
                        (unsigned long long)w->nfilled, (unsigned long long)w->grid.total, what);
    }
    uint64_t end_at, A = w->h.alignment;
    if (kvw_next_frame_offset(w->pos, A, &end_at))
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "container offset overflows");
    uint8_t endf[KVW_FRAME_SIZE];
    memset(endf, 0, sizeof endf);
    memcpy(endf, FRAME_END, 4);
    kvw_st64(endf + 8, (uint64_t)w->nrec);
    kvw_st64(endf + 16, kvw_xxh3(w->records ? w->records : endf + 24, w->nrec * KVW_RECORD_SIZE));
    kvw_st32(endf + 4, kvw_check32(endf + 8, 56));
    kvw_iovec v[5];
    int n = 0;
    if (end_at > w->pos) v[n++] = (kvw_iovec){w->zeros, (size_t)(end_at - w->pos)};
    v[n++] = (kvw_iovec){endf, sizeof endf};
    if (w->form == KVW_FORM_STREAM) {
        kvw_code c = emit(w, v, n, err);
        if (c) return c;
        w->state = W_DONE;
        return KVW_OK;
    }
    uint8_t *idx = NULL;
    size_t idx_len = 0;
    kvw_code c = kvw_index_encode(w->records, (uint32_t)w->nrec, &idx, &idx_len, err);
    if (c) return c;
    if (idx_len > KVW_MAX_INDEX_LENGTH) {
        free(idx);
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "KVW-FILE-2", "index of %zu bytes, at most %u",
                        idx_len, (unsigned)KVW_MAX_INDEX_LENGTH);
    }
    uint64_t index_offset = end_at + KVW_FRAME_SIZE;
    uint8_t trailer[KVW_TRAILER_SIZE];
    kvw_st64(trailer, index_offset);
    kvw_st32(trailer + 8, (uint32_t)idx_len);
    kvw_st32(trailer + 12, 0);
    kvw_st64(trailer + 16, kvw_xxh3(idx, idx_len));
    memcpy(trailer + 24, KVW_TRAILER_MAGIC, 8);
    size_t pad8 = (size_t)(-(index_offset + idx_len)) & 7;
    v[n++] = (kvw_iovec){idx, idx_len};
    if (pad8) v[n++] = (kvw_iovec){w->zeros, pad8};
    v[n++] = (kvw_iovec){trailer, sizeof trailer};
    c = emit(w, v, n, err);
    free(idx);
    if (c) return c;
    w->state = W_DONE;
    return KVW_OK;
}
