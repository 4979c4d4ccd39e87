/*
 * int_affine revision 1.3 (spec/codecs.md section 9, KVW-TQ-1..5): vLLM's TurboQuant
 * key codebook and the unsigned rotation, byte for byte as python/kvwire/codecs/turboquant.py.
 * vLLM's turboquant_*_nc caches store each key row as Lloyd-Max indices after an unsigned
 * Hadamard rotation, plus the row's fp16 norm, and decode the codebook vector re-normalised
 * to unit length times the norm; carrying those numbers as they are needs a codebook whose
 * decoding divides by the row's own norm (KVW-TQ-4), which section 8's per-element levels
 * cannot express. Decoding is fp32 in a fixed order (the squares added one channel at a time,
 * a correctly rounded sqrtf, a division, two multiplications, then section 8.4's rotation),
 * so every reader produces the same bytes. Why a file apart from codecs_rot*.c: the row's
 * norm makes the codebook a whole-row step of its own; the 1.2 files reach this one through
 * one-line hooks (the rotation's sign masks, kvwc_rot_mask, and the dispatch). The writer's
 * side is encode/codecs_tq_enc.c.
 */
#include "common/fp_exact.h" /* first: no FMA contraction, fp32 evaluation (KVW-LOSSY-3) */

#include "decode/decode.h"

#include <math.h>
#include <stdlib.h>

/* KVW-TQ-4's table, upper halves as fp32 bits: [b == 4][log2(D) odd]. vLLM's centroids for
 * D = 64 (even) and D = 128 (odd); other powers of two scale them by powers of two, which the
 * normalisation cancels exactly. */
static const uint32_t LEVEL_BITS[2][2][8] = {
    {{0x3CFADCFBu, 0x3DC171FCu, 0x3E2BED53u, 0x3E899F54u},
     {0x3CB16317u, 0x3D88C955u, 0x3DF3243Du, 0x3E42A09Fu}},
    {{0x3C83828Au, 0x3D46B9FFu, 0x3DA82948u, 0x3DF1444Au, 0x3E20CD0Cu, 0x3E4F16C0u, 0x3E846170u,
      0x3EAEC76Eu},
     {0x3C39FBAEu, 0x3D0C8559u, 0x3D6DD0E1u, 0x3DAA99F2u, 0x3DE3682Bu, 0x3E126F17u, 0x3E3B36E7u,
      0x3E772CC4u}}};

void kvwc_tq_levels(unsigned b, uint64_t D, float *lv) {
    const uint32_t *pos = LEVEL_BITS[b == 4][kvwc_log2_floor(D) & 1];
    unsigned half = 1u << (b - 1);
    for (unsigned u = 0; u < 2 * half; u++) /* L[half - 1 - i] = -L[half + i] */
        lv[u] = u >= half ? kvwc_bits_f32(pos[u - half])
                          : kvwc_bits_f32(pos[half - 1 - u] | 0x80000000u);
}

void kvwc_rot_mask(const kvw_codec_spec *s, uint64_t D, uint32_t *mask) {
    if (s->rotation == KVW_ROTATION_HADAMARD)
        kvwc_rot_signs(s->rotation_seed, D, mask);
    else /* sylvester: sigma = +1 (KVW-TQ-3), the sign flip a no-op */
        memset(mask, 0, (size_t)D * sizeof(uint32_t));
}

/* ---- decoding ------------------------------------------------------------------------- */

/* n codes of b bits from element i0 on (KVW-ROT-3's little-endian bit string). */
static void unpack_codes(const uint8_t *codes, uint64_t i0, uint64_t n, unsigned b, uint8_t *u) {
    uint64_t k = 0;
    if ((i0 * b) % 8 == 0) { /* from a byte boundary: 8 codes are b whole bytes */
        const uint8_t *p = codes + i0 * b / 8;
        if (b == 4)
            for (; k + 2 <= n; k += 2, p++) u[k] = *p & 15, u[k + 1] = *p >> 4;
        else
            for (; k + 8 <= n; k += 8, p += 3) {
                uint32_t v = p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16);
                for (unsigned q = 0; q < 8; q++) u[k + q] = (uint8_t)((v >> (3 * q)) & 7);
            }
    }
    for (; k < n; k++) {
        uint64_t bit = (i0 + k) * b, at = bit >> 3;
        unsigned sh = (unsigned)(bit & 7), v = codes[at];
        if (sh + b > 8) v |= (unsigned)codes[at + 1] << 8;
        u[k] = (uint8_t)((v >> sh) & ((1u << b) - 1u));
    }
}

static void store_row(uint8_t *dst, const float *x, uint64_t n, unsigned dtype) {
    if (dtype == KVW_DTYPE_F32)
        for (uint64_t i = 0; i < n; i++) kvw_st32(dst + 4 * i, kvwc_to_f32(x[i]));
    else if (dtype == KVW_DTYPE_BF16)
        for (uint64_t i = 0; i < n; i++) kvw_st16(dst + 2 * i, kvwc_to_bf16(x[i]));
    else
        for (uint64_t i = 0; i < n; i++) kvw_st16(dst + 2 * i, kvwc_to_f16(x[i]));
}

