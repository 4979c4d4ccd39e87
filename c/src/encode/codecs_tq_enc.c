/*
 * int_affine revision 1.3's writer (spec/codecs.md section 9, informative; KVW-TQ-2, TQ-5):
 * the reference writer's TurboQuant bodies byte for byte as python/kvwire/codecs/turboquant.py,
 * the decoding side being decode/codecs_tq.c (its levels and sign masks are used here).
 */
#include "common/fp_exact.h" /* first: no FMA contraction, fp32 evaluation (KVW-LOSSY-3) */

#include "encode/encode.h"

#include <math.h>
#include <stdlib.h>

#define REFUSE(rule, ...) kvw_fail(err, KVW_ERR_UNSUPPORTED, rule, __VA_ARGS__)
#define ROWS 8 /* rows encoded together while they sit in L1 */

/* ---- encoding (the reference writer, section 9 informative) ---------------------------- */

kvw_code kvwc_tq_writer_fits(const kvw_codec_spec *s, const kvwc_geom *g, kvw_error *err) {
    if (s->codec != KVW_CODEC_INT_AFFINE || s->codebook != KVW_CODEBOOK_TURBOQUANT || !g->M ||
        !g->H || !g->D || (kvwc_pow2(g->D) && s->group_size >= g->D))
        return KVW_OK;
    return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "KVW-TQ-2",
                    "the turboquant codebook needs head_dim a power of two and group_size >= "
                    "head_dim: this layer has head_dim %llu, the spec group_size %u",
                    (unsigned long long)g->D, (unsigned)s->group_size);
}

/* Every nonzero row's largest magnitude inside rotation.band (codecs_rot_enc.c's band):
 * KVW-ROT-7 then holds by construction. */
static int rows_in_band(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                        const float *x) {
    double lo;
    float hi;
    kvwc_rot_band(h, s, g, &lo, &hi);
    uint64_t D = g->D;
    int avx2 = D % 8 == 0 && kvw_simd_rot();
    for (uint64_t r = 0; r < g->H * g->M; r++) {
        uint32_t a = 0;
        const float *xr = x + r * D;
        if (avx2) a = kvwc_tq_amax_avx2(xr, D);
        else for (uint64_t d = 0; d < D; d++) {
            uint32_t v = kvwc_f32_bits(xr[d]) & 0x7FFFFFFFu;
            a = v > a ? v : a;
        }
        if (!kvwc_rot_in_band(a, lo, hi)) return 0;
    }
    return 1;
}

/* n codes u of element i0 on or-ed into the zeroed bit string (KVW-ROT-3). */
static void pack_codes(const uint8_t *u, uint64_t i0, uint64_t n, unsigned b, uint8_t *codes) {
    uint64_t k = 0;
    if ((i0 * b) % 8 == 0) {
        uint8_t *p = codes + i0 * b / 8;
        if (b == 4)
            for (; k + 2 <= n; k += 2) *p++ = (uint8_t)(u[k] | (u[k + 1] << 4));
        else
            for (; k + 8 <= n; k += 8, p += 3) {
                uint32_t v = 0;
                for (unsigned q = 0; q < 8; q++) v |= (uint32_t)u[k + q] << (3 * q);
                p[0] = (uint8_t)v, p[1] = (uint8_t)(v >> 8), p[2] = (uint8_t)(v >> 16);
            }
    }
    for (; k < n; k++) {
        uint64_t bit = (i0 + k) * b;
        codes[bit >> 3] |= (uint8_t)(u[k] << (bit & 7));
        if ((bit & 7) + b > 8) codes[(bit >> 3) + 1] |= (uint8_t)(u[k] >> (8 - (bit & 7)));
    }
}

/* The midpoints M of vLLM's table T = L * 2^-e for this D, in fp32 (2^b - 1 of them). */
static void tq_midpoints(unsigned b, uint64_t D, float *mid) {
    unsigned k = kvwc_log2_floor(D), nm = (1u << b) - 1u;
    int e = ((int)k - ((k & 1) ? 7 : 6)) / 2; /* an even numerator: exact, no rounding */
    float lv[16];
    kvwc_tq_levels(b, D, lv);
    for (unsigned j = 0; j <= nm; j++) lv[j] = ldexpf(lv[j], -e); /* exact: a power of two */
    for (unsigned j = 0; j < nm; j++) mid[j] = (lv[j] + lv[j + 1]) / 2.0f;
}

/* A row's sum of squares in channel order (KVW-TQ-4's order, the chains the AVX2 kernel
 * runs a lane per row) and whether it holds a nonzero element. */
static float row_sumsq(const float *xr, uint64_t D, int *live) {
    float q = 0.0f;
    int nz = 0;
    for (uint64_t d = 0; d < D; d++) {
        float sq = xr[d] * xr[d];
        q = q + sq;
        nz |= xr[d] != 0.0f;
    }
    *live = nz;
    return q;
}

