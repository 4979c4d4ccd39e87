/*
 * Header rules of spec/kvwire-v1.md 14.1 step 3 for the architecture (section 6 with
 * crossmodel.md STATE-2/3): each referenced layer spec in the order of KVW-ARCH-10, its
 * kind, fields, state tensors and cell size (LIM-4). Split from rules.c, whose
 * kvw_header_rules calls kvw_rules_architecture at its place in the order.
 */
#include "format/rules_impl.h"

/* ---- architecture (section 6, crossmodel.md section 6) ------------------------------ */

/* EVOL-9: a layer kind registered by a feature is in range only with the feature's bit. */
static int kind_enabled(uint8_t kind, uint64_t required_features) {
    if (kind >= KVW_LAYER_KIND_COUNT) return 0;
    if (kind == KVW_KIND_STATE) return (required_features & KVW_FEATURE_STATE_LAYERS) != 0;
    return 1;
}

static int state_name_char(uint8_t c) {
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
           c == '_' || c == '.' || c == '-';
}

static int bytes_equal(kvw_bytes a, kvw_bytes b) {
    return a.len == b.len && (a.len == 0 || memcmp(a.ptr, b.ptr, a.len) == 0);
}

/* KVW-STATE-2 for a referenced `state` spec: fields and source_layer, tensor count, then
 * per tensor name (with uniqueness), shape, size (LIM-4). */
static kvw_code check_state_spec(const kvw_layer_spec *s, uint32_t i, kvw_error *err) {
    if (s->num_kv_heads || s->head_dim_k || s->head_dim_v || s->window || s->kv_lora_rank ||
        s->qk_rope_head_dim || s->source_layer != -1)
        return kvw_fail(err, KVW_STATE_INVALID, "KVW-STATE-2",
                        "state layer %u declares attention fields (heads %u, head dims %u/%u, "
                        "window %u, kv_lora_rank %u, qk_rope_head_dim %u) or source_layer %d",
                        (unsigned)i, (unsigned)s->num_kv_heads, (unsigned)s->head_dim_k,
                        (unsigned)s->head_dim_v, (unsigned)s->window,
                        (unsigned)s->kv_lora_rank, (unsigned)s->qk_rope_head_dim,
                        (int)s->source_layer);
    if (s->state_tensor_count < 1 || s->state_tensor_count > 64)
        return kvw_fail(err, KVW_STATE_INVALID, "KVW-STATE-2",
                        "state layer %u has %u state tensors, need 1 to 64", (unsigned)i,
                        (unsigned)s->state_tensor_count);
    if (!s->state_tensors)
        return kvw_fail(err, KVW_STATE_INVALID, "KVW-STATE-2",
                        "state layer %u: state tensors missing", (unsigned)i);
    for (uint32_t j = 0; j < s->state_tensor_count; j++) {
        const kvw_state_tensor *t = &s->state_tensors[j];
        int ok = t->name.len >= 1 && t->name.len <= 256 && t->name.ptr != NULL;
        for (uint32_t c = 0; ok && c < t->name.len; c++) ok = state_name_char(t->name.ptr[c]);
        for (uint32_t q = 0; ok && q < j; q++)
            if (bytes_equal(s->state_tensors[q].name, t->name)) ok = 0;
        if (!ok)
            return kvw_fail(err, KVW_STATE_INVALID, "KVW-STATE-2",
                            "state layer %u tensor %u: name of %u bytes is empty, longer than "
                            "256 bytes, repeated or not [A-Za-z0-9_.-]",
                            (unsigned)i, (unsigned)j, (unsigned)t->name.len);
        if (t->shape.count < 1 || t->shape.count > 8)
            return kvw_fail(err, KVW_STATE_INVALID, "KVW-STATE-2",
                            "state layer %u tensor %u has %u dimensions, need 1 to 8",
                            (unsigned)i, (unsigned)j, (unsigned)t->shape.count);
        uint64_t n = kvw_dtype_size(t->dtype);
        int over = 0;
        for (uint32_t d = 0; d < t->shape.count; d++) {
            uint32_t dim = kvw_u32_at(t->shape, d);
            if (dim < 1)
                return kvw_fail(err, KVW_STATE_INVALID, "KVW-STATE-2",
                                "state layer %u tensor %u dimension %u is 0", (unsigned)i,
                                (unsigned)j, (unsigned)d);
            if (!over && kvw_mul_ovf(n, dim, &n)) over = 1;
        }
        if (over || n > (UINT64_C(1) << 32))
            return kvw_fail(err, KVW_LIMIT_EXCEEDED, "KVW-LIM-4",
                            "state layer %u tensor %u exceeds 2^32 bytes", (unsigned)i,
                            (unsigned)j);
    }
    return KVW_OK;
}

