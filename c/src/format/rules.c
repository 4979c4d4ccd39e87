/*
 * Header rules of spec/kvwire-v1.md section 14.1 step 3, applied to a decoded header in
 * the order the spec gives (KVW-ERR-4): the order decides which code a header with
 * several defects reports. This file holds the header-wide rules, layer token ranges,
 * sparse.md SPARSE-1..5, state layers and the layer map (and the order itself);
 * rules_arch.c the architecture (section 6 with crossmodel.md STATE-2/3); rules2.c the
 * prefix chain, fingerprints, metadata keys, codec specs and kv scales. Decoding-time
 * checks (FlatBuffers, enums, vector limits, ARCH-1) belong to header.c and are not
 * repeated here except where a cheap guard keeps this code safe on its own.
 */
#include "format/rules_impl.h"

/* ---- header-wide rules ------------------------------------------------------------- */

static kvw_code check_header_wide(const kvw_header *h, kvw_error *err) {
    if (h->format_major != KVW_FORMAT_MAJOR)
        return kvw_fail(err, KVW_UNSUPPORTED_VERSION, "KVW-PRE-2",
                        "header format_major %u, this reader implements %u",
                        (unsigned)h->format_major, (unsigned)KVW_FORMAT_MAJOR);
    uint64_t unknown = h->required_features & ~KVW_FEATURES_KNOWN;
    if (unknown)
        return kvw_fail(err, KVW_UNSUPPORTED_FEATURE, "KVW-EVOL-3",
                        "required feature bits 0x%llx are not implemented",
                        (unsigned long long)unknown);
    uint32_t a = h->alignment;
    if (a < 64 || a > (UINT32_C(1) << 21) || (a & (a - 1)) != 0)
        return kvw_fail(err, KVW_BAD_ALIGNMENT, "KVW-CONV-2",
                        "alignment %u is not a power of two in [64, 2097152]", (unsigned)a);
    if (h->chunk_tokens < 1 || h->chunk_tokens > (UINT32_C(1) << 20))
        return kvw_fail(err, KVW_BAD_CHUNK_TOKENS, "KVW-HDR-11",
                        "chunk_tokens %u outside [1, 1048576]", (unsigned)h->chunk_tokens);
    uint64_t t = h->token_count;
    if (t > (UINT64_C(1) << 31) - 1 || h->first_position >= (UINT64_C(1) << 63) - t)
        return kvw_fail(err, KVW_LIMIT_EXCEEDED, "KVW-LIM-3",
                        "token_count %llu from first_position %llu: token_count must be at "
                        "most 2^31-1 and first_position + token_count below 2^63",
                        (unsigned long long)t, (unsigned long long)h->first_position);
    return KVW_OK;
}

/* ---- layer token ranges (5.7) ------------------------------------------------------- */

/* Layer i's resolved range: the carried one, else the default (KVW-HDR-15). */
static kvw_token_range layer_range(const kvw_header *h, uint32_t i) {
    if (h->layer_tokens && i < h->layer_tokens_count) return h->layer_tokens[i];
    kvw_token_range r = {0, 0};
    if (kvw_layer(h, i)->kind != KVW_KIND_SHARED) r.count = h->token_count;
    return r;
}

static int carries_layer_tokens(const kvw_header *h) {
    return h->has_layer_tokens && h->layer_tokens_count != 0; /* empty = absent, HDR-15 */
}

static kvw_code check_layer_tokens(const kvw_header *h, kvw_error *err) {
    uint32_t n = h->arch.num_layers;
    if (carries_layer_tokens(h) && h->layer_tokens_count != n)
        return kvw_fail(err, KVW_TOKEN_RANGE_INVALID, "KVW-HDR-13",
                        "%u layer token ranges for %u layers", (unsigned)h->layer_tokens_count,
                        (unsigned)n);
    for (uint32_t i = 0; i < n; i++) {
        kvw_token_range r = layer_range(h, i);
        if ((uint64_t)r.start + r.count > h->token_count)
            return kvw_fail(err, KVW_TOKEN_RANGE_INVALID, "KVW-HDR-13",
                            "layer %u tokens [%u, %llu) exceed token_count %u", (unsigned)i,
                            (unsigned)r.start, (unsigned long long)r.start + r.count,
                            (unsigned)h->token_count);
        if (r.count && kvw_layer(h, i)->kind == KVW_KIND_SHARED)
            return kvw_fail(err, KVW_TOKEN_RANGE_INVALID, "KVW-HDR-13",
                            "shared layer %u declares %u tokens", (unsigned)i,
                            (unsigned)r.count);
    }
    return KVW_OK;
}