/* A row norm's bits in the scale dtype (nearest, ties to even) and KVW-TQ-5's verdict: 0 it
 * fits, 1 it is beyond the scale dtype, 2 a nonzero row's norm rounds to 0. */
static int norm_scale(float norm, unsigned sd, int live, uint32_t *sb) {
    *sb = kvwc_nearest_bits(norm, sd);
    float sf = kvwc_bits_value(*sb, sd);
    if ((kvwc_f32_bits(sf) & 0x7F800000u) == 0x7F800000u) return 1;
    return live && sf == 0.0f ? 2 : 0;
}

kvw_code kvwc_tq_encode(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                        float *x, uint8_t *body, kvw_error *err) {
    kvw_code rc = kvwc_tq_writer_fits(s, g, err);
    if (rc) return rc;
    uint64_t H = g->H, M = g->M, D = g->D, rows = H * M, n = rows * D;
    unsigned b = s->bits, sd = s->scale_dtype, nm = (1u << b) - 1u;
    uint8_t *params = body + g->fp_bytes, *codes = params + g->param_bytes;
    int check = !rows_in_band(h, s, g, x), rot = s->rotation != KVW_ROTATION_NONE;
    /* The input (for the decoded check), the sign masks, the row norms and codes. */
    size_t keep = check ? (size_t)n : 0;
    float *x0 = (float *)malloc((keep + (size_t)rows) * sizeof(float) + (size_t)D * 5 + 8);
    if (!x0) return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "turboquant: %llu elements",
                             (unsigned long long)n);
    float *norm = x0 + keep;
    uint32_t *mask = (uint32_t *)(void *)(norm + rows);
    uint8_t *u = (uint8_t *)(mask + D);
    if (check) memcpy(x0, x, (size_t)n * sizeof(float));
    /* Norms first (vLLM's order: before the rotation); their scales and KVW-TQ-5. AVX2:
     * 8 rows' squares added in channel order a lane per row, the same sums. */
    int avx2 = D >= 8 && kvw_simd_rot();
    float q8[ROWS];
    uint8_t live8[ROWS];
    for (uint64_t r = 0; !rc && r < rows; r++) {
        const float *xr = x + r * D;
        float q;
        int live;
        if (avx2 && r % ROWS == 0 && rows - r >= ROWS) kvwc_rot_sumsq8_avx2(xr, D, D, q8, live8);
        if (avx2 && rows - r + r % ROWS >= ROWS) q = q8[r % ROWS], live = live8[r % ROWS];
        else q = row_sumsq(xr, D, &live);
        norm[r] = sqrtf(q);
        uint32_t sb;
        int verdict = norm_scale(norm[r], sd, live, &sb);
        if (verdict == 1)
            rc = REFUSE("KVW-TQ-5", "turboquant: head %llu token %llu has a norm beyond the "
                        "scale dtype", (unsigned long long)(r / M), (unsigned long long)(g->P + r % M));
        else if (verdict == 2)
            rc = REFUSE("KVW-TQ-5", "turboquant: the nonzero row of head %llu token %llu has a "
                        "norm that rounds to 0", (unsigned long long)(r / M),
                        (unsigned long long)(g->P + r % M));
        else if (g->psize == 4) kvw_st32(params + 4 * r, sb);
        else kvw_st16(params + 2 * r, (uint16_t)sb);
    }
    if (rc) {
        free(x0);
        return rc;
    }
    float mid[15];
    tq_midpoints(b, D, mid);
    float cb = kvwc_rot_cb(D);
    if (rot) kvwc_rot_mask(s, D, mask);
    memset(codes, 0, (size_t)g->code_bytes); /* codes are or-ed in where rows share bytes */
    for (uint64_t r = 0; r < rows; r++) {
        float *y = x + r * D, den = norm[r] + 1e-8f; /* x / (||x|| + 1e-8), vLLM's */
        if (avx2) { /* whole bytes per row: D * b % 8 == 0 */
            kvwc_tq_enc_row_avx2(y, D, den, rot ? mask : NULL, cb, mid, b, codes + r * D * b / 8);
            continue;
        }
        for (uint64_t d = 0; d < D; d++) y[d] = y[d] / den;
        if (rot) { /* forward: signs, butterflies, then c_B (section 8.4) */
            for (uint64_t d = 0; d < D; d++) y[d] = kvwc_bits_f32(kvwc_f32_bits(y[d]) ^ mask[d]);
            kvwc_rot_row(y, D, D, cb, NULL);
            for (uint64_t d = 0; d < D; d++) y[d] = y[d] * cb;
        }
        for (uint64_t d = 0; d < D; d++) { /* u = #{ j : y >= M_j }, vLLM's bucketize */
            unsigned c = 0;
            for (unsigned j = 0; j < nm; j++) c += y[d] >= mid[j];
            u[d] = (uint8_t)c;
        }
        pack_codes(u, r * D, D, b, codes);
    }
    if (check) rc = kvwc_rot_check_decoded(h, s, g, x0, body, err);
    free(x0);
    return rc;
}

