/*
 * What the writer refuses (spec section 15, KVW-WRITE-1): the header rules that readers
 * tolerate but writers must not emit, and the check of each chunk against the header and
 * its chunk grid before anything of it is emitted (misuse is KVW_ERR_INVALID_ARGUMENT and
 * leaves the writer usable), with the readers' own record checks as a safety net and the
 * name of the first missing chunk for kvw_writer_finish. Split from writer.c so that the
 * emitting code stays short; the writer's state is in writer_impl.h.
 */
#include "encode/writer_impl.h"

#include <stdio.h>

/* ---- writer-only header rules (what readers tolerate but writers must not emit) -------- */

static int axes_ok(kvw_bytes a, uint32_t *ndims) {
    /* axes = dim *("," dim); dim = axis *("*" axis); axis = UPPER *(UPPER / DIGIT) */
    uint32_t n = 1, i = 0;
    if (!a.len) { *ndims = 0; return 1; }
    for (;;) {
        for (;;) { /* one axis */
            if (i >= a.len || a.ptr[i] < 'A' || a.ptr[i] > 'Z') return 0;
            i++;
            while (i < a.len && ((a.ptr[i] >= 'A' && a.ptr[i] <= 'Z') || (a.ptr[i] >= '0' && a.ptr[i] <= '9'))) i++;
            if (i < a.len && a.ptr[i] == '*') { i++; continue; }
            break;
        }
        if (i == a.len) break;
        if (a.ptr[i] != ',') return 0;
        i++;
        n++;
    }
    *ndims = n;
    return 1;
}

kvw_code kvw_writer_only_rules(const kvw_header *h, kvw_error *err) {
    if (h->optional_features)
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "KVW-REG-1",
                        "optional_features 0x%llx: no optional feature bit is assigned, write 0",
                        (unsigned long long)h->optional_features);
    if (h->arch.schema_version != 1)
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "KVW-ARCH-9",
                        "Architecture.schema_version %u: format v1 writes 1", h->arch.schema_version);
    for (uint32_t i = 0; h->metadata && i < h->metadata_count; i++) {
        kvw_bytes k = h->metadata[i].key;
        if (k.len >= 7 && memcmp(k.ptr, "kvwire.", 7) == 0)
            return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "KVW-META-3",
                            "metadata key '%.*s': the namespace 'kvwire' is reserved (it defines no keys)",
                            (int)(k.len > 80 ? 80 : k.len), (const char *)k.ptr);
        if (h->metadata[i].value.len > (UINT32_C(1) << 20))
            return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "KVW-META-1",
                            "METADATA_VALUE_INVALID: value of '%.*s' has %u bytes, at most 1048576",
                            (int)(k.len > 80 ? 80 : k.len), (const char *)k.ptr, h->metadata[i].value.len);
    }
    if (h->has_engine_layout) {
        const kvw_engine_layout *e = &h->engine_layout;
        uint32_t nd = 0;
        if (!axes_ok(e->axes, &nd))
            return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "KVW-HDR-19",
                            "engine_layout.axes '%.*s' is not empty and not 'DIM,DIM,...' with DIM = AXIS*AXIS...,"
                            " AXIS = upper-case letter then letters/digits", (int)(e->axes.len > 60 ? 60 : e->axes.len),
                            (const char *)e->axes.ptr);
        if (e->stride_order.len) {
            uint64_t seen = 0;
            int ok = nd > 0 && e->stride_order.len == nd && nd <= 64;
            for (uint32_t i = 0; ok && i < e->stride_order.len; i++) {
                uint8_t d = e->stride_order.ptr[i];
                if (d >= nd || (seen >> d) & 1) ok = 0;
                else seen |= UINT64_C(1) << d;
            }
            if (!ok)
                return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "KVW-HDR-19",
                                "engine_layout.stride_order (%u entries) must be empty or a permutation of "
                                "0..%u (the %u dimensions of axes)", e->stride_order.len, nd ? nd - 1 : 0, nd);
        }
    }
    return KVW_OK;
}

/* ---- chunks ----------------------------------------------------------------------------- */

/* Components a layer stores (ARCH-3; SPARSE-6 adds POSITIONS; crossmodel.md: STATE). */
static int layer_stores(const kvw_header *h, const kvw_layer_spec *s, int comp) {
    switch (s->kind) {
    case KVW_KIND_FULL_ATTENTION: case KVW_KIND_SLIDING_ATTENTION: case KVW_KIND_CHUNKED_ATTENTION:
        return comp == KVW_COMP_K || comp == KVW_COMP_V || (h->has_sparse && comp == KVW_COMP_POSITIONS);
    case KVW_KIND_MLA_LATENT:
        return comp == KVW_COMP_LATENT || (h->has_sparse && comp == KVW_COMP_POSITIONS);
    case KVW_KIND_STATE: return comp == KVW_COMP_STATE;
    default: return 0;
    }
}