/* LIM-4 for one component: heads x dim x chunk_tokens x itemsize <= 2^32. */
static kvw_code check_cell(const kvw_header *h, uint32_t i, const char *comp, uint64_t heads,
                           uint64_t dim, kvw_error *err) {
    uint64_t n = heads;
    int over = kvw_mul_ovf(n, dim, &n) || kvw_mul_ovf(n, h->chunk_tokens, &n) ||
               kvw_mul_ovf(n, kvw_dtype_size(h->dtype), &n);
    if (over || n > (UINT64_C(1) << 32))
        return kvw_fail(err, KVW_LIMIT_EXCEEDED, "KVW-LIM-4",
                        "layer %u %s: a full cell of %llu heads x %llu x %u tokens x %u bytes "
                        "exceeds 2^32 bytes",
                        (unsigned)i, comp, (unsigned long long)heads, (unsigned long long)dim,
                        (unsigned)h->chunk_tokens, kvw_dtype_size(h->dtype));
    return KVW_OK;
}

/* The rules of one referenced layer spec, first referenced by layer i (KVW-ARCH-10). */
static kvw_code check_spec(const kvw_header *h, const kvw_layer_spec *s, uint32_t i,
                           kvw_error *err) {
    if (!kind_enabled(s->kind, h->required_features))
        return kvw_fail(err, KVW_ENUM_OUT_OF_RANGE, "KVW-EVOL-9",
                        "layer %u kind %u (%s): a kind registered by a feature needs its "
                        "required bit",
                        (unsigned)i, (unsigned)s->kind,
                        kvw_layer_kind_name(s->kind) ? kvw_layer_kind_name(s->kind) : "?");
    if (s->kind != KVW_KIND_STATE && s->state_tensor_count != 0)
        return kvw_fail(err, KVW_STATE_INVALID, "KVW-STATE-3",
                        "layer %u (%s) declares %u state tensors", (unsigned)i,
                        kvw_layer_kind_name(s->kind), (unsigned)s->state_tensor_count);
    if (s->kind == KVW_KIND_STATE) return check_state_spec(s, i, err);
    if (s->kind == KVW_KIND_SHARED) {
        if (s->num_kv_heads || s->head_dim_k || s->head_dim_v || s->window ||
            s->kv_lora_rank || s->qk_rope_head_dim)
            return kvw_fail(err, KVW_ARCH_INVALID, "KVW-ARCH-4",
                            "shared layer %u declares dimensions or a window (heads %u, head "
                            "dims %u/%u, window %u, kv_lora_rank %u, qk_rope_head_dim %u); "
                            "its source layer defines them",
                            (unsigned)i, (unsigned)s->num_kv_heads, (unsigned)s->head_dim_k,
                            (unsigned)s->head_dim_v, (unsigned)s->window,
                            (unsigned)s->kv_lora_rank, (unsigned)s->qk_rope_head_dim);
        return KVW_OK;
    }
    if (s->source_layer != -1)
        return kvw_fail(err, KVW_ARCH_INVALID, "KVW-ARCH-4",
                        "layer %u (%s) is not shared but has source_layer %d", (unsigned)i,
                        kvw_layer_kind_name(s->kind), (int)s->source_layer);
    if (s->kind == KVW_KIND_MLA_LATENT) {
        uint64_t width = (uint64_t)s->kv_lora_rank + s->qk_rope_head_dim;
        if (!(s->num_kv_heads == 1 && s->head_dim_v == 0 && s->kv_lora_rank >= 1 &&
              s->head_dim_k == width))
            return kvw_fail(err, KVW_ARCH_INVALID, "KVW-ARCH-5",
                            "mla_latent layer %u: num_kv_heads %u, head_dim_v %u, head_dim_k "
                            "%u, kv_lora_rank %u, qk_rope_head_dim %u; need 1 head, "
                            "head_dim_v 0, kv_lora_rank >= 1, head_dim_k = kv_lora_rank + "
                            "qk_rope_head_dim",
                            (unsigned)i, (unsigned)s->num_kv_heads, (unsigned)s->head_dim_v,
                            (unsigned)s->head_dim_k, (unsigned)s->kv_lora_rank,
                            (unsigned)s->qk_rope_head_dim);
    } else {
        if (s->head_dim_v < 1)
            return kvw_fail(err, KVW_ARCH_INVALID, "KVW-ARCH-2",
                            "layer %u (%s) has head_dim_v 0", (unsigned)i,
                            kvw_layer_kind_name(s->kind));
        if (s->kv_lora_rank || s->qk_rope_head_dim)
            return kvw_fail(err, KVW_ARCH_INVALID, "KVW-ARCH-5",
                            "layer %u (%s) sets MLA fields kv_lora_rank %u / qk_rope_head_dim "
                            "%u",
                            (unsigned)i, kvw_layer_kind_name(s->kind),
                            (unsigned)s->kv_lora_rank, (unsigned)s->qk_rope_head_dim);
    }
    if (s->num_kv_heads < 1 || s->num_kv_heads > 4096 || s->head_dim_k < 1 ||
        s->head_dim_k > 65536 || s->head_dim_v > 65536)
        return kvw_fail(err, KVW_ARCH_INVALID, "KVW-ARCH-2",
                        "layer %u: num_kv_heads %u / head_dim_k %u / head_dim_v %u outside "
                        "[1, 4096] / [1, 65536] / [0, 65536]",
                        (unsigned)i, (unsigned)s->num_kv_heads, (unsigned)s->head_dim_k,
                        (unsigned)s->head_dim_v);
    int windowed = s->kind == KVW_KIND_SLIDING_ATTENTION || s->kind == KVW_KIND_CHUNKED_ATTENTION;
    if ((s->window >= 1) != windowed)
        return kvw_fail(err, KVW_ARCH_INVALID, "KVW-ARCH-6",
                        "layer %u (%s) window %u: sliding and chunked layers need one, others "
                        "must have 0",
                        (unsigned)i, kvw_layer_kind_name(s->kind), (unsigned)s->window);
    kvw_code rc;
    if (s->kind == KVW_KIND_MLA_LATENT)
        return check_cell(h, i, "latent", 1, s->head_dim_k, err);
    if ((rc = check_cell(h, i, "k", s->num_kv_heads, s->head_dim_k, err)) != KVW_OK) return rc;
    return check_cell(h, i, "v", s->num_kv_heads, s->head_dim_v, err);
}

