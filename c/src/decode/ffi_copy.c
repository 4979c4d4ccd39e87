/*
 * FFI: checked copies of chunk bodies into strided destinations (kvw_copy_checked).
 *
 * Why: a reader assembling a layer puts each chunk [heads, tokens, dim] at a token slice of
 * a [heads, layer tokens, dim] tensor, so a chunk is `heads` runs at a stride. From Python
 * that is numpy's strided assignment, which holds the GIL, plus xxhash-python's hash, a
 * second pass over memory; threads then only contend. Here the runs are hashed (XXH3,
 * KVW-CSUM-1) block by block as they are copied, the block still in the CPU caches, with
 * the GIL released by ctypes, so one thread per core assembles distinct chunks.
 *
 * The destination is written before the digest is known: on KVW_BODY_CHECKSUM the caller
 * must treat what it passed as garbage (the Python reader raises, so nothing is used).
 */
#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include <stdint.h>
#include <string.h>
#include <xxhash.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "common/common.h"

#define COPY_BLOCK ((size_t)32 << 10)

/* memcpy with non-temporal stores where the CPU has them (SSE2: every x86-64): a layer
 * being assembled is not read back soon, and ordinary stores first read each destination
 * line into the cache (three memory transfers a byte instead of two). Measured: ... */
static void copy_stream(uint8_t *d, const uint8_t *s, size_t n) {
#if defined(__SSE2__)
    size_t head = (size_t)(-(uintptr_t)d & 15u);
    if (n < 256 || head > n) {
        memcpy(d, s, n);
        return;
    }
    memcpy(d, s, head);
    d += head, s += head, n -= head;
    size_t k = n & ~(size_t)63;
    for (size_t o = 0; o < k; o += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(const void *)(s + o));
        __m128i b = _mm_loadu_si128((const __m128i *)(const void *)(s + o + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(const void *)(s + o + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(const void *)(s + o + 48));
        _mm_stream_si128((__m128i *)(void *)(d + o), a);
        _mm_stream_si128((__m128i *)(void *)(d + o + 16), b);
        _mm_stream_si128((__m128i *)(void *)(d + o + 32), c);
        _mm_stream_si128((__m128i *)(void *)(d + o + 48), e);
    }
    memcpy(d + k, s + k, n - k);
#else
    memcpy(d, s, n);
#endif
}

static void stream_fence(void) {
#if defined(__SSE2__)
    _mm_sfence(); /* the streamed stores are visible before the call returns */
#endif
}

kvw_code kvw_copy_checked(const uint8_t *src, size_t n, uint64_t checksum, int verify, uint8_t *dst,
                          size_t run, size_t dst_stride, kvw_error *err) {
    kvw_error_clear(err);
    if ((n && !src) || (!dst && n && run) || (n && !run && dst) || (run && n % run))
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "",
                        "kvw_copy_checked: %zu bytes in runs of %zu (a whole number of runs; dst "
                        "NULL or run 0 hashes only)", n, run);
    if (!dst || !run) { /* hash only */
        if (!verify) return KVW_OK;
        uint64_t got = kvw_xxh3(src, n);
        return got == checksum ? KVW_OK
             : kvw_fail(err, KVW_BODY_CHECKSUM, "KVW-CSUM-1",
                        "body checksum %016llx, the record says %016llx", (unsigned long long)got,
                        (unsigned long long)checksum);
    }
    if (!verify) {
        for (size_t r = 0; r < n / run; r++) copy_stream(dst + r * dst_stride, src + r * run, run);
        stream_fence();
        return KVW_OK;
    }
    XXH3_state_t st;
    kvw_xxh3_reset(&st);
    for (size_t r = 0; r < n / run; r++) {
        const uint8_t *s = src + r * run;
        uint8_t *d = dst + r * dst_stride;
        for (size_t o = 0; o < run; o += COPY_BLOCK) {
            size_t k = run - o < COPY_BLOCK ? run - o : COPY_BLOCK;
            kvw_xxh3_update(&st, s + o, k);
            copy_stream(d + o, s + o, k);
        }
    }
    stream_fence();
    uint64_t got = kvw_xxh3_digest(&st);
    return got == checksum ? KVW_OK
         : kvw_fail(err, KVW_BODY_CHECKSUM, "KVW-CSUM-1", "body checksum %016llx, the record says %016llx",
                    (unsigned long long)got, (unsigned long long)checksum);
}

