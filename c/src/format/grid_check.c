/*
 * The per-record checks of spec section 8 in the order of the note at the end of 8.3
 * (with CSPEC-9, STATE-8 and SPARSE-7..9 where the companions put them), against the
 * chunk grid of grid.c: split from grid.c, which builds the grid; the contract for both
 * is grid.h.
 */
#include "format/grid.h"

/* ---- record checks ---------------------------------------------------------------- */

static int lossy_codec(uint8_t codec) {
    return codec == KVW_CODEC_FP8 || codec == KVW_CODEC_INT_AFFINE;
}

static kvw_code check_cspec(const kvw_header *h, const kvw_record *r, kvw_error *err) {
    if (!(h->required_features & KVW_FEATURE_CODEC_SPECS)) return KVW_OK;
    uint32_t i = r->reserved0;
    if (i > h->codec_spec_count)
        return kvw_fail(err, KVW_CODEC_SPEC_MISMATCH, "KVW-CSPEC-9",
                        "codec_spec %u but the header has %u codec specs", i,
                        h->codec_spec_count);
    if (i == 0) {
        if (r->codec > KVW_CODEC_ZSTD)
            return kvw_fail(err, KVW_CODEC_SPEC_MISMATCH, "KVW-CSPEC-9",
                            "codec %u with codec_spec 0 (a codec_spec 0 record is raw or zstd)",
                            r->codec);
        return KVW_OK;
    }
    const kvw_codec_spec *s = &h->codec_specs[i - 1];
    if (r->codec != s->codec)
        return kvw_fail(err, KVW_CODEC_SPEC_MISMATCH, "KVW-CSPEC-9",
                        "codec %u with codec_spec %u whose codec is %u", r->codec, i, s->codec);
    if (lossy_codec(s->codec) && r->component > KVW_COMP_LATENT)
        return kvw_fail(err, KVW_CODEC_SPEC_MISMATCH, "KVW-CSPEC-9",
                        "lossy codec spec %u on component %u", i, r->component);
    return KVW_OK;
}

static uint32_t geo_heads(const kvw_grid_impl *gi, const kvw_record *r) {
    return gi->heads[(size_t)r->layer * KVW_NCOMP + r->component];
}
static uint32_t geo_dim(const kvw_grid_impl *gi, const kvw_record *r) {
    return gi->dims[(size_t)r->layer * KVW_NCOMP + r->component];
}

/* STATE-7 raw length of state tensor `which` of a state layer spec; 0 on overflow. */
static uint64_t state_nbytes(const kvw_state_tensor *t) {
    uint64_t n = kvw_dtype_size(t->dtype);
    for (uint32_t i = 0; i < t->shape.count; i++)
        if (kvw_mul_ovf(n, kvw_u32_at(t->shape, i), &n)) return 0;
    return n;
}

static kvw_code dense_step(const kvw_header *h, const kvw_grid_impl *gi, const kvw_record *r,
                           kvw_record_step step, kvw_error *err) {
    const kvw_layer_spec *s = kvw_layer(h, r->layer);
    int state = r->component == KVW_COMP_STATE;
    uint64_t lo = h->layer_tokens[r->layer].start;
    uint64_t hi = lo + h->layer_tokens[r->layer].count;
    uint64_t t0 = r->token_start, n = r->token_count, t1 = t0 + n;
    switch (step) {
    case KVW_RS_KIND_CODEC:
        if (state && (r->codec > KVW_CODEC_ZSTD || r->reserved0 != 0))
            return kvw_fail(err, KVW_STATE_INVALID, "KVW-STATE-8",
                            "state chunk (layer %u) with codec %u and codec_spec %u: raw or zstd "
                            "and codec_spec 0 only", r->layer, r->codec, r->reserved0);
        return KVW_OK;
    case KVW_RS_GRID_A: {
        uint64_t C = state ? (hi > 1 ? hi : 1) : gi->chunk;
        if (n < 1 || t0 < lo || t1 > hi || (t0 != lo && t0 % C) || (t1 != hi && t1 % C) ||
            t0 / C != (t1 - 1) / C)
            return kvw_fail(err, KVW_CHUNK_BOUNDARY, state ? "KVW-STATE-7" : "KVW-CHUNK-2",
                            "layer %u tokens [%llu, %llu) are not one cell of the grid of "
                            "[%llu, %llu) with chunk_tokens %llu", r->layer,
                            (unsigned long long)t0, (unsigned long long)t1,
                            (unsigned long long)lo, (unsigned long long)hi,
                            (unsigned long long)C);
        return KVW_OK;
    }
    case KVW_RS_GRID_B: {
        uint32_t head_max = state ? s->state_tensor_count - 1 : 0;
        if (r->head_start > head_max || r->head_count != geo_heads(gi, r))
            return kvw_fail(err, KVW_HEAD_RANGE, state ? "KVW-STATE-7" : "KVW-CHUNK-3",
                            "layer %u component %u: head_start %u head_count %u, expected "
                            "%s and %u", r->layer, r->component, r->head_start, r->head_count,
                            state ? "a state tensor index" : "0", geo_heads(gi, r));
        return KVW_OK;
    }
    case KVW_RS_RAW_LENGTH: {
        uint64_t want;
        int ovf = 0;
        if (state) {
            want = r->head_start < s->state_tensor_count
                       ? state_nbytes(&s->state_tensors[r->head_start]) : 0;
            ovf = want == 0;
        } else {
            ovf = kvw_mul_ovf(geo_heads(gi, r), n, &want) ||
                  kvw_mul_ovf(want, geo_dim(gi, r), &want) ||
                  kvw_mul_ovf(want, kvw_dtype_size(h->dtype), &want);
        }
        if (ovf || r->raw_length != want)
            return kvw_fail(err, KVW_LENGTH_MISMATCH, state ? "KVW-STATE-7" : "KVW-CHUNK-4",
                            "layer %u component %u: raw_length %llu, the chunk's tensor has "
                            "%llu bytes", r->layer, r->component,
                            (unsigned long long)r->raw_length, (unsigned long long)want);
        return KVW_OK;
    }
    default: return KVW_OK;
    }
}

