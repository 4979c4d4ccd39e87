/*
 * The geometry of a lossy body (spec/codecs.md: KVW-LOSSY-1, LOSSY-2, FP8-2, INT-2) from
 * the codec spec and the record alone: integer arithmetic with overflow checks, split from
 * codecs_lossy.c, which decodes the body with the normative fp32 arithmetic.
 */
#include "format/codec.h"

static int mul3(uint64_t a, uint64_t b, uint64_t c, uint64_t *out) {
    uint64_t t;
    return kvw_mul_ovf(a, b, &t) || kvw_mul_ovf(t, c, out);
}

/* heads(l) of spec/sparse.md section 2. */
static uint64_t sparse_heads(const kvw_layer_spec *ls) {
    if (!ls) return 0;
    switch (ls->kind) {
    case KVW_KIND_FULL_ATTENTION:
    case KVW_KIND_SLIDING_ATTENTION:
    case KVW_KIND_CHUNKED_ATTENTION: return ls->num_kv_heads;
    case KVW_KIND_MLA_LATENT: return 1;
    default: return 0;
    }
}

kvw_code kvwc_lossy_geometry(const kvw_header *h, const kvw_record *rec,
                             const kvw_codec_spec *s, kvwc_geom *g, kvw_error *err) {
    memset(g, 0, sizeof *g);
    /* The spec rules a decoder relies on (the header rules checked them already). */
    if (h->dtype != KVW_DTYPE_BF16 && h->dtype != KVW_DTYPE_F16 && h->dtype != KVW_DTYPE_F32)
        return kvw_fail(err, KVW_CODEC_SPEC_INVALID, "KVW-CSPEC-6",
                        "lossy codec spec in a container of dtype %u", h->dtype);
    if (s->lossless > KVW_CODEC_BYTEPLANE_ZSTD)
        return kvw_fail(err, KVW_CODEC_SPEC_INVALID, "KVW-CSPEC-4", "lossless stage %u",
                        s->lossless);
    if (s->codec == KVW_CODEC_FP8) {
        if (s->fp8_format < KVW_DTYPE_F8_E4M3FN || s->fp8_format > KVW_DTYPE_F8_E4M3FNUZ)
            return kvw_fail(err, KVW_CODEC_SPEC_INVALID, "KVW-FP8-1", "fp8_format %u",
                            s->fp8_format);
        if (s->scale_granularity > KVW_SCALE_TOKEN)
            return kvw_fail(err, KVW_CODEC_SPEC_INVALID, "KVW-CSPEC-4", "scale_granularity %u",
                            s->scale_granularity);
    } else if (s->codec == KVW_CODEC_INT_AFFINE) {
        int rot = (h->required_features & KVW_FEATURE_ROTATION) != 0;
        if (s->bits != 2 && s->bits != 4 && s->bits != 8 && !(rot && s->bits == 3))
            return kvw_fail(err, KVW_CODEC_SPEC_INVALID, "KVW-INT-1", "bits %u", s->bits);
        unsigned top = (h->required_features & KVW_FEATURE_TURBOQUANT) ? 2 : 1; /* TQ-1 */
        if (s->rotation > top || s->codebook > top ||
            (s->codebook == KVW_CODEBOOK_GAUSSIAN && (!s->symmetric || s->bits == 8)))
            return kvw_fail(err, KVW_CODEC_SPEC_INVALID, "KVW-ROT-2",
                            "rotation %u, codebook %u (symmetric %u, bits %u)", s->rotation,
                            s->codebook, s->symmetric, s->bits);
        if ((s->rotation == KVW_ROTATION_SYLVESTER && s->rotation_seed) ||
            (s->codebook == KVW_CODEBOOK_TURBOQUANT &&
             (!s->symmetric || s->group_axis != KVW_GROUP_CHANNELS || (s->bits != 3 && s->bits != 4))))
            return kvw_fail(err, KVW_CODEC_SPEC_INVALID, "KVW-TQ-2",
                            "rotation %u (seed %llu), codebook %u (symmetric %u, group_axis %u, "
                            "bits %u)", s->rotation, (unsigned long long)s->rotation_seed,
                            s->codebook, s->symmetric, s->group_axis, s->bits);
        if (s->scale_dtype > KVW_DTYPE_F32)
            return kvw_fail(err, KVW_CODEC_SPEC_INVALID, "KVW-INT-1", "scale_dtype %u",
                            s->scale_dtype);
        if (s->group_size < 1 || s->group_size > 65536)
            return kvw_fail(err, KVW_CODEC_SPEC_INVALID, "KVW-INT-2", "group_size %u",
                            (unsigned)s->group_size);
        if (s->group_axis > KVW_GROUP_CHANNELS)
            return kvw_fail(err, KVW_CODEC_SPEC_INVALID, "KVW-CSPEC-4", "group_axis %u",
                            s->group_axis);
    } else {
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "codec %u is not lossy", s->codec);
    }
    if (rec->component != KVW_COMP_K && rec->component != KVW_COMP_V &&
        rec->component != KVW_COMP_LATENT)
        return kvw_fail(err, KVW_CODEC_SPEC_MISMATCH, "KVW-CSPEC-9",
                        "lossy codec spec on a chunk of component %u", rec->component);
    const kvw_layer_spec *ls = kvw_layer(h, rec->layer);
    if (!ls)
        return kvw_fail(err, KVW_LAYER_OUT_OF_RANGE, "KVW-CHUNK-1", "layer %u of %u",
                        rec->layer, h->arch.num_layers);
    uint64_t H = rec->head_count, T = rec->token_count, w = kvw_dtype_size(h->dtype);
    uint64_t D = rec->component == KVW_COMP_V ? ls->head_dim_v : ls->head_dim_k, len;
    if (mul3(H, T, D, &len) || kvw_mul_ovf(len, w, &len) || len != rec->raw_length)
        return kvw_fail(err, KVW_LENGTH_MISMATCH, h->has_sparse ? "KVW-SPARSE-8" : "KVW-CHUNK-4",
                        "raw_length %llu for a chunk [%llu, %llu, %llu] of %llu-byte elements",
                        (unsigned long long)rec->raw_length, (unsigned long long)H,
                        (unsigned long long)T, (unsigned long long)D, (unsigned long long)w);
    int64_t lo, hi;
    if (h->has_sparse) { /* KVW-CSPEC-8: the head's retained index space */
        uint64_t entry = rec->head_start;
        for (uint32_t l = 0; l < rec->layer; l++) entry += sparse_heads(kvw_layer(h, l));
        if (entry >= h->sparse.retained_counts.count)
            return kvw_fail(err, KVW_SPARSE_INVALID, "KVW-SPARSE-3",
                            "no retained count for layer %u head %u", rec->layer, rec->head_start);
        lo = 0;
        hi = kvw_u32_at(h->sparse.retained_counts, (uint32_t)entry);
    } else if (rec->layer < h->layer_tokens_count && h->layer_tokens) {
        lo = h->layer_tokens[rec->layer].start;
        hi = lo + (int64_t)h->layer_tokens[rec->layer].count;
    } else {
        lo = 0;
        hi = h->token_count;
    }
    /* KVW-LOSSY-1 (all values below 2^34: int64 is exact). */
    int64_t t0 = rec->token_start, t1 = t0 + (int64_t)T, S = s->sink_tokens, R = s->residual_tokens;
    int64_t sink_end = hi < lo + S ? hi : lo + S;
    int64_t resid_start = lo > hi - R ? lo : hi - R;
    int64_t qa = t0 > sink_end ? t0 : sink_end;
    if (qa > t1) qa = t1;
    int64_t qb = t0 > resid_start ? t0 : resid_start;
    if (qb > t1) qb = t1;
    if (qb < qa) qb = qa;
    g->H = H, g->T = T, g->D = D, g->w = w;
    g->ohs = T * D * w; /* no overflow: H * T * D * w is the record's raw_length, checked above */
    g->P = (uint64_t)(qa - t0), g->Q = (uint64_t)(t1 - qb), g->M = (uint64_t)(qb - qa);
    uint64_t M = g->M, HMD;
    if (mul3(H, M, D, &HMD)) goto overflow;
    if (s->codec == KVW_CODEC_FP8) {
        g->bits = 8, g->psize = 4, g->zeros = 0;
        g->nparams = !M ? 0 : s->scale_granularity == KVW_SCALE_TENSOR ? 1
                   : s->scale_granularity == KVW_SCALE_HEAD ? H : H * M;
    } else {
        uint64_t G = s->group_size;
        g->bits = s->bits, g->psize = kvw_dtype_size(s->scale_dtype), g->zeros = !s->symmetric;
        g->gm = (M + G - 1) / G, g->gd = (D + G - 1) / G;
        if (M && (s->group_axis == KVW_GROUP_TOKENS ? mul3(H, g->gm, D, &g->nparams)
                                                    : mul3(H, M, g->gd, &g->nparams)))
            goto overflow;
    }
    uint64_t t;
    if (mul3(H, g->P + g->Q, D, &t) || kvw_mul_ovf(t, w, &g->fp_bytes) ||
        mul3(g->nparams, g->psize, g->zeros ? 2 : 1, &g->param_bytes) ||
        kvw_mul_ovf(HMD, g->bits, &t))
        goto overflow;
    g->code_bytes = t / 8 + (t % 8 != 0);
    if (kvw_add_ovf(g->fp_bytes, g->param_bytes, &t) || kvw_add_ovf(t, g->code_bytes, &g->Lb))
        goto overflow;
    return KVW_OK;
overflow:
    return kvw_fail(err, KVW_LENGTH_MISMATCH, "KVW-LOSSY-2", "lossy body length overflows");
}
