/*
 * Private interface between the kvwire-c files: kvwire-c.c (main, dispatch, serve),
 * tool_common.c (shared helpers), tool_decode.c (validate, decode, reassemble) and
 * tool_encode.c (encode). Only those files include it.
 */
#ifndef KVW_TOOLS_TOOL_IMPL_H
#define KVW_TOOLS_TOOL_IMPL_H

#include "json.h"
#include "kvwire.h"
#include "neutral.h"

#include <stddef.h>
#include <stdint.h>

#define EXIT_REJECTED 1
#define EXIT_USAGE 2
#define EXIT_INTERNAL 3

/* Captured standard output and error of one command. */
typedef struct tool_io { sbuf out, err; } tool_io;

/* A library failure: a rejection (exit 1, "CODE RULE message") or an internal error. */
int kvw_tool_fail(tool_io *o, const kvw_error *e);
/* The whole file at path into *data (malloc'ed); -1 with a message on o->err. */
int kvw_tool_read_file(const char *path, uint8_t **data, size_t *len, tool_io *o);
/* "k", "v", "latent", "positions" or "state.NAME" into buf. */
const char *kvw_tool_component_label(int component, const kvw_layer_spec *s, uint32_t which, char *buf, size_t n);
/* The (component, which) pairs a layer stores (PROTOCOL.md 2.3); returns the count. */
uint32_t kvw_tool_layer_tensors(const kvw_header *h, uint32_t layer, int comps[], uint32_t which[], uint32_t max);

/* The commands; each returns the exit code and writes into o. */
int kvw_tool_cmd_validate(const char *in, tool_io *o);
int kvw_tool_cmd_decode(const char *in, const char *dir, tool_io *o);
int kvw_tool_cmd_reassemble(const char *in, const char *dir, tool_io *o);
int kvw_tool_cmd_encode(const char *spec_path, const char *out_path, tool_io *o);

#endif
