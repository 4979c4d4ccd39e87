/*
 * JSON parser of the kvwire-c tool (see json.h for why it exists): recursive descent with
 * a depth limit, every read bounded by the input length, and the typed accessors. The
 * output side (sbuf and the JSON emitters) is json_emit.c.
 */
#include "json.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define JSON_MAX_DEPTH 128

typedef struct jparser {
    const char *p, *end, *start;
    char *err;
    size_t errlen;
    int failed;
} jparser;

static int jfail(jparser *ps, const char *what) {
    if (!ps->failed && ps->err && ps->errlen)
        snprintf(ps->err, ps->errlen, "JSON: %s at byte %ld", what, (long)(ps->p - ps->start));
    ps->failed = 1;
    return -1;
}

static void skip_ws(jparser *ps) {
    while (ps->p < ps->end && (*ps->p == ' ' || *ps->p == '\t' || *ps->p == '\n' || *ps->p == '\r'))
        ps->p++;
}

static void jv_clear(jv *v) {
    size_t i;
    if (!v) return;
    if (v->type == JV_STRING) free(v->s);
    if (v->type == JV_ARRAY || v->type == JV_OBJECT) {
        for (i = 0; i < v->len; i++) {
            jv_clear(&v->items[i]);
            if (v->keys) free(v->keys[i]);
        }
        free(v->items);
        free(v->keys);
    }
    memset(v, 0, sizeof *v);
}

void json_free(jv *v) {
    if (!v) return;
    jv_clear(v);
    free(v);
}

static int hex4(jparser *ps, unsigned *out) {
    unsigned v = 0;
    int k;
    if (ps->end - ps->p < 4) return jfail(ps, "short \\u escape");
    for (k = 0; k < 4; k++) {
        char c = ps->p[k];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f') v |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v |= (unsigned)(c - 'A' + 10);
        else return jfail(ps, "bad \\u escape");
    }
    ps->p += 4;
    *out = v;
    return 0;
}

