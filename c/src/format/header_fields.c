/*
 * The Header fields outside Architecture (spec sections 5.5-5.9, 7, and the fields of the
 * companion specs: sparse, codec_specs, prefix, kv_scales), split from header.c so that the
 * decoding driver and the Architecture subtree stay one module: each reader here is called
 * by header.c's decode_header at its place in the order of 14.1 step 2.
 */
#include "format/header_impl.h"

/* ---- Producer (5.5) and ModelIdentity (5.6) ---- */
kvw_code kvw_hd_producer_model(hdec *d, const kvw_fbt *root) {
    kvw_error *e = d->err;
    kvw_header *h = d->h;
    kvw_fbt pt, mt;
    kvw_code c;
    if ((c = kvw_fbt_table(root, 4, 0, "Header.producer", &pt, &h->has_producer, e)) ||
        (c = kvw_fbt_table(root, 5, 0, "Header.model", &mt, &h->has_model, e)))
        return c;
    if (h->has_producer &&
        ((c = kvw_fbt_string(&pt, 0, MAX_STRING_LENGTH, 0, "Producer.library",
                             &h->producer_library, e)) ||
         (c = kvw_fbt_string(&pt, 1, MAX_STRING_LENGTH, 0, "Producer.version",
                             &h->producer_version, e))))
        return c;
    if (!h->has_model) return KVW_OK;
    kvw_model *m = &h->model;
    if ((c = kvw_fbt_string(&mt, 0, MAX_STRING_LENGTH, 0, "ModelIdentity.model_type",
                            &m->model_type, e)) ||
        (c = kvw_fbt_string(&mt, 1, MAX_STRING_LENGTH, 0, "ModelIdentity.model_id",
                            &m->model_id, e)) ||
        (c = kvw_fbt_string(&mt, 2, MAX_STRING_LENGTH, 0, "ModelIdentity.revision",
                            &m->revision, e)) ||
        (c = kvw_fbt_bytes(&mt, 3, MAX_BYTES_LENGTH, "ModelIdentity.config_fingerprint",
                           &m->config_fingerprint, e)) ||
        (c = kvw_fbt_bytes(&mt, 4, MAX_BYTES_LENGTH, "ModelIdentity.tokenizer_fingerprint",
                           &m->tokenizer_fingerprint, e)) ||
        (c = kvw_fbt_bytes(&mt, 5, MAX_BYTES_LENGTH, "ModelIdentity.weights_fingerprint",
                           &m->weights_fingerprint, e)) ||
        (c = kvw_fbt_bytes(&mt, 6, MAX_BYTES_LENGTH, "ModelIdentity.compat_fingerprint",
                           &m->compat_fingerprint, e)) ||
        (c = kvw_fbt_string(&mt, 7, MAX_STRING_LENGTH, 0, "ModelIdentity.framework",
                            &m->framework, e)) ||
        (c = kvw_fbt_string(&mt, 8, MAX_STRING_LENGTH, 0, "ModelIdentity.framework_version",
                            &m->framework_version, e)) ||
        (c = kvw_fbt_bytes(&mt, 9, MAX_BYTES_LENGTH, "ModelIdentity.layer_weights_fingerprints",
                           &m->layer_weights_fingerprints, e)) ||
        (c = kvw_fbt_u16(&mt, 10, 0, &m->fingerprint_scheme, e)))
        return c;
    return KVW_OK;
}

/* ---- layer_map (section 7) ---- */
kvw_code kvw_hd_layer_map(hdec *d, const kvw_fbt *root) {
    kvw_fbvec v;
    kvw_code c = kvw_fbt_vector(root, 7, 12, 4, KVW_MAX_LAYERS, 0, "Header.layer_map", &v, d->err);
    if (c || !v.count) return c;
    kvw_layer_map_entry *m = kvw_hd_alloc(d, v.count, sizeof *m);
    if (!m) return kvw_hd_oom(d);
    for (uint32_t j = 0; j < v.count; j++) {
        const uint8_t *p = d->fb.data + v.start + 12u * j;
        m[j].receiver_layer = kvw_ld32(p);
        m[j].transmitted_layer = (int32_t)kvw_ld32(p + 4);
        m[j].op = p[8];
        if (m[j].op >= KVW_MAP_OP_COUNT)
            return kvw_fail(d->err, KVW_ENUM_OUT_OF_RANGE, "KVW-HDR-10",
                            "layer_map[%u] op code %u is not in the registry", j, m[j].op);
    }
    d->h->layer_map = m;
    d->h->layer_map_count = v.count;
    return KVW_OK;
}