kvw_code kvw_rules_architecture(const kvw_header *h, kvw_error *err) {
    const kvw_arch *a = &h->arch;
    uint32_t n = a->num_layers;
    /* ARCH-1 is a decoding check (header.c); repeated as a guard for the indexing below. */
    if (n < 1 || n > KVW_MAX_LAYERS)
        return kvw_fail(err, n ? KVW_LIMIT_EXCEEDED : KVW_ARCH_INVALID, "KVW-ARCH-1",
                        "num_layers %u outside [1, 4096]", (unsigned)n);
    if (!a->layer_spec_index || a->layer_spec_index_count != n || !a->layer_specs ||
        a->layer_spec_count > KVW_MAX_LAYERS)
        return kvw_fail(err, KVW_ARCH_INVALID, "KVW-ARCH-1",
                        "layer_spec_index (%u entries) does not map %u layers onto %u specs",
                        (unsigned)a->layer_spec_index_count, (unsigned)n,
                        (unsigned)a->layer_spec_count);
    uint64_t checked[SPEC_BITSET_WORDS];
    memset(checked, 0, sizeof checked);
    for (uint32_t i = 0; i < n; i++) {
        uint16_t si = a->layer_spec_index[i];
        if (si >= a->layer_spec_count)
            return kvw_fail(err, KVW_ARCH_INVALID, "KVW-ARCH-1",
                            "layer %u names layer spec %u of %u", (unsigned)i, (unsigned)si,
                            (unsigned)a->layer_spec_count);
        const kvw_layer_spec *s = &a->layer_specs[si];
        uint64_t bit = UINT64_C(1) << (si % 64);
        if (!(checked[si / 64] & bit)) {
            checked[si / 64] |= bit;
            kvw_code rc = check_spec(h, s, i, err);
            if (rc != KVW_OK) return rc;
        }
        if (s->kind == KVW_KIND_SHARED) {
            int32_t src = s->source_layer;
            if (src < 0 || (uint32_t)src >= i || kvw_layer(h, (uint32_t)src)->kind == KVW_KIND_SHARED)
                return kvw_fail(err, KVW_ARCH_INVALID, "KVW-ARCH-4",
                                "shared layer %u has source_layer %d: must be an earlier, "
                                "non-shared layer",
                                (unsigned)i, (int)src);
        }
    }
    return KVW_OK;
}
