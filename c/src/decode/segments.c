/*
 * Segment reassembly (spec/kvwire-v1.md 10.2-10.3, KVW-STREAM-3 to KVW-STREAM-10): the
 * receiver side of a decode-phase sequence sent as concatenated stream-form containers.
 * It drives the sans-IO decoder with concatenated input, checks each segment against the
 * first (resolved header values, KVW-STREAM-5/7), the order (KVW-STREAM-6) and the prefix
 * chain (KVW-STREAM-9), and places every chunk at its absolute position. A segment's
 * header checks are decided at its header but reported at its end frame, after its
 * chunks were fully validated, as a receiver that decodes the segment first would.
 * The checks themselves are in segments_check.c (shared state: segments_impl.h).
 */
#include "decode/segments_impl.h"

#include <stdlib.h>

/* Make the first segment's header the base: a private copy of its FlatBuffer as it arrived
 * (the decoder's copy goes with the next container), parsed again. */
static kvw_code take_base(kvw_reassembly *ra, const kvw_decoder *d, const kvw_header *h, kvw_error *err) {
    size_t len, i, n = h->arch.num_layers;
    const uint8_t *fb = kvw_decoder_header_fb(d, &len);
    ra->base_fb = (uint8_t *)malloc(len ? len : 1);
    if (!ra->base_fb) return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "reassembly: no memory");
    memcpy(ra->base_fb, fb, len);
    kvw_code c = kvw_header_parse(ra->base_fb, len, &ra->base, err);
    if (c != KVW_OK) return c;
    ra->have_base = 1;
    ra->start = ra->end = ra->last_start = h->first_position;
    ra->chain = kvw_seg_chain_kind(h);
    ra->tensors = calloc(n * 3 + 1, sizeof *ra->tensors);
    ra->states = calloc(n + 1, sizeof *ra->states);
    ra->ranges = calloc(n + 1, sizeof *ra->ranges);
    if (!ra->tensors || !ra->states || !ra->ranges) return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "reassembly: no memory");
    for (i = 0; i < n; i++) {
        const kvw_layer_spec *s = kvw_layer(&ra->base, (uint32_t)i);
        unsigned es = kvw_dtype_size(ra->base.dtype);
        if (!s) continue;
        if (s->kind == KVW_KIND_STATE) {
            ra->states[i] = calloc(s->state_tensor_count + 1, sizeof **ra->states);
            if (!ra->states[i]) return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "reassembly: no memory");
        } else if (s->kind == KVW_KIND_MLA_LATENT) {
            seg_tensor *t = &ra->tensors[3 * i + KVW_COMP_LATENT];
            t->present = 1, t->heads = 1, t->row = (uint64_t)s->head_dim_k * es;
        } else if (s->kind != KVW_KIND_SHARED) {
            seg_tensor *k = &ra->tensors[3 * i + KVW_COMP_K], *v = &ra->tensors[3 * i + KVW_COMP_V];
            k->present = v->present = 1;
            k->heads = v->heads = s->num_kv_heads;
            k->row = (uint64_t)s->head_dim_k * es;
            v->row = (uint64_t)s->head_dim_v * es;
        }
    }
    return KVW_OK;
}

/* Accept segment h (checks passed): join the chain, move the window. */
static kvw_code accept_segment(kvw_reassembly *ra, const kvw_header *h, size_t keep, kvw_error *err) {
    uint64_t s = h->first_position, e = s + h->token_count;
    if (h->has_prefix && h->prefix.scheme == SEG_PREFIX_SCHEME) {
        size_t own = h->prefix.hashes.len / SEG_HASH_SIZE, need = keep + own;
        if (need > ra->hash_cap) {
            uint8_t *nh = realloc(ra->hashes, need * SEG_HASH_SIZE);
            if (!nh) return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "reassembly: no memory for the prefix chain");
            ra->hashes = nh;
            ra->hash_cap = need;
        }
        if (own) memcpy(ra->hashes + keep * SEG_HASH_SIZE, h->prefix.hashes.ptr, own * SEG_HASH_SIZE);
        ra->hash_count = need;
    }
    ra->last_start = s;
    ra->end = e;
    ra->partial = (e % (h->chunk_tokens ? h->chunk_tokens : 1)) != 0;
    ra->segments++;
    return KVW_OK;
}

