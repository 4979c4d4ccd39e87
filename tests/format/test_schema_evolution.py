"""KVW-EVOL-7: the schemas of format v1 only ever grow.

The v1.0 tables and structs are pinned below (taken from schemas/*.fbs when v1.0 was
drafted). A later revision may add table fields with new ids; it may never remove,
renumber or retype a pinned field, give a table field no explicit id, reuse an id, or
change a struct (structs are frozen for the major version). Never edit the pins.
"""

import pathlib
import re

SCHEMAS = pathlib.Path(__file__).resolve().parents[2] / "schemas"


def parse(text: str):
    text = re.sub(r"//.*", "", text)
    tables, structs = {}, {}
    for kind, name, body in re.findall(r"\b(table|struct)\s+(\w+)\s*\{(.*?)\}", text, re.S):
        fields = []
        for decl in body.split(";"):
            m = re.match(r"\s*(\w+)\s*:\s*([\w.\[\]]+)(.*)", decl, re.S)
            if m:
                fid = re.search(r"\bid:\s*(\d+)", m.group(3))
                fields.append((m.group(1), m.group(2), int(fid.group(1)) if fid else None))
        (tables if kind == "table" else structs)[name] = fields
    return tables, structs


TABLES_V1_0 = {
    'Producer': [('library', 'string', 0), ('version', 'string', 1)],
    'ModelIdentity': [('model_type', 'string', 0), ('model_id', 'string', 1), ('revision', 'string', 2), ('config_fingerprint', '[ubyte]', 3), ('tokenizer_fingerprint', '[ubyte]', 4), ('weights_fingerprint', '[ubyte]', 5), ('compat_fingerprint', '[ubyte]', 6)],
    'RopeParams': [('rope_type', 'RopeType', 0), ('theta', 'double', 1), ('rotary_dim', 'uint', 2), ('interleaved', 'bool', 3), ('factor', 'double', 4), ('original_max_position_embeddings', 'uint', 5), ('low_freq_factor', 'double', 6), ('high_freq_factor', 'double', 7), ('beta_fast', 'double', 8), ('beta_slow', 'double', 9), ('attention_factor', 'double', 10), ('mscale', 'double', 11), ('mscale_all_dim', 'double', 12), ('short_factor', '[double]', 13), ('long_factor', '[double]', 14), ('mrope_section', '[uint]', 15), ('seq_len_at_encode', 'ulong', 16)],
    'LayerSpec': [('kind', 'LayerKind', 0), ('num_kv_heads', 'uint', 1), ('head_dim_k', 'uint', 2), ('head_dim_v', 'uint', 3), ('window', 'uint', 4), ('source_layer', 'int', 5), ('uses_rope', 'bool', 6), ('rope', 'RopeParams', 7), ('kv_lora_rank', 'uint', 8), ('qk_rope_head_dim', 'uint', 9)],
    'Architecture': [('schema_version', 'ushort', 0), ('num_layers', 'uint', 1), ('layer_specs', '[LayerSpec]', 2), ('layer_spec_index', '[ushort]', 3), ('rope', 'RopeParams', 4), ('keys_post_rope', 'bool', 5)],
    'KeyValue': [('key', 'string', 0), ('value', '[ubyte]', 1)],
    'EngineLayout': [('name', 'string', 0), ('axes', 'string', 1), ('stride_order', '[ubyte]', 2), ('block_size', 'uint', 3), ('engine', 'string', 4)],
    'Header': [('format_major', 'ushort', 0), ('format_minor', 'ushort', 1), ('required_features', 'ulong', 2), ('optional_features', 'ulong', 3), ('producer', 'Producer', 4), ('model', 'ModelIdentity', 5), ('arch', 'Architecture', 6), ('layer_map', '[LayerMapEntry]', 7), ('dtype', 'DType', 8), ('alignment', 'uint', 9), ('chunk_tokens', 'uint', 10), ('first_position', 'ulong', 11), ('token_count', 'uint', 12), ('layer_tokens', '[TokenRange]', 13), ('checksum_algorithm', 'ChecksumAlgorithm', 14), ('custom_metadata', '[KeyValue]', 15), ('engine_layout', 'EngineLayout', 16)],
    'ChunkIndex': [('records', '[ChunkRecord]', 0)],
}
STRUCTS_V1_0 = {
    'LayerMapEntry': [('receiver_layer', 'uint'), ('transmitted_layer', 'int'), ('op', 'MapOp')],
    'TokenRange': [('start', 'uint'), ('count', 'uint')],
    'ChunkRecord': [('offset', 'ulong'), ('stored_length', 'ulong'), ('raw_length', 'ulong'), ('checksum', 'ulong'), ('token_start', 'uint'), ('token_count', 'uint'), ('layer', 'ushort'), ('component', 'Component'), ('codec', 'Codec'), ('flags', 'ushort'), ('head_start', 'ushort'), ('head_count', 'ushort'), ('reserved0', 'ushort'), ('reserved1', 'uint')],
}


def current():
    return parse("".join(p.read_text() for p in sorted(SCHEMAS.glob("*.fbs"))))


def test_pinned_table_fields_keep_name_type_and_id():
    tables, _ = current()
    for table, pinned in TABLES_V1_0.items():
        assert table in tables, f"table {table} removed"
        now = {name: (typ, fid) for name, typ, fid in tables[table]}
        for name, typ, fid in pinned:
            assert now.get(name) == (typ, fid), f"{table}.{name} changed: {now.get(name)} != {(typ, fid)}"


def test_every_table_field_has_a_unique_explicit_id():
    tables, _ = current()
    for table, fields in tables.items():
        ids = [fid for _, _, fid in fields]
        assert None not in ids, f"{table} has a field without id:"
        assert len(set(ids)) == len(ids), f"{table} reuses an id"


def test_structs_are_frozen():
    _, structs = current()
    for name, pinned in STRUCTS_V1_0.items():
        assert [(f, t) for f, t, _ in structs[name]] == pinned, f"struct {name} changed"
    assert set(structs) >= set(STRUCTS_V1_0)


def test_parser_sees_the_schema():
    """Guards the guard: the parser must find what it pins (a regex that matched nothing would pass)."""
    tables, structs = current()
    assert len(tables["Header"]) >= 17 and len(structs["ChunkRecord"]) == 14