/* ---- layer_tokens (5.7): the carried ranges, resolved later ---- */
kvw_code kvw_hd_layer_tokens(hdec *d, const kvw_fbt *root) {
    kvw_header *h = d->h;
    kvw_fbvec v;
    kvw_code c = kvw_fbt_vector(root, 13, 8, 4, KVW_MAX_LAYERS, 0, "Header.layer_tokens", &v,
                                d->err);
    if (c || !v.count) return c; /* empty is like absent (KVW-HDR-15) */
    kvw_token_range *r = kvw_hd_alloc(d, v.count, sizeof *r);
    if (!r) return kvw_hd_oom(d);
    for (uint32_t j = 0; j < v.count; j++) {
        r[j].start = kvw_ld32(d->fb.data + v.start + 8u * j);
        r[j].count = kvw_ld32(d->fb.data + v.start + 8u * j + 4);
    }
    h->layer_tokens = r;
    h->layer_tokens_count = v.count;
    h->has_layer_tokens = 1;
    return KVW_OK;
}

/* The default ranges (5.7) when the container carries none. */
kvw_code kvw_hd_resolve_layer_tokens(hdec *d) {
    kvw_header *h = d->h;
    if (h->has_layer_tokens) return KVW_OK;
    uint32_t n = h->arch.num_layers;
    kvw_token_range *r = kvw_hd_alloc(d, n, sizeof *r);
    if (n && !r) return kvw_hd_oom(d);
    for (uint32_t i = 0; i < n; i++) {
        const kvw_layer_spec *s = kvw_layer(h, i);
        r[i].start = 0;
        r[i].count = (s && s->kind == KVW_KIND_SHARED) ? 0 : h->token_count;
    }
    h->layer_tokens = r;
    h->layer_tokens_count = n;
    return KVW_OK;
}

/* ---- custom_metadata (5.8): key required, at most 256 bytes, unique (META-2) ---- */
kvw_code kvw_hd_metadata(hdec *d, const kvw_fbt *root) {
    kvw_error *e = d->err;
    kvw_fbvec v;
    kvw_code c = kvw_fbt_vector(root, 15, 4, 4, MAX_METADATA_ENTRIES, 0,
                                "Header.custom_metadata", &v, e);
    if (c || !v.count) return c;
    if ((c = kvw_hd_visit_all(d, &v))) return c;
    kvw_key_value *kv = kvw_hd_alloc(d, v.count, sizeof *kv);
    uint32_t nslots = 16;
    while (nslots < 2 * v.count) nslots *= 2;
    uint32_t *slot = kvw_hd_alloc(d, nslots, sizeof *slot); /* entry index + 1, 0 = empty */
    if (!kv || !slot) return kvw_hd_oom(d);
    for (uint32_t j = 0; j < v.count; j++) {
        kvw_fbt t;
        kvw_hd_elem_table(d, &v, j, &t);
        if ((c = kvw_fbt_string(&t, 0, MAX_METADATA_KEY, 1, "KeyValue.key", &kv[j].key, e)))
            return c;
        uint32_t s = (uint32_t)kvw_xxh3(kv[j].key.ptr, kv[j].key.len) & (nslots - 1);
        for (; slot[s]; s = (s + 1) & (nslots - 1)) {
            const kvw_bytes *o = &kv[slot[s] - 1].key;
            if (o->len == kv[j].key.len && memcmp(o->ptr, kv[j].key.ptr, o->len) == 0)
                return kvw_fail(e, KVW_METADATA_KEY_DUPLICATE, "KVW-META-2",
                                "metadata key \"%.*s\" appears twice (entries %u and %u)",
                                (int)(o->len > 64 ? 64 : o->len), (const char *)o->ptr,
                                slot[s] - 1, j);
        }
        slot[s] = j + 1;
        if ((c = kvw_fbt_bytes(&t, 1, MAX_BYTES_LENGTH, "KeyValue.value", &kv[j].value, e)))
            return c;
    }
    d->h->metadata = kv;
    d->h->metadata_count = v.count;
    return KVW_OK;
}