static kvw_code reserve_rows(kvw_reassembly *ra, seg_tensor *t, uint64_t rows, kvw_error *err) {
    uint64_t cap = t->cap ? t->cap : 16, bytes, old_bytes, hd;
    uint8_t *nb;
    if (rows <= t->cap) return KVW_OK;
    while (cap < rows) cap = cap > (UINT64_MAX >> 1) ? rows : cap * 2;
    if (kvw_mul_ovf(cap, t->row, &bytes) || kvw_mul_ovf(bytes, t->heads, &bytes) || bytes > SIZE_MAX)
        return kvw_fail(err, KVW_DECODED_SIZE_LIMIT, "KVW-LIM-5", "reassembled tensor too large");
    old_bytes = t->cap * t->row * t->heads;
    if (ra->stored - old_bytes + bytes > ra->limit)
        return kvw_fail(err, KVW_DECODED_SIZE_LIMIT, "KVW-LIM-5",
                        "the reassembled sequence needs more than %llu bytes", (unsigned long long)ra->limit);
    nb = malloc(bytes ? (size_t)bytes : 1);
    if (!nb) return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "reassembly: no memory for %llu bytes",
                             (unsigned long long)bytes);
    for (hd = 0; t->buf && hd < t->heads; hd++)
        memcpy(nb + hd * cap * t->row, t->buf + hd * t->cap * t->row, (size_t)(t->cap * t->row));
    free(t->buf);
    t->buf = nb;
    ra->stored = ra->stored - old_bytes + bytes;
    t->cap = cap;
    return KVW_OK;
}

/* Place one verified, decoded chunk of the current segment (first position s). */
static kvw_code place_chunk(kvw_reassembly *ra, uint64_t s, const kvw_record *r, const uint8_t *data, size_t len,
                            kvw_error *err) {
    uint64_t at, rows, hd;
    seg_tensor *t;
    if (r->layer >= ra->base.arch.num_layers)
        return kvw_fail(err, KVW_ERR_STATE, "", "reassembly: chunk of layer %u", r->layer);
    if (r->component == KVW_COMP_STATE) {
        seg_state *st = ra->states[r->layer];
        const kvw_layer_spec *ls = kvw_layer(&ra->base, r->layer);
        uint8_t *copy;
        if (!st || !ls || r->head_start >= ls->state_tensor_count)
            return kvw_fail(err, KVW_ERR_STATE, "", "reassembly: unexpected state chunk");
        copy = malloc(len ? len : 1);
        if (!copy) return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "reassembly: no memory");
        memcpy(copy, data, len);
        free(st[r->head_start].data);
        st[r->head_start].data = copy;
        st[r->head_start].len = len;
        st[r->head_start].present = 1;
        return KVW_OK;
    }
    if (r->component > KVW_COMP_LATENT || !ra->tensors[3 * r->layer + r->component].present)
        return kvw_fail(err, KVW_ERR_STATE, "", "reassembly: unexpected chunk component %u", r->component);
    t = &ra->tensors[3 * r->layer + r->component];
    at = s - ra->start + r->token_start;
    if (r->head_count != t->heads || (uint64_t)r->head_count * r->token_count * t->row != len)
        return kvw_fail(err, KVW_ERR_STATE, "", "reassembly: chunk shape disagrees with the header");
    rows = at + r->token_count;
    {
        kvw_code c = reserve_rows(ra, t, rows, err);
        if (c != KVW_OK) return c;
    }
    for (hd = 0; hd < t->heads; hd++)
        memcpy(t->buf + (hd * t->cap + at) * t->row, data + hd * r->token_count * t->row,
               (size_t)(r->token_count * t->row));
    return KVW_OK;
}