static kvw_code sparse_step(const kvw_header *h, const kvw_grid_impl *gi, const kvw_record *r,
                            kvw_record_step step, kvw_error *err) {
    int pos = r->component == KVW_COMP_POSITIONS;
    uint64_t C = gi->chunk;
    uint64_t t0 = r->token_start, n = r->token_count, t1 = t0 + n;
    switch (step) {
    case KVW_RS_KIND_CODEC:
        if (pos && (r->codec > KVW_CODEC_ZSTD || r->reserved0 != 0))
            return kvw_fail(err, KVW_POSITIONS_CODEC, "KVW-SPARSE-9",
                            "POSITIONS chunk (layer %u) with codec %u and codec_spec %u: raw or "
                            "zstd and codec_spec 0 only", r->layer, r->codec, r->reserved0);
        return KVW_OK;
    case KVW_RS_GRID_A:
        if (r->head_start >= geo_heads(gi, r) || r->head_count != 1)
            return kvw_fail(err, KVW_HEAD_RANGE, "KVW-SPARSE-7",
                            "layer %u: head_start %u head_count %u; a sparse chunk holds one "
                            "of the layer's %u heads", r->layer, r->head_start, r->head_count,
                            geo_heads(gi, r));
        return KVW_OK;
    case KVW_RS_GRID_B: {
        uint64_t cnt = kvw_u32_at(h->sparse.retained_counts,
                                  (uint32_t)(gi->entry[r->layer] + r->head_start));
        if (n < 1 || t1 > cnt || t0 % C || (t1 != cnt && t1 % C))
            return kvw_fail(err, KVW_CHUNK_BOUNDARY, "KVW-SPARSE-7",
                            "layer %u head %u: tokens [%llu, %llu) are not one cell of the "
                            "head's grid [0, %llu)", r->layer, r->head_start,
                            (unsigned long long)t0, (unsigned long long)t1,
                            (unsigned long long)cnt);
        return KVW_OK;
    }
    case KVW_RS_RAW_LENGTH: {
        uint64_t raw = r->raw_length;
        if (pos) {
            if (raw < n || raw > 9 * n)
                return kvw_fail(err, KVW_LENGTH_MISMATCH, "KVW-SPARSE-8",
                                "POSITIONS chunk of %llu tokens with raw_length %llu (must be "
                                "%llu to %llu)", (unsigned long long)n, (unsigned long long)raw,
                                (unsigned long long)n, (unsigned long long)(9 * n));
            return KVW_OK;
        }
        uint64_t want = n * geo_dim(gi, r) * kvw_dtype_size(h->dtype); /* < 2^52 */
        if (raw != want)
            return kvw_fail(err, KVW_LENGTH_MISMATCH, "KVW-SPARSE-8",
                            "layer %u component %u: raw_length %llu, one head's rows are %llu "
                            "bytes", r->layer, r->component, (unsigned long long)raw,
                            (unsigned long long)want);
        return KVW_OK;
    }
    default: return KVW_OK;
    }
}

