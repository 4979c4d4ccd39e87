/*
 * Header decoding (spec sections 5-7, 14.1 step 2) and the index FlatBuffer (KVW-FILE-5).
 * The Header FlatBuffer is verified and decoded through fb.c in exactly the decoding
 * order of 14.1 step 2 (so the first defect found is the one every reader reports),
 * defaults resolved (KVW-HDR-14); then the header rules of step 3 (rules.c) run.
 * Strings and byte vectors point into the FlatBuffer; the arrays built here live in
 * blocks owned by the header (kvw_header_free), each allocated only after the count that
 * sizes it passed its limit (KVW-LIM-1, KVW-LIM-8). This module keeps the decoding
 * driver, the header's memory and the Architecture subtree; the other Header fields are
 * read in header_fields.c (shared state and limits: header_impl.h).
 */
#include "format/header_impl.h"

#include <stdlib.h>

/* n elements of size bytes, zeroed, owned by the header; NULL for n == 0 (and on OOM:
 * callers check n && !p). n was checked against its limit before. */
void *kvw_hd_alloc(hdec *d, size_t n, size_t size) {
    if (n == 0) return NULL;
    hblock *b = calloc(1, sizeof(hblock) + n * size);
    if (!b) return NULL;
    b->next = (hblock *)d->h->owned_;
    d->h->owned_ = b;
    return b + 1;
}

kvw_code kvw_hd_oom(hdec *d) {
    return kvw_fail(d->err, KVW_ERR_NO_MEMORY, "", "out of memory decoding the header");
}

/* Visit every table of a vector of tables (in element order, before any is decoded). */
kvw_code kvw_hd_visit_all(hdec *d, const kvw_fbvec *v) {
    kvw_fbt t;
    for (uint32_t j = 0; j < v->count; j++) {
        kvw_code c = kvw_fb_visit(&d->fb, kvw_fb_elem_pos(&d->fb, v, j), &t, d->err);
        if (c) return c;
    }
    return KVW_OK;
}

void kvw_hd_elem_table(hdec *d, const kvw_fbvec *v, uint32_t j, kvw_fbt *t) {
    kvw_fb_reopen(&d->fb, kvw_fb_elem_pos(&d->fb, v, j), t);
}

kvw_vec kvw_hd_as_vec(const hdec *d, const kvw_fbvec *v) {
    kvw_vec out;
    out.ptr = v->present ? d->fb.data + v->start : NULL;
    out.count = v->count;
    return out;
}

/* ---- RopeParams (6.4) ---- */
static kvw_code read_rope(hdec *d, const kvw_fbt *t, const kvw_rope **out) {
    kvw_error *e = d->err;
    kvw_code c;
    for (uint32_t i = 0; i < d->nropes; i++)
        if (d->rope_pos[i] == t->pos) { /* decoded already: charged its visit only */
            *out = &d->ropes[i];
            return KVW_OK;
        }
    if (d->nropes >= d->rope_cap) /* cannot happen: one rope per spec and one for arch */
        return kvw_fail(e, KVW_ERR_STATE, "", "internal: RopeParams table count");
    kvw_rope *r = &d->ropes[d->nropes];
    kvw_rope_init(r);
    kvw_fbvec v;
    if ((c = kvw_fbt_enum(t, 0, KVW_ROPE_DEFAULT, KVW_ROPE_TYPE_COUNT, &r->rope_type,
                          "RopeParams.rope_type", e)) ||
        (c = kvw_fbt_f64(t, 1, 10000.0, &r->theta, e)) ||
        (c = kvw_fbt_u32(t, 2, 0, &r->rotary_dim, e)) ||
        (c = kvw_fbt_bool(t, 3, 0, &r->interleaved, "RopeParams.interleaved", e)) ||
        (c = kvw_fbt_f64(t, 4, 1.0, &r->factor, e)) ||
        (c = kvw_fbt_u32(t, 5, 0, &r->original_max_position_embeddings, e)) ||
        (c = kvw_fbt_f64(t, 6, 1.0, &r->low_freq_factor, e)) ||
        (c = kvw_fbt_f64(t, 7, 4.0, &r->high_freq_factor, e)) ||
        (c = kvw_fbt_f64(t, 8, 32.0, &r->beta_fast, e)) ||
        (c = kvw_fbt_f64(t, 9, 1.0, &r->beta_slow, e)) ||
        (c = kvw_fbt_f64(t, 10, 1.0, &r->attention_factor, e)) ||
        (c = kvw_fbt_f64(t, 11, 1.0, &r->mscale, e)) ||
        (c = kvw_fbt_f64(t, 12, 0.0, &r->mscale_all_dim, e)) ||
        (c = kvw_fbt_u64(t, 16, 0, &r->seq_len_at_encode, e)) ||
        (c = kvw_fbt_bool(t, 17, 1, &r->truncate, "RopeParams.truncate", e)))
        return c;
    if ((c = kvw_fbt_vector(t, 13, 8, 8, MAX_ROPE_FACTORS, 0, "RopeParams.short_factor", &v, e)))
        return c;
    r->short_factor = kvw_hd_as_vec(d, &v);
    if ((c = kvw_fbt_vector(t, 14, 8, 8, MAX_ROPE_FACTORS, 0, "RopeParams.long_factor", &v, e)))
        return c;
    r->long_factor = kvw_hd_as_vec(d, &v);
    if ((c = kvw_fbt_vector(t, 15, 4, 4, MAX_ROPE_FACTORS, 0, "RopeParams.mrope_section", &v, e)))
        return c;
    r->mrope_section = kvw_hd_as_vec(d, &v);
    d->rope_pos[d->nropes++] = t->pos;
    *out = r;
    return KVW_OK;
}

