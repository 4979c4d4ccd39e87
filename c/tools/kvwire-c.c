/*
 * kvwire-c: libkvwire behind the conformance protocol (conformance/PROTOCOL.md, version
 * 1), so that `kvwire conformance run --impl kvwire-c` judges the C library against the
 * gold vectors and the reference writer. Commands: info, validate, decode, encode,
 * reassemble, serve. Every command writes into a captured stdout/stderr pair, so that
 * serve answers exactly what the separate process would print. This file: main, the
 * command dispatch and serve; the commands are tool_decode.c and tool_encode.c.
 */
#define _POSIX_C_SOURCE 200809L

#include "tool_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char USAGE[] = "usage: kvwire-c decode IN.kvw OUT_DIR | encode SPEC.json OUT.kvw | validate IN.kvw | "
                            "reassemble IN.kvws OUT_DIR | info | serve\n";

static int run_command(int argc, char **argv, tool_io *o) {
    const char *cmd = argc > 0 ? argv[0] : "";
    if (strcmp(cmd, "validate") == 0 && argc == 2) return kvw_tool_cmd_validate(argv[1], o);
    if (strcmp(cmd, "decode") == 0 && argc == 3) return kvw_tool_cmd_decode(argv[1], argv[2], o);
    if (strcmp(cmd, "encode") == 0 && argc == 3) return kvw_tool_cmd_encode(argv[1], argv[2], o);
    if (strcmp(cmd, "reassemble") == 0 && argc == 3) return kvw_tool_cmd_reassemble(argv[1], argv[2], o);
    if (strcmp(cmd, "info") == 0 && argc == 1) {
        sb_puts(&o->out, "{\"name\": \"libkvwire\", \"version\": \"" KVW_VERSION_STRING "\", \"protocol\": 1, "
                         "\"commands\": [\"decode\", \"validate\", \"encode\", \"reassemble\", \"serve\"]}\n");
        return 0;
    }
    sb_puts(&o->err, USAGE);
    return EXIT_USAGE;
}

/* One request line: {"id": ..., "args": [...]} -> one answer line. */
static void serve_line(const char *line, size_t len, sbuf *answer) {
    tool_io o;
    jv *req = NULL;
    char msg[200];
    int code = 1;
    const jv *id = NULL, *args;
    sb_init(&o.out);
    sb_init(&o.err);
    if (json_parse(line, len, &req, msg, sizeof msg) != 0) {
        sb_printf(&o.err, "kvwire-c serve: bad request: %s\n", msg);
    } else {
        id = json_get(req, "id");
        args = json_get(req, "args");
        if (!args || args->type != JV_ARRAY || args->len > 16) {
            sb_puts(&o.err, "kvwire-c serve: request without args\n");
        } else {
            char *argv[16];
            size_t i;
            int ok = 1;
            for (i = 0; i < args->len; i++) {
                if (args->items[i].type != JV_STRING) ok = 0;
                argv[i] = args->items[i].s;
            }
            if (!ok) sb_puts(&o.err, "kvwire-c serve: args must be strings\n");
            else if (args->len && (strcmp(argv[0], "serve") == 0 || strcmp(argv[0], "info") == 0)) code = EXIT_USAGE;
            else code = run_command((int)args->len, argv, &o);
        }
    }
    sb_puts(answer, "{\"id\": ");
    if (id && id->type == JV_UINT) sb_u64(answer, id->u);
    else if (id && id->type == JV_INT) sb_i64(answer, id->i);
    else if (id && id->type == JV_STRING) sb_jstr(answer, id->s, id->len);
    else sb_puts(answer, "null");
    sb_printf(answer, ", \"exit\": %d, \"stdout\": ", code);
    sb_jstr(answer, o.out.p ? o.out.p : "", o.out.len);
    sb_puts(answer, ", \"stderr\": ");
    sb_jstr(answer, o.err.p ? o.err.p : "", o.err.len);
    sb_puts(answer, "}\n");
    sb_free(&o.out);
    sb_free(&o.err);
    json_free(req);
}

static int serve(void) {
    char *line = NULL;
    size_t cap = 0;
    ssize_t n;
    while ((n = getline(&line, &cap, stdin)) >= 0) {
        sbuf answer;
        size_t k = (size_t)n;
        while (k && (line[k - 1] == '\n' || line[k - 1] == '\r' || line[k - 1] == ' ')) k--;
        if (k == 0) continue;
        sb_init(&answer);
        serve_line(line, k, &answer);
        if (answer.oom) {
            sb_free(&answer);
            fputs("{\"id\": null, \"exit\": 3, \"stdout\": \"\", \"stderr\": \"out of memory\"}\n", stdout);
        } else {
            fwrite(answer.p, 1, answer.len, stdout);
            sb_free(&answer);
        }
        fflush(stdout);
    }
    free(line);
    return 0;
}

int main(int argc, char **argv) {
    tool_io o;
    int code;
    if (argc == 2 && strcmp(argv[1], "serve") == 0) return serve();
    sb_init(&o.out);
    sb_init(&o.err);
    code = run_command(argc - 1, argv + 1, &o);
    if (o.out.len) fwrite(o.out.p, 1, o.out.len, stdout);
    if (o.err.len) fwrite(o.err.p, 1, o.err.len, stderr);
    if (o.out.oom || o.err.oom) { fputs("kvwire-c: out of memory\n", stderr); code = EXIT_INTERNAL; }
    sb_free(&o.out);
    sb_free(&o.err);
    return code;
}
