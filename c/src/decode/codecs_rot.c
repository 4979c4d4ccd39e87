/*
 * int_affine revision 1.2 decoding (spec/codecs.md section 8: KVW-ROT-3..6): 3-bit codes
 * (a little-endian bit string), the gaussian codebook (x = C_b[u] * s) and the inverse
 * randomized Hadamard rotation of each quantized token row, in the fp32 order the spec
 * fixes (butterfly stages h = 1, 2, .., B/2, then (y * c_B) * sigma), so that every reader
 * produces the same bytes. Why a file apart from codecs_lossy.c: the rotation works on whole
 * token rows (the butterflies need all D channels), where the 1.0 decoder streams blocks of
 * elements; specs without these features keep the 1.0 path untouched. The row transform
 * has an AVX2 build (simd/rot_avx2.c), chosen at run time like hash.c's.
 */
#include "common/fp_exact.h" /* first: no FMA contraction, fp32 evaluation (KVW-LOSSY-3) */

#include "decode/decode.h"

#include <stdlib.h>

/* ---- shared with the encoder (codecs_rot_enc.c) ---------------------------------------- */

float kvwc_rot_cb(uint64_t B) {
    unsigned k = 0;
    while (k < 63 && (UINT64_C(1) << k) < B) k++;
    float p = kvwc_bits_f32((uint32_t)(127 - (int)(k / 2)) << 23); /* 2^-floor(k/2), exact */
    return (k & 1) ? p * kvwc_bits_f32(0x3F3504F3u) : p;           /* exact: a power of two */
}

void kvwc_rot_signs(uint64_t seed, uint64_t D, uint32_t *mask) {
    uint64_t state = seed;
    for (uint64_t d = 0; d < D; d++) { /* SplitMix64 (KVW-ROT-5) */
        state += UINT64_C(0x9E3779B97F4A7C15);
        uint64_t z = state;
        z = (z ^ (z >> 30)) * UINT64_C(0xBF58476D1CE4E5B9);
        z = (z ^ (z >> 27)) * UINT64_C(0x94D049BB133111EB);
        z ^= z >> 31;
        mask[d] = (uint32_t)(z >> 63) << 31;
    }
}

void kvwc_rot_row_portable(float *y, uint64_t D, uint64_t B, float cb, const uint32_t *mask) {
    for (uint64_t j = 0; j < D; j += B)
        for (uint64_t hh = 1; hh < B; hh *= 2) /* stages in this order (KVW-ROT-6) */
            for (uint64_t i0 = j; i0 < j + B; i0 += 2 * hh)
                for (uint64_t i = i0; i < i0 + hh; i++) {
                    float a = y[i], b = y[i + hh];
                    y[i] = a + b;
                    y[i + hh] = a - b;
                }
    if (!mask) return;
    for (uint64_t d = 0; d < D; d++) /* the sign flip is exact: an xor of the sign bit */
        y[d] = kvwc_bits_f32(kvwc_f32_bits(y[d] * cb) ^ mask[d]);
}


void kvwc_rot_row(float *y, uint64_t D, uint64_t B, float cb, const uint32_t *mask) {
    if (B >= 8 && kvw_simd_rot())
        kvwc_rot_row_avx2(y, D, B, cb, mask);
    else
        kvwc_rot_row_portable(y, D, B, cb, mask);
}

/* Positive levels C_b[2^(b-1) ..] as fp32 bits (the normative table of KVW-ROT-4). */
static const uint32_t POS2[2] = {0x3EE7D2C9u, 0x3FC1555Du};
static const uint32_t POS3[4] = {0x3E7AF9F8u, 0x3F418990u, 0x3FAC0538u, 0x4009B97Au};
static const uint32_t POS4[8] = {0x3E0379FDu, 0x3EC6AE44u, 0x3F28215Eu, 0x3F713D39u,
                                 0x3FA0CC2Fu, 0x3FCF1C25u, 0x40046AC7u, 0x402EE2BFu};

void kvwc_codebook_levels(unsigned b, float *lv) {
    const uint32_t *pos = b == 2 ? POS2 : b == 3 ? POS3 : POS4;
    unsigned half = 1u << (b - 1);
    for (unsigned u = 0; u < 2 * half; u++) /* C_b[half - 1 - i] = -C_b[half + i] */
        lv[u] = u >= half ? kvwc_bits_f32(pos[u - half])
                          : kvwc_bits_f32(pos[half - 1 - u] | 0x80000000u);
}

/* ---- decoding ------------------------------------------------------------------------- */

/* Code i of the bit string (b <= 8 bits: within two bytes; the second exists whenever the
 * code reaches into it, KVW-ROT-3). */
