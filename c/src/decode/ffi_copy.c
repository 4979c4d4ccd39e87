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
