/*
 * Lossy encoders (spec/codecs.md KVW-FP8-5, KVW-INT-6, KVW-LOSSY-5/6, section 3.1): the
 * reference writer's choice of scales and zeros, in the same fp32 arithmetic, so that a C
 * writer produces the same bodies as the reference codec (python/kvwire/codecs/quant.py)
 * and every body meets LOSSY-5 (finite, not all-zero groups). A chunk that cannot meet it,
 * or holds NaN or infinity (LOSSY-6), is refused with KVW_ERR_UNSUPPORTED: the writer then
 * stores it losslessly. Apart from the decoders, which readers need alone.
 */
#include "common/fp_exact.h" /* first: no FMA contraction, fp32 evaluation (KVW-LOSSY-3) */

#include "encode/encode.h"

#include <stdlib.h>

#define REFUSE(rule, ...) kvw_fail(err, KVW_ERR_UNSUPPORTED, rule, __VA_ARGS__)

static int fin(float f) { return (kvwc_f32_bits(f) & 0x7F800000u) != 0x7F800000u; }

static float from_dtype(const uint8_t *p, unsigned dt) {
    return dt == KVW_DTYPE_F32 ? kvw_ldf32(p)
         : dt == KVW_DTYPE_F16 ? kvwc_from_f16(kvw_ld16(p)) : kvwc_from_bf16(kvw_ld16(p));
}
/* fp32 -> header dtype -> fp32 (overflow to infinity). */
static float to_header(float v, unsigned dt) { return kvwc_bits_value(kvwc_nearest_bits(v, dt), dt); }

static uint32_t sign_bit(unsigned dt) { return dt == KVW_DTYPE_F32 ? 0x80000000u : 0x8000u; }

/* One unit in the last place toward +inf (up) or -inf, in dt's bits (scales.py _step). */
static uint32_t step(uint32_t u, unsigned dt, int up) {
    uint32_t sg = sign_bit(dt), mag = u & ~sg;
    if (mag == 0) return up ? 1u : (sg | 1u);
    int neg = (u & sg) != 0;
    return (up ? !neg : neg) ? u + 1 : u - 1;
}
/* v rounded to dt toward +inf (up) or -inf (round_dir). */
static uint32_t round_dir(float v, unsigned dt, int up) {
    uint32_t r = kvwc_nearest_bits(v, dt);
    float back = kvwc_bits_value(r, dt);
    if (up ? back < v : back > v) r = step(r, dt, up);
    return r;
}
/* Non-negative v rounded up to dt (round_up), from fp32 or (exact quotients) double. */
static uint32_t round_up_f(float v, unsigned dt) {
    uint32_t r = kvwc_nearest_bits(v, dt);
    if (dt != KVW_DTYPE_F32 && kvwc_bits_value(r, dt) < v) r++;
    return r;
}
static uint32_t round_up_d(double v, unsigned dt) {
    uint32_t r = kvwc_nearest_bits((float)v, dt); /* double -> float -> dt: floor or ceil of v */
    if ((double)kvwc_bits_value(r, dt) < v) r++;
    return r;
}

static const float SMALLEST[3] = {0x1p-133f, 0x1p-24f, 0x1p-149f}; /* bf16, f16, f32 */
static const float LARGEST[3] = {3.3895313892515355e38f, 65504.0f, FLT_MAX};
static const int PRECISION[3] = {8, 11, 24};

/* fp32 |v| <= fmax (finite) -> fp8 code, round to nearest even. */
static uint8_t to_fp8(float v, unsigned fmt) {
    unsigned mb = fmt == KVW_DTYPE_F8_E5M2 ? 2 : 3;
    int bias = fmt == KVW_DTYPE_F8_E5M2 ? 15 : fmt == KVW_DTYPE_F8_E4M3FN ? 7 : 8;
    uint32_t u = kvwc_f32_bits(v), sg = u >> 31, a = u & 0x7FFFFFFFu, code;
    float av = kvwc_bits_f32(a);
    if (av < kvwc_bits_f32((uint32_t)(128 - bias) << 23)) { /* below 2^(1-bias): subnormal */
        float y = av * kvwc_bits_f32((uint32_t)(127 + bias - 1 + (int)mb) << 23); /* exact */
        code = (uint32_t)((y + 8388608.0f) - 8388608.0f); /* RNE to an integer */
    } else {
        unsigned sh = 23 - mb;
        uint32_t r = (a + ((1u << (sh - 1)) - 1u) + ((a >> sh) & 1u)) >> sh;
        code = r - ((uint32_t)(127 - bias) << mb);
    }
    if (fmt == KVW_DTYPE_F8_E4M3FNUZ && code == 0) return 0; /* no negative zero */
    return (uint8_t)(code | (sg << 7));
}