/* ---- engine_layout (5.9) ---- */
kvw_code kvw_hd_engine_layout(hdec *d, const kvw_fbt *root) {
    kvw_error *e = d->err;
    kvw_header *h = d->h;
    kvw_fbt t;
    kvw_code c = kvw_fbt_table(root, 16, 0, "Header.engine_layout", &t, &h->has_engine_layout, e);
    if (c || !h->has_engine_layout) return c;
    kvw_engine_layout *el = &h->engine_layout;
    if ((c = kvw_fbt_string(&t, 0, MAX_STRING_LENGTH, 0, "EngineLayout.name", &el->name, e)) ||
        (c = kvw_fbt_string(&t, 1, MAX_STRING_LENGTH, 0, "EngineLayout.axes", &el->axes, e)) ||
        (c = kvw_fbt_bytes(&t, 2, MAX_LAYOUT_DIMS, "EngineLayout.stride_order",
                           &el->stride_order, e)) ||
        (c = kvw_fbt_u32(&t, 3, 0, &el->block_size, e)) ||
        (c = kvw_fbt_string(&t, 4, MAX_STRING_LENGTH, 0, "EngineLayout.engine", &el->engine, e)))
        return c;
    return KVW_OK;
}

/* ---- sparse (field 19, sparse.md) ---- */
kvw_code kvw_hd_sparse(hdec *d, const kvw_fbt *root) {
    kvw_error *e = d->err;
    kvw_header *h = d->h;
    kvw_fbt t;
    kvw_fbvec v;
    kvw_code c = kvw_fbt_table(root, 19, 0, "Header.sparse", &t, &h->has_sparse, e);
    if (c || !h->has_sparse) return c;
    kvw_sparse_info *s = &h->sparse;
    if ((c = kvw_fbt_vector(&t, 2, 4, 4, MAX_RETAINED_ENTRIES, 0, "SparseInfo.retained_counts",
                            &v, e)))
        return c;
    s->retained_counts = kvw_hd_as_vec(d, &v);
    if ((c = kvw_fbt_u64(&t, 1, 0, &s->next_position, e)) ||
        (c = kvw_fbt_string(&t, 0, MAX_STRING_LENGTH, 0, "SparseInfo.method", &s->method, e)) ||
        (c = kvw_fbt_u32(&t, 3, 0, &s->sink_tokens, e)) ||
        (c = kvw_fbt_u32(&t, 4, 0, &s->window_tokens, e)))
        return c;
    return KVW_OK;
}