/* A RopeParams field: NULL when absent. */
static kvw_code rope_field(hdec *d, const kvw_fbt *t, unsigned fid, const char *what,
                           const kvw_rope **out) {
    kvw_fbt rt;
    int present;
    kvw_code c = kvw_fbt_table(t, fid, 0, what, &rt, &present, d->err);
    *out = NULL;
    if (c || !present) return c;
    return read_rope(d, &rt, out);
}

/* ---- StateTensor (crossmodel.md section 6) ---- */
static kvw_code read_state_tensors(hdec *d, const kvw_fbt *st, kvw_layer_spec *s) {
    kvw_error *e = d->err;
    kvw_fbvec v, shape;
    kvw_code c = kvw_fbt_vector(st, 10, 4, 4, MAX_STATE_TENSORS_VECTOR, 0,
                                "LayerSpec.state_tensors", &v, e);
    if (c || !v.count) return c;
    if ((c = kvw_hd_visit_all(d, &v))) return c;
    kvw_state_tensor *ts = kvw_hd_alloc(d, v.count, sizeof *ts);
    if (!ts) return kvw_hd_oom(d);
    for (uint32_t j = 0; j < v.count; j++) {
        kvw_fbt t;
        kvw_hd_elem_table(d, &v, j, &t);
        if ((c = kvw_fbt_vector(&t, 1, 4, 4, MAX_STATE_SHAPE, 0, "StateTensor.shape", &shape, e)))
            return c;
        ts[j].shape = kvw_hd_as_vec(d, &shape);
        if ((c = kvw_fbt_enum(&t, 2, KVW_DTYPE_F32, KVW_DTYPE_COUNT, &ts[j].dtype,
                              "StateTensor.dtype", e)) ||
            (c = kvw_fbt_string(&t, 0, MAX_STRING_LENGTH, 1, "StateTensor.name", &ts[j].name, e)))
            return c;
    }
    s->state_tensors = ts;
    s->state_tensor_count = v.count;
    return KVW_OK;
}

