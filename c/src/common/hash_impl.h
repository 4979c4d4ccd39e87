/*
 * Between hash.c (the dispatching entry points of common/common.h) and hash_avx2.c (the AVX2
 * build of XXH3). Both compile xxhash.h inline (XXH_INLINE_ALL): the shared libxxhash of
 * the distribution measured about half the speed (7.7-9.4 GB/s against 15 on the AVX2
 * build, 10-14 on the portable inline one, one core of the benchmark machine), and a
 * checksum pass bounds every verified read. The state type is the header's, the same in
 * both files.
 */
#ifndef KVWIRE_HASH_IMPL_H
#define KVWIRE_HASH_IMPL_H
#include <stddef.h>
#include <stdint.h>

uint64_t kvw_xxh3_avx2(const void *p, size_t n);
void kvw_xxh3_update_avx2(XXH3_state_t *st, const void *p, size_t n);
uint64_t kvw_xxh3_digest_avx2(const XXH3_state_t *st);
#endif