static unsigned code_at(const uint8_t *codes, uint64_t i, unsigned b) {
    uint64_t bit = i * b, k = bit >> 3;
    unsigned sh = (unsigned)(bit & 7), v = codes[k];
    if (sh + b > 8) v |= (unsigned)codes[k + 1] << 8;
    return (v >> sh) & ((1u << b) - 1u);
}

/* n codes from element i0 on into u. Runs of 8 codes are b whole bytes from a byte boundary. */
static void unpack_row(const uint8_t *codes, uint64_t i0, size_t n, unsigned b, uint8_t *u) {
    size_t k = 0;
    if (b == 8) {
        memcpy(u, codes + i0, n);
        return;
    }
    for (; k < n && ((i0 + k) & 7); k++) u[k] = (uint8_t)code_at(codes, i0 + k, b);
    const uint8_t *p = codes + (i0 + k) * b / 8;
    size_t runs = (n - k) / 8; /* constant shifts per width: the loops vectorize */
    if (b == 4) {
        for (size_t r = 0; r < 4 * runs; r++) u[k + 2 * r] = p[r] & 15, u[k + 2 * r + 1] = p[r] >> 4;
    } else if (b == 2) {
        for (size_t r = 0; r < 2 * runs; r++)
            for (unsigned q = 0; q < 4; q++) u[k + 4 * r + q] = (p[r] >> (2 * q)) & 3;
    } else {
        for (size_t r = 0; r < runs; r++) {
            uint32_t v = p[3 * r] | ((uint32_t)p[3 * r + 1] << 8) | ((uint32_t)p[3 * r + 2] << 16);
            for (unsigned q = 0; q < 8; q++) u[k + 8 * r + q] = (uint8_t)((v >> (3 * q)) & 7);
        }
    }
    k += 8 * runs;
    for (; k < n; k++) u[k] = (uint8_t)code_at(codes, i0 + k, b);
}

static void store_row(uint8_t *dst, const float *x, size_t n, unsigned dtype, uint16_t *t16) {
    if (dtype == KVW_DTYPE_F32) {
        for (size_t i = 0; i < n; i++) kvw_st32(dst + 4 * i, kvwc_to_f32(x[i]));
        return;
    }
    if (dtype == KVW_DTYPE_BF16)
        for (size_t i = 0; i < n; i++) t16[i] = kvwc_to_bf16(x[i]);
    else
        for (size_t i = 0; i < n; i++) t16[i] = kvwc_to_f16(x[i]);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(dst, t16, n * 2);
#else
    for (size_t i = 0; i < n; i++) kvw_st16(dst + 2 * i, t16[i]);
#endif
}

int kvwc_rot_fused_fits(const kvw_codec_spec *s, const kvwc_geom *g) {
    return g->bits >= 2 && g->bits <= 4 && g->D % 8 == 0 && s->codec == KVW_CODEC_INT_AFFINE &&
           (s->group_axis == KVW_GROUP_TOKENS || s->group_size % 8 == 0) && kvw_simd_rot();
}

kvw_code kvwc_rot_decode(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                         const uint8_t *params, const uint8_t *codes, uint8_t *out,
                         kvw_error *err) {
    float *sc;
    kvw_code rc = kvwc_int_params(s, g, params, codes, &sc, err);
    if (rc) return rc;
    uint64_t H = g->H, D = g->D, M = g->M, w = g->w, G = s->group_size;
    unsigned b = g->bits;
    int rot = s->rotation != KVW_ROTATION_NONE, tokens_axis = s->group_axis == KVW_GROUP_TOKENS;
    const float *zr = g->zeros ? sc + g->nparams : NULL;
    /* One row of scratch: fp32 values, scales, zeros, codes, sign masks, 16-bit results. */
    size_t Dn = (size_t)D;
    uint8_t *scratch = D < SIZE_MAX / 32 ? (uint8_t *)malloc(Dn * (4 * 4 + 1 + 2) + 64) : NULL;
    if (!scratch) {
        free(sc);
        return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "int_affine rows of %llu channels",
                        (unsigned long long)D);
    }
    float *x = (float *)(void *)scratch, *sx = x + Dn, *zx = sx + Dn;
    uint32_t *mask = (uint32_t *)(void *)(zx + Dn);
    uint16_t *t16 = (uint16_t *)(void *)(mask + Dn);
    uint8_t *u = (uint8_t *)(t16 + Dn);
    float lv[256], cbk[16];
    if (s->codebook == KVW_CODEBOOK_GAUSSIAN) kvwc_codebook_levels(b, cbk);
    for (unsigned c = 0; c < 256; c++) /* value of a code before its scale (INT-5, ROT-4) */
        lv[c] = c >= (1u << b) ? 0.0f
              : s->codebook == KVW_CODEBOOK_GAUSSIAN ? cbk[c]
              : s->symmetric ? (float)c - (float)(1u << (b - 1)) : (float)c;
    uint64_t B = kvwc_rot_block(D);
    float cb = kvwc_rot_cb(B);
    if (rot) kvwc_rot_mask(s, D, mask); /* sylvester (1.3, codecs_tq.c): every sign + */
    int avx2 = D % 8 == 0 && kvw_simd_rot(); /* whole registers per row */
    /* The fused AVX2 row (codes straight to levels, scales read in place): codes of 2..4 bits,
     * scales per channel (tokens axis) or per register (channel groups of a multiple of 8). */
    uint16_t *grp = NULL;
    kvwc_rot_drow q = {b, lv, NULL, rot ? mask : NULL, cb, D};
    int fused = avx2 && b >= 2 && b <= 4 && (tokens_axis || G % 8 == 0);
    if (fused && !tokens_axis) {
        grp = (uint16_t *)malloc((Dn / 8) * sizeof(uint16_t) + 2);
        if (!grp) fused = 0;
        for (size_t k = 0; grp && k < Dn / 8; k++) grp[k] = (uint16_t)((8 * k) / G);
        q.grp = grp;
    }
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    int whole = fused && h->dtype == KVW_DTYPE_BF16 && kvwc_rot_dec_bf16_fits(D);
#else
    int whole = 0;