/* fp32 value of an fp8 code (finite codes only are produced here). */
static float fp8_val(uint8_t c, unsigned fmt) {
    unsigned mb = fmt == KVW_DTYPE_F8_E5M2 ? 2 : 3;
    int bias = fmt == KVW_DTYPE_F8_E5M2 ? 15 : fmt == KVW_DTYPE_F8_E4M3FN ? 7 : 8;
    unsigned e = (c & 0x7Fu) >> mb, m = c & ((1u << mb) - 1u);
    float v = e == 0 ? (float)m * kvwc_bits_f32((uint32_t)(127 + 1 - bias - (int)mb) << 23)
                     : (float)((1u << mb) + m) * kvwc_bits_f32((uint32_t)(127 + (int)e - bias - (int)mb) << 23);
    return (c & 0x80) ? -v : v;
}

static float rint_f(float y) { /* |y| < 2^23 */
    return y >= 0 ? (y + 8388608.0f) - 8388608.0f : -((-y + 8388608.0f) - 8388608.0f);
}

static kvw_code encode_fp8(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                           const float *x, uint8_t *params, uint8_t *codes, kvw_error *err) {
    uint64_t H = g->H, M = g->M, D = g->D, ns = g->nparams, per = H * M * D / ns;
    unsigned dt = h->dtype, fmt = s->fp8_format;
    float f = fmt == KVW_DTYPE_F8_E5M2 ? 57344.0f : fmt == KVW_DTYPE_F8_E4M3FN ? 448.0f : 240.0f;
    float lo = 0x1p-125f * f, hi = LARGEST[dt] / 4;
    if (lo < 4 * SMALLEST[dt]) lo = 4 * SMALLEST[dt];
    float *sc = (float *)malloc((size_t)ns * 2 * sizeof(float));
    if (!sc) return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "fp8: %llu scales", (unsigned long long)ns);
    float *amax = sc + ns;
    int safe = 1;
    for (uint64_t k = 0; k < ns; k++) { /* scale groups are runs of `per` elements */
        float a = 0;
        for (uint64_t i = k * per; i < (k + 1) * per; i++) {
            float v = x[i] < 0 ? -x[i] : x[i];
            if (v > a) a = v;
        }
        amax[k] = a;
        sc[k] = a / f;
        safe &= a >= lo && a <= hi;
    }
    for (uint64_t k = 0; !safe && k < ns; k++) { /* section 3.1: near the extremes */
        float a = amax[k], sv = sc[k];
        int live = a > 0;
        if (live && sv == 0) sv = 0x1p-149f;
        if (live && a / sv > f) sv = kvwc_bits_f32(kvwc_f32_bits(sv) + 1);
        if (!fin(to_header(f * sv, dt))) sv = kvwc_bits_f32(kvwc_f32_bits(sv) - 1);
        if (!live || !fin(sv)) sv = 1.0f;
        if (!fin(to_header(f * sv, dt))) {
            free(sc);
            return REFUSE("KVW-LOSSY-5", "fp8 group %llu would decode %g * scale to infinity",
                          (unsigned long long)k, (double)f);
        }
        float q = a / sv;
        if (q > f) q = f;
        if (live && to_header(fp8_val(to_fp8(q, fmt), fmt) * sv, dt) == 0) {
            free(sc);
            return REFUSE("KVW-LOSSY-5", "fp8 group %llu with nonzero input would decode to "
                          "zero", (unsigned long long)k);
        }
        sc[k] = sv;
    }
    for (uint64_t k = 0; k < ns; k++) {
        kvw_st32(params + 4 * k, kvwc_f32_bits(sc[k]));
        for (uint64_t i = k * per; i < (k + 1) * per; i++) {
            float y = x[i] / sc[k];
            if (y > f) y = f;
            if (y < -f) y = -f;
            codes[i] = to_fp8(y, fmt);
        }
    }
    free(sc);
    return KVW_OK;
}

/* Group k's elements: tokens axis (h, gm, d) over m; channels axis (h, m, c) over d. */
typedef struct { uint64_t first, stride, n; } grp;
static grp group_of(const kvw_codec_spec *s, const kvwc_geom *g, uint64_t k) {
    uint64_t G = s->group_size, M = g->M, D = g->D;
    grp r;
    if (s->group_axis == KVW_GROUP_TOKENS) {
        uint64_t d = k % D, gi = (k / D) % g->gm, hh = k / D / g->gm, m0 = gi * G;
        r.first = (hh * M + m0) * D + d, r.stride = D, r.n = (M - m0 < G ? M - m0 : G);
    } else {
        uint64_t c = k % g->gd, row = k / g->gd, d0 = c * G;
        r.first = row * D + d0, r.stride = 1, r.n = (D - d0 < G ? D - d0 : G);
    }
    return r;
}