/* The reassembled header and compact tensors, after the last segment. */
static kvw_code finish(kvw_reassembly *ra, kvw_error *err) {
    uint64_t n = ra->end - ra->start, hd;
    uint32_t i;
    if (n > UINT32_MAX)
        return kvw_fail(err, KVW_ERR_UNSUPPORTED, "", "reassembled sequence of %llu tokens", (unsigned long long)n);
    for (i = 0; i < 3 * ra->base.arch.num_layers; i++) {
        seg_tensor *t = &ra->tensors[i];
        if (!t->present) continue;
        if (t->cap < n) {
            kvw_code c = reserve_rows(ra, t, n, err);
            if (c != KVW_OK) return c;
        }
        for (hd = 1; hd < t->heads; hd++)
            memmove(t->buf + hd * n * t->row, t->buf + hd * t->cap * t->row, (size_t)(n * t->row));
        t->cap = n;
    }
    ra->out = ra->base;
    ra->out.first_position = ra->start;
    ra->out.token_count = (uint32_t)n;
    for (i = 0; i < ra->base.arch.num_layers; i++) {
        const kvw_layer_spec *ls = kvw_layer(&ra->base, i);
        ra->ranges[i].start = 0;
        ra->ranges[i].count = ls && ls->kind == KVW_KIND_SHARED ? 0 : (uint32_t)n;
    }
    ra->out.layer_tokens = ra->ranges;
    ra->out.layer_tokens_count = ra->base.arch.num_layers;
    ra->out.has_layer_tokens = 0;
    memset(&ra->out.prefix, 0, sizeof ra->out.prefix);
    ra->out.has_prefix = 0;
    if (ra->chain == SEG_PREFIX_SCHEME) { /* another scheme is treated as absent (KVW-PREFIX-1) */
        ra->out.has_prefix = 1;
        ra->out.prefix.scheme = SEG_PREFIX_SCHEME;
        ra->out.prefix.root = ra->base.prefix.root;
        ra->out.prefix.hashes.ptr = ra->hashes;
        ra->out.prefix.hashes.len = (uint32_t)(ra->hash_count * SEG_HASH_SIZE);
    }
    ra->out.owned_ = NULL;
    return KVW_OK;
}

void kvw_reassembly_free(kvw_reassembly *ra) {
    uint32_t i, j;
    if (!ra) return;
    if (ra->have_base) {
        for (i = 0; ra->tensors && i < 3 * ra->base.arch.num_layers; i++) free(ra->tensors[i].buf);
        for (i = 0; ra->states && i < ra->base.arch.num_layers; i++) {
            const kvw_layer_spec *ls = kvw_layer(&ra->base, i);
            for (j = 0; ra->states[i] && ls && j < ls->state_tensor_count; j++) free(ra->states[i][j].data);
            free(ra->states[i]);
        }
    }
    free(ra->tensors);
    free(ra->states);
    free(ra->ranges);
    free(ra->hashes);
    kvw_header_free(&ra->base);
    free(ra->base_fb);
    free(ra);
}