#endif
    for (uint64_t hh = 0; hh < H; hh++)
        for (uint64_t m = 0; m < M; m++) {
            if (fused) {
                uint64_t k = tokens_axis ? (hh * g->gm + m / G) * D : (hh * M + m) * g->gd;
                const uint8_t *cr = codes + (hh * M + m) * D * b / 8;
                uint8_t *dst = out + hh * g->ohs + (g->P + m) * D * w;
                if (whole) {
                    kvwc_rot_dec_bf16_avx2(&q, cr, sc + k, zr ? zr + k : NULL, dst);
                    continue;
                }
                kvwc_rot_dequant_codes_avx2(&q, cr, sc + k, zr ? zr + k : NULL, x);
                if (rot) kvwc_rot_row(x, D, B, cb, mask);
                if (h->dtype == KVW_DTYPE_BF16) {
                    kvwc_rot_to_bf16_avx2(x, t16, D);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
                    memcpy(dst, t16, Dn * 2);
#else
                    for (size_t i = 0; i < Dn; i++) kvw_st16(dst + 2 * i, t16[i]);
#endif
                } else {
                    store_row(dst, x, Dn, h->dtype, t16);
                }
                continue;
            }
            /* The row's scales: tokens axis group (h, m / G, d), channels axis (h, m, d / G). */
            if (tokens_axis) {
                uint64_t k = (hh * g->gm + m / G) * D;
                memcpy(sx, sc + k, Dn * sizeof(float));
                if (zr) memcpy(zx, zr + k, Dn * sizeof(float));
            } else {
                uint64_t k = (hh * M + m) * g->gd;
                for (uint64_t c = 0, d0 = 0; d0 < D; c++, d0 += G) { /* group c: [d0, d0 + G) */
                    uint64_t d1 = D - d0 < G ? D : d0 + G;
                    float sv = sc[k + c], zv = zr ? zr[k + c] : 0.0f;
                    for (uint64_t d = d0; d < d1; d++) sx[d] = sv, zx[d] = zv;
                }
            }
            unpack_row(codes, (hh * M + m) * D, Dn, b, u);
            if (avx2 && b <= 4)
                kvwc_rot_dequant_avx2(u, lv, sx, zr ? zx : NULL, x, D);
            else if (zr)
                for (size_t d = 0; d < Dn; d++) {
                    float p = lv[u[d]] * sx[d]; /* two roundings (KVW-LOSSY-3) */
                    x[d] = p + zx[d];
                }
            else
                for (size_t d = 0; d < Dn; d++) x[d] = lv[u[d]] * sx[d];
            if (rot) kvwc_rot_row(x, D, B, cb, mask);
            uint8_t *dst = out + hh * g->ohs + (g->P + m) * D * w;
            if (avx2 && h->dtype == KVW_DTYPE_BF16) {
                kvwc_rot_to_bf16_avx2(x, t16, D);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
                memcpy(dst, t16, Dn * 2);
#else
                for (size_t i = 0; i < Dn; i++) kvw_st16(dst + 2 * i, t16[i]);
#endif
            } else {
                store_row(dst, x, Dn, h->dtype, t16);
            }
        }
    free(grp);
    free(scratch);
    free(sc);
    return KVW_OK;
}