/* ---- sparse (sparse.md section 2) --------------------------------------------------- */

static uint32_t sparse_heads(const kvw_layer_spec *s) {
    if (s->kind == KVW_KIND_SHARED) return 0;
    return s->kind == KVW_KIND_MLA_LATENT ? 1 : s->num_kv_heads;
}

static kvw_code check_sparse(const kvw_header *h, kvw_error *err) {
    int bit = (h->required_features & KVW_FEATURE_SPARSE) != 0;
    if (!!h->has_sparse != bit)
        return kvw_fail(err, KVW_SPARSE_INVALID, "KVW-SPARSE-1",
                        "Header.sparse is %s but required feature bit 1 (sparse) is %s",
                        h->has_sparse ? "present" : "absent", bit ? "set" : "clear");
    if (!h->has_sparse) return KVW_OK;
    uint32_t n = h->arch.num_layers;
    uint64_t entries = 0;
    for (uint32_t i = 0; i < n; i++) {
        const kvw_layer_spec *s = kvw_layer(h, i);
        if (s->kind > KVW_KIND_SHARED)
            return kvw_fail(err, KVW_SPARSE_INVALID, "KVW-SPARSE-2",
                            "layer %u of kind %s cannot be sparse", (unsigned)i,
                            kvw_layer_kind_name(s->kind) ? kvw_layer_kind_name(s->kind) : "?");
    }
    for (uint32_t i = 0; i < n; i++) entries += sparse_heads(kvw_layer(h, i));
    const kvw_vec rc = h->sparse.retained_counts;
    if (rc.count != entries)
        return kvw_fail(err, KVW_SPARSE_INVALID, "KVW-SPARSE-3",
                        "retained_counts has %u entries, the layers have %llu kv heads",
                        (unsigned)rc.count, (unsigned long long)entries);
    uint32_t top = 0;
    for (uint32_t j = 0; j < rc.count; j++) {
        uint32_t c = kvw_u32_at(rc, j);
        if (c > top) top = c;
    }
    if (h->token_count != top)
        return kvw_fail(err, KVW_SPARSE_INVALID, "KVW-SPARSE-4",
                        "token_count %u is not the largest retained count %u",
                        (unsigned)h->token_count, (unsigned)top);
    for (uint32_t i = 0; i < n; i++) {
        kvw_token_range r = layer_range(h, i);
        uint32_t want = kvw_layer(h, i)->kind == KVW_KIND_SHARED ? 0 : h->token_count;
        if (r.start != 0 || r.count != want)
            return kvw_fail(err, KVW_SPARSE_INVALID, "KVW-SPARSE-4",
                            "layer %u has token range [%u, +%u): a sparse container has no "
                            "layer_tokens",
                            (unsigned)i, (unsigned)r.start, (unsigned)r.count);
    }
    uint64_t lo = h->first_position + h->token_count; /* < 2^63 by LIM-3 */
    if (h->sparse.next_position < lo || h->sparse.next_position >= (UINT64_C(1) << 63))
        return kvw_fail(err, KVW_SPARSE_INVALID, "KVW-SPARSE-5",
                        "next_position %llu outside [first_position + token_count, 2^63) = "
                        "[%llu, 2^63)",
                        (unsigned long long)h->sparse.next_position, (unsigned long long)lo);
    return KVW_OK;
}

/* ---- state layers (crossmodel.md STATE-4, STATE-5) ----------------------------------- */

static kvw_code check_state_layers(const kvw_header *h, kvw_error *err) {
    for (uint32_t i = 0; i < h->arch.num_layers; i++) {
        const kvw_layer_spec *s = kvw_layer(h, i);
        if (s->kind == KVW_KIND_SHARED &&
            kvw_layer(h, (uint32_t)s->source_layer)->kind == KVW_KIND_STATE)
            return kvw_fail(err, KVW_STATE_INVALID, "KVW-STATE-5",
                            "shared layer %u has state layer %d as its source", (unsigned)i,
                            (int)s->source_layer);
        if (s->kind == KVW_KIND_STATE) {
            kvw_token_range r = layer_range(h, i);
            if (r.start != 0 || r.count != h->token_count)
                return kvw_fail(err, KVW_TOKEN_RANGE_INVALID, "KVW-STATE-4",
                                "state layer %u tokens [%u, +%u): a state covers exactly "
                                "[0, %u)",
                                (unsigned)i, (unsigned)r.start, (unsigned)r.count,
                                (unsigned)h->token_count);
        }
    }
    return KVW_OK;
}

