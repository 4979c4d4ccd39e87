/*
 * The header FlatBuffer (root Header, identifier "KVWH", spec section 5): kvw_header_encode
 * and the header's sub-tables, on the builder of fbbuild.c (fbbuild_impl.h). Split from
 * fbbuild.c so that the builder's primitives and the header schema are separate modules.
 *
 * Encoding choices: fields at their schema default are omitted (KVW-HDR-14), empty strings
 * and vectors are omitted except where the schema requires them, metadata is sorted by key
 * (KVW-META-4), layer map entries by receiver layer with zero padding (KVW-MAP-3), and
 * layer_tokens is omitted when every range is the default one (KVW-HDR-15). No rule of
 * sections 5-7 is checked here: the writer parses the result back for that.
 */
#include "encode/fbbuild_impl.h"

#include <stdlib.h>

/* n objects of at least 4 bytes each cannot fit: refuse before allocating for them. */
static int too_many(fbb *b, uint64_t n) {
    if (n <= b->limit / 4) return 0;
    b->failed = 2;
    return 1;
}

/* ---- header sub-tables ----------------------------------------------------------------- */

static uint32_t build_rope(fbb *b, const kvw_rope *r) {
    uint32_t sf = kvw_fbb_scalar_vec_opt(b, r->short_factor, 8);
    uint32_t lf = kvw_fbb_scalar_vec_opt(b, r->long_factor, 8);
    uint32_t ms = kvw_fbb_scalar_vec_opt(b, r->mrope_section, 4);
    fb_table t = {.n = 0};
    kvw_fbb_t_scalar(&t, 0, 1, r->rope_type, KVW_ROPE_DEFAULT);
    kvw_fbb_t_f64(&t, 1, r->theta, 10000.0);
    kvw_fbb_t_scalar(&t, 2, 4, r->rotary_dim, 0);
    kvw_fbb_t_scalar(&t, 3, 1, r->interleaved, 0);
    kvw_fbb_t_f64(&t, 4, r->factor, 1.0);
    kvw_fbb_t_scalar(&t, 5, 4, r->original_max_position_embeddings, 0);
    kvw_fbb_t_f64(&t, 6, r->low_freq_factor, 1.0);
    kvw_fbb_t_f64(&t, 7, r->high_freq_factor, 4.0);
    kvw_fbb_t_f64(&t, 8, r->beta_fast, 32.0);
    kvw_fbb_t_f64(&t, 9, r->beta_slow, 1.0);
    kvw_fbb_t_f64(&t, 10, r->attention_factor, 1.0);
    kvw_fbb_t_f64(&t, 11, r->mscale, 1.0);
    kvw_fbb_t_f64(&t, 12, r->mscale_all_dim, 0.0);
    kvw_fbb_t_ref(&t, 13, sf);
    kvw_fbb_t_ref(&t, 14, lf);
    kvw_fbb_t_ref(&t, 15, ms);
    kvw_fbb_t_scalar(&t, 16, 8, r->seq_len_at_encode, 0);
    kvw_fbb_t_scalar(&t, 17, 1, r->truncate, 1);
    return kvw_fbb_table_end(b, &t);
}

static uint32_t build_state_tensors(fbb *b, const kvw_state_tensor *st, uint32_t n) {
    if (!n || too_many(b, n)) return 0;
    uint32_t *offs = malloc(sizeof *offs * n);
    if (!offs) { b->failed = 1; return 0; }
    for (uint32_t i = 0; i < n; i++) {
        uint32_t name = kvw_fbb_bytes_vec(b, st[i].name.ptr, st[i].name.len, 1); /* required */
        uint32_t shape = kvw_fbb_scalar_vec_opt(b, st[i].shape, 4);
        fb_table t = {.n = 0};
        kvw_fbb_t_ref(&t, 0, name);
        kvw_fbb_t_ref(&t, 1, shape);
        kvw_fbb_t_scalar(&t, 2, 1, st[i].dtype, KVW_DTYPE_F32);
        offs[i] = kvw_fbb_table_end(b, &t);
    }
    uint32_t v = kvw_fbb_table_vec(b, offs, n);
    free(offs);
    return v;
}