kvw_code kvwc_encode_int(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                         const float *x, uint8_t *params, uint8_t *codes, kvw_error *err) {
    uint64_t np = g->nparams;
    unsigned dt = h->dtype, sd = s->scale_dtype, b = s->bits, ps = g->psize;
    int sym = s->symmetric;
    float qmax = (float)(sym ? (1u << (b - 1)) - 1u : (1u << b) - 1u);
    float lo = kvwc_bits_f32((uint32_t)(127 + PRECISION[sd]) << 23) * SMALLEST[sd];
    float hi = (LARGEST[dt] < LARGEST[sd] ? LARGEST[dt] : LARGEST[sd]) / 4;
    if (lo < 4 * SMALLEST[dt]) lo = 4 * SMALLEST[dt];
    float *mn = (float *)malloc((size_t)np * 4 * sizeof(float));
    if (!mn) return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "int_affine: %llu groups",
                             (unsigned long long)np);
    float *mx = mn + np, *sf = mx + np, *zf = sf + np;
    int safe = 1;
    for (uint64_t k = 0; k < np; k++) {
        grp gr = group_of(s, g, k);
        float a = x[gr.first], c = a;
        for (uint64_t i = 1; i < gr.n; i++) {
            float v = x[gr.first + i * gr.stride];
            if (v <= a) a = v; /* the last of equal values (a zero's sign), as numpy's */
            if (v >= c) c = v; /* minimum / maximum reductions keep */
        }
        mn[k] = a, mx[k] = c;
        float amax = (-a > c ? -a : c) + 0.0f; /* +0, never -0 */
        uint32_t sb, zb = 0;
        if (sym) {
            sb = round_up_f(amax / qmax, sd);
        } else {
            zb = kvwc_nearest_bits(a, sd);
            float z = kvwc_bits_value(zb, sd), fit = (c - z) / qmax;
            sb = round_up_f(fit > 0 ? fit : 0.0f, sd);
        }
        sf[k] = kvwc_bits_value(sb, sd), zf[k] = kvwc_bits_value(zb, sd);
        safe &= amax >= lo && amax <= hi;
    }
    for (uint64_t k = 0; !safe && k < np; k++) { /* section 3.1: near the extremes */
        float a = mn[k], c = mx[k], amax = (-a > c ? -a : c) + 0.0f, need, big, z = 0;
        int P = PRECISION[sd];
        if (sym) {
            need = amax / qmax, big = amax;
        } else {
            need = (c - a) / qmax;
            big = c >= -a ? c : a;
            uint32_t zb = round_dir(a, sd, 0);
            if (!fin(to_header(kvwc_bits_value(zb, sd), dt))) zb = round_dir(a, sd, 1);
            z = kvwc_bits_value(zb, sd);
            if (!fin(z) || !fin(to_header(z, dt)) ||
                !(z - a <= amax * kvwc_bits_f32((uint32_t)(127 + 1 - P) << 23))) {
                free(mn);
                return REFUSE("KVW-LOSSY-5", "int_affine group %llu has a minimum beyond the "
                              "scale or header dtype", (unsigned long long)k);
            }
        }
        double q = sym ? (double)amax : ((double)c - z > 0 ? (double)c - z : 0.0);
        uint32_t sb = round_up_d(q / qmax, sd);
        float sv = kvwc_bits_value(sb, sd);
        if (fin(sv) && !fin(to_header(qmax * sv + z, dt))) sb = step(sb, sd, 0), sv = kvwc_bits_value(sb, sd);
        float tol = need, t2 = amax * kvwc_bits_f32((uint32_t)(127 - P) << 23);
        if (t2 > tol) tol = t2;
        if (SMALLEST[dt] > tol) tol = SMALLEST[dt];
        tol = 2 * tol;
        if (!fin(sv) || !fin(to_header(qmax * sv + z, dt)) || !(sv <= tol)) {
            free(mn);
            return REFUSE("KVW-LOSSY-5", "int_affine group %llu spans more than the scale or "
                          "header dtype holds", (unsigned long long)k);
        }
        float code = sv > 0 ? (big - z) / sv : 0.0f;
        if (code > qmax) code = qmax;
        if (code < (sym ? -qmax : 0)) code = sym ? -qmax : 0;
        code = rint_f(code);
        if (big != 0 && to_header(code * sv + z, dt) == 0) {
            free(mn);
            return REFUSE("KVW-LOSSY-5", "int_affine group %llu with nonzero input would "
                          "decode to zero", (unsigned long long)k);
        }
        sf[k] = sv, zf[k] = z;
    }
    for (uint64_t k = 0; k < np; k++) {
        uint32_t sb = kvwc_nearest_bits(sf[k], sd), zb = kvwc_nearest_bits(zf[k], sd);
        if (ps == 4) kvw_st32(params + 4 * k, sb); else kvw_st16(params + 2 * k, (uint16_t)sb);
        if (!sym) {
            if (ps == 4) kvw_st32(params + 4 * (np + k), zb);
            else kvw_st16(params + 2 * (np + k), (uint16_t)zb);
        }
        grp gr = group_of(s, g, k);
        float sv = sf[k], z = zf[k], half = (float)(1u << (b - 1));
        for (uint64_t i = 0; i < gr.n; i++) {
            uint64_t e = gr.first + i * gr.stride;
            float y = sv > 0 ? (sym ? x[e] / sv : (x[e] - z) / sv) : 0.0f, lo_c = sym ? -qmax : 0;
            if (y > qmax) y = qmax;
            if (y < lo_c) y = lo_c;
            y = rint_f(y);
            if (sym) y += half;
            unsigned u = (unsigned)y;
            uint64_t bit = e * b;
            codes[bit >> 3] |= (uint8_t)(u << (bit & 7));
            if ((bit & 7) + b > 8) codes[(bit >> 3) + 1] |= (uint8_t)(u >> (8 - (bit & 7))); /* ROT-3 */
        }
    }
    free(mn);
    return KVW_OK;
}

