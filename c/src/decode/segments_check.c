/*
 * The checks of one segment against the sequence so far (spec/kvwire-v1.md 10.2-10.3):
 * its resolved header values against the first segment's (KVW-STREAM-5, 7), its order
 * (KVW-STREAM-6) and its prefix root against the joined chain (KVW-STREAM-9). Split from
 * segments.c, which decides when they run and reports them (see there).
 */
#include "decode/segments_impl.h"

static int bytes_eq(kvw_bytes a, kvw_bytes b) {
    return a.len == b.len && (a.len == 0 || memcmp(a.ptr, b.ptr, a.len) == 0);
}
static int vec_eq(kvw_vec a, kvw_vec b, size_t w) {
    return a.count == b.count && (a.count == 0 || memcmp(a.ptr, b.ptr, (size_t)a.count * w) == 0);
}
static int f64_vec_eq(kvw_vec a, kvw_vec b) {
    uint32_t i;
    if (a.count != b.count) return 0;
    for (i = 0; i < a.count; i++)
        if (kvw_f64_at(a, i) != kvw_f64_at(b, i)) return 0;
    return 1;
}

static int rope_eq(const kvw_rope *a, const kvw_rope *b) {
    if (!a || !b) return a == b;
    return a->rope_type == b->rope_type && a->theta == b->theta && a->rotary_dim == b->rotary_dim &&
           a->interleaved == b->interleaved && a->factor == b->factor &&
           a->original_max_position_embeddings == b->original_max_position_embeddings &&
           a->low_freq_factor == b->low_freq_factor && a->high_freq_factor == b->high_freq_factor &&
           a->beta_fast == b->beta_fast && a->beta_slow == b->beta_slow &&
           a->attention_factor == b->attention_factor && a->mscale == b->mscale &&
           a->mscale_all_dim == b->mscale_all_dim && f64_vec_eq(a->short_factor, b->short_factor) &&
           f64_vec_eq(a->long_factor, b->long_factor) && vec_eq(a->mrope_section, b->mrope_section, 4) &&
           a->seq_len_at_encode == b->seq_len_at_encode && a->truncate == b->truncate;
}

static int layer_eq(const kvw_layer_spec *a, const kvw_layer_spec *b) {
    uint32_t i;
    if (!a || !b) return a == b;
    if (a->kind != b->kind || a->num_kv_heads != b->num_kv_heads || a->head_dim_k != b->head_dim_k ||
        a->head_dim_v != b->head_dim_v || a->window != b->window || a->source_layer != b->source_layer ||
        a->uses_rope != b->uses_rope || !rope_eq(a->rope, b->rope) || a->kv_lora_rank != b->kv_lora_rank ||
        a->qk_rope_head_dim != b->qk_rope_head_dim || a->state_tensor_count != b->state_tensor_count)
        return 0;
    for (i = 0; i < a->state_tensor_count; i++) {
        const kvw_state_tensor *x = &a->state_tensors[i], *y = &b->state_tensors[i];
        if (!bytes_eq(x->name, y->name) || !vec_eq(x->shape, y->shape, 4) || x->dtype != y->dtype) return 0;
    }
    return 1;
}

static int codec_spec_eq(const kvw_codec_spec *a, const kvw_codec_spec *b) {
    return a->codec == b->codec && a->lossless == b->lossless && a->fp8_format == b->fp8_format &&
           a->scale_granularity == b->scale_granularity && a->bits == b->bits && a->group_size == b->group_size &&
           a->group_axis == b->group_axis && a->symmetric == b->symmetric && a->scale_dtype == b->scale_dtype &&
           a->sink_tokens == b->sink_tokens && a->residual_tokens == b->residual_tokens;
}

/* Metadata as a key/value map (keys are unique, KVW-META rules). */
static int metadata_eq(const kvw_header *a, const kvw_header *b) {
    uint32_t i, j;
    if (a->metadata_count != b->metadata_count) return 0;
    for (i = 0; i < a->metadata_count; i++) {
        for (j = 0; j < b->metadata_count; j++)
            if (bytes_eq(a->metadata[i].key, b->metadata[j].key)) break;
        if (j == b->metadata_count || !bytes_eq(a->metadata[i].value, b->metadata[j].value)) return 0;
    }
    return 1;
}