static uint32_t build_layer_spec(fbb *b, const kvw_layer_spec *s) {
    uint32_t rope = s->rope ? build_rope(b, s->rope) : 0;
    uint32_t st = build_state_tensors(b, s->state_tensors, s->state_tensor_count);
    fb_table t = {.n = 0};
    kvw_fbb_t_scalar(&t, 0, 1, s->kind, KVW_KIND_FULL_ATTENTION);
    kvw_fbb_t_scalar(&t, 1, 4, s->num_kv_heads, 0);
    kvw_fbb_t_scalar(&t, 2, 4, s->head_dim_k, 0);
    kvw_fbb_t_scalar(&t, 3, 4, s->head_dim_v, 0);
    kvw_fbb_t_scalar(&t, 4, 4, s->window, 0);
    kvw_fbb_t_scalar(&t, 5, 4, (uint32_t)s->source_layer, UINT32_MAX);
    kvw_fbb_t_scalar(&t, 6, 1, s->uses_rope, 1);
    kvw_fbb_t_ref(&t, 7, rope);
    kvw_fbb_t_scalar(&t, 8, 4, s->kv_lora_rank, 0);
    kvw_fbb_t_scalar(&t, 9, 4, s->qk_rope_head_dim, 0);
    kvw_fbb_t_ref(&t, 10, st);
    return kvw_fbb_table_end(b, &t);
}

static uint32_t build_arch(fbb *b, const kvw_arch *a) {
    uint32_t n = a->layer_spec_count;
    if (too_many(b, n)) return 0;
    uint32_t *offs = malloc(sizeof *offs * (n ? n : 1));
    if (!offs) { b->failed = 1; return 0; }
    for (uint32_t i = 0; i < n; i++) offs[i] = build_layer_spec(b, &a->layer_specs[i]);
    uint32_t specs = kvw_fbb_table_vec(b, offs, n);
    free(offs);
    uint32_t m = a->layer_spec_index ? a->layer_spec_index_count : 0;
    uint8_t *d = kvw_fbb_vec_begin(b, 2, 2, m);
    for (uint32_t i = 0; d && i < m; i++) kvw_st16(d + 2 * i, a->layer_spec_index[i]);
    uint32_t index = kvw_fbb_vec_end(b, m);
    uint32_t rope = a->rope ? build_rope(b, a->rope) : 0;
    fb_table t = {.n = 0};
    kvw_fbb_t_scalar(&t, 0, 2, a->schema_version, 1);
    kvw_fbb_t_force(&t, 1, 4, a->num_layers);
    kvw_fbb_t_ref(&t, 2, specs);
    kvw_fbb_t_ref(&t, 3, index);
    kvw_fbb_t_ref(&t, 4, rope);
    kvw_fbb_t_scalar(&t, 5, 1, a->keys_post_rope, 1);
    return kvw_fbb_table_end(b, &t);
}

static uint32_t build_model(fbb *b, const kvw_model *m) {
    uint32_t o[10];
    o[0] = kvw_fbb_str_opt(b, m->model_type);
    o[1] = kvw_fbb_str_opt(b, m->model_id);
    o[2] = kvw_fbb_str_opt(b, m->revision);
    o[3] = kvw_fbb_bytes_opt(b, m->config_fingerprint);
    o[4] = kvw_fbb_bytes_opt(b, m->tokenizer_fingerprint);
    o[5] = kvw_fbb_bytes_opt(b, m->weights_fingerprint);
    o[6] = kvw_fbb_bytes_opt(b, m->compat_fingerprint);
    o[7] = kvw_fbb_str_opt(b, m->framework);
    o[8] = kvw_fbb_str_opt(b, m->framework_version);
    o[9] = kvw_fbb_bytes_opt(b, m->layer_weights_fingerprints);
    fb_table t = {.n = 0};
    for (uint16_t i = 0; i < 10; i++) kvw_fbb_t_ref(&t, i, o[i]);
    kvw_fbb_t_scalar(&t, 10, 2, m->fingerprint_scheme, 0);
    return kvw_fbb_table_end(b, &t);
}

static int cmp_map(const void *a, const void *b) {
    const kvw_layer_map_entry *x = a, *y = b;
    return (x->receiver_layer > y->receiver_layer) - (x->receiver_layer < y->receiver_layer);
}

