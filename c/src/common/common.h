/*
 * libkvwire's lowest layer (src/common): error reporting, little-endian access, checked
 * arithmetic, XXH3 (hash.c), the spec's constants, and the one CPU-feature probe (cpu.h).
 * Not installed; nothing here is API. Every other folder may include this header; it
 * includes nothing of theirs.
 *
 * Layers (c/README.md "Layout"), each including only its own and lower folders' headers:
 *   common  errors, names, records, header defaults, XXH3, the CPU probe, FlatBuffers reading
 *   format  what a container is: header decoding and rules, the chunk grid, frame checks,
 *           codec geometry (shared by both directions)
 *   simd    the AVX2 kernels of the codecs (both directions), chosen at run time
 *   decode  random-access reader, sans-IO decoder, segment reassembly, codec decoders, ffi
 *   encode  FlatBuffers builder, writer, file sink, codec encoders, kvw_lossy_encode_wire
 * Decode never depends on encode (tests/c/test_c_layers.py checks includes and symbols).
 */
#ifndef KVW_COMMON_H
#define KVW_COMMON_H

#include "kvwire.h"
#include "common/cpu.h"

#include <stdarg.h>
#include <stdint.h>
#include <string.h>

/* ---- errors ----------------------------------------------------------------------- */
/* Fill err (when not NULL) and return code. fmt is printf-style. */
kvw_code kvw_fail(kvw_error *err, kvw_code code, const char *rule, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 4, 5)))
#endif
    ;
/* TRUNCATED with the number of bytes needed from offset 0 (KVW-ERR-3). */
kvw_code kvw_fail_truncated(kvw_error *err, const char *rule, uint64_t needed);
void kvw_error_clear(kvw_error *err);

/* ---- little-endian loads and stores (unaligned) ------------------------------------ */
static inline uint16_t kvw_ld16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline uint32_t kvw_ld32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) |
           ((uint32_t)p[3] << 24);
}
static inline uint64_t kvw_ld64(const uint8_t *p) {
    return (uint64_t)kvw_ld32(p) | ((uint64_t)kvw_ld32(p + 4) << 32);
}
static inline void kvw_st16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }
static inline void kvw_st32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); p[2] = (uint8_t)(v >> 16); p[3] = (uint8_t)(v >> 24);
}
static inline void kvw_st64(uint8_t *p, uint64_t v) {
    kvw_st32(p, (uint32_t)v); kvw_st32(p + 4, (uint32_t)(v >> 32));
}
static inline double kvw_ldf64(const uint8_t *p) { uint64_t u = kvw_ld64(p); double d; memcpy(&d, &u, 8); return d; }
static inline float kvw_ldf32(const uint8_t *p) { uint32_t u = kvw_ld32(p); float f; memcpy(&f, &u, 4); return f; }

/* ---- checked arithmetic (KVW-CONV-4): return 1 on overflow ------------------------- */
static inline int kvw_add_ovf(uint64_t a, uint64_t b, uint64_t *out) { return __builtin_add_overflow(a, b, out); }
static inline int kvw_mul_ovf(uint64_t a, uint64_t b, uint64_t *out) { return __builtin_mul_overflow(a, b, out); }
/* align_up(x, a) for a power of two a; 1 on overflow. */
static inline int kvw_align_up(uint64_t x, uint64_t a, uint64_t *out) {
    uint64_t t;
    if (kvw_add_ovf(x, a - 1, &t)) return 1;
    *out = t & ~(a - 1);
    return 0;
}
/* next_frame_offset(prev_end, A) = align_up(prev_end + 64, A) - 64 (9.3); 1 on overflow. */
static inline int kvw_next_frame_offset(uint64_t prev_end, uint64_t a, uint64_t *out) {
    uint64_t t;
    if (kvw_add_ovf(prev_end, 64, &t) || kvw_align_up(t, a, &t)) return 1;
    *out = t - 64;
    return 0;
}

/* ---- checksums (KVW-CONV-3) --------------------------------------------------------- */
uint64_t kvw_xxh3(const void *p, size_t n);
/* Streaming XXH3-64 over an XXH3_state_t of xxhash.h (XXH_STATIC_LINKING_ONLY), passed as
 * void *: hash.c compiles xxhash.h inline, whose struct tag differs (same layout). */
void kvw_xxh3_reset(void *st);
void kvw_xxh3_update(void *st, const void *p, size_t n);
uint64_t kvw_xxh3_digest(const void *st);
uint32_t kvw_check32(const void *p, size_t n); /* low 32 bits of XXH3-64 */

/* ---- constants (spec section 17 and magic numbers) ---------------------------------- */
#define KVW_PREAMBLE_SIZE 32
#define KVW_FRAME_SIZE 64
#define KVW_TRAILER_SIZE 32
#define KVW_MAX_HEADER_LENGTH (UINT32_C(16) << 20)
#define KVW_MAX_INDEX_LENGTH (UINT32_C(64) << 20)
#define KVW_MAX_LAYERS 4096
#define KVW_MAX_CHUNKS (UINT32_C(1) << 20)
#define KVW_DEFAULT_MAX_DECODED (UINT64_C(1) << 36)
extern const uint8_t KVW_MAGIC[8];      /* 89 4B 56 57 0D 0A 1A 0A */
extern const uint8_t KVW_TRAILER_MAGIC[8]; /* "KVWINDEX" */

#endif /* KVW_COMMON_H */
