/*
 * Neutral JSON of a header, the input direction (conformance/PROTOCOL.md 2.2 and 2.5):
 * kvwire-c encode reads an encode spec's header object back into a kvw_header, field by
 * field in schema order (ropes, layers, layer map, tokens, metadata, companion specs).
 * The field readers are neutral_fields.c; the output direction is neutral.c.
 */
#include "neutral_impl.h"

#include <string.h>

static int rope_from(nctx *c, const jv *o, const kvw_rope **out) {
    kvw_rope *r;
    *out = NULL;
    if (!o || o->type == JV_NULL) return 0;
    if (o->type != JV_OBJECT) return kvw_nj_fail(c, "rope");
    r = kvw_nj_alloc(c->a, sizeof *r);
    if (!r) return kvw_nj_fail(c, "out of memory");
    kvw_rope_init(r);
    if (kvw_nj_get_enum(c, o, "rope_type", kvw_rope_type_name, KVW_ROPE_TYPE_COUNT, &r->rope_type) ||
        kvw_nj_get_f64(c, o, "theta", &r->theta) || kvw_nj_get_bool(c, o, "interleaved", &r->interleaved) ||
        kvw_nj_get_f64(c, o, "factor", &r->factor) || kvw_nj_get_f64(c, o, "low_freq_factor", &r->low_freq_factor) ||
        kvw_nj_get_f64(c, o, "high_freq_factor", &r->high_freq_factor) ||
        kvw_nj_get_f64(c, o, "beta_fast", &r->beta_fast) ||
        kvw_nj_get_f64(c, o, "beta_slow", &r->beta_slow) ||
        kvw_nj_get_f64(c, o, "attention_factor", &r->attention_factor) ||
        kvw_nj_get_f64(c, o, "mscale", &r->mscale) || kvw_nj_get_f64(c, o, "mscale_all_dim", &r->mscale_all_dim) ||
        kvw_nj_get_vec(c, o, "short_factor", 1, &r->short_factor) ||
        kvw_nj_get_vec(c, o, "long_factor", 1, &r->long_factor) ||
        kvw_nj_get_vec(c, o, "mrope_section", 0, &r->mrope_section) || kvw_nj_get_bool(c, o, "truncate", &r->truncate))
        return -1;
    GET_UINT(c, o, "rotary_dim", UINT32_MAX, r->rotary_dim);
    GET_UINT(c, o, "original_max_position_embeddings", UINT32_MAX, r->original_max_position_embeddings);
    GET_UINT(c, o, "seq_len_at_encode", UINT64_MAX, r->seq_len_at_encode);
    *out = r;
    return 0;
}

static int layer_from(nctx *c, const jv *o, kvw_layer_spec *s) {
    const jv *st;
    kvw_layer_spec_init(s);
    if (!o || o->type != JV_OBJECT) return kvw_nj_fail(c, "layer");
    if (kvw_nj_get_enum(c, o, "kind", kvw_layer_kind_name, KVW_LAYER_KIND_COUNT, &s->kind) ||
        kvw_nj_get_i32(c, o, "source_layer", &s->source_layer) || kvw_nj_get_bool(c, o, "uses_rope", &s->uses_rope) ||
        rope_from(c, json_get(o, "rope"), &s->rope))
        return -1;
    GET_UINT(c, o, "num_kv_heads", UINT32_MAX, s->num_kv_heads);
    GET_UINT(c, o, "head_dim_k", UINT32_MAX, s->head_dim_k);
    GET_UINT(c, o, "head_dim_v", UINT32_MAX, s->head_dim_v);
    GET_UINT(c, o, "window", UINT32_MAX, s->window);
    GET_UINT(c, o, "kv_lora_rank", UINT32_MAX, s->kv_lora_rank);
    GET_UINT(c, o, "qk_rope_head_dim", UINT32_MAX, s->qk_rope_head_dim);
    st = kvw_nj_get_array(c, o, "state_tensors", 1u << 16);
    if (c->failed) return -1;
    if (st && st->len) {
        kvw_state_tensor *t = kvw_nj_alloc(c->a, st->len * sizeof *t);
        size_t i;
        if (!t) return kvw_nj_fail(c, "out of memory");
        for (i = 0; i < st->len; i++) {
            const jv *e = &st->items[i];
            t[i].dtype = KVW_DTYPE_F32;
            if (e->type != JV_OBJECT) return kvw_nj_fail(c, "state_tensors");
            if (kvw_nj_get_str(c, e, "name", &t[i].name) || kvw_nj_get_vec(c, e, "shape", 0, &t[i].shape) ||
                kvw_nj_get_enum(c, e, "dtype", kvw_dtype_name, KVW_DTYPE_COUNT, &t[i].dtype))
                return -1;
        }
        s->state_tensors = t;
        s->state_tensor_count = (uint32_t)st->len;
    }
    return 0;
}