static uint32_t build_layer_map(fbb *b, const kvw_layer_map_entry *e, uint32_t n) {
    if (!n || too_many(b, n)) return 0;
    kvw_layer_map_entry *s = malloc(sizeof *s * n);
    if (!s) { b->failed = 1; return 0; }
    memcpy(s, e, sizeof *s * n);
    /* stable enough: receiver layers are unique in a valid map (KVW-MAP-1) */
    qsort(s, n, sizeof *s, cmp_map);
    uint8_t *d = kvw_fbb_vec_begin(b, 12, 4, n);
    for (uint32_t i = 0; d && i < n; i++) {
        kvw_st32(d + 12 * i, s[i].receiver_layer);
        kvw_st32(d + 12 * i + 4, (uint32_t)s[i].transmitted_layer);
        d[12 * i + 8] = s[i].op; /* bytes 9..11 stay zero (KVW-MAP-3) */
    }
    free(s);
    return kvw_fbb_vec_end(b, n);
}

/* Layer i's default range (5.7): (0, 0) for shared layers, (0, token_count) otherwise. */
static int default_ranges(const kvw_header *h) {
    if (h->layer_tokens_count != h->arch.num_layers) return 0;
    for (uint32_t i = 0; i < h->layer_tokens_count; i++) {
        const kvw_layer_spec *s = kvw_layer(h, i);
        uint32_t want = (s && s->kind == KVW_KIND_SHARED) ? 0 : h->token_count;
        if (h->layer_tokens[i].start != 0 || h->layer_tokens[i].count != want) return 0;
    }
    return 1;
}

static uint32_t build_layer_tokens(fbb *b, const kvw_header *h) {
    uint32_t n = h->layer_tokens ? h->layer_tokens_count : 0;
    if (!n || default_ranges(h)) return 0; /* never empty, omitted at defaults (HDR-15) */
    uint8_t *d = kvw_fbb_vec_begin(b, 8, 4, n);
    for (uint32_t i = 0; d && i < n; i++) {
        kvw_st32(d + 8 * i, h->layer_tokens[i].start);
        kvw_st32(d + 8 * i + 4, h->layer_tokens[i].count);
    }
    return kvw_fbb_vec_end(b, n);
}

static int kv_cmp(const void *x, const void *y) {
    kvw_bytes a = (*(const kvw_key_value *const *)x)->key, b = (*(const kvw_key_value *const *)y)->key;
    uint32_t n = a.len < b.len ? a.len : b.len;
    int c = n ? memcmp(a.ptr, b.ptr, n) : 0;
    return c ? c : (a.len > b.len) - (a.len < b.len);
}

static uint32_t build_metadata(fbb *b, const kvw_key_value *kv, uint32_t n) {
    if (!n || too_many(b, n)) return 0;
    const kvw_key_value **order = malloc(sizeof *order * n);
    uint32_t *offs = malloc(sizeof *offs * n);
    if (!order || !offs) { free(order); free(offs); b->failed = 1; return 0; }
    for (uint32_t i = 0; i < n; i++) order[i] = &kv[i];
    qsort(order, n, sizeof *order, kv_cmp); /* byte order of the keys (KVW-META-4) */
    for (uint32_t i = 0; i < n; i++) {
        const kvw_key_value *e = order[i];
        uint32_t k = kvw_fbb_bytes_vec(b, e->key.ptr, e->key.len, 1); /* required (HDR-6) */
        uint32_t v = kvw_fbb_bytes_opt(b, e->value);
        fb_table t = {.n = 0};
        kvw_fbb_t_ref(&t, 0, k);
        kvw_fbb_t_ref(&t, 1, v);
        offs[i] = kvw_fbb_table_end(b, &t);
    }
    uint32_t vec = kvw_fbb_table_vec(b, offs, n);
    free(order);
    free(offs);
    return vec;
}