uint64_t kvw_xxh3_runs(const uint8_t *src, size_t runs, size_t run, size_t stride) {
    if (runs == 1 || stride == run) return kvw_xxh3(src, runs * run);
    XXH3_state_t st;
    kvw_xxh3_reset(&st);
    for (size_t r = 0; r < runs; r++) kvw_xxh3_update(&st, src + r * stride, run);
    return kvw_xxh3_digest(&st);
}

/* ---- slot-addressed copies between a standard [heads, tokens, dim] array and a paged view ----
 *
 * Why: an engine's paged KV buffer holds token t of a request at slot s = block * N + offset,
 * in a [blocks, heads, N, dim] view whose strides the attention backend chooses (vLLM's CPU
 * kernels keep K transposed per block and head: channel stride N elements, token stride one).
 * numpy copies such a view element by element with the GIL held (about 1 GB/s for K); here a
 * run of consecutive slots in one block is one memcpy per head (rows) or one tile transposed
 * in the CPU caches (K), with the GIL released, so a layer's copy costs about what its bytes
 * cost and layers copy in parallel on the loader's threads. */

typedef struct {
    size_t heads, tokens, dim, esize, std_head_stride;           /* the standard side */
    size_t n_blocks, block_size, block_stride, head_stride, token_stride, chan_stride; /* paged */
} slot_geom;

/* One element of esize bytes: memcpy of a constant size compiles to a load and a store. */
#define COPY_ELEMS(T)                                                                              \
    for (size_t c = 0; c < g->dim; c++)                                                            \
        for (size_t k = 0; k < r; k++) {                                                           \
            T x;                                                                                   \
            const uint8_t *from = gather ? p + c * g->chan_stride + k * g->token_stride            \
                                         : s + k * row + c * sizeof(T);                            \
            uint8_t *to = gather ? s + k * row + c * sizeof(T) : p + c * g->chan_stride + k * g->token_stride; \
            memcpy(&x, from, sizeof(T));                                                           \
            memcpy(to, &x, sizeof(T));                                                             \
        }

#if defined(__SSE2__)
/* An 8 x 8 tile of 16-bit elements transposed: rows of s (ss bytes apart) become the
 * columns of d (rows ds bytes apart); three rounds of unpacks, 16-byte loads and stores. */
