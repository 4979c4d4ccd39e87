/*
 * Sans-IO sequential decoder (spec 14.2): bytes go in with kvw_decoder_feed as they
 * arrive, events come out of kvw_next in the order the bytes allow (header, each chunk
 * once its body is verified, end). Every check of 14.2 in its order; the memory held
 * follows the bytes received (KVW-LIM-8: a body is never allocated from its declared
 * length, the input buffer grows with what was fed); concatenated stream-form containers
 * (KVW-STREAM-3) when the caller opts in; the file-form tail checked at end of input.
 */
#include "format/grid.h"
#include "decode/decode.h"

#include <stdlib.h>

enum { ST_PREAMBLE, ST_HEADER, ST_FRAME, ST_BODY, ST_TAIL, ST_ENDED, ST_EOF };

#define TAIL_MAX ((uint64_t)KVW_MAX_INDEX_LENGTH + 8 + KVW_TRAILER_SIZE)

struct kvw_decoder {
    kvw_decoder_options opt;
    uint64_t max_decoded;
    uint8_t *buf; /* input bytes buf[head, len): container offsets [abs, abs + len - head) */
    size_t cap, head, len;
    uint64_t abs;
    uint64_t consume_to; /* consumed at the next call (event pointers stay valid until then) */
    int finished;
    kvw_code sticky;
    kvw_error sticky_err;
    int state;
    unsigned containers; /* containers begun */
    /* the container being read */
    uint32_t hlen;
    uint16_t minor;
    uint64_t hsum;
    uint8_t *hdr_bytes;
    kvw_header h;
    int have_header;
    kvw_grid g;
    uint8_t *filled; /* one byte per slot */
    uint64_t nfilled;
    uint8_t *records; /* wire records in container order */
    size_t nrec, rcap;
    uint64_t decoded;
    uint64_t pos; /* prev_end of 14.2 step 3 */
    kvw_record cur;
    uint64_t end_at;
    uint8_t *data; /* decoded body */
    size_t data_cap;
    /* sparse: first/last position of each POSITIONS cell seen, by slot (SPARSE-11) */
    uint64_t *pfirst, *plast;
    int64_t *pbuf;
    size_t pcap;
};

static size_t avail(const kvw_decoder *d) { return d->len - d->head; }
static const uint8_t *at(const kvw_decoder *d, uint64_t off) {
    static const uint8_t none[1] = {0}; /* no buffer yet: nothing is read through it */
    if (!d->buf) return none;
    return d->buf + d->head + (size_t)(off - d->abs);
}
static uint64_t have_to(const kvw_decoder *d) { return d->abs + avail(d); }

static void consume(kvw_decoder *d, uint64_t upto) {
    if (upto <= d->abs) return;
    size_t k = (size_t)(upto - d->abs);
    if (k > avail(d)) k = avail(d);
    d->head += k;
    d->abs += k;
    if (d->head == d->len) d->head = d->len = 0;
}

static void free_container(kvw_decoder *d) {
    kvw_grid_free(&d->g);
    free(d->filled);
    free(d->records);
    free(d->pfirst);
    free(d->plast);
    d->filled = d->records = NULL;
    d->pfirst = d->plast = NULL;
    d->nrec = d->rcap = 0;
    d->nfilled = d->decoded = 0;
}

static void free_header(kvw_decoder *d) {
    if (d->have_header) kvw_header_free(&d->h);
    d->have_header = 0;
    free(d->hdr_bytes);
    d->hdr_bytes = NULL;
}

kvw_code kvw_decoder_new(const kvw_decoder_options *opt, kvw_decoder **out, kvw_error *err) {
    kvw_error_clear(err);
    if (!out) return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "out is NULL");
    kvw_decoder *d = calloc(1, sizeof *d);
    if (!d) return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "out of memory");
    if (opt) d->opt = *opt;
    d->max_decoded = d->opt.base.max_decoded_bytes ? d->opt.base.max_decoded_bytes
                                                   : KVW_DEFAULT_MAX_DECODED;
    kvw_header_init(&d->h);
    d->state = ST_PREAMBLE;
    *out = d;
    return KVW_OK;
}

void kvw_decoder_free(kvw_decoder *d) {
    if (!d) return;
    free_container(d);
    free_header(d);
    free(d->buf);
    free(d->data);
    free(d->pbuf);
    free(d);
}