static uint32_t build_engine_layout(fbb *b, const kvw_engine_layout *e) {
    uint32_t name = kvw_fbb_str_opt(b, e->name), axes = kvw_fbb_str_opt(b, e->axes);
    uint32_t order = kvw_fbb_bytes_opt(b, e->stride_order), engine = kvw_fbb_str_opt(b, e->engine);
    fb_table t = {.n = 0};
    kvw_fbb_t_ref(&t, 0, name);
    kvw_fbb_t_ref(&t, 1, axes);
    kvw_fbb_t_ref(&t, 2, order);
    kvw_fbb_t_scalar(&t, 3, 4, e->block_size, 0);
    kvw_fbb_t_ref(&t, 4, engine);
    return kvw_fbb_table_end(b, &t);
}

static uint32_t build_prefix(fbb *b, const kvw_prefix *p) {
    uint32_t root = kvw_fbb_bytes_opt(b, p->root), hashes = kvw_fbb_bytes_opt(b, p->hashes);
    fb_table t = {.n = 0};
    kvw_fbb_t_scalar(&t, 0, 2, p->scheme, 1);
    kvw_fbb_t_ref(&t, 1, root);
    kvw_fbb_t_ref(&t, 2, hashes);
    return kvw_fbb_table_end(b, &t);
}

/* Fields 11-13 (revision 1.2) only with required bit 4 (KVW-ROT-1: not without it). */
static uint32_t build_codec_specs(fbb *b, const kvw_codec_spec *cs, uint32_t n, int rot) {
    if (!n || too_many(b, n)) return 0;
    uint32_t *offs = malloc(sizeof *offs * n);
    if (!offs) { b->failed = 1; return 0; }
    for (uint32_t i = 0; i < n; i++) {
        const kvw_codec_spec *c = &cs[i];
        fb_table t = {.n = 0};
        kvw_fbb_t_scalar(&t, 0, 1, c->codec, KVW_CODEC_RAW);
        kvw_fbb_t_scalar(&t, 1, 1, c->lossless, KVW_CODEC_RAW);
        kvw_fbb_t_scalar(&t, 2, 1, c->fp8_format, KVW_DTYPE_F8_E4M3FN);
        kvw_fbb_t_scalar(&t, 3, 1, c->scale_granularity, KVW_SCALE_TENSOR);
        kvw_fbb_t_scalar(&t, 4, 1, c->bits, 8);
        kvw_fbb_t_scalar(&t, 5, 4, c->group_size, 32);
        kvw_fbb_t_scalar(&t, 6, 1, c->group_axis, KVW_GROUP_TOKENS);
        kvw_fbb_t_scalar(&t, 7, 1, c->symmetric, 0);
        kvw_fbb_t_scalar(&t, 8, 1, c->scale_dtype, KVW_DTYPE_F32);
        kvw_fbb_t_scalar(&t, 9, 4, c->sink_tokens, 0);
        kvw_fbb_t_scalar(&t, 10, 4, c->residual_tokens, 0);
        if (rot) {
            kvw_fbb_t_scalar(&t, 11, 1, c->rotation, KVW_ROTATION_NONE);
            kvw_fbb_t_scalar(&t, 12, 8, c->rotation_seed, 0);
            kvw_fbb_t_scalar(&t, 13, 1, c->codebook, KVW_CODEBOOK_UNIFORM);
        }
        offs[i] = kvw_fbb_table_end(b, &t);
    }
    uint32_t v = kvw_fbb_table_vec(b, offs, n);
    free(offs);
    return v;
}

static uint32_t build_sparse(fbb *b, const kvw_sparse_info *s) {
    uint32_t method = kvw_fbb_str_opt(b, s->method);
    uint8_t *d = kvw_fbb_vec_begin(b, 4, 4, s->retained_counts.count);
    if (d && s->retained_counts.count) memcpy(d, s->retained_counts.ptr, 4u * s->retained_counts.count);
    uint32_t counts = kvw_fbb_vec_end(b, s->retained_counts.count);
    fb_table t = {.n = 0};
    kvw_fbb_t_ref(&t, 0, method);
    kvw_fbb_t_force(&t, 1, 8, s->next_position);
    kvw_fbb_t_ref(&t, 2, counts);
    kvw_fbb_t_scalar(&t, 3, 4, s->sink_tokens, 0);
    kvw_fbb_t_scalar(&t, 4, 4, s->window_tokens, 0);
    return kvw_fbb_table_end(b, &t);
}