static inline void t8x8_u16(const uint8_t *s, size_t ss, uint8_t *d, size_t ds) {
    __m128i r[8], a[8], b[8];
    for (int i = 0; i < 8; i++) r[i] = _mm_loadu_si128((const __m128i *)(const void *)(s + i * ss));
    for (int i = 0; i < 4; i++) {
        a[2 * i] = _mm_unpacklo_epi16(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm_unpackhi_epi16(r[2 * i], r[2 * i + 1]);
    }
    b[0] = _mm_unpacklo_epi32(a[0], a[2]), b[1] = _mm_unpackhi_epi32(a[0], a[2]);
    b[2] = _mm_unpacklo_epi32(a[1], a[3]), b[3] = _mm_unpackhi_epi32(a[1], a[3]);
    b[4] = _mm_unpacklo_epi32(a[4], a[6]), b[5] = _mm_unpackhi_epi32(a[4], a[6]);
    b[6] = _mm_unpacklo_epi32(a[5], a[7]), b[7] = _mm_unpackhi_epi32(a[5], a[7]);
    for (int i = 0; i < 4; i++) {
        _mm_storeu_si128((__m128i *)(void *)(d + 2 * i * ds), _mm_unpacklo_epi64(b[i], b[i + 4]));
        _mm_storeu_si128((__m128i *)(void *)(d + (2 * i + 1) * ds), _mm_unpackhi_epi64(b[i], b[i + 4]));
    }
}
#endif

/* r consecutive tokens of one head: std rows at s (row bytes apart), paged at p. */
static void copy_run(const slot_geom *g, uint8_t *s, uint8_t *p, size_t r, int gather) {
    size_t row = g->dim * g->esize;
    if (g->chan_stride == g->esize) { /* channels contiguous: rows */
        if (g->token_stride == row)
            gather ? (void)memcpy(s, p, r * row) : copy_stream(p, s, r * row); /* into the engine: streamed */
        else
            for (size_t k = 0; k < r; k++)
                gather ? (void)memcpy(s + k * row, p + k * g->token_stride, row)
                       : copy_stream(p + k * g->token_stride, s + k * row, row);
        return;
    }
    /* a tile [r tokens, dim channels] transposed (or any other strides), in the caches */
#if defined(__SSE2__)
    if (g->esize == 2 && g->token_stride == 2 && r >= 8 && g->dim >= 8) { /* K transposed: 8 x 8 tiles */
        size_t r8 = r & ~(size_t)7, d8 = g->dim & ~(size_t)7, cs = g->chan_stride;
        for (size_t k = 0; k < r8; k += 8) /* measured: faster than channel-major (2.5-3.7 vs 1.9-2.9 GB/s) */
            for (size_t c = 0; c < d8; c += 8)
                gather ? t8x8_u16(p + c * cs + k * 2, cs, s + k * row + c * 2, row)
                       : t8x8_u16(s + k * row + c * 2, row, p + c * cs + k * 2, cs);
        if (r8 == r && d8 == g->dim) return;
        for (size_t k = 0; k < r; k++) /* the edges: tokens past r8, channels past d8 */
            for (size_t c = k < r8 ? d8 : 0; c < g->dim; c++) {
                uint8_t *ps = s + k * row + c * 2, *pp = p + c * cs + k * 2;
                gather ? memcpy(ps, pp, 2) : memcpy(pp, ps, 2);
            }
        return;
    }
#endif
    switch (g->esize) {
    case 1: COPY_ELEMS(uint8_t) break;
    case 2: COPY_ELEMS(uint16_t) break;
    case 4: COPY_ELEMS(uint32_t) break;
    default: COPY_ELEMS(uint64_t) break;
    }
}

static kvw_code copy_slots(const slot_geom *g, uint8_t *std, const int64_t *slots, uint8_t *paged, int gather,
                           kvw_error *err) {
    kvw_error_clear(err);
    const char *fn = gather ? "kvw_gather_slots" : "kvw_scatter_slots";
    if (g->esize != 1 && g->esize != 2 && g->esize != 4 && g->esize != 8)
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "%s: element size %zu (1, 2, 4 or 8 bytes)", fn,
                        g->esize);
    if (!g->heads || !g->tokens || !g->dim) return KVW_OK;
    if (!std || !slots || !paged || !g->block_size || g->n_blocks > SIZE_MAX / g->block_size)
        return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "%s: NULL buffer, slot ids or block size 0", fn);
    uint64_t n_slots = (uint64_t)g->n_blocks * g->block_size;
    for (size_t t = 0; t < g->tokens; t++) /* every slot checked before a byte is written */
        if (slots[t] < 0 || (uint64_t)slots[t] >= n_slots)
            return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "",
                            "%s: slot id %lld of token %zu is outside the view's %llu slots", fn,
                            (long long)slots[t], t, (unsigned long long)n_slots);
    size_t row = g->dim * g->esize;
    for (size_t h = 0; h < g->heads; h++) {
        for (size_t t = 0; t < g->tokens;) {
            size_t blk = (size_t)slots[t] / g->block_size, off = (size_t)slots[t] % g->block_size, r = 1;
            while (t + r < g->tokens && off + r < g->block_size && slots[t + r] == slots[t] + (int64_t)r) r++;
            copy_run(g, std + h * g->std_head_stride + t * row,
                     paged + blk * g->block_stride + h * g->head_stride + off * g->token_stride, r, gather);
            t += r;
        }
    }
    stream_fence();
    return KVW_OK;
}

#define SLOT_GEOM                                                                                  \
    slot_geom g = {heads, tokens, dim, esize, std_head_stride, n_blocks, block_size, strides[0], \
                   strides[1], strides[2], strides[3]}

kvw_code kvw_scatter_slots(const uint8_t *src, size_t heads, size_t tokens, size_t dim, size_t esize,
                           size_t std_head_stride, const int64_t *slots, uint8_t *dst, size_t n_blocks,
                           size_t block_size, const size_t strides[4], kvw_error *err) {
    if (!strides) return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "kvw_scatter_slots: strides NULL");
    SLOT_GEOM;
    return copy_slots(&g, (uint8_t *)(uintptr_t)src, slots, dst, 0, err);
}

kvw_code kvw_gather_slots(uint8_t *dst, size_t heads, size_t tokens, size_t dim, size_t esize,
                          size_t std_head_stride, const int64_t *slots, const uint8_t *src, size_t n_blocks,
                          size_t block_size, const size_t strides[4], kvw_error *err) {
    if (!strides) return kvw_fail(err, KVW_ERR_INVALID_ARGUMENT, "", "kvw_gather_slots: strides NULL");
    SLOT_GEOM;
    return copy_slots(&g, dst, slots, (uint8_t *)(uintptr_t)src, 1, err);
}
