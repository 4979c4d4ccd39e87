/*
 * XXH3-64 compiled for AVX2 (selected at run time by hash.c when the CPU has it).
 *
 * Why a file of its own: xxhash.h picks its vector code with the preprocessor (__AVX2__),
 * so the AVX2 variant needs a translation unit compiled for AVX2, while the library must
 * run on any x86-64. GCC's target pragma defines __AVX2__ for the rest of the file; other
 * compilers (and other architectures) get the portable inline variant here too, and
 * hash.c never selects it over its own.
 */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("avx2")
#define KVW_HASH_AVX2 1
#else
#define KVW_HASH_AVX2 0
#endif

#define XXH_INLINE_ALL
#define XXH_STATIC_LINKING_ONLY
#include <stddef.h>
#include <stdint.h>
#include <xxhash.h>

#include "hash_impl.h"

int kvw_hash_avx2_built(void) { return KVW_HASH_AVX2; }
uint64_t kvw_xxh3_avx2(const void *p, size_t n) { return (uint64_t)XXH3_64bits(p, n); }
void kvw_xxh3_update_avx2(XXH3_state_t *st, const void *p, size_t n) { (void)XXH3_64bits_update(st, p, n); }
uint64_t kvw_xxh3_digest_avx2(const XXH3_state_t *st) { return (uint64_t)XXH3_64bits_digest(st); }