static uint32_t build_kv_scales(fbb *b, const kvw_kv_scale *ks, uint32_t n) {
    uint8_t *d = kvw_fbb_vec_begin(b, 8, 4, n);
    for (uint32_t i = 0; d && i < n; i++) {
        uint32_t k, v;
        memcpy(&k, &ks[i].k_scale, 4);
        memcpy(&v, &ks[i].v_scale, 4);
        kvw_st32(d + 8 * i, k);
        kvw_st32(d + 8 * i + 4, v);
    }
    return kvw_fbb_vec_end(b, n);
}

kvw_code kvw_header_encode(const kvw_header *h, uint8_t **out, size_t *out_len, kvw_error *err) {
    if (!h || !out || !out_len)
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "kvw_header_encode: NULL argument");
    fbb b = {0};
    b.limit = KVW_MAX_HEADER_LENGTH;
    uint32_t arch = build_arch(&b, &h->arch);
    uint32_t producer = 0, model = 0, engine = 0, prefix = 0, sparse = 0, scales = 0;
    if (h->has_producer) {
        uint32_t lib = kvw_fbb_str_opt(&b, h->producer_library), ver = kvw_fbb_str_opt(&b, h->producer_version);
        fb_table t = {.n = 0};
        kvw_fbb_t_ref(&t, 0, lib);
        kvw_fbb_t_ref(&t, 1, ver);
        producer = kvw_fbb_table_end(&b, &t);
    }
    if (h->has_model) model = build_model(&b, &h->model);
    uint32_t layer_map = build_layer_map(&b, h->layer_map, h->layer_map ? h->layer_map_count : 0);
    uint32_t layer_tokens = build_layer_tokens(&b, h);
    uint32_t metadata = build_metadata(&b, h->metadata, h->metadata ? h->metadata_count : 0);
    if (h->has_engine_layout) engine = build_engine_layout(&b, &h->engine_layout);
    if (h->has_prefix) prefix = build_prefix(&b, &h->prefix);
    uint32_t cspecs = build_codec_specs(&b, h->codec_specs, h->codec_specs ? h->codec_spec_count : 0,
                                        (h->required_features & KVW_FEATURE_ROTATION) != 0);
    if (h->has_sparse) sparse = build_sparse(&b, &h->sparse);
    if (h->has_kv_scales) scales = build_kv_scales(&b, h->kv_scales, h->kv_scales ? h->kv_scale_count : 0);

    fb_table t = {.n = 0};
    kvw_fbb_t_force(&t, 0, 2, h->format_major);
    kvw_fbb_t_scalar(&t, 1, 2, h->format_minor, 0);
    kvw_fbb_t_scalar(&t, 2, 8, h->required_features, 0);
    kvw_fbb_t_scalar(&t, 3, 8, h->optional_features, 0);
    kvw_fbb_t_ref(&t, 4, producer);
    kvw_fbb_t_ref(&t, 5, model);
    kvw_fbb_t_ref(&t, 6, arch);
    kvw_fbb_t_ref(&t, 7, layer_map);
    kvw_fbb_t_scalar(&t, 8, 1, h->dtype, KVW_DTYPE_BF16);
    kvw_fbb_t_scalar(&t, 9, 4, h->alignment, 64);
    kvw_fbb_t_scalar(&t, 10, 4, h->chunk_tokens, 256);
    kvw_fbb_t_scalar(&t, 11, 8, h->first_position, 0);
    kvw_fbb_t_scalar(&t, 12, 4, h->token_count, 0);
    kvw_fbb_t_ref(&t, 13, layer_tokens);
    kvw_fbb_t_scalar(&t, 14, 1, h->checksum_algorithm, KVW_CHECKSUM_XXH3_64);
    kvw_fbb_t_ref(&t, 15, metadata);
    kvw_fbb_t_ref(&t, 16, engine);
    kvw_fbb_t_ref(&t, 17, prefix);
    kvw_fbb_t_ref(&t, 18, cspecs);
    kvw_fbb_t_ref(&t, 19, sparse);
    kvw_fbb_t_ref(&t, 20, scales);
    uint32_t root = kvw_fbb_table_end(&b, &t);
    return kvw_fbb_finish(&b, root, "KVWH", out, out_len, err);
}