/* The first field, other than first_position, token_count, layer_tokens and prefix, whose
 * resolved values differ (KVW-STREAM-7); NULL when they are all equal. */
static const char *shared_diff(const kvw_header *a, const kvw_header *b) {
    const kvw_model *m = &a->model, *n = &b->model;
    uint32_t i;
    if (a->format_major != b->format_major || a->format_minor != b->format_minor) return "format version";
    if (a->required_features != b->required_features) return "required_features";
    if (a->optional_features != b->optional_features) return "optional_features";
    if (!bytes_eq(a->producer_library, b->producer_library) || !bytes_eq(a->producer_version, b->producer_version))
        return "producer";
    if (!bytes_eq(m->model_type, n->model_type) || !bytes_eq(m->model_id, n->model_id) ||
        !bytes_eq(m->revision, n->revision) || !bytes_eq(m->config_fingerprint, n->config_fingerprint) ||
        !bytes_eq(m->tokenizer_fingerprint, n->tokenizer_fingerprint) ||
        !bytes_eq(m->weights_fingerprint, n->weights_fingerprint) ||
        !bytes_eq(m->compat_fingerprint, n->compat_fingerprint) || !bytes_eq(m->framework, n->framework) ||
        !bytes_eq(m->framework_version, n->framework_version) ||
        !bytes_eq(m->layer_weights_fingerprints, n->layer_weights_fingerprints) ||
        m->fingerprint_scheme != n->fingerprint_scheme)
        return "model";
    if (a->arch.schema_version != b->arch.schema_version || a->arch.num_layers != b->arch.num_layers ||
        a->arch.keys_post_rope != b->arch.keys_post_rope || !rope_eq(a->arch.rope, b->arch.rope))
        return "arch";
    for (i = 0; i < a->arch.num_layers; i++)
        if (!layer_eq(kvw_layer(a, i), kvw_layer(b, i))) return "a layer spec";
    if (a->layer_map_count != b->layer_map_count) return "layer_map";
    for (i = 0; i < a->layer_map_count; i++)
        if (a->layer_map[i].receiver_layer != b->layer_map[i].receiver_layer ||
            a->layer_map[i].transmitted_layer != b->layer_map[i].transmitted_layer ||
            a->layer_map[i].op != b->layer_map[i].op)
            return "layer_map";
    if (a->dtype != b->dtype) return "dtype";
    if (a->alignment != b->alignment) return "alignment";
    if (a->chunk_tokens != b->chunk_tokens) return "chunk_tokens";
    if (a->checksum_algorithm != b->checksum_algorithm) return "checksum_algorithm";
    if (!metadata_eq(a, b)) return "metadata";
    if (a->has_engine_layout != b->has_engine_layout ||
        (a->has_engine_layout &&
         (!bytes_eq(a->engine_layout.name, b->engine_layout.name) ||
          !bytes_eq(a->engine_layout.axes, b->engine_layout.axes) ||
          !bytes_eq(a->engine_layout.stride_order, b->engine_layout.stride_order) ||
          !bytes_eq(a->engine_layout.engine, b->engine_layout.engine) ||
          a->engine_layout.block_size != b->engine_layout.block_size)))
        return "engine_layout";
    if (a->codec_spec_count != b->codec_spec_count) return "codec_specs";
    for (i = 0; i < a->codec_spec_count; i++)
        if (!codec_spec_eq(&a->codec_specs[i], &b->codec_specs[i])) return "codec_specs";
    if (a->has_sparse != b->has_sparse) return "sparse";
    if (a->has_kv_scales != b->has_kv_scales || a->kv_scale_count != b->kv_scale_count) return "kv_scales";
    for (i = 0; a->has_kv_scales && i < a->kv_scale_count; i++)
        if (a->kv_scales[i].k_scale != b->kv_scales[i].k_scale || a->kv_scales[i].v_scale != b->kv_scales[i].v_scale)
            return "kv_scales";
    return NULL;
}

int kvw_seg_chain_kind(const kvw_header *h) { return h->has_prefix ? (int)h->prefix.scheme : -1; }

