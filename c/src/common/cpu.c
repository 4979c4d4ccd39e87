/*
 * The CPU-feature probe (common/cpu.h). Why one: XXH3 and three kernel files each asked
 * the CPU on their own; one cached answer keeps every dispatch consistent and leaves one
 * place to change when a feature (or an override) is added.
 */
#include "common/cpu.h"

#include <stdatomic.h>

static atomic_int avx2_state = -1; /* -1 not probed yet, else the answer */

static int probe_avx2(void) {
#if KVW_BUILD_AVX2_ATTR
    __builtin_cpu_init(); /* idempotent; needed when called before constructors ran */
    return __builtin_cpu_supports("avx2") ? 1 : 0;
#else
    return 0;
#endif
}

int kvw_cpu_has_avx2(void) {
    int v = atomic_load_explicit(&avx2_state, memory_order_relaxed);
    if (v < 0) {
        v = probe_avx2();
        atomic_store_explicit(&avx2_state, v, memory_order_relaxed);
    }
    return v;
}