static void comp_names(const kvw_header *h, const kvw_layer_spec *s, char *buf, size_t n) {
    size_t used = 0;
    buf[0] = 0;
    for (int c = 0; c < KVW_COMPONENT_COUNT; c++)
        if (layer_stores(h, s, c) && used < n)
            used += (size_t)snprintf(buf + used, n - used, "%s%s (%d)", used ? ", " : "", kvw_component_name(c), c);
    if (!used) snprintf(buf, n, "nothing (no chunk may name it)");
}

/* Heads with their own retained counts in a sparse layer (sparse.md): kv heads, 1 for MLA. */
static uint32_t sparse_heads(const kvw_layer_spec *s) {
    if (s->kind == KVW_KIND_SHARED) return 0;
    return s->kind == KVW_KIND_MLA_LATENT ? 1 : s->num_kv_heads;
}
static uint32_t retained(const kvw_header *h, uint32_t layer, uint32_t head) {
    uint64_t e = 0;
    for (uint32_t i = 0; i < layer; i++) e += sparse_heads(kvw_layer(h, i));
    e += head;
    return e < h->sparse.retained_counts.count ? kvw_u32_at(h->sparse.retained_counts, (uint32_t)e) : 0;
}
static kvw_token_range layer_range(const kvw_header *h, uint32_t layer) {
    if (h->layer_tokens && layer < h->layer_tokens_count) return h->layer_tokens[layer];
    const kvw_layer_spec *s = kvw_layer(h, layer);
    return (kvw_token_range){0, (s && s->kind == KVW_KIND_SHARED) ? 0 : h->token_count};
}

static kvw_code misuse(kvw_error *err, const char *rule, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
static kvw_code misuse(kvw_error *err, const char *rule, const char *fmt, ...) {
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, rule, "%s", "");
        vsnprintf(err->message, sizeof err->message, fmt, ap);
        va_end(ap);
    }
    return KVW_ERR_INVALID_ARGUMENT;
}

/* Check one chunk against the header and fill its record (all but offset, stored length,
 * checksum and codec) and slot. */