static kvw_code set_sticky(kvw_decoder *d, kvw_code c, const kvw_error *e, kvw_error *err) {
    d->sticky = c;
    if (e) d->sticky_err = *e;
    else kvw_fail(&d->sticky_err, c, "", "%s", kvw_code_name(c));
    if (err && err != e) *err = d->sticky_err;
    return c;
}

kvw_code kvw_decoder_feed(kvw_decoder *d, const void *data, size_t len, kvw_error *err) {
    kvw_error_clear(err);
    if (!d || (!data && len)) return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "NULL argument");
    if (d->finished) return kvw_fail(err, KVW_ERR_STATE, "", "input after kvw_decoder_finish");
    if (d->sticky) {
        if (err) *err = d->sticky_err;
        return d->sticky;
    }
    if (!len) return KVW_OK;
    consume(d, d->consume_to);
    if (d->state == ST_TAIL && have_to(d) - d->end_at + len > TAIL_MAX) {
        kvw_error e;
        kvw_fail(&e, KVW_TRAILING_BYTES, "KVW-LAYOUT-4",
                 "more than %llu bytes after the end frame: not an index and trailer",
                 (unsigned long long)TAIL_MAX);
        return set_sticky(d, KVW_TRAILING_BYTES, &e, err);
    }
    if (d->cap - d->len < len) {
        if (d->head) { /* compact first */
            memmove(d->buf, d->buf + d->head, avail(d));
            d->len -= d->head;
            d->head = 0;
        }
        if (d->cap - d->len < len) {
            size_t need = d->len + len, nc = d->cap ? d->cap : 4096;
            while (nc < need) nc = nc > SIZE_MAX / 2 ? need : 2 * nc;
            uint8_t *b = realloc(d->buf, nc);
            if (!b) return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "out of memory");
            d->buf = b;
            d->cap = nc;
        }
    }
    memcpy(d->buf + d->len, data, len);
    d->len += len;
    return KVW_OK;
}

kvw_code kvw_decoder_finish(kvw_decoder *d, kvw_error *err) {
    kvw_error_clear(err);
    if (!d) return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "NULL decoder");
    if (d->finished) return kvw_fail(err, KVW_ERR_STATE, "", "kvw_decoder_finish called twice");
    d->finished = 1;
    return KVW_OK;
}

static kvw_code need(kvw_decoder *d, kvw_event *ev, uint64_t needed, const char *rule,
                     kvw_error *err) {
    if (d->finished) return kvw_fail_truncated(err, rule, needed);
    ev->type = KVW_EVENT_NEED_DATA;
    ev->needed = needed;
    return KVW_OK;
}

/* 14.2 steps 1-2. */
static kvw_code step_preamble(kvw_decoder *d, kvw_event *ev, kvw_error *err) {
    size_t n = avail(d);
    if (n < KVW_PREAMBLE_SIZE) {
        if (d->finished) {
            if (n == 0 && d->containers > 0) { /* the sequence ended after an end frame */
                d->state = ST_EOF;
                ev->type = KVW_EVENT_EOF;
                return KVW_OK;
            }
            return kvw_preamble_check(at(d, 0), n, NULL, NULL, NULL, err);
        }
        if (n && !kvw_magic_undecided(at(d, 0), n)) {
            kvw_code c = kvw_preamble_check(at(d, 0), n, NULL, NULL, NULL, err);
            if (c != KVW_TRUNCATED) return c;
            kvw_error_clear(err);
        }
        return need(d, ev, KVW_PREAMBLE_SIZE, "KVW-PRE-1", err);
    }
    kvw_code c = kvw_preamble_check(at(d, 0), n, &d->minor, &d->hlen, &d->hsum, err);
    if (c) return c;
    d->containers++;
    d->state = ST_HEADER;
    return KVW_OK;
}