kvw_code kvw_seg_mismatch(kvw_error *err, const char *rule, const char *what, uint64_t s) {
    return kvw_fail(err, KVW_SEGMENT_MISMATCH, rule, "segment at position %llu: %s", (unsigned long long)s, what);
}

/* The checks of KVW-STREAM-5 after the sparse one, in its order, for segment h. On
 * success the chain entries before the segment are kept (*keep) for the join. */
kvw_code kvw_seg_check(const kvw_reassembly *ra, const kvw_header *h, size_t *keep, kvw_error *err) {
    uint64_t s = h->first_position, e, start = ra->have_base ? ra->start : s;
    uint32_t i, C = h->chunk_tokens ? h->chunk_tokens : 1;
    if (kvw_add_ovf(s, h->token_count, &e)) return kvw_seg_mismatch(err, "KVW-STREAM-5", "positions overflow", s);
    if (h->token_count < 1)
        return kvw_seg_mismatch(err, "KVW-STREAM-5", "a segment carries at least one token (token_count 0)", s);
    if (h->layer_tokens_count != h->arch.num_layers)
        return kvw_seg_mismatch(err, "KVW-STREAM-5", "a segment has the default layer token ranges", s);
    for (i = 0; i < h->arch.num_layers; i++) {
        const kvw_layer_spec *ls = kvw_layer(h, i);
        uint32_t want = ls && ls->kind == KVW_KIND_SHARED ? 0 : h->token_count;
        if (h->layer_tokens[i].start != 0 || h->layer_tokens[i].count != want)
            return kvw_fail(err, KVW_SEGMENT_MISMATCH, "KVW-STREAM-5",
                            "segment at position %llu: layer %u has token range [%u, +%u), not the default "
                            "[0, +%u)", (unsigned long long)s, i, h->layer_tokens[i].start,
                            h->layer_tokens[i].count, want);
    }
    if (ra->have_base) {
        const char *diff = shared_diff(&ra->base, h);
        if (!diff && kvw_seg_chain_kind(h) != ra->chain) diff = "prefix (present in some segments only, or another scheme)";
        if (diff)
            return kvw_fail(err, KVW_SEGMENT_MISMATCH, "KVW-STREAM-5",
                            "segment at position %llu: its %s differs from the first segment's (resolved values "
                            "compared)", (unsigned long long)s, diff);
        if (!(s == ra->end || (ra->partial && s == ra->last_start && e >= ra->end)))
            return kvw_fail(err, KVW_SEGMENT_ORDER, "KVW-STREAM-6",
                            "segment [%llu, %llu) neither continues the sequence at %llu nor supersedes a "
                            "partial segment at %llu", (unsigned long long)s, (unsigned long long)e,
                            (unsigned long long)ra->end, (unsigned long long)ra->last_start);
    }
    *keep = 0;
    if (h->has_prefix && h->prefix.scheme == SEG_PREFIX_SCHEME) {
        uint64_t k0;
        const uint8_t *expected;
        uint32_t expected_len;
        if ((s - start) % C)
            return kvw_fail(err, KVW_SEGMENT_MISMATCH, "KVW-STREAM-9",
                            "segment at %llu carries a prefix chain but does not start on the chunk grid of "
                            "the sequence (from %llu, chunks of %u)", (unsigned long long)s,
                            (unsigned long long)start, C);
        k0 = (s - start) / C;
        if (!ra->have_base || s == start) {
            expected = ra->have_base ? ra->base.prefix.root.ptr : h->prefix.root.ptr;
            expected_len = ra->have_base ? ra->base.prefix.root.len : h->prefix.root.len;
        } else {
            if (k0 > ra->hash_count)
                return kvw_seg_mismatch(err, "KVW-STREAM-9", "the chain so far has no entry for the chunk before it", s);
            expected = ra->hashes + (k0 - 1) * SEG_HASH_SIZE;
            expected_len = SEG_HASH_SIZE;
        }
        if (h->prefix.root.len != expected_len ||
            (expected_len && memcmp(h->prefix.root.ptr, expected, expected_len) != 0))
            return kvw_seg_mismatch(err, "KVW-STREAM-9",
                            "the prefix root is not the chain value of the sequence before its first position", s);
        *keep = (size_t)k0;
    }
    return KVW_OK;
}
