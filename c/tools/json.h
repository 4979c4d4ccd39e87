/*
 * A small JSON parser and emitter for the kvwire-c conformance command (conformance/
 * PROTOCOL.md section 2). Why our own: the protocol needs integers exact up to 2^64 - 1,
 * which common C JSON libraries lose, and the tool must not depend on more than libzstd
 * and libxxhash. Parsing is strict RFC 8259 with a nesting limit; bad input is an error
 * message, never a crash.
 */
#ifndef KVW_TOOLS_JSON_H
#define KVW_TOOLS_JSON_H

#include <stddef.h>
#include <stdint.h>

typedef enum jv_type {
    JV_NULL = 0, JV_BOOL, JV_UINT, JV_INT, JV_DOUBLE, JV_STRING, JV_ARRAY, JV_OBJECT
} jv_type;

/* One JSON value. Integers without fraction/exponent: JV_UINT (>= 0, fits u64) or JV_INT
 * (negative, fits i64); every other number is JV_DOUBLE. Strings are UTF-8, NUL-terminated
 * (len excludes the NUL; an embedded \u0000 is kept). */
typedef struct jv {
    jv_type type;
    int b;
    uint64_t u;
    int64_t i;
    double d;
    char *s;
    size_t len;          /* string bytes, or item count of an array / object */
    struct jv *items;    /* array items or object values */
    char **keys;         /* object keys (NUL-terminated) */
} jv;

/* Parse text[0..len); 0 on success (*out owned by the caller, json_free), -1 with a
 * message in err otherwise. */
int json_parse(const char *text, size_t len, jv **out, char *err, size_t errlen);
void json_free(jv *v);

/* Object member by key (last one wins for duplicates), NULL when absent or v not an object. */
const jv *json_get(const jv *v, const char *key);
/* Typed reads: 0 on success, -1 on a wrong type or range. NULL v gives -1. */
int json_u64(const jv *v, uint64_t *out);
int json_i64(const jv *v, int64_t *out);
int json_f64(const jv *v, double *out); /* numbers, or "NaN" / "Infinity" / "-Infinity" */
int json_bool(const jv *v, int *out);
const char *json_str(const jv *v); /* NULL unless a string */

/* A growable output buffer. On allocation failure it sets oom and drops further output. */
typedef struct sbuf { char *p; size_t len, cap; int oom; } sbuf;
void sb_init(sbuf *b);
void sb_free(sbuf *b);
void sb_putn(sbuf *b, const char *s, size_t n);
void sb_puts(sbuf *b, const char *s);
void sb_printf(sbuf *b, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
/* JSON string literal of s[0..n) (escapes quotes, backslash, control bytes). */
void sb_jstr(sbuf *b, const char *s, size_t n);
void sb_jcstr(sbuf *b, const char *s);
/* A binary64 as JSON: shortest round-trip digits, always with a '.' or exponent, and
 * the strings "NaN", "Infinity", "-Infinity" for non-finite values. */
void sb_f64(sbuf *b, double x);
void sb_u64(sbuf *b, uint64_t v);
void sb_i64(sbuf *b, int64_t v);
void sb_hex(sbuf *b, const uint8_t *p, size_t n); /* "0a1b..." with quotes */

#endif