/* ---- LayerSpec (6.2) ---- */
static kvw_code read_layer_spec(hdec *d, const kvw_fbt *t, kvw_layer_spec *s) {
    kvw_error *e = d->err;
    kvw_code c;
    kvw_layer_spec_init(s);
    if ((c = kvw_fbt_enum(t, 0, KVW_KIND_FULL_ATTENTION, KVW_LAYER_KIND_COUNT, &s->kind,
                          "LayerSpec.kind", e)) ||
        (c = kvw_fbt_u32(t, 1, 0, &s->num_kv_heads, e)) ||
        (c = kvw_fbt_u32(t, 2, 0, &s->head_dim_k, e)) ||
        (c = kvw_fbt_u32(t, 3, 0, &s->head_dim_v, e)) ||
        (c = kvw_fbt_u32(t, 4, 0, &s->window, e)) ||
        (c = kvw_fbt_i32(t, 5, -1, &s->source_layer, e)) ||
        (c = kvw_fbt_bool(t, 6, 1, &s->uses_rope, "LayerSpec.uses_rope", e)) ||
        (c = kvw_fbt_u32(t, 8, 0, &s->kv_lora_rank, e)) ||
        (c = kvw_fbt_u32(t, 9, 0, &s->qk_rope_head_dim, e)) ||
        (c = rope_field(d, t, 7, "LayerSpec.rope", &s->rope)))
        return c;
    return read_state_tensors(d, t, s);
}

/* ---- Architecture (6.1) ---- */
static kvw_code read_arch(hdec *d, const kvw_fbt *at) {
    kvw_error *e = d->err;
    kvw_arch *a = &d->h->arch;
    kvw_fbvec specs, index;
    kvw_code c;
    if ((c = kvw_fbt_u32(at, 1, 0, &a->num_layers, e))) return c;
    if (a->num_layers == 0)
        return kvw_fail(e, KVW_ARCH_INVALID, "KVW-ARCH-1", "num_layers is 0");
    if (a->num_layers > KVW_MAX_LAYERS)
        return kvw_fail(e, KVW_LIMIT_EXCEEDED, "KVW-ARCH-1", "num_layers %u exceeds %d",
                        a->num_layers, KVW_MAX_LAYERS);
    if ((c = kvw_fbt_vector(at, 2, 4, 4, KVW_MAX_LAYERS, 0, "Architecture.layer_specs", &specs, e)))
        return c;
    if ((c = kvw_hd_visit_all(d, &specs))) return c;
    /* one RopeParams per spec and one for the architecture at most */
    d->rope_cap = specs.count + 1;
    d->ropes = kvw_hd_alloc(d, d->rope_cap, sizeof *d->ropes);
    d->rope_pos = kvw_hd_alloc(d, d->rope_cap, sizeof *d->rope_pos);
    if (!d->ropes || !d->rope_pos) return kvw_hd_oom(d);
    kvw_layer_spec *ls = kvw_hd_alloc(d, specs.count, sizeof *ls);
    if (specs.count && !ls) return kvw_hd_oom(d);
    for (uint32_t j = 0; j < specs.count; j++) {
        kvw_fbt st;
        kvw_hd_elem_table(d, &specs, j, &st);
        if ((c = read_layer_spec(d, &st, &ls[j]))) return c;
    }
    a->layer_specs = ls;
    a->layer_spec_count = specs.count;
    if ((c = kvw_fbt_vector(at, 3, 2, 2, KVW_MAX_LAYERS, 0, "Architecture.layer_spec_index",
                            &index, e)))
        return c;
    if (index.count != a->num_layers)
        return kvw_fail(e, KVW_ARCH_INVALID, "KVW-ARCH-1",
                        "layer_spec_index has %u entries for %u layers", index.count,
                        a->num_layers);
    uint16_t *ix = kvw_hd_alloc(d, index.count, sizeof *ix);
    if (!ix) return kvw_hd_oom(d);
    for (uint32_t i = 0; i < index.count; i++) {
        ix[i] = kvw_ld16(d->fb.data + index.start + 2u * i);
        if (ix[i] >= specs.count)
            return kvw_fail(e, KVW_ARCH_INVALID, "KVW-ARCH-1",
                            "layer_spec_index[%u] = %u but there are %u layer specs", i, ix[i],
                            specs.count);
    }
    a->layer_spec_index = ix;
    a->layer_spec_index_count = index.count;
    if ((c = rope_field(d, at, 4, "Architecture.rope", &a->rope)) ||
        (c = kvw_fbt_bool(at, 5, 1, &a->keys_post_rope, "Architecture.keys_post_rope", e)) ||
        (c = kvw_fbt_u16(at, 0, 1, &a->schema_version, e)))
        return c;
    return KVW_OK;
}

