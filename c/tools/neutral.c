/*
 * Neutral JSON of a header (conformance/PROTOCOL.md 2.2, the reference's
 * python/kvwire/conformance/neutral.py), the output direction: kvwire-c decode renders the
 * library's parsed header. The input direction (an encode spec's header back into a
 * kvw_header) is neutral_parse.c on the field readers of neutral_fields.c.
 */
#include "neutral.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- header -> JSON ----------------------------------------------------------------- */

static void put_enum(sbuf *b, const char *name, int code) {
    if (name) sb_jcstr(b, name);
    else sb_printf(b, "%d", code);
}

static void put_bytes_str(sbuf *b, kvw_bytes s) { sb_jstr(b, (const char *)s.ptr, s.ptr ? s.len : 0); }

static void put_bool(sbuf *b, int v) { sb_puts(b, v ? "true" : "false"); }

static void put_rope(sbuf *b, const kvw_rope *r) {
    uint32_t i;
    if (!r) { sb_puts(b, "null"); return; }
    sb_puts(b, "{\"rope_type\": ");
    put_enum(b, kvw_rope_type_name(r->rope_type), r->rope_type);
    sb_puts(b, ", \"theta\": "); sb_f64(b, r->theta);
    sb_printf(b, ", \"rotary_dim\": %u, \"interleaved\": ", r->rotary_dim);
    put_bool(b, r->interleaved);
    sb_puts(b, ", \"factor\": "); sb_f64(b, r->factor);
    sb_printf(b, ", \"original_max_position_embeddings\": %u", r->original_max_position_embeddings);
    sb_puts(b, ", \"low_freq_factor\": "); sb_f64(b, r->low_freq_factor);
    sb_puts(b, ", \"high_freq_factor\": "); sb_f64(b, r->high_freq_factor);
    sb_puts(b, ", \"beta_fast\": "); sb_f64(b, r->beta_fast);
    sb_puts(b, ", \"beta_slow\": "); sb_f64(b, r->beta_slow);
    sb_puts(b, ", \"attention_factor\": "); sb_f64(b, r->attention_factor);
    sb_puts(b, ", \"mscale\": "); sb_f64(b, r->mscale);
    sb_puts(b, ", \"mscale_all_dim\": "); sb_f64(b, r->mscale_all_dim);
    sb_puts(b, ", \"short_factor\": [");
    for (i = 0; i < r->short_factor.count; i++) {
        if (i) sb_puts(b, ", ");
        sb_f64(b, kvw_f64_at(r->short_factor, i));
    }
    sb_puts(b, "], \"long_factor\": [");
    for (i = 0; i < r->long_factor.count; i++) {
        if (i) sb_puts(b, ", ");
        sb_f64(b, kvw_f64_at(r->long_factor, i));
    }
    sb_puts(b, "], \"mrope_section\": [");
    for (i = 0; i < r->mrope_section.count; i++) sb_printf(b, "%s%u", i ? ", " : "", kvw_u32_at(r->mrope_section, i));
    sb_puts(b, "], \"seq_len_at_encode\": ");
    sb_u64(b, r->seq_len_at_encode);
    sb_puts(b, ", \"truncate\": ");
    put_bool(b, r->truncate);
    sb_puts(b, "}");
}

static void put_layer(sbuf *b, const kvw_layer_spec *s) {
    uint32_t i, j;
    sb_puts(b, "{\"kind\": ");
    put_enum(b, kvw_layer_kind_name(s->kind), s->kind);
    sb_printf(b, ", \"num_kv_heads\": %u, \"head_dim_k\": %u, \"head_dim_v\": %u, \"window\": %u, "
                 "\"source_layer\": %d, \"uses_rope\": ",
              s->num_kv_heads, s->head_dim_k, s->head_dim_v, s->window, (int)s->source_layer);
    put_bool(b, s->uses_rope);
    sb_puts(b, ", \"rope\": ");
    put_rope(b, s->rope);
    sb_printf(b, ", \"kv_lora_rank\": %u, \"qk_rope_head_dim\": %u", s->kv_lora_rank, s->qk_rope_head_dim);
    if (s->state_tensor_count) {
        sb_puts(b, ", \"state_tensors\": [");
        for (i = 0; i < s->state_tensor_count; i++) {
            const kvw_state_tensor *t = &s->state_tensors[i];
            sb_puts(b, i ? ", {\"name\": " : "{\"name\": ");
            put_bytes_str(b, t->name);
            sb_puts(b, ", \"shape\": [");
            for (j = 0; j < t->shape.count; j++) sb_printf(b, "%s%u", j ? ", " : "", kvw_u32_at(t->shape, j));
            sb_puts(b, "], \"dtype\": ");
            put_enum(b, kvw_dtype_name(t->dtype), t->dtype);
            sb_puts(b, "}");
        }
        sb_puts(b, "]");
    }
    sb_puts(b, "}");
}