/* ---- codec_specs (field 18, codecs.md section 1) ---- */
kvw_code kvw_hd_codec_specs(hdec *d, const kvw_fbt *root) {
    kvw_error *e = d->err;
    kvw_fbvec v;
    kvw_code c = kvw_fbt_vector(root, 18, 4, 4, MAX_CODEC_SPECS, 0, "Header.codec_specs", &v, e);
    if (c || !v.count) return c;
    if ((c = kvw_hd_visit_all(d, &v))) return c;
    kvw_codec_spec *cs = kvw_hd_alloc(d, v.count, sizeof *cs);
    if (!cs) return kvw_hd_oom(d);
    for (uint32_t j = 0; j < v.count; j++) {
        kvw_fbt t;
        kvw_codec_spec *s = &cs[j];
        kvw_hd_elem_table(d, &v, j, &t);
        kvw_codec_spec_init(s);
        if ((c = kvw_fbt_enum(&t, 0, KVW_CODEC_RAW, KVW_CODEC_COUNT, &s->codec,
                              "CodecSpec.codec", e)) ||
            (c = kvw_fbt_enum(&t, 1, KVW_CODEC_RAW, KVW_CODEC_COUNT, &s->lossless,
                              "CodecSpec.lossless", e)) ||
            (c = kvw_fbt_enum(&t, 2, KVW_DTYPE_F8_E4M3FN, KVW_DTYPE_COUNT, &s->fp8_format,
                              "CodecSpec.fp8_format", e)) ||
            (c = kvw_fbt_enum(&t, 3, KVW_SCALE_TENSOR, 3, &s->scale_granularity,
                              "CodecSpec.scale_granularity", e)) ||
            (c = kvw_fbt_u8(&t, 4, 8, &s->bits, e)) ||
            (c = kvw_fbt_u32(&t, 5, 32, &s->group_size, e)) ||
            (c = kvw_fbt_enum(&t, 6, KVW_GROUP_TOKENS, 2, &s->group_axis,
                              "CodecSpec.group_axis", e)) ||
            (c = kvw_fbt_bool(&t, 7, 0, &s->symmetric, "CodecSpec.symmetric", e)) ||
            (c = kvw_fbt_enum(&t, 8, KVW_DTYPE_F32, KVW_DTYPE_COUNT, &s->scale_dtype,
                              "CodecSpec.scale_dtype", e)) ||
            (c = kvw_fbt_u32(&t, 9, 0, &s->sink_tokens, e)) ||
            (c = kvw_fbt_u32(&t, 10, 0, &s->residual_tokens, e)))
            return c;
        /* Fields 11-13 (revision 1.2) only with required bit 4: without it they are unknown
         * fields a reader does not read (KVW-ROT-1), like kv_scales without bit 3. */
        /* Code 2 of both (revision 1.3) is registered by required bit 5: out of range
         * without it (KVW-TQ-1, KVW-EVOL-9). */
        unsigned n2 = (d->h->required_features & KVW_FEATURE_TURBOQUANT) ? 3 : 2;
        if ((d->h->required_features & KVW_FEATURE_ROTATION) &&
            ((c = kvw_fbt_enum(&t, 11, KVW_ROTATION_NONE, n2, &s->rotation, "CodecSpec.rotation",
                               e)) ||
             (c = kvw_fbt_u64(&t, 12, 0, &s->rotation_seed, e)) ||
             (c = kvw_fbt_enum(&t, 13, KVW_CODEBOOK_UNIFORM, n2, &s->codebook,
                               "CodecSpec.codebook", e))))
            return c;
    }
    d->h->codec_specs = cs;
    d->h->codec_spec_count = v.count;
    return KVW_OK;
}

/* ---- prefix (field 17, crossmodel.md section 5) ---- */
kvw_code kvw_hd_prefix(hdec *d, const kvw_fbt *root) {
    kvw_error *e = d->err;
    kvw_header *h = d->h;
    kvw_fbt t;
    kvw_code c = kvw_fbt_table(root, 17, 0, "Header.prefix", &t, &h->has_prefix, e);
    if (c || !h->has_prefix) return c;
    if ((c = kvw_fbt_u16(&t, 0, 1, &h->prefix.scheme, e)) ||
        (c = kvw_fbt_bytes(&t, 1, MAX_BYTES_LENGTH, "PrefixChain.root", &h->prefix.root, e)) ||
        (c = kvw_fbt_bytes(&t, 2, MAX_PREFIX_HASH_BYTES, "PrefixChain.hashes",
                           &h->prefix.hashes, e)))
        return c;
    return KVW_OK;
}

/* ---- kv_scales (field 20, revision 1.1): followed only with required bit 3 ---- */
kvw_code kvw_hd_kv_scales(hdec *d, const kvw_fbt *root) {
    kvw_header *h = d->h;
    kvw_fbvec v;
    if (!(h->required_features & KVW_FEATURE_KV_SCALES)) return KVW_OK; /* KVW-SCALE-1 */
    kvw_code c = kvw_fbt_vector(root, 20, 8, 4, KVW_MAX_LAYERS, 0, "Header.kv_scales", &v, d->err);
    if (c || !v.present) return c;
    h->has_kv_scales = 1;
    kvw_kv_scale *s = kvw_hd_alloc(d, v.count, sizeof *s);
    if (v.count && !s) return kvw_hd_oom(d);
    for (uint32_t j = 0; j < v.count; j++) {
        s[j].k_scale = kvw_ldf32(d->fb.data + v.start + 8u * j);
        s[j].v_scale = kvw_ldf32(d->fb.data + v.start + 8u * j + 4);
    }
    h->kv_scales = s;
    h->kv_scale_count = v.count;
    return KVW_OK;
}
