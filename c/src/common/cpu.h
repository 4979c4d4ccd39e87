/*
 * The one CPU-feature probe of libkvwire (cpu.c) and which AVX2 kernels this compiler
 * builds. Every run-time choice of an AVX2 path (XXH3 in hash.c, the codec kernels of
 * src/simd) asks kvw_cpu_has_avx2(); the one exception is decode/codecs_lossy.c's decoders,
 * compiled twice by target_clones and picked by the dynamic loader (KVW_BUILD_AVX2_CLONES).
 * The kernels give the portable code's values bit for bit, so the choice changes speed only.
 */
#ifndef KVW_CPU_H
#define KVW_CPU_H

/* Kernels built with the target("avx2") attribute (src/simd rot_avx2.c, tq_avx2.c). */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KVW_BUILD_AVX2_ATTR 1
#else
#define KVW_BUILD_AVX2_ATTR 0
#endif
/* Translation units compiled under GCC's target pragma (common/hash_avx2.c, simd/qenc_avx2.c):
 * GCC on x86-64 only (clang's pragma does not define __AVX2__ for xxhash.h). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KVW_BUILD_AVX2_PRAGMA 1
#else
#define KVW_BUILD_AVX2_PRAGMA 0
#endif

/* Functions compiled for AVX2 beside the portable code with target_clones (an ifunc the
 * dynamic loader resolves by the CPU: ELF with glibc; decode/codecs_lossy.c's decoders). */
#include <stdint.h> /* glibc's headers define __GLIBC__ */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && defined(__linux__) && defined(__GLIBC__)
#define KVW_BUILD_AVX2_CLONES 1
#else
#define KVW_BUILD_AVX2_CLONES 0
#endif

/* 1 when the CPU (and the OS, which must save the YMM registers) runs AVX2; 0 elsewhere,
 * including any build that is not x86-64 GCC or clang. Probed on the first call, then a
 * cached load: safe from any thread (every thread computes the same answer). */
int kvw_cpu_has_avx2(void);

#endif /* KVW_CPU_H */