static kvw_code step_header(kvw_decoder *d, kvw_event *ev, kvw_error *err) {
    uint64_t end = KVW_PREAMBLE_SIZE + (uint64_t)d->hlen;
    if (have_to(d) < end) return need(d, ev, end, "KVW-PRE-5", err);
    const uint8_t *hb = at(d, KVW_PREAMBLE_SIZE);
    if (kvw_xxh3(hb, d->hlen) != d->hsum)
        return kvw_fail(err, KVW_HEADER_CHECKSUM, "KVW-PRE-6",
                        "header bytes do not match the preamble's header_checksum");
    free_header(d);
    d->hdr_bytes = malloc(d->hlen ? d->hlen : 1); /* the header's bytes have arrived */
    if (!d->hdr_bytes) return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "out of memory");
    memcpy(d->hdr_bytes, hb, d->hlen);
    kvw_code c = kvw_header_parse(d->hdr_bytes, d->hlen, &d->h, err);
    if (c) return c;
    d->have_header = 1;
    if (d->h.format_major != KVW_FORMAT_MAJOR || d->h.format_minor != d->minor)
        return kvw_fail(err, KVW_VERSION_MISMATCH, "KVW-HDR-9",
                        "header says format %u.%u, the preamble %u.%u", d->h.format_major,
                        d->h.format_minor, KVW_FORMAT_MAJOR, d->minor);
    c = kvw_grid_build(&d->h, &d->g, err);
    if (c) return c;
    size_t total = (size_t)d->g.total; /* <= 2^20, checked */
    d->filled = calloc(total ? total : 1, 1);
    if (!d->filled) return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "out of memory");
    if (d->h.has_sparse) {
        d->pfirst = malloc((total ? total : 1) * sizeof *d->pfirst);
        d->plast = malloc((total ? total : 1) * sizeof *d->plast);
        if (!d->pfirst || !d->plast) return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "out of memory");
    }
    d->consume_to = end;
    d->pos = end;
    d->state = ST_FRAME;
    ev->type = KVW_EVENT_HEADER;
    ev->header = &d->h;
    return KVW_OK;
}

static kvw_code record_checks(kvw_decoder *d, const kvw_record *r, uint64_t *slot,
                              kvw_error *err) {
    for (int s = 0; s < KVW_RS_COUNT; s++) {
        kvw_code c = kvw_record_check_step(&d->h, &d->g, r, (kvw_record_step)s, err);
        if (c) return c;
    }
    *slot = kvw_grid_slot(&d->g, r);
    if (*slot >= d->g.total || d->filled[*slot])
        return kvw_fail(err, KVW_CHUNK_DUPLICATE, "KVW-CHUNK-8",
                        "a second record for layer %u component %u tokens %u+%u head %u",
                        r->layer, r->component, r->token_start, r->token_count,
                        r->head_start);
    return KVW_OK;
}

/* 14.2 step 3 (and 5 for the end frame). */
static kvw_code step_frame(kvw_decoder *d, kvw_event *ev, kvw_error *err) {
    uint64_t p;
    if (kvw_next_frame_offset(d->pos, d->h.alignment, &p))
        return kvw_fail(err, KVW_BAD_OFFSET, "KVW-LAYOUT-1", "frame position overflows");
    if (have_to(d) < p + KVW_FRAME_SIZE)
        return need(d, ev, p + KVW_FRAME_SIZE, "KVW-LAYOUT-3", err);
    kvw_code c = kvw_zero_check(at(d, d->pos), (size_t)(p - d->pos), d->pos, err);
    if (c) return c;
    const uint8_t *f = at(d, p);
    int is_end;
    c = kvw_frame_check(f, p, &is_end, err);
    if (c) return c;
    if (is_end) {
        c = kvw_end_frame_check(f, d->nrec, kvw_xxh3(d->records, d->nrec * KVW_RECORD_SIZE),
                                err);
        if (c) return c;
        if (d->nfilled < d->g.total)
            return kvw_fail(err, KVW_CHUNK_MISSING, "KVW-CHUNK-8",
                            "%llu of the %llu chunks the header implies never arrived",
                            (unsigned long long)(d->g.total - d->nfilled),
                            (unsigned long long)d->g.total);
        d->end_at = p + KVW_FRAME_SIZE;
        d->consume_to = d->end_at;
        if (d->opt.concatenated) { /* KVW-STREAM-3: what follows is the next container */
            consume(d, d->end_at);
            d->abs = 0;
            d->consume_to = 0;
            free_container(d);
            d->state = ST_PREAMBLE;
            ev->type = KVW_EVENT_END;
            ev->form = KVW_FORM_STREAM;
            return KVW_OK;
        }
        d->state = ST_TAIL;
        return KVW_OK;
    }
    if (d->nrec >= KVW_MAX_CHUNKS)
        return kvw_fail(err, KVW_LIMIT_EXCEEDED, "KVW-LIM-1", "more than %u chunk frames",
                        (unsigned)KVW_MAX_CHUNKS);
    kvw_record r;
    kvw_record_decode(f + 8, &r);
    if (r.offset != p + KVW_FRAME_SIZE)
        return kvw_fail(err, KVW_BAD_OFFSET, "KVW-LAYOUT-1",
                        "frame at %llu records body offset %llu, expected %llu",
                        (unsigned long long)p, (unsigned long long)r.offset,
                        (unsigned long long)(p + KVW_FRAME_SIZE));
    uint64_t slot;
    c = record_checks(d, &r, &slot, err);
    if (c) return c;
    if (kvw_add_ovf(d->decoded, r.raw_length, &d->decoded) || d->decoded > d->max_decoded)
        return kvw_fail(err, KVW_DECODED_SIZE_LIMIT, "KVW-LIM-5",
                        "the stream decodes to more than %llu bytes",
                        (unsigned long long)d->max_decoded);
    d->filled[slot] = 1;
    d->nfilled++;
    if (d->nrec == d->rcap) { /* grows with the frames received */
        size_t nc = d->rcap ? 2 * d->rcap : 64;
        uint8_t *w = realloc(d->records, nc * KVW_RECORD_SIZE);
        if (!w) return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "out of memory");
        d->records = w;
        d->rcap = nc;
    }
    memcpy(d->records + d->nrec * KVW_RECORD_SIZE, f + 8, KVW_RECORD_SIZE);
    d->nrec++;
    d->cur = r;
    d->consume_to = p + KVW_FRAME_SIZE;
    d->pos = p + KVW_FRAME_SIZE;
    d->state = ST_BODY;
    return KVW_OK;
}