int neutral_header_from_json(const jv *d, kvw_header *h, neutral_arena *a, char *msg, size_t msglen) {
    nctx cx = {a, msg, msglen, 0}, *c = &cx;
    const jv *arch, *layers, *m, *arr, *o;
    size_t i;
    kvw_header_init(h);
    if (!d || d->type != JV_OBJECT) return kvw_nj_fail(c, "not an object");
    GET_UINT(c, d, "format_major", UINT16_MAX, h->format_major);
    GET_UINT(c, d, "format_minor", UINT16_MAX, h->format_minor);
    GET_UINT(c, d, "required_features", UINT64_MAX, h->required_features);
    GET_UINT(c, d, "optional_features", UINT64_MAX, h->optional_features);
    h->has_producer = 1;
    h->producer_library.ptr = (const uint8_t *)"libkvwire";
    h->producer_library.len = 9;
    h->producer_version.ptr = (const uint8_t *)KVW_VERSION_STRING;
    h->producer_version.len = (uint32_t)strlen(KVW_VERSION_STRING);
    m = json_get(d, "model");
    if (m && m->type == JV_OBJECT) {
        kvw_model *md = &h->model;
        h->has_model = 1;
        if (kvw_nj_get_str(c, m, "model_type", &md->model_type) || kvw_nj_get_str(c, m, "model_id", &md->model_id) ||
            kvw_nj_get_str(c, m, "revision", &md->revision) ||
            kvw_nj_get_hex(c, m, "config_fingerprint", &md->config_fingerprint) ||
            kvw_nj_get_hex(c, m, "tokenizer_fingerprint", &md->tokenizer_fingerprint) ||
            kvw_nj_get_hex(c, m, "weights_fingerprint", &md->weights_fingerprint) ||
            kvw_nj_get_hex(c, m, "compat_fingerprint", &md->compat_fingerprint) ||
            kvw_nj_get_str(c, m, "framework", &md->framework) ||
            kvw_nj_get_str(c, m, "framework_version", &md->framework_version) ||
            kvw_nj_get_hex(c, m, "layer_weights_fingerprints", &md->layer_weights_fingerprints))
            return -1;
        GET_UINT(c, m, "fingerprint_scheme", UINT16_MAX, md->fingerprint_scheme);
    }
    arch = json_get(d, "arch");
    if (!arch || arch->type != JV_OBJECT) return kvw_nj_fail(c, "arch");
    GET_UINT(c, arch, "schema_version", UINT16_MAX, h->arch.schema_version);
    if (kvw_nj_get_bool(c, arch, "keys_post_rope", &h->arch.keys_post_rope) ||
        rope_from(c, json_get(arch, "rope"), &h->arch.rope))
        return -1;
    layers = kvw_nj_get_array(c, arch, "layers", 65536);
    if (c->failed) return -1;
    if (layers && layers->len) {
        kvw_layer_spec *specs = kvw_nj_alloc(a, layers->len * sizeof *specs);
        uint16_t *index = kvw_nj_alloc(a, layers->len * sizeof *index);
        if (!specs || !index) return kvw_nj_fail(c, "out of memory");
        for (i = 0; i < layers->len; i++) {
            if (layer_from(c, &layers->items[i], &specs[i])) return -1;
            index[i] = (uint16_t)i;
        }
        h->arch.layer_specs = specs;
        h->arch.layer_spec_count = (uint32_t)layers->len;
        h->arch.layer_spec_index = index;
        h->arch.layer_spec_index_count = (uint32_t)layers->len;
        h->arch.num_layers = (uint32_t)layers->len;
    }
    arr = kvw_nj_get_array(c, d, "layer_map", 1u << 20);
    if (c->failed) return -1;
    if (arr && arr->len) {
        kvw_layer_map_entry *e = kvw_nj_alloc(a, arr->len * sizeof *e);
        if (!e) return kvw_nj_fail(c, "out of memory");
        for (i = 0; i < arr->len; i++) {
            o = &arr->items[i];
            if (o->type != JV_OBJECT || kvw_nj_get_i32(c, o, "transmitted_layer", &e[i].transmitted_layer) ||
                kvw_nj_get_enum(c, o, "op", kvw_map_op_name, KVW_MAP_OP_COUNT, &e[i].op))
                return kvw_nj_fail(c, "layer_map");
            GET_UINT(c, o, "receiver_layer", UINT32_MAX, e[i].receiver_layer);
        }
        h->layer_map = e;
        h->layer_map_count = (uint32_t)arr->len;
    }
    if (kvw_nj_get_enum(c, d, "dtype", kvw_dtype_name, KVW_DTYPE_COUNT, &h->dtype)) return -1;
    GET_UINT(c, d, "alignment", UINT32_MAX, h->alignment);
    GET_UINT(c, d, "chunk_tokens", UINT32_MAX, h->chunk_tokens);
    GET_UINT(c, d, "first_position", UINT64_MAX, h->first_position);
    GET_UINT(c, d, "token_count", UINT32_MAX, h->token_count);
    arr = kvw_nj_get_array(c, d, "layer_tokens", 65536);
    if (c->failed) return -1;
    if (arr) {
        kvw_token_range *r = kvw_nj_alloc(a, arr->len * sizeof *r);
        if (!r) return kvw_nj_fail(c, "out of memory");
        for (i = 0; i < arr->len; i++) {
            o = &arr->items[i];
            if (o->type != JV_OBJECT) return kvw_nj_fail(c, "layer_tokens");
            GET_UINT(c, o, "start", UINT32_MAX, r[i].start);
            GET_UINT(c, o, "count", UINT32_MAX, r[i].count);
        }
        h->layer_tokens = r;
        h->layer_tokens_count = (uint32_t)arr->len;
        h->has_layer_tokens = 1;
    }
    o = json_get(d, "checksum_algorithm");
    if (o && o->type == JV_STRING && strcmp(o->s, "xxh3_64") != 0) return kvw_nj_fail(c, "checksum_algorithm");
    o = json_get(d, "metadata");
    if (o && o->type == JV_OBJECT && o->len) {
        kvw_key_value *kv = kvw_nj_alloc(a, o->len * sizeof *kv);
        if (!kv) return kvw_nj_fail(c, "out of memory");
        for (i = 0; i < o->len; i++) {
            kv[i].key.ptr = (const uint8_t *)o->keys[i];
            kv[i].key.len = (uint32_t)strlen(o->keys[i]);
            if (kvw_nj_hex_to_bytes(c, &o->items[i], "metadata", &kv[i].value)) return -1;
        }
        h->metadata = kv;
        h->metadata_count = (uint32_t)o->len;
    }
    o = json_get(d, "engine_layout");
    if (o && o->type == JV_OBJECT) {
        kvw_engine_layout *e = &h->engine_layout;
        h->has_engine_layout = 1;
        if (kvw_nj_get_str(c, o, "name", &e->name) || kvw_nj_get_str(c, o, "axes", &e->axes) ||
            kvw_nj_get_str(c, o, "engine", &e->engine))
            return -1;
        GET_UINT(c, o, "block_size", UINT32_MAX, e->block_size);
        arr = kvw_nj_get_array(c, o, "stride_order", 65536);
        if (c->failed) return -1;
        if (arr) {
            uint8_t *p = kvw_nj_alloc(a, arr->len);
            uint64_t x;
            if (!p) return kvw_nj_fail(c, "out of memory");
            for (i = 0; i < arr->len; i++) {
                if (json_u64(&arr->items[i], &x) || x > 255) return kvw_nj_fail(c, "stride_order");
                p[i] = (uint8_t)x;
            }
            e->stride_order.ptr = p;
            e->stride_order.len = (uint32_t)arr->len;
        }
    }
    o = json_get(d, "prefix");
    if (o && o->type == JV_OBJECT) {
        h->has_prefix = 1;
        GET_UINT(c, o, "scheme", UINT16_MAX, h->prefix.scheme);
        if (kvw_nj_get_hex(c, o, "root", &h->prefix.root) ||
            kvw_nj_get_hex(c, o, "hashes", &h->prefix.hashes)) return -1;
    }
    arr = kvw_nj_get_array(c, d, "codec_specs", 65536);
    if (c->failed) return -1;
    if (arr && arr->len) {
        kvw_codec_spec *cs = kvw_nj_alloc(a, arr->len * sizeof *cs);
        if (!cs) return kvw_nj_fail(c, "out of memory");
        for (i = 0; i < arr->len; i++) {
            o = &arr->items[i];
            kvw_codec_spec_init(&cs[i]);
            if (o->type != JV_OBJECT ||
                kvw_nj_get_enum(c, o, "codec", kvw_codec_name, KVW_CODEC_COUNT, &cs[i].codec) ||
                kvw_nj_get_enum(c, o, "lossless", kvw_codec_name, KVW_CODEC_COUNT, &cs[i].lossless) ||
                kvw_nj_get_enum(c, o, "fp8_format", kvw_dtype_name, KVW_DTYPE_COUNT, &cs[i].fp8_format) ||
                kvw_nj_get_enum(c, o, "scale_granularity", kvw_scale_granularity_name, 3, &cs[i].scale_granularity) ||
                kvw_nj_get_enum(c, o, "group_axis", kvw_group_axis_name, 2, &cs[i].group_axis) ||
                kvw_nj_get_bool(c, o, "symmetric", &cs[i].symmetric) ||
                kvw_nj_get_enum(c, o, "scale_dtype", kvw_dtype_name, KVW_DTYPE_COUNT, &cs[i].scale_dtype))
                return kvw_nj_fail(c, "codec_specs");
            GET_UINT(c, o, "bits", 255, cs[i].bits);
            GET_UINT(c, o, "group_size", UINT32_MAX, cs[i].group_size);
            GET_UINT(c, o, "sink_tokens", UINT32_MAX, cs[i].sink_tokens);
            GET_UINT(c, o, "residual_tokens", UINT32_MAX, cs[i].residual_tokens);
            /* revision 1.2 (spec/codecs.md 8.1): the writer sets bit 4 when one is used */
            if (kvw_nj_get_enum(c, o, "rotation", kvw_rotation_name, 3, &cs[i].rotation) ||
                kvw_nj_get_enum(c, o, "codebook", kvw_codebook_name, 3, &cs[i].codebook) ||
                kvw_nj_get_u64(c, o, "rotation_seed", UINT64_MAX, &cs[i].rotation_seed))
                return kvw_nj_fail(c, "codec_specs");
        }
        h->codec_specs = cs;
        h->codec_spec_count = (uint32_t)arr->len;
    }
    o = json_get(d, "sparse");
    if (o && o->type == JV_OBJECT) {
        h->has_sparse = 1;
        if (kvw_nj_get_str(c, o, "method", &h->sparse.method) ||
            kvw_nj_get_vec(c, o, "retained_counts", 0, &h->sparse.retained_counts))
            return -1;
        GET_UINT(c, o, "next_position", UINT64_MAX, h->sparse.next_position);
        GET_UINT(c, o, "sink_tokens", UINT32_MAX, h->sparse.sink_tokens);
        GET_UINT(c, o, "window_tokens", UINT32_MAX, h->sparse.window_tokens);
    }
    arr = kvw_nj_get_array(c, d, "kv_scales", 65536);
    if (c->failed) return -1;
    if (arr) {
        kvw_kv_scale *ks = kvw_nj_alloc(a, arr->len * sizeof *ks);
        double k, v;
        if (!ks) return kvw_nj_fail(c, "out of memory");
        for (i = 0; i < arr->len; i++) {
            o = &arr->items[i];
            if (json_f64(json_get(o, "k_scale"), &k) || json_f64(json_get(o, "v_scale"), &v))
                return kvw_nj_fail(c, "kv_scales");
            ks[i].k_scale = (float)k;
            ks[i].v_scale = (float)v;
        }
        h->kv_scales = ks;
        h->kv_scale_count = (uint32_t)arr->len;
        h->has_kv_scales = 1;
    }
    return 0;
}