/* ---- layer map (section 7) ---------------------------------------------------------- */

static kvw_code check_layer_map(const kvw_header *h, kvw_error *err) {
    uint32_t n = h->arch.num_layers;
    if (h->layer_map_count == 0) return KVW_OK;
    if (!h->layer_map || h->layer_map_count > KVW_MAX_LAYERS)
        return kvw_fail(err, KVW_LIMIT_EXCEEDED, "KVW-LIM-1",
                        "layer map of %u entries, limit 4096", (unsigned)h->layer_map_count);
    uint64_t seen[SPEC_BITSET_WORDS];
    memset(seen, 0, sizeof seen);
    /* owner[t]: 1 + smallest receiver layer copying transmitted layer t, 0 when none */
    uint16_t owner[KVW_MAX_LAYERS];
    memset(owner, 0, sizeof owner);
    for (uint32_t j = 0; j < h->layer_map_count; j++) {
        const kvw_layer_map_entry *e = &h->layer_map[j];
        if (e->op >= KVW_MAP_OP_COUNT)
            return kvw_fail(err, KVW_ENUM_OUT_OF_RANGE, "KVW-HDR-10", "layer map op %u",
                            (unsigned)e->op);
        uint32_t r = e->receiver_layer;
        if (r >= KVW_MAX_LAYERS || (seen[r / 64] >> (r % 64) & 1))
            return kvw_fail(err, KVW_LAYER_MAP_INVALID, "KVW-MAP-1",
                            "layer map entry %u: receiver layer %u out of range or mapped "
                            "twice",
                            (unsigned)j, (unsigned)r);
        seen[r / 64] |= UINT64_C(1) << (r % 64);
        if (e->op == KVW_MAP_COPY || e->op == KVW_MAP_ALIAS) {
            if (e->transmitted_layer < 0 || (uint32_t)e->transmitted_layer >= n)
                return kvw_fail(err, KVW_LAYER_MAP_INVALID, "KVW-MAP-1",
                                "layer map entry %u: %s from transmitted layer %d outside "
                                "[0, %u)",
                                (unsigned)j, kvw_map_op_name(e->op), (int)e->transmitted_layer,
                                (unsigned)n);
            if (e->op == KVW_MAP_COPY) {
                uint16_t *o = &owner[e->transmitted_layer];
                if (*o == 0 || r + 1 < *o) *o = (uint16_t)(r + 1);
            }
        } else if (e->transmitted_layer != -1) {
            return kvw_fail(err, KVW_LAYER_MAP_INVALID, "KVW-MAP-1",
                            "layer map entry %u: %s must have transmitted_layer -1, not %d",
                            (unsigned)j, kvw_map_op_name(e->op), (int)e->transmitted_layer);
        }
    }
    for (uint32_t j = 0; j < h->layer_map_count; j++) {
        const kvw_layer_map_entry *e = &h->layer_map[j];
        if (e->op != KVW_MAP_ALIAS) continue;
        uint16_t o = owner[e->transmitted_layer];
        if (o != 0 && (uint32_t)(o - 1) > e->receiver_layer)
            return kvw_fail(err, KVW_LAYER_MAP_INVALID, "KVW-MAP-4",
                            "receiver layer %u aliases transmitted layer %d before receiver "
                            "layer %u copies it (a consumer before its producer)",
                            (unsigned)e->receiver_layer, (int)e->transmitted_layer,
                            (unsigned)(o - 1));
    }
    return KVW_OK;
}

/* ---- entry point ---------------------------------------------------------------------- */

kvw_code kvw_header_rules(const kvw_header *h, kvw_error *err) {
    kvw_code rc;
    if (!h) return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "header is NULL");
    if ((rc = check_header_wide(h, err)) != KVW_OK) return rc;
    if ((rc = kvw_rules_architecture(h, err)) != KVW_OK) return rc;
    if ((rc = check_layer_tokens(h, err)) != KVW_OK) return rc;
    if ((rc = check_sparse(h, err)) != KVW_OK) return rc;
    if ((rc = check_state_layers(h, err)) != KVW_OK) return rc;
    if ((rc = check_layer_map(h, err)) != KVW_OK) return rc;
    if ((rc = kvw_rules_prefix(h, err)) != KVW_OK) return rc;
    if ((rc = kvw_rules_fingerprints(h, err)) != KVW_OK) return rc;
    if ((rc = kvw_rules_metadata(h, err)) != KVW_OK) return rc;
    if ((rc = kvw_rules_codec_specs(h, err)) != KVW_OK) return rc;
    return kvw_rules_kv_scales(h, err);
}