static kvw_code grow_data(kvw_decoder *d, uint64_t n, kvw_error *err) {
    if (d->data_cap >= n) return KVW_OK;
    if (n > SIZE_MAX) return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "body too large");
    uint8_t *b = realloc(d->data, (size_t)n); /* raw_length: bounded by LIM-4 and LIM-5 */
    if (!b) return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "out of memory");
    d->data = b;
    d->data_cap = (size_t)n;
    return KVW_OK;
}

/* SPARSE-10/11 for a POSITIONS cell on arrival, against the neighbouring cells seen. */
static kvw_code check_positions(kvw_decoder *d, const kvw_record *r, const uint8_t *raw,
                                uint64_t slot, kvw_error *err) {
    uint64_t C = d->h.chunk_tokens, k = r->token_start / C;
    uint32_t cnt = kvw_grid_retained(&d->h, &d->g, r->layer, r->head_start);
    uint64_t prev = UINT64_MAX, next = UINT64_MAX;
    if (k > 0 && d->filled[slot - 1] == 2) prev = d->plast[slot - 1];
    if ((k + 1) * C < cnt && d->filled[slot + 1] == 2) next = d->pfirst[slot + 1];
    if (d->pcap < r->token_count) {
        int64_t *b = realloc(d->pbuf, (size_t)r->token_count * sizeof *b);
        if (!b) return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "out of memory");
        d->pbuf = b;
        d->pcap = r->token_count;
    }
    kvw_code c = kvw_positions_decode(raw, (size_t)r->raw_length, r->token_count,
                                      d->h.first_position, d->h.sparse.next_position, prev,
                                      next, d->pbuf, err);
    if (c) return c;
    d->pfirst[slot] = (uint64_t)d->pbuf[0];
    d->plast[slot] = (uint64_t)d->pbuf[r->token_count - 1];
    d->filled[slot] = 2;
    return KVW_OK;
}

/* 14.2 step 4. */
static kvw_code step_body(kvw_decoder *d, kvw_event *ev, kvw_error *err) {
    const kvw_record *r = &d->cur;
    uint64_t end;
    if (kvw_add_ovf(r->offset, r->stored_length, &end)) end = UINT64_MAX;
    if (have_to(d) < end) return need(d, ev, end == UINT64_MAX ? 0 : end, "KVW-LAYOUT-3", err);
    const uint8_t *body = at(d, r->offset);
    size_t len = (size_t)r->stored_length;
    if (!d->opt.base.skip_body_checksums && kvw_xxh3(body, len) != r->checksum)
        return kvw_fail(err, KVW_BODY_CHECKSUM, "KVW-CSUM-1",
                        "chunk at %llu (layer %u component %u tokens %u+%u): body checksum "
                        "mismatch", (unsigned long long)r->offset, r->layer, r->component,
                        r->token_start, r->token_count);
    const uint8_t *data = NULL;
    int positions = d->h.has_sparse && r->component == KVW_COMP_POSITIONS;
    if (d->opt.decode_bodies || positions) {
        if (r->codec == KVW_CODEC_RAW) {
            data = body;
        } else {
            kvw_code c = grow_data(d, r->raw_length, err);
            if (c) return c;
            c = kvw_decode_body(&d->h, r, body, d->data, err);
            if (c) return c;
            data = d->data;
        }
    }
    if (positions) {
        kvw_code c = check_positions(d, r, data, kvw_grid_slot(&d->g, r), err);
        if (c) return c;
    }
    d->consume_to = end;
    d->pos = end;
    d->state = ST_FRAME;
    ev->type = KVW_EVENT_CHUNK;
    ev->record = &d->cur;
    ev->body = body;
    ev->data = d->opt.decode_bodies ? data : NULL;
    ev->data_len = d->opt.decode_bodies ? (size_t)r->raw_length : 0;
    return KVW_OK;
}