kvw_code kvw_record_check_step(const kvw_header *h, const kvw_grid *g, const kvw_record *r,
                               kvw_record_step step, kvw_error *err) {
    const kvw_grid_impl *gi = kvw_gi(g);
    uint64_t f = h->required_features;
    switch (step) {
    case KVW_RS_LAYER:
        if (r->layer >= h->arch.num_layers)
            return kvw_fail(err, KVW_LAYER_OUT_OF_RANGE, "KVW-CHUNK-1",
                            "record layer %u, the header has %u layers", r->layer,
                            h->arch.num_layers);
        return KVW_OK;
    case KVW_RS_COMPONENT_CODE:
        if (r->component >= KVW_COMPONENT_COUNT ||
            (r->component == KVW_COMP_STATE && !(f & KVW_FEATURE_STATE_LAYERS)) ||
            (r->component == KVW_COMP_POSITIONS && !(f & KVW_FEATURE_SPARSE)))
            return kvw_fail(err, KVW_ENUM_OUT_OF_RANGE, "KVW-CHUNK-1",
                            "component code %u is not in the registry (or its feature bit is "
                            "not set, KVW-EVOL-9)", r->component);
        return KVW_OK;
    case KVW_RS_COMPONENT_KIND:
        if (geo_heads(gi, r) == 0)
            return kvw_fail(err, KVW_COMPONENT_INVALID, "KVW-CHUNK-1",
                            "layer %u (kind %s) does not store component %s", r->layer,
                            kvw_layer_kind_name(kvw_layer(h, r->layer)->kind),
                            kvw_component_name(r->component));
        return KVW_OK;
    case KVW_RS_RESERVED:
        if ((r->reserved0 && !(f & KVW_FEATURE_CODEC_SPECS)) || r->reserved1)
            return kvw_fail(err, KVW_RESERVED_NONZERO, "KVW-CHUNK-7",
                            "record reserved0 %u, reserved1 %u: must be 0", r->reserved0,
                            r->reserved1);
        return KVW_OK;
    case KVW_RS_FLAGS:
        if (r->flags & 0xFF00u)
            return kvw_fail(err, KVW_UNSUPPORTED_FEATURE, "KVW-EVOL-4",
                            "record flags 0x%04x set a required bit this reader does not "
                            "implement", r->flags);
        return KVW_OK;
    case KVW_RS_CODEC:
        if (r->codec >= KVW_CODEC_COUNT ||
            (r->codec > KVW_CODEC_ZSTD && !(f & KVW_FEATURE_CODEC_SPECS)))
            return kvw_fail(err, KVW_UNKNOWN_CODEC, "KVW-CHUNK-5",
                            "codec %u is not in the registry (or its feature bit is not set, "
                            "KVW-EVOL-9)", r->codec);
        return KVW_OK;
    case KVW_RS_CSPEC: return check_cspec(h, r, err);
    case KVW_RS_KIND_CODEC:
    case KVW_RS_GRID_A:
    case KVW_RS_GRID_B:
    case KVW_RS_RAW_LENGTH:
        return gi->sparse ? sparse_step(h, gi, r, step, err) : dense_step(h, gi, r, step, err);
    case KVW_RS_STORED_LENGTH:
        if (r->stored_length == 0)
            return kvw_fail(err, KVW_LENGTH_MISMATCH, "KVW-CHUNK-4", "stored_length is 0");
        return KVW_OK;
    case KVW_RS_RAW_STORED:
        if (r->codec == KVW_CODEC_RAW && r->stored_length != r->raw_length)
            return kvw_fail(err, KVW_RAW_LENGTH_MISMATCH, "KVW-CHUNK-6",
                            "raw codec with stored_length %llu != raw_length %llu",
                            (unsigned long long)r->stored_length,
                            (unsigned long long)r->raw_length);
        return KVW_OK;
    default: return KVW_OK;
    }
}

/* The contract's coarser rules map onto the steps (KVW_RR_CODEC covers CHUNK-5, CSPEC-9 and
 * STATE-8 / SPARSE-9; KVW_RR_BOUNDARY and KVW_RR_HEADS are the two grid steps in the
 * container's order; KVW_RR_EXTRA has nothing left to check). */
kvw_code kvw_record_check_rule(const kvw_header *h, const kvw_grid *g, const kvw_record *r,
                               kvw_record_rule rule, kvw_error *err) {
    static const int8_t first[KVW_RR_COUNT] = {
        KVW_RS_LAYER, KVW_RS_COMPONENT_CODE, KVW_RS_COMPONENT_KIND, KVW_RS_RESERVED,
        KVW_RS_FLAGS, KVW_RS_CODEC, KVW_RS_GRID_A, KVW_RS_GRID_B, KVW_RS_RAW_LENGTH,
        KVW_RS_STORED_LENGTH, KVW_RS_RAW_STORED, -1};
    static const int8_t last[KVW_RR_COUNT] = {
        KVW_RS_LAYER, KVW_RS_COMPONENT_CODE, KVW_RS_COMPONENT_KIND, KVW_RS_RESERVED,
        KVW_RS_FLAGS, KVW_RS_KIND_CODEC, KVW_RS_GRID_A, KVW_RS_GRID_B, KVW_RS_RAW_LENGTH,
        KVW_RS_STORED_LENGTH, KVW_RS_RAW_STORED, -1};
    if ((int)rule < 0 || rule >= KVW_RR_COUNT || first[rule] < 0) return KVW_OK;
    for (int s = first[rule]; s <= last[rule]; s++) {
        kvw_code c = kvw_record_check_step(h, g, r, (kvw_record_step)s, err);
        if (c) return c;
    }
    return KVW_OK;
}
