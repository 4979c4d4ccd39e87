/*
 * The header <-> neutral JSON mapping of conformance/PROTOCOL.md section 2.2 for the
 * kvwire-c tool: decode writes a parsed kvw_header as JSON (resolved values, registry
 * names), encode builds a kvw_header from an encode spec's JSON.
 */
#ifndef KVW_TOOLS_NEUTRAL_H
#define KVW_TOOLS_NEUTRAL_H

#include "json.h"
#include "kvwire.h"

/* Write the header object (section 2.2, every field of the 1.0 schema plus kv_scales). */
void neutral_header_to_json(sbuf *b, const kvw_header *h);

/* Allocations behind a header built from JSON (freed together). */
typedef struct neutral_arena { void **blocks; size_t n, cap; } neutral_arena;
void neutral_arena_free(neutral_arena *a);

/* Fill h (kvw_header_init'ed here) from the header object d. Strings point into d (keep
 * it alive), arrays and decoded hex live in the arena. 0 on success, -1 with a message. */
int neutral_header_from_json(const jv *d, kvw_header *h, neutral_arena *a, char *msg,
                             size_t msglen);

/* Registry code by name (dtype, codec, ...); -1 when unknown. */
int neutral_enum(const char *(*name_of)(int), int count, const char *name);

#endif