/* 14.2 step 6: end of input after the end frame. */
static kvw_code step_tail(kvw_decoder *d, kvw_event *ev, kvw_error *err) {
    /* the tail: bytes received after the end frame (the end frame itself may still be in
     * the buffer, before them) */
    size_t n = have_to(d) > d->end_at ? (size_t)(have_to(d) - d->end_at) : 0;
    if (n > TAIL_MAX)
        return kvw_fail(err, KVW_TRAILING_BYTES, "KVW-LAYOUT-4",
                        "more than %llu bytes after the end frame",
                        (unsigned long long)TAIL_MAX);
    if (!d->finished) return need(d, ev, 0, "KVW-LAYOUT-4", err);
    ev->type = KVW_EVENT_END;
    ev->form = KVW_FORM_STREAM;
    if (n) {
        const uint8_t *t = at(d, d->end_at);
        if (n < KVW_TRAILER_SIZE || memcmp(t + n - 8, KVW_TRAILER_MAGIC, 8) != 0)
            return kvw_fail(err, KVW_TRAILING_BYTES, "KVW-LAYOUT-4",
                            "%zu bytes after the end frame, not an index and trailer", n);
        uint64_t off;
        uint32_t ilen;
        kvw_code c = kvw_trailer_check(t, n, d->end_at, 1, &off, &ilen, err);
        if (c) return c;
        const uint8_t *recs;
        uint32_t count;
        c = kvw_index_parse(t + (off - d->end_at), ilen, &recs, &count, err);
        if (c) return c;
        if (count != d->nrec ||
            (d->nrec && memcmp(recs, d->records, d->nrec * KVW_RECORD_SIZE) != 0))
            return kvw_fail(err, KVW_INDEX_MISMATCH, "KVW-FILE-4",
                            "the index's %u records differ from the %zu chunk frames' records",
                            count, d->nrec);
        ev->form = KVW_FORM_FILE;
    }
    d->consume_to = d->end_at + n;
    d->state = ST_ENDED;
    return KVW_OK;
}

kvw_code kvw_next(kvw_decoder *d, kvw_event *ev, kvw_error *err) {
    kvw_error_clear(err);
    if (!d || !ev) return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "NULL argument");
    memset(ev, 0, sizeof *ev);
    if (d->sticky) {
        if (err) *err = d->sticky_err;
        return d->sticky;
    }
    consume(d, d->consume_to);
    kvw_error local;
    kvw_error *e = err ? err : &local;
    for (;;) {
        int before = d->state;
        kvw_code c;
        switch (d->state) {
        case ST_PREAMBLE: c = step_preamble(d, ev, e); break;
        case ST_HEADER: c = step_header(d, ev, e); break;
        case ST_FRAME: c = step_frame(d, ev, e); break;
        case ST_BODY: c = step_body(d, ev, e); break;
        case ST_TAIL: c = step_tail(d, ev, e); break;
        case ST_ENDED: d->state = ST_EOF; /* fall through */
        default: ev->type = KVW_EVENT_EOF; return KVW_OK;
        }
        if (c) {
            if (kvw_code_is_format_error(c)) return set_sticky(d, c, e, err);
            return c;
        }
        if (ev->type != KVW_EVENT_NEED_DATA || d->state == before) return KVW_OK;
        /* a state change without an event: go on */
    }
}

const uint8_t *kvw_decoder_header_fb(const kvw_decoder *d, size_t *len) {
    *len = d->have_header ? d->hlen : 0;
    return d->have_header ? d->hdr_bytes : NULL;
}