kvw_code kvw_writer_chunk_check(kvw_writer *w, uint32_t layer, int comp, int head, uint32_t t0,
                                uint32_t n, int codec, uint16_t cs, uint64_t raw, kvw_record *rec,
                                uint64_t *slot, const kvw_codec_spec **spec, kvw_error *err) {
    const kvw_header *h = &w->h;
    if (layer >= h->arch.num_layers)
        return misuse(err, "KVW-CHUNK-1", "layer %u: the header has %u layers (0..%u)", layer,
                      h->arch.num_layers, h->arch.num_layers ? h->arch.num_layers - 1 : 0);
    const kvw_layer_spec *s = kvw_layer(h, layer);
    char names[96];
    if (comp < 0 || comp >= KVW_COMPONENT_COUNT || !layer_stores(h, s, comp)) {
        comp_names(h, s, names, sizeof names);
        return misuse(err, "KVW-CHUNK-1", "component %d: layer %u (%s) stores %s", comp, layer,
                      kvw_layer_kind_name(s->kind), names);
    }
    if (codec < KVW_CODEC_RAW || codec >= KVW_CODEC_COUNT)
        return misuse(err, "KVW-CHUNK-5", "codec %d: the writer encodes raw (0), zstd (1), byteplane_zstd (2), "
                      "fp8 (3) or int_affine (4)", codec);
    *spec = NULL;
    if (cs == 0) {
        if (codec >= KVW_CODEC_BYTEPLANE_ZSTD)
            return misuse(err, "KVW-CSPEC-9", "%s needs codec_spec i >= 1 naming a %s entry of "
                          "Header.codec_specs (the header has %u)", kvw_codec_name(codec),
                          kvw_codec_name(codec), h->codec_spec_count);
    } else {
        if (cs > h->codec_spec_count)
            return misuse(err, "KVW-CSPEC-9", "codec_spec %u: the header has %u codec specs (1..%u, 0 for none)",
                          cs, h->codec_spec_count, h->codec_spec_count);
        *spec = &h->codec_specs[cs - 1];
        if ((*spec)->codec != codec)
            return misuse(err, "KVW-CSPEC-9", "codec_spec %u is a %s spec, the chunk's codec is %s", cs,
                          kvw_codec_name((*spec)->codec), kvw_codec_name(codec));
        if (codec >= KVW_CODEC_FP8 && comp != KVW_COMP_K && comp != KVW_COMP_V && comp != KVW_COMP_LATENT)
            return misuse(err, "KVW-CSPEC-9", "codec_spec %u is lossy (%s): only k, v and latent chunks take it",
                          cs, kvw_codec_name(codec));
    }
    if ((comp == KVW_COMP_STATE || comp == KVW_COMP_POSITIONS) && (codec > KVW_CODEC_ZSTD || cs))
        return misuse(err, comp == KVW_COMP_STATE ? "KVW-STATE-8" : "KVW-SPARSE-9",
                      "%s chunks use codec raw or zstd with codec_spec 0", kvw_component_name(comp));

    memset(rec, 0, sizeof *rec);
    rec->layer = (uint16_t)layer;
    rec->component = (uint8_t)comp;
    rec->token_start = t0;
    rec->token_count = n;
    rec->raw_length = raw;
    uint64_t C = h->chunk_tokens, t1 = (uint64_t)t0 + n, want;
    unsigned isz = kvw_dtype_size(h->dtype);
    uint32_t dim = comp == KVW_COMP_V ? s->head_dim_v : s->head_dim_k;
    if (comp == KVW_COMP_STATE) {
        kvw_token_range r = layer_range(h, layer);
        if (n == 0 || t0 != r.start || n != r.count)
            return misuse(err, "KVW-STATE-7", "a state chunk covers the layer's tokens: token_start %u, "
                          "token_count %u (got %u, %u)", r.start, r.count, t0, n);
        rec->head_count = 1;
        if (head < 0) { /* the first tensor not yet written */
            for (head = 0; (uint32_t)head < s->state_tensor_count; head++) {
                rec->head_start = (uint16_t)head;
                if (!w->filled[kvw_grid_slot(&w->grid, rec)]) break;
            }
        }
        if ((uint32_t)head >= s->state_tensor_count)
            return misuse(err, "KVW-STATE-7", "state tensor %d: layer %u has %u (0..%u)%s", head, layer,
                          s->state_tensor_count, s->state_tensor_count ? s->state_tensor_count - 1 : 0,
                          head == (int)s->state_tensor_count ? ", all written" : "");
        const kvw_state_tensor *st = &s->state_tensors[head];
        want = kvw_dtype_size(st->dtype);
        for (uint32_t i = 0; i < st->shape.count; i++)
            if (kvw_mul_ovf(want, kvw_u32_at(st->shape, i), &want))
                return misuse(err, "KVW-STATE-7", "state tensor size overflows");
        rec->head_start = (uint16_t)head;
        if (raw != want)
            return misuse(err, "KVW-STATE-7", "parts hold %llu bytes; state tensor %d '%.*s' of layer %u has %llu",
                          (unsigned long long)raw, head, (int)(st->name.len > 40 ? 40 : st->name.len),
                          (const char *)st->name.ptr, layer, (unsigned long long)want);
    } else if (h->has_sparse) {
        uint32_t nh = sparse_heads(s);
        if (head < 0 || (uint32_t)head >= nh)
            return misuse(err, "KVW-SPARSE-7", "head %d: a sparse chunk holds one kv head of layer %u, 0..%u "
                          "(kvw_writer_add_head)", head, layer, nh ? nh - 1 : 0);
        uint32_t cnt = retained(h, layer, (uint32_t)head);
        if (n == 0 || t0 % C || t1 > cnt || (t1 != cnt && t1 % C) || t1 > t0 + C)
            return misuse(err, "KVW-SPARSE-7", "tokens [%u, %llu) of layer %u head %d: cells are [k*%llu, "
                          "min(%u, (k+1)*%llu)) of its %u retained tokens", t0, (unsigned long long)t1, layer,
                          head, (unsigned long long)C, cnt, (unsigned long long)C, cnt);
        rec->head_start = (uint16_t)head;
        rec->head_count = 1;
        if (comp == KVW_COMP_POSITIONS) {
            if (raw < n || raw > (uint64_t)9 * n)
                return misuse(err, "KVW-SPARSE-8", "positions chunk of %u tokens: its varints take %u to %llu "
                              "bytes, the parts hold %llu", n, n, (unsigned long long)9 * n, (unsigned long long)raw);
        } else if ((want = (uint64_t)n * dim * isz) != raw) {
            return misuse(err, "KVW-SPARSE-8", "parts hold %llu bytes; layer %u %s head %d tokens [%u, %llu) is "
                          "[%u, %u] x %u = %llu bytes", (unsigned long long)raw, layer, kvw_component_name(comp),
                          head, t0, (unsigned long long)t1, n, dim, isz, (unsigned long long)want);
        }
    } else {
        if (head > 0)
            return misuse(err, "KVW-CHUNK-3", "head %d: a dense chunk covers every head (head 0 or -1)", head);
        kvw_token_range r = layer_range(h, layer);
        uint64_t lo = r.start, hi = (uint64_t)r.start + r.count;
        if (n == 0 || t0 < lo || t1 > hi || (t0 != lo && t0 % C) || (t1 != hi && t1 % C) ||
            t0 / C != (t1 - 1) / C) {
            return misuse(err, "KVW-CHUNK-2", "tokens [%u, %llu) of layer %u: not one cell of its grid (range "
                          "[%llu, %llu), chunk_tokens %llu)%s", t0, (unsigned long long)t1, layer,
                          (unsigned long long)lo, (unsigned long long)hi, (unsigned long long)C,
                          hi > lo ? "; cells start at the range start and at multiples of chunk_tokens" : ": the layer has no tokens");
        }
        uint32_t heads = comp == KVW_COMP_LATENT ? 1 : s->num_kv_heads;
        rec->head_count = (uint16_t)heads;
        if (kvw_mul_ovf((uint64_t)heads * n, (uint64_t)dim * isz, &want) || want != raw)
            return misuse(err, "KVW-CHUNK-4", "parts hold %llu bytes; layer %u %s tokens [%u, %llu) is [%u, %u, %u]"
                          " x %u = %llu bytes", (unsigned long long)raw, layer, kvw_component_name(comp), t0,
                          (unsigned long long)t1, heads, n, dim, isz, (unsigned long long)want);
    }
    if (raw == 0)
        return misuse(err, "KVW-CHUNK-4", "an empty chunk cannot be stored (stored_length >= 1)");
    *slot = kvw_grid_slot(&w->grid, rec);
    if (*slot >= w->grid.total || w->filled[*slot])
        return misuse(err, "KVW-CHUNK-8", "chunk (layer %u, %s, head %u, tokens [%u, %llu)) was already written",
                      layer, kvw_component_name(comp), rec->head_start, t0, (unsigned long long)t1);
    return KVW_OK;
}

