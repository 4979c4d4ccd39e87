/*
 * XXH3-64 compiled for AVX2 (selected at run time by hash.c when the CPU has it).
 *
 * Why a file of its own: xxhash.h picks its vector code with the preprocessor (__AVX2__),
 * so the AVX2 variant needs a translation unit compiled for AVX2, while the library must
 * run on any x86-64. GCC's target pragma defines __AVX2__ for the rest of the file; other
 * compilers (and other architectures) get the portable inline variant here too, and
 * hash.c never selects it over its own.
 */
#include "common/cpu.h" /* KVW_BUILD_AVX2_PRAGMA: macros only, before the pragma */

#if KVW_BUILD_AVX2_PRAGMA
#pragma GCC target("avx2")
#endif

#define XXH_INLINE_ALL
#define XXH_STATIC_LINKING_ONLY
#include <stddef.h>
#include <stdint.h>
#include <xxhash.h>

#include "common/hash_impl.h"

uint64_t kvw_xxh3_avx2(const void *p, size_t n) { return (uint64_t)XXH3_64bits(p, n); }
void kvw_xxh3_update_avx2(XXH3_state_t *st, const void *p, size_t n) { (void)XXH3_64bits_update(st, p, n); }
uint64_t kvw_xxh3_digest_avx2(const XXH3_state_t *st) { return (uint64_t)XXH3_64bits_digest(st); }