static int cmp_kv(const void *x, const void *y) {
    const kvw_key_value *a = *(const kvw_key_value *const *)x, *c = *(const kvw_key_value *const *)y;
    uint32_t n = a->key.len < c->key.len ? a->key.len : c->key.len;
    int r = n ? memcmp(a->key.ptr, c->key.ptr, n) : 0;
    if (r) return r;
    return a->key.len < c->key.len ? -1 : a->key.len > c->key.len;
}

void neutral_header_to_json(sbuf *b, const kvw_header *h) {
    uint32_t i;
    const kvw_model *m = &h->model;
    sb_printf(b, "{\"format_major\": %u, \"format_minor\": %u, \"required_features\": ", h->format_major,
              h->format_minor);
    sb_u64(b, h->required_features);
    sb_puts(b, ", \"optional_features\": ");
    sb_u64(b, h->optional_features);
    sb_puts(b, ", \"producer\": {\"library\": ");
    put_bytes_str(b, h->producer_library);
    sb_puts(b, ", \"version\": ");
    put_bytes_str(b, h->producer_version);
    sb_puts(b, "}, \"model\": {\"model_type\": ");
    put_bytes_str(b, m->model_type);
    sb_puts(b, ", \"model_id\": "); put_bytes_str(b, m->model_id);
    sb_puts(b, ", \"revision\": "); put_bytes_str(b, m->revision);
    sb_puts(b, ", \"config_fingerprint\": "); sb_hex(b, m->config_fingerprint.ptr, m->config_fingerprint.len);
    sb_puts(b, ", \"tokenizer_fingerprint\": "); sb_hex(b, m->tokenizer_fingerprint.ptr, m->tokenizer_fingerprint.len);
    sb_puts(b, ", \"weights_fingerprint\": "); sb_hex(b, m->weights_fingerprint.ptr, m->weights_fingerprint.len);
    sb_puts(b, ", \"compat_fingerprint\": "); sb_hex(b, m->compat_fingerprint.ptr, m->compat_fingerprint.len);
    sb_puts(b, ", \"framework\": "); put_bytes_str(b, m->framework);
    sb_puts(b, ", \"framework_version\": "); put_bytes_str(b, m->framework_version);
    sb_puts(b, ", \"layer_weights_fingerprints\": ");
    sb_hex(b, m->layer_weights_fingerprints.ptr, m->layer_weights_fingerprints.len);
    sb_printf(b, ", \"fingerprint_scheme\": %u}", m->fingerprint_scheme);

    sb_printf(b, ", \"arch\": {\"schema_version\": %u, \"keys_post_rope\": ", h->arch.schema_version);
    put_bool(b, h->arch.keys_post_rope);
    sb_puts(b, ", \"rope\": ");
    put_rope(b, h->arch.rope);
    sb_puts(b, ", \"layers\": [");
    for (i = 0; i < h->arch.num_layers; i++) {
        const kvw_layer_spec *s = kvw_layer(h, i);
        if (i) sb_puts(b, ", ");
        if (s) put_layer(b, s);
        else sb_puts(b, "null");
    }
    sb_puts(b, "]}, \"layer_map\": [");
    for (i = 0; i < h->layer_map_count; i++) {
        const kvw_layer_map_entry *e = &h->layer_map[i];
        sb_printf(b, "%s{\"receiver_layer\": %u, \"transmitted_layer\": %d, \"op\": ", i ? ", " : "",
                  e->receiver_layer, (int)e->transmitted_layer);
        put_enum(b, kvw_map_op_name(e->op), e->op);
        sb_puts(b, "}");
    }
    sb_puts(b, "], \"dtype\": ");
    put_enum(b, kvw_dtype_name(h->dtype), h->dtype);
    sb_printf(b, ", \"alignment\": %u, \"chunk_tokens\": %u, \"first_position\": ", h->alignment, h->chunk_tokens);
    sb_u64(b, h->first_position);
    sb_printf(b, ", \"token_count\": %u, \"layer_tokens\": [", h->token_count);
    for (i = 0; i < h->layer_tokens_count; i++)
        sb_printf(b, "%s{\"start\": %u, \"count\": %u}", i ? ", " : "", h->layer_tokens[i].start,
                  h->layer_tokens[i].count);
    sb_puts(b, "], \"checksum_algorithm\": ");
    if (h->checksum_algorithm == KVW_CHECKSUM_XXH3_64) sb_puts(b, "\"xxh3_64\"");
    else sb_printf(b, "%u", h->checksum_algorithm);
    sb_puts(b, ", \"metadata\": {");
    if (h->metadata_count) {
        const kvw_key_value **sorted = malloc(h->metadata_count * sizeof *sorted);
        if (!sorted) { b->oom = 1; return; }
        for (i = 0; i < h->metadata_count; i++) sorted[i] = &h->metadata[i];
        qsort(sorted, h->metadata_count, sizeof *sorted, cmp_kv);
        for (i = 0; i < h->metadata_count; i++) {
            if (i) sb_puts(b, ", ");
            put_bytes_str(b, sorted[i]->key);
            sb_puts(b, ": ");
            sb_hex(b, sorted[i]->value.ptr, sorted[i]->value.len);
        }
        free(sorted);
    }
    sb_puts(b, "}");
    if (h->codec_spec_count) {
        sb_puts(b, ", \"codec_specs\": [");
        for (i = 0; i < h->codec_spec_count; i++) {
            const kvw_codec_spec *c = &h->codec_specs[i];
            sb_puts(b, i ? ", {\"codec\": " : "{\"codec\": ");
            put_enum(b, kvw_codec_name(c->codec), c->codec);
            sb_puts(b, ", \"lossless\": "); put_enum(b, kvw_codec_name(c->lossless), c->lossless);
            sb_puts(b, ", \"fp8_format\": "); put_enum(b, kvw_dtype_name(c->fp8_format), c->fp8_format);
            sb_puts(b, ", \"scale_granularity\": ");
            put_enum(b, kvw_scale_granularity_name(c->scale_granularity), c->scale_granularity);
            sb_printf(b, ", \"bits\": %u, \"group_size\": %u, \"group_axis\": ", c->bits, c->group_size);
            put_enum(b, kvw_group_axis_name(c->group_axis), c->group_axis);
            sb_puts(b, ", \"symmetric\": "); put_bool(b, c->symmetric);
            sb_puts(b, ", \"scale_dtype\": "); put_enum(b, kvw_dtype_name(c->scale_dtype), c->scale_dtype);
            sb_printf(b, ", \"sink_tokens\": %u, \"residual_tokens\": %u", c->sink_tokens, c->residual_tokens);
            /* revision 1.2 (codecs.md 8.1; defaults without bit 4): as the twins have them, only
             * where they differ from their defaults (kvwire's spec_to_json) */
            if (c->rotation) { sb_puts(b, ", \"rotation\": "); put_enum(b, kvw_rotation_name(c->rotation), c->rotation); }
            if (c->rotation_seed) { sb_puts(b, ", \"rotation_seed\": "); sb_u64(b, c->rotation_seed); }
            if (c->codebook) { sb_puts(b, ", \"codebook\": "); put_enum(b, kvw_codebook_name(c->codebook), c->codebook); }
            sb_puts(b, "}");
        }
        sb_puts(b, "]");
    }
    if (h->has_sparse) {
        sb_puts(b, ", \"sparse\": {\"method\": ");
        put_bytes_str(b, h->sparse.method);
        sb_puts(b, ", \"next_position\": ");
        sb_u64(b, h->sparse.next_position);
        sb_puts(b, ", \"retained_counts\": [");
        for (i = 0; i < h->sparse.retained_counts.count; i++)
            sb_printf(b, "%s%u", i ? ", " : "", kvw_u32_at(h->sparse.retained_counts, i));
        sb_printf(b, "], \"sink_tokens\": %u, \"window_tokens\": %u}", h->sparse.sink_tokens,
                  h->sparse.window_tokens);
    }
    if (h->has_kv_scales) {
        sb_puts(b, ", \"kv_scales\": [");
        for (i = 0; i < h->kv_scale_count; i++) {
            sb_puts(b, i ? ", {\"k_scale\": " : "{\"k_scale\": ");
            sb_f64(b, (double)h->kv_scales[i].k_scale);
            sb_puts(b, ", \"v_scale\": ");
            sb_f64(b, (double)h->kv_scales[i].v_scale);
            sb_puts(b, "}");
        }
        sb_puts(b, "]");
    }
    if (h->has_prefix) {
        sb_printf(b, ", \"prefix\": {\"scheme\": %u, \"root\": ", h->prefix.scheme);
        sb_hex(b, h->prefix.root.ptr, h->prefix.root.len);
        sb_puts(b, ", \"hashes\": ");
        sb_hex(b, h->prefix.hashes.ptr, h->prefix.hashes.len);
        sb_puts(b, "}");
    }
    if (h->has_engine_layout) {
        const kvw_engine_layout *e = &h->engine_layout;
        sb_puts(b, ", \"engine_layout\": {\"name\": ");
        put_bytes_str(b, e->name);
        sb_puts(b, ", \"axes\": ");
        put_bytes_str(b, e->axes);
        sb_puts(b, ", \"stride_order\": [");
        for (i = 0; i < e->stride_order.len; i++) sb_printf(b, "%s%u", i ? ", " : "", e->stride_order.ptr[i]);
        sb_printf(b, "], \"block_size\": %u, \"engine\": ", e->block_size);
        put_bytes_str(b, e->engine);
        sb_puts(b, "}");
    }
    sb_puts(b, "}");
}