static void put_utf8(char *dst, size_t *n, unsigned cp) {
    if (cp < 0x80) {
        dst[(*n)++] = (char)cp;
    } else if (cp < 0x800) {
        dst[(*n)++] = (char)(0xC0 | (cp >> 6));
        dst[(*n)++] = (char)(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
        dst[(*n)++] = (char)(0xE0 | (cp >> 12));
        dst[(*n)++] = (char)(0x80 | ((cp >> 6) & 0x3F));
        dst[(*n)++] = (char)(0x80 | (cp & 0x3F));
    } else {
        dst[(*n)++] = (char)(0xF0 | (cp >> 18));
        dst[(*n)++] = (char)(0x80 | ((cp >> 12) & 0x3F));
        dst[(*n)++] = (char)(0x80 | ((cp >> 6) & 0x3F));
        dst[(*n)++] = (char)(0x80 | (cp & 0x3F));
    }
}

/* At the opening quote. The decoded string is never longer than its source. */
static int parse_string(jparser *ps, char **out, size_t *outlen) {
    const char *q = ps->p + 1;
    char *dst;
    size_t n = 0;
    while (q < ps->end && *q != '"') q += (*q == '\\' && q + 1 < ps->end) ? 2 : 1;
    if (q >= ps->end) return jfail(ps, "unterminated string");
    dst = malloc((size_t)(q - ps->p) + 1);
    if (!dst) return jfail(ps, "out of memory");
    ps->p++;
    while (ps->p < ps->end && *ps->p != '"') {
        unsigned char c = (unsigned char)*ps->p;
        if (c < 0x20) { free(dst); return jfail(ps, "control character in string"); }
        if (c != '\\') { dst[n++] = (char)c; ps->p++; continue; }
        ps->p++;
        if (ps->p >= ps->end) { free(dst); return jfail(ps, "bad escape"); }
        c = (unsigned char)*ps->p++;
        switch (c) {
        case '"': dst[n++] = '"'; break;
        case '\\': dst[n++] = '\\'; break;
        case '/': dst[n++] = '/'; break;
        case 'b': dst[n++] = '\b'; break;
        case 'f': dst[n++] = '\f'; break;
        case 'n': dst[n++] = '\n'; break;
        case 'r': dst[n++] = '\r'; break;
        case 't': dst[n++] = '\t'; break;
        case 'u': {
            unsigned cp, lo;
            if (hex4(ps, &cp)) { free(dst); return -1; }
            if (cp >= 0xD800 && cp < 0xDC00) {
                if (ps->end - ps->p >= 6 && ps->p[0] == '\\' && ps->p[1] == 'u') {
                    const char *save = ps->p;
                    ps->p += 2;
                    if (hex4(ps, &lo)) { free(dst); return -1; }
                    if (lo >= 0xDC00 && lo < 0xE000) cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                    else { ps->p = save; cp = 0xFFFD; }
                } else {
                    cp = 0xFFFD; /* lone high surrogate */
                }
            } else if (cp >= 0xDC00 && cp < 0xE000) {
                cp = 0xFFFD; /* lone low surrogate */
            }
            put_utf8(dst, &n, cp); /* 6 source bytes give at most 3 (or 12 give 4) */
            break;
        }
        default: free(dst); return jfail(ps, "bad escape");
        }
    }
    if (ps->p >= ps->end) { free(dst); return jfail(ps, "unterminated string"); }
    ps->p++;
    dst[n] = 0;
    *out = dst;
    *outlen = n;
    return 0;
}

static int parse_number(jparser *ps, jv *v) {
    const char *s = ps->p, *q = ps->p;
    int neg = 0, isint = 1;
    char buf[512];
    size_t n;
    if (q < ps->end && *q == '-') { neg = 1; q++; }
    if (q >= ps->end || *q < '0' || *q > '9') return jfail(ps, "bad number");
    if (*q == '0') q++;
    else while (q < ps->end && *q >= '0' && *q <= '9') q++;
    if (q < ps->end && *q == '.') {
        isint = 0; q++;
        if (q >= ps->end || *q < '0' || *q > '9') return jfail(ps, "bad number");
        while (q < ps->end && *q >= '0' && *q <= '9') q++;
    }
    if (q < ps->end && (*q == 'e' || *q == 'E')) {
        isint = 0; q++;
        if (q < ps->end && (*q == '+' || *q == '-')) q++;
        if (q >= ps->end || *q < '0' || *q > '9') return jfail(ps, "bad number");
        while (q < ps->end && *q >= '0' && *q <= '9') q++;
    }
    n = (size_t)(q - s);
    if (n >= sizeof buf) return jfail(ps, "number too long");
    memcpy(buf, s, n);
    buf[n] = 0;
    ps->p = q;
    if (isint) {
        uint64_t acc = 0;
        const char *d = buf + neg;
        int ovf = 0;
        for (; *d; d++) {
            unsigned dig = (unsigned)(*d - '0');
            if (acc > (UINT64_MAX - dig) / 10) { ovf = 1; break; }
            acc = acc * 10 + dig;
        }
        if (!ovf && !neg) { v->type = JV_UINT; v->u = acc; v->d = (double)acc; return 0; }
        if (!ovf && neg && acc <= (uint64_t)INT64_MAX + 1) {
            v->type = JV_INT;
            v->i = acc == (uint64_t)INT64_MAX + 1 ? INT64_MIN : -(int64_t)acc;
            v->d = (double)v->i;
            if (acc == 0) { v->type = JV_UINT; v->u = 0; v->d = -0.0; }
            return 0;
        }
    }
    v->type = JV_DOUBLE;
    v->d = strtod(buf, NULL);
    return 0;
}

static int parse_value(jparser *ps, jv *v, int depth);

static int parse_container(jparser *ps, jv *v, int depth, int obj) {
    size_t cap = 0;
    char close = obj ? '}' : ']';
    v->type = obj ? JV_OBJECT : JV_ARRAY;
    ps->p++;
    skip_ws(ps);
    if (ps->p < ps->end && *ps->p == close) { ps->p++; return 0; }
    for (;;) {
        char *key = NULL;
        size_t klen;
        if (obj) {
            skip_ws(ps);
            if (ps->p >= ps->end || *ps->p != '"') return jfail(ps, "expected a key");
            if (parse_string(ps, &key, &klen)) return -1;
            skip_ws(ps);
            if (ps->p >= ps->end || *ps->p != ':') { free(key); return jfail(ps, "expected ':'"); }
            ps->p++;
        }
        if (v->len == cap) {
            size_t nc = cap ? cap * 2 : 4;
            jv *ni = realloc(v->items, nc * sizeof *ni);
            if (!ni) { free(key); return jfail(ps, "out of memory"); }
            v->items = ni;
            if (obj) {
                char **nk = realloc(v->keys, nc * sizeof *nk);
                if (!nk) { free(key); return jfail(ps, "out of memory"); }
                v->keys = nk;
            }
            cap = nc;
        }
        memset(&v->items[v->len], 0, sizeof(jv));
        if (obj) v->keys[v->len] = key;
        v->len++;
        if (parse_value(ps, &v->items[v->len - 1], depth + 1)) return -1;
        skip_ws(ps);
        if (ps->p < ps->end && *ps->p == ',') { ps->p++; continue; }
        if (ps->p < ps->end && *ps->p == close) { ps->p++; return 0; }
        return jfail(ps, obj ? "expected ',' or '}'" : "expected ',' or ']'");
    }
}

static int lit(jparser *ps, const char *word) {
    size_t n = strlen(word);
    if ((size_t)(ps->end - ps->p) < n || memcmp(ps->p, word, n) != 0) return 0;
    ps->p += n;
    return 1;
}

static int parse_value(jparser *ps, jv *v, int depth) {
    if (depth > JSON_MAX_DEPTH) return jfail(ps, "nesting too deep");
    skip_ws(ps);
    if (ps->p >= ps->end) return jfail(ps, "unexpected end");
    switch (*ps->p) {
    case '{': return parse_container(ps, v, depth, 1);
    case '[': return parse_container(ps, v, depth, 0);
    case '"':
        v->type = JV_STRING;
        return parse_string(ps, &v->s, &v->len);
    case 't': if (lit(ps, "true")) { v->type = JV_BOOL; v->b = 1; return 0; } break;
    case 'f': if (lit(ps, "false")) { v->type = JV_BOOL; v->b = 0; return 0; } break;
    case 'n': if (lit(ps, "null")) { v->type = JV_NULL; return 0; } break;
    default:
        if (*ps->p == '-' || (*ps->p >= '0' && *ps->p <= '9')) return parse_number(ps, v);
    }
    return jfail(ps, "unexpected character");
}

int json_parse(const char *text, size_t len, jv **out, char *err, size_t errlen) {
    jparser ps;
    jv *v = calloc(1, sizeof *v);
    if (err && errlen) err[0] = 0;
    *out = NULL;
    if (!v) return -1;
    ps.p = text;
    ps.start = text;
    ps.end = text + len;
    ps.err = err;
    ps.errlen = errlen;
    ps.failed = 0;
    if (parse_value(&ps, v, 0) == 0) {
        skip_ws(&ps);
        if (ps.p == ps.end) { *out = v; return 0; }
        jfail(&ps, "trailing characters");
    }
    json_free(v);
    return -1;
}

const jv *json_get(const jv *v, const char *key) {
    size_t i;
    const jv *found = NULL;
    if (!v || v->type != JV_OBJECT) return NULL;
    for (i = 0; i < v->len; i++)
        if (strcmp(v->keys[i], key) == 0) found = &v->items[i];
    return found;
}

int json_u64(const jv *v, uint64_t *out) {
    if (!v) return -1;
    if (v->type == JV_UINT) { *out = v->u; return 0; }
    if (v->type == JV_DOUBLE && v->d >= 0 && v->d < 18446744073709551616.0 && v->d == floor(v->d)) {
        *out = (uint64_t)v->d;
        return 0;
    }
    return -1;
}

int json_i64(const jv *v, int64_t *out) {
    if (!v) return -1;
    if (v->type == JV_INT) { *out = v->i; return 0; }
    if (v->type == JV_UINT && v->u <= (uint64_t)INT64_MAX) { *out = (int64_t)v->u; return 0; }
    if (v->type == JV_DOUBLE && v->d >= -9223372036854775808.0 && v->d < 9223372036854775808.0 &&
        v->d == floor(v->d)) {
        *out = (int64_t)v->d;
        return 0;
    }
    return -1;
}

int json_f64(const jv *v, double *out) {
    if (!v) return -1;
    if (v->type == JV_UINT || v->type == JV_INT || v->type == JV_DOUBLE) { *out = v->d; return 0; }
    if (v->type == JV_STRING) {
        if (strcmp(v->s, "NaN") == 0) { *out = NAN; return 0; }
        if (strcmp(v->s, "Infinity") == 0) { *out = INFINITY; return 0; }
        if (strcmp(v->s, "-Infinity") == 0) { *out = -INFINITY; return 0; }
    }
    return -1;
}

int json_bool(const jv *v, int *out) {
    if (!v || v->type != JV_BOOL) return -1;
    *out = v->b;
    return 0;
}

const char *json_str(const jv *v) { return v && v->type == JV_STRING ? v->s : NULL; }