kvw_code kvw_reassemble(const void *buf, size_t len, const kvw_options *opt, kvw_reassembly **out,
                        kvw_error *err) {
    kvw_decoder_options dopt;
    kvw_decoder *d = NULL;
    kvw_reassembly *ra;
    kvw_code c, deferred = KVW_OK;
    kvw_error derr;
    uint64_t seg_start = 0;
    size_t keep = 0;
    int in_segment = 0;
    const kvw_header *cur = NULL; /* the decoder's header of the segment being read */
    if (!out) return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "kvw_reassemble: out is NULL");
    *out = NULL;
    if (!buf && len) return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "kvw_reassemble: NULL buffer");
    if (len == 0) /* no segment at all: a sequence has at least one */
        return kvw_fail_truncated(err, "KVW-STREAM-10", KVW_PREAMBLE_SIZE);
    ra = calloc(1, sizeof *ra);
    if (!ra) return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "reassembly: no memory");
    kvw_header_init(&ra->base);
    ra->chain = -1;
    memset(&dopt, 0, sizeof dopt);
    if (opt) dopt.base = *opt;
    ra->limit = dopt.base.max_decoded_bytes ? dopt.base.max_decoded_bytes : KVW_DEFAULT_MAX_DECODED;
    dopt.decode_bodies = 1;
    dopt.concatenated = 1;
    memset(&derr, 0, sizeof derr);
    c = kvw_decoder_new(&dopt, &d, err);
    if (c == KVW_OK && len) c = kvw_decoder_feed(d, buf, len, err);
    if (c == KVW_OK) c = kvw_decoder_finish(d, err);
    while (c == KVW_OK) {
        kvw_event ev;
        memset(&ev, 0, sizeof ev);
        c = kvw_next(d, &ev, err);
        if (c != KVW_OK) break;
        if (ev.type == KVW_EVENT_EOF) break;
        if (ev.type == KVW_EVENT_NEED_DATA) {
            c = kvw_fail_truncated(err, "KVW-LAYOUT-3", ev.needed);
            break;
        }
        if (ev.type == KVW_EVENT_HEADER) {
            const kvw_header *h = ev.header;
            in_segment = 1;
            cur = h;
            seg_start = h->first_position;
            if (h->has_sparse) {
                c = kvw_seg_mismatch(err, "KVW-STREAM-5",
                             "a sparse cache is not sent as segments: its token indices are per-head retained "
                             "tokens, not positions", seg_start);
                break;
            }
            deferred = kvw_seg_check(ra, h, &keep, &derr);
            if (deferred == KVW_OK && !ra->have_base) c = take_base(ra, d, h, err);
        } else if (ev.type == KVW_EVENT_CHUNK) {
            if (deferred == KVW_OK && in_segment)
                c = place_chunk(ra, seg_start, ev.record, ev.data, ev.data_len, err);
        } else if (ev.type == KVW_EVENT_END) {
            if (deferred != KVW_OK) {
                if (err) *err = derr;
                c = deferred;
                break;
            }
            if (in_segment && cur) c = accept_segment(ra, cur, keep, err);
            in_segment = 0;
        }
    }
    kvw_decoder_free(d);
    if (c == KVW_OK && !ra->have_base)
        c = kvw_fail_truncated(err, "KVW-STREAM-10", KVW_PREAMBLE_SIZE);
    if (c == KVW_OK) c = finish(ra, err);
    if (c != KVW_OK) {
        kvw_reassembly_free(ra);
        return c;
    }
    *out = ra;
    return KVW_OK;
}

const kvw_header *kvw_reassembly_header(const kvw_reassembly *ra) { return ra ? &ra->out : NULL; }
size_t kvw_reassembly_segments(const kvw_reassembly *ra) { return ra ? ra->segments : 0; }

kvw_code kvw_reassembly_tensor(const kvw_reassembly *ra, uint32_t layer, int component, uint32_t which,
                               kvw_tensor_info *info, const uint8_t **data, kvw_error *err) {
    const kvw_layer_spec *ls;
    if (!ra || !info || !data || layer >= ra->out.arch.num_layers)
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "kvw_reassembly_tensor: no layer %u", layer);
    ls = kvw_layer(&ra->out, layer);
    memset(info, 0, sizeof *info);
    if (component == KVW_COMP_STATE) {
        const kvw_state_tensor *st;
        uint32_t d;
        if (!ls || ls->kind != KVW_KIND_STATE || which >= ls->state_tensor_count || !ra->states[layer] ||
            !ra->states[layer][which].present)
            return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "layer %u holds no state tensor %u", layer, which);
        st = &ls->state_tensors[which];
        info->ndim = st->shape.count > 8 ? 8 : st->shape.count;
        for (d = 0; d < info->ndim; d++) info->shape[d] = kvw_u32_at(st->shape, d);
        info->nbytes = ra->states[layer][which].len;
        info->dtype = st->dtype;
        *data = ra->states[layer][which].data;
        return KVW_OK;
    }
    if (component < 0 || component > KVW_COMP_LATENT || !ra->tensors[3 * layer + component].present)
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "layer %u does not store component %d", layer,
                        component);
    {
        const seg_tensor *t = &ra->tensors[3 * layer + component];
        unsigned es = kvw_dtype_size(ra->out.dtype);
        info->ndim = 3;
        info->shape[0] = t->heads;
        info->shape[1] = ra->out.token_count;
        info->shape[2] = es ? t->row / es : 0;
        info->nbytes = (uint64_t)t->heads * ra->out.token_count * t->row;
        info->dtype = ra->out.dtype;
        *data = t->buf;
        return KVW_OK;
    }
}