#define ROWS 8 /* rows decoded together: their sums of squares are independent chains */

/* KVW-TQ-4 on R <= ROWS rows of codes u ([R, D]) with scales s: v = L[u], n = the squares
 * added in order, inv = 1 / sqrt(n), then y = (v * inv) * s. n >= D * L[half]^2 > 0. Each
 * row's sum keeps its own order; the rows only interleave (ILP, not reassociation). */
static void tq_rows(const uint8_t *u, const float *lv, const float *s, uint64_t R, uint64_t D,
                    float *y) {
    float n[ROWS] = {0};
    for (uint64_t i = 0; i < R * D; i++) y[i] = lv[u[i]];
    if (R == ROWS) /* the common case: a constant trip count the compiler unrolls */
        for (uint64_t d = 0; d < D; d++)
            for (uint64_t r = 0; r < ROWS; r++) {
                float v = y[r * D + d], sq = v * v;
                n[r] = n[r] + sq;
            }
    else
        for (uint64_t d = 0; d < D; d++)
            for (uint64_t r = 0; r < R; r++) {
                float v = y[r * D + d], sq = v * v;
                n[r] = n[r] + sq;
            }
    for (uint64_t r = 0; r < R; r++) {
        float inv = 1.0f / sqrtf(n[r]), sv = s[r];
        float *yr = y + r * D;
        for (uint64_t d = 0; d < D; d++) {
            float t = yr[d] * inv; /* two roundings (KVW-LOSSY-3) */
            yr[d] = t * sv;
        }
    }
}

kvw_code kvwc_tq_decode(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                        const uint8_t *params, const uint8_t *codes, uint8_t *out,
                        kvw_error *err) {
    float *sc;
    kvw_error pe;
    kvw_code rc = kvwc_int_params(s, g, params, codes, &sc, &pe);
    /* The reference's order: the scales (KVW-INT-3), the chunk's geometry, the padding. */
    int padding = rc == KVW_DECODE_FAILED && pe.rule && strcmp(pe.rule, "KVW-INT-3") != 0;
    if (rc && !padding) {
        if (err) *err = pe;
        return rc;
    }
    uint64_t H = g->H, D = g->D, M = g->M, w = g->w;
    if (!kvwc_pow2(D) || s->group_size < D) {
        free(sc);
        return kvw_fail(err, KVW_DECODE_FAILED, "KVW-TQ-2",
                        "the turboquant codebook needs head_dim a power of two and group_size >= "
                        "head_dim (one group per token row); has head_dim %llu, group_size %u",
                        (unsigned long long)D, (unsigned)s->group_size);
    }
    if (rc) {
        if (err) *err = pe;
        return rc;
    }
    unsigned b = g->bits;
    size_t Dn = (size_t)D;
    /* ROWS rows of values and codes, one row of sign masks */
    uint8_t *scratch = D < SIZE_MAX / 128 ? (uint8_t *)malloc(Dn * (5 * ROWS + 4) + 16) : NULL;
    if (!scratch) {
        free(sc);
        return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "turboquant rows of %llu channels",
                        (unsigned long long)D);
    }
    float *y = (float *)(void *)scratch;
    uint32_t *mask = (uint32_t *)(void *)(y + ROWS * Dn);
    uint8_t *u = (uint8_t *)(mask + Dn);
    float lv[16] = {0};
    kvwc_tq_levels(b, D, lv);
    int rot = s->rotation != KVW_ROTATION_NONE;
    float cb = kvwc_rot_cb(D); /* B = D: D is a power of two */
    if (rot) kvwc_rot_mask(s, D, mask);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    int avx2 = h->dtype == KVW_DTYPE_BF16 && D >= 8 && D <= 128 && kvw_simd_rot(); /* in registers */
#else
    int avx2 = 0;
#endif
    for (uint64_t r0 = 0; r0 < H * M; r0 += ROWS) { /* one scale per row: groups >= D */
        uint64_t R = H * M - r0 < ROWS ? H * M - r0 : ROWS;
        if (avx2 && R == ROWS) {
            kvwc_tq_rows8_bf16(g, codes + r0 * D * b / 8, lv, sc + r0, rot ? mask : NULL, cb, r0, out);
            continue;
        }
        unpack_codes(codes, r0 * D, R * D, b, u);
        tq_rows(u, lv, sc + r0, R, D, y);
        for (uint64_t r = r0; r < r0 + R; r++) {
            float *yr = y + (r - r0) * D;
            if (rot) kvwc_rot_row(yr, D, D, cb, mask); /* back from the rotated basis (TQ-3) */
            store_row(out + (r / M) * g->ohs + (g->P + r % M) * D * w, yr, D, h->dtype);
        }
    }
    free(scratch);
    free(sc);
    return KVW_OK;
}