kvw_code kvwc_lossy_encode_into(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                                const kvw_iovec *parts, int nparts, uint8_t *body, kvw_error *err) {
    uint64_t H = g->H, T = g->T, D = g->D, w = g->w, P = g->P, Q = g->Q, M = g->M;
    uint64_t rowb = D * w;
    kvw_code fits = kvwc_tq_writer_fits(s, g, err); /* revision 1.3: codecs_tq.c */
    if (fits) return fits;
    if (nparts == 1 && kvwc_qenc_fast(h, s, g, (const uint8_t *)parts[0].base, body))
        return KVW_OK;
    if (g->Lb) memset(body, 0, (size_t)g->Lb); /* the codes are or-ed in */
    float *x = (float *)malloc(M ? (size_t)(H * M * D) * sizeof(float) : 1);
    uint8_t *row = (uint8_t *)malloc(rowb ? (size_t)rowb : 1);
    kvw_code rc = KVW_OK;
    if (!x || !row) {
        rc = kvw_fail(err, KVW_ERR_NO_MEMORY, "", "lossy body of %llu bytes",
                      (unsigned long long)g->Lb);
        goto done;
    }
    uint8_t *resid = body + H * P * rowb;
    for (uint64_t hh = 0; hh < H; hh++) { /* kept tokens as they are (KVW-LOSSY-2) */
        kvwc_copy_range(parts, nparts, (size_t)(hh * T * rowb), body + hh * P * rowb,
                        (size_t)(P * rowb));
        kvwc_copy_range(parts, nparts, (size_t)((hh * T + P + M) * rowb), resid + hh * Q * rowb,
                        (size_t)(Q * rowb));
        for (uint64_t m = 0; m < M; m++) {
            kvwc_copy_range(parts, nparts, (size_t)((hh * T + P + m) * rowb), row, (size_t)rowb);
            float *xr = x + (hh * M + m) * D;
            for (uint64_t d = 0; d < D; d++) {
                xr[d] = from_dtype(row + d * w, h->dtype);
                if (!fin(xr[d])) {
                    rc = REFUSE("KVW-LOSSY-6", "the quantized part holds NaN or infinity (head "
                                "%llu token %llu): store the chunk losslessly",
                                (unsigned long long)hh, (unsigned long long)(P + m));
                    goto done;
                }
            }
        }
    }
    if (M && H && D) {
        uint8_t *params = body + g->fp_bytes, *codes = params + g->param_bytes;
        rc = s->codec == KVW_CODEC_FP8 ? encode_fp8(h, s, g, x, params, codes, err)
           : s->codebook == KVW_CODEBOOK_TURBOQUANT ? kvwc_tq_encode(h, s, g, x, body, err)
           : kvw_codec_spec_uses_rotation(s) ? kvwc_rot_encode(h, s, g, x, body, err)
                                             : kvwc_encode_int(h, s, g, x, params, codes, err);
    }
done:
    free(x);
    free(row);
    return rc;
}

kvw_code kvwc_lossy_encode(const kvw_header *h, const kvw_codec_spec *s, const kvwc_geom *g,
                           const kvw_iovec *parts, int nparts, uint8_t **out, size_t *out_len,
                           kvw_error *err) {
    uint8_t *body = (uint8_t *)malloc(g->Lb ? (size_t)g->Lb : 1);
    if (!body) return kvw_fail(err, KVW_ERR_NO_MEMORY, "", "lossy body of %llu bytes",
                               (unsigned long long)g->Lb);
    kvw_code rc = kvwc_lossy_encode_into(h, s, g, parts, nparts, body, err);
    if (rc) {
        free(body);
        return rc;
    }
    *out = body, *out_len = (size_t)g->Lb;
    return KVW_OK;
}