/* 14.1 step 2, in its order. */
static kvw_code decode_header(hdec *d, const uint8_t *fb, size_t len) {
    kvw_error *e = d->err;
    kvw_header *h = d->h;
    kvw_fbt root, at;
    int present;
    kvw_code c;
    if ((c = kvw_fb_begin(&d->fb, fb, len, "KVWH", "KVW-HDR-1", e)) ||
        (c = kvw_fb_root(&d->fb, &root, e)) ||
        (c = kvw_fbt_table(&root, 6, 1, "Header.arch", &at, &present, e)) ||
        (c = read_arch(d, &at)) ||
        (c = kvw_hd_producer_model(d, &root)) ||
        (c = kvw_hd_layer_map(d, &root)) ||
        (c = kvw_fbt_u32(&root, 12, 0, &h->token_count, e)) ||
        (c = kvw_hd_layer_tokens(d, &root)) ||
        (c = kvw_hd_metadata(d, &root)) ||
        (c = kvw_fbt_enum(&root, 8, KVW_DTYPE_BF16, KVW_DTYPE_COUNT, &h->dtype, "Header.dtype", e)) ||
        (c = kvw_fbt_u64(&root, 11, 0, &h->first_position, e)) ||
        (c = kvw_fbt_u32(&root, 10, 256, &h->chunk_tokens, e)) ||
        (c = kvw_fbt_u32(&root, 9, 64, &h->alignment, e)) ||
        (c = kvw_fbt_enum(&root, 14, KVW_CHECKSUM_XXH3_64, CHECKSUM_COUNT, &h->checksum_algorithm,
                          "Header.checksum_algorithm", e)) ||
        (c = kvw_fbt_u64(&root, 2, 0, &h->required_features, e)) ||
        (c = kvw_fbt_u64(&root, 3, 0, &h->optional_features, e)) ||
        (c = kvw_fbt_u16(&root, 0, 0, &h->format_major, e)) ||
        (c = kvw_fbt_u16(&root, 1, 0, &h->format_minor, e)) ||
        (c = kvw_hd_engine_layout(d, &root)) ||
        (c = kvw_hd_sparse(d, &root)) ||
        (c = kvw_hd_codec_specs(d, &root)) ||
        (c = kvw_hd_prefix(d, &root)) ||
        (c = kvw_hd_kv_scales(d, &root)) ||
        (c = kvw_hd_resolve_layer_tokens(d)))
        return c;
    return KVW_OK;
}

kvw_code kvw_header_parse(const uint8_t *fb, size_t len, kvw_header *out, kvw_error *err) {
    if (!out)
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "kvw_header_parse: out is NULL");
    kvw_header_init(out);
    if (!fb && len)
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "kvw_header_parse: fb is NULL");
    kvw_error_clear(err);
    hdec d;
    memset(&d, 0, sizeof d);
    d.h = out;
    d.err = err;
    kvw_code c = decode_header(&d, fb, len);
    if (!c) c = kvw_header_rules(out, err);
    if (c) kvw_header_free(out);
    return c;
}

void kvw_header_free(kvw_header *h) {
    if (!h) return;
    hblock *b = (hblock *)h->owned_;
    while (b) {
        hblock *next = b->next;
        free(b);
        b = next;
    }
    kvw_header_init(h);
}

/* ---- index FlatBuffer (KVW-FILE-5) ---- */
kvw_code kvw_index_parse(const uint8_t *fb, size_t len, const uint8_t **records,
                         uint32_t *count, kvw_error *err) {
    kvw_fb f;
    kvw_fbt root;
    kvw_fbvec v;
    kvw_code c;
    if (!records || !count || (!fb && len))
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "kvw_index_parse: NULL argument");
    *records = NULL;
    *count = 0;
    if ((c = kvw_fb_begin(&f, fb, len, "KVWI", "KVW-FILE-5", err)) ||
        (c = kvw_fb_root(&f, &root, err)) ||
        (c = kvw_fbt_vector(&root, 0, KVW_RECORD_SIZE, 8, KVW_MAX_CHUNKS, 1, "ChunkIndex.records",
                            &v, err)))
        return c;
    *records = fb + v.start;
    *count = v.count;
    return KVW_OK;
}
