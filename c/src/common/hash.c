/*
 * XXH3-64 (spec section 11, KVW-CSUM-1) for the whole library: the AVX2 build of
 * hash_avx2.c where the CPU has AVX2, the portable inline build otherwise (see
 * hash_impl.h for why not the shared libxxhash). Same digests either way: XXH3 is defined
 * bit for bit, its vector variants only compute it faster.
 */
#define XXH_INLINE_ALL
#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

#include "common/hash_impl.h"
#include "common/common.h"

/* hash_avx2.c has the AVX2 build (GCC's pragma) and the CPU runs it (common/cpu.c). */
static inline int use_avx2(void) { return KVW_BUILD_AVX2_PRAGMA && kvw_cpu_has_avx2(); }

uint64_t kvw_xxh3(const void *p, size_t n) {
    return use_avx2() ? kvw_xxh3_avx2(p, n) : (uint64_t)XXH3_64bits(p, n);
}
void kvw_xxh3_reset(void *st) { (void)XXH3_64bits_reset((XXH3_state_t *)st); }
void kvw_xxh3_update(void *st, const void *p, size_t n) {
    if (use_avx2())
        kvw_xxh3_update_avx2((XXH3_state_t *)st, p, n);
    else
        (void)XXH3_64bits_update((XXH3_state_t *)st, p, n);
}
uint64_t kvw_xxh3_digest(const void *st) {
    const XXH3_state_t *s = (const XXH3_state_t *)st;
    return use_avx2() ? kvw_xxh3_digest_avx2(s) : (uint64_t)XXH3_64bits_digest(s);
}