/* kvwc_tq_encode's steps on ROWS rows at a time while they sit in L1 (AVX2, D a power of two
 * >= 8, bf16 or f32): load (exact), the largest magnitude (finite, inside the band), the
 * sums of squares in channel order, norms and their scales, then each row's codes; the same
 * values as the careful path's passes over the whole chunk. 0 wherever that path would check
 * the decoded bytes or refuse: it then does it again and says why. */
static int tq_fused(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                    const uint8_t *raw, uint8_t *body) {
    uint64_t M = g->M, D = g->D, rows = g->H * M, rowb = D * g->w;
    unsigned b = s->bits, sd = s->scale_dtype;
    uint8_t *params = body + g->fp_bytes, *codes = params + g->param_bytes;
    float *y = (float *)malloc((size_t)(ROWS + 1) * (size_t)D * sizeof(float)), mid[15], cb = kvwc_rot_cb(D), hi;
    if (!y) return 0;
    uint32_t *mask = (uint32_t *)(void *)(y + ROWS * D);
    int rot = s->rotation != KVW_ROTATION_NONE, ok = 1;
    double lo;
    tq_midpoints(b, D, mid);
    kvwc_rot_band(h, s, g, &lo, &hi);
    if (rot) kvwc_rot_mask(s, D, mask); /* every code byte is written: D * b % 8 == 0 */
    for (uint64_t r0 = 0; ok && r0 < rows; r0 += ROWS) {
        uint64_t R = rows - r0 < ROWS ? rows - r0 : ROWS;
        float q[ROWS], norm[ROWS];
        uint8_t live[ROWS];
        for (uint64_t i = 0; ok && i < R; i++) {
            uint64_t r = r0 + i;
            uint32_t a;
            kvwc_rot_enc_row_avx2(raw + ((r / M) * g->T + g->P + r % M) * rowb, h->dtype, D, D, 1.0f, NULL,
                                  y + i * D, &a);
            ok = a < 0x7F800000u && kvwc_rot_in_band(a, lo, hi);
        }
        if (ok && R == ROWS) kvwc_rot_sumsq8_avx2(y, D, D, q, live);
        else
            for (uint64_t i = 0; ok && i < R; i++) {
                int nz;
                q[i] = row_sumsq(y + i * D, D, &nz);
                live[i] = (uint8_t)nz;
            }
        for (uint64_t i = 0; ok && i < R; i++) {
            uint32_t sb;
            norm[i] = sqrtf(q[i]);
            ok = norm_scale(norm[i], sd, live[i], &sb) == 0; /* KVW-TQ-5 */
            if (g->psize == 4) kvw_st32(params + 4 * (r0 + i), sb);
            else kvw_st16(params + 2 * (r0 + i), (uint16_t)sb);
        }
        for (uint64_t i = 0; ok && i < R; i++)
            kvwc_tq_enc_row_avx2(y + i * D, D, norm[i] + 1e-8f, rot ? mask : NULL, cb, mid, b,
                                 codes + (r0 + i) * D * b / 8);
    }
    free(y);
    return ok;
}

int kvwc_tq_qenc_fast(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                      const uint8_t *raw, uint8_t *body) {
    uint64_t H = g->H, M = g->M, D = g->D, rowb = D * g->w, n = H * M * D;
    if (kvwc_tq_writer_fits(s, g, NULL)) return 0; /* misuse: the careful path says so */
    if (D % 8 == 0 && h->dtype != KVW_DTYPE_F16 && kvw_simd_rot()) return tq_fused(h, s, g, raw, body);
    float *x = (float *)malloc((size_t)n * sizeof(float) + 4);
    if (!x) return 0;
    int ok = 1;
    for (uint64_t r = 0; ok && r < H * M; r++) { /* the quantized rows, in fp32; all finite */
        const uint8_t *p = raw + ((r / M) * g->T + g->P + r % M) * rowb;
        float *y = x + r * D;
        uint32_t bad = 0;
        for (uint64_t d = 0; d < D; d++) {
            if (h->dtype == KVW_DTYPE_F32) y[d] = kvwc_bits_f32(kvw_ld32(p + 4 * d));
            else if (h->dtype == KVW_DTYPE_BF16) y[d] = kvwc_from_bf16(kvw_ld16(p + 2 * d));
            else y[d] = kvwc_from_f16(kvw_ld16(p + 2 * d));
            bad |= (kvwc_f32_bits(y[d]) & 0x7F800000u) == 0x7F800000u;
        }
        ok = !bad;
    }
    /* Refusals, misuse and failures: the careful path does it again and reports. */
    ok = ok && kvwc_tq_encode(h, s, g, x, body, NULL) == KVW_OK;
    free(x);
    return ok;
}