/* The readers' record checks (grid.c), run on the finished record as a safety net. */
kvw_code kvw_writer_grid_recheck(kvw_writer *w, const kvw_record *rec, kvw_error *err) {
    kvw_error e;
    kvw_error_clear(&e);
    for (int r = 0; r < KVW_RR_COUNT; r++) {
        kvw_code c = kvw_record_check_rule(&w->h, &w->grid, rec, (kvw_record_rule)r, &e);
        if (c)
            return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, e.rule, "readers would reject this chunk: %s (%s): %s",
                            kvw_code_name(c), e.rule, e.message);
    }
    return KVW_OK;
}

/* Name the first chunk not yet written, in canonical order. */
void kvw_writer_describe_slot(kvw_writer *w, uint64_t s, char *buf, size_t n) {
    const kvw_header *h = &w->h;
    uint64_t C = h->chunk_tokens;
    snprintf(buf, n, "slot %llu", (unsigned long long)s);
    for (uint32_t l = 0; l < h->arch.num_layers; l++) {
        const kvw_layer_spec *sp = kvw_layer(h, l);
        for (int c = 0; c < KVW_COMPONENT_COUNT; c++) {
            if (!layer_stores(h, sp, c)) continue;
            kvw_record r;
            memset(&r, 0, sizeof r);
            r.layer = (uint16_t)l;
            r.component = (uint8_t)c;
            r.head_count = 1;
            kvw_token_range lr = layer_range(h, l);
            if (c == KVW_COMP_STATE) {
                if (!lr.count) continue;
                r.token_start = lr.start;
                r.token_count = lr.count;
                for (uint32_t t = 0; t < sp->state_tensor_count; t++) {
                    r.head_start = (uint16_t)t;
                    if (kvw_grid_slot(&w->grid, &r) == s) {
                        snprintf(buf, n, "layer %u state tensor %u", l, t);
                        return;
                    }
                }
                continue;
            }
            uint32_t nh = h->has_sparse ? sparse_heads(sp) : 1;
            for (uint32_t hd = 0; hd < nh; hd++) {
                uint64_t lo = h->has_sparse ? 0 : lr.start;
                uint64_t hi = h->has_sparse ? retained(h, l, hd) : (uint64_t)lr.start + lr.count;
                r.head_start = (uint16_t)(h->has_sparse ? hd : 0);
                r.head_count = (uint16_t)(h->has_sparse || c == KVW_COMP_LATENT ? 1 : sp->num_kv_heads);
                for (uint64_t t = lo; t < hi;) {
                    uint64_t e = (t / C + 1) * C;
                    if (e > hi) e = hi;
                    r.token_start = (uint32_t)t;
                    r.token_count = (uint32_t)(e - t);
                    if (kvw_grid_slot(&w->grid, &r) == s) {
                        if (h->has_sparse)
                            snprintf(buf, n, "layer %u %s head %u tokens [%llu, %llu)", l, kvw_component_name(c),
                                     hd, (unsigned long long)t, (unsigned long long)e);
                        else
                            snprintf(buf, n, "layer %u %s tokens [%llu, %llu)", l, kvw_component_name(c),
                                     (unsigned long long)t, (unsigned long long)e);
                        return;
                    }
                    t = e;
                }
            }
        }
    }
}
