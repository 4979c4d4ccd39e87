"""The ``kvwire`` command: synth, inspect (text, --json), validate, demo."""

import json
import subprocess
import sys

import pytest

import forge
import kvwire
from kvwire.tools.cli import main


@pytest.fixture(scope="module")
def synth_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "s.kvw"
    assert main(["synth", "-o", str(path), "--layers", "2", "--kv-heads", "2", "--head-dim", "16",
                 "--tokens", "300", "--chunk-tokens", "128", "--dtype", "f16", "--codec", "zstd", "--seed", "4"]) == 0
    return path


def test_synth_writes_the_requested_cache(synth_file):
    from kvwire.tools.synth import synth_cache

    expected = synth_cache(2, 2, 16, 300, dtype="f16", chunk_tokens=128, seed=4)
    loaded = kvwire.load(synth_file)
    assert loaded.equal(expected)
    with kvwire.open(synth_file) as r:
        assert r.form == "file" and r.chunk_count == 2 * 2 * 3


def test_synth_reports_what_it_wrote(tmp_path, capsys):
    path = tmp_path / "x.kvw"
    assert main(["synth", "-o", str(path), "--layers", "1", "--kv-heads", "1", "--head-dim", "8", "--tokens", "10"]) == 0
    out = capsys.readouterr().out
    assert str(path) in out and str(path.stat().st_size) in out


def test_inspect_text(synth_file, capsys):
    assert main(["inspect", str(synth_file)]) == 0
    out = capsys.readouterr().out
    assert "file form" in out and str(synth_file.stat().st_size) in out
    assert "tokens     300 from position 0, chunks of 128" in out
    assert "dtype      f16, alignment 64, checksum xxh3_64" in out
    assert "chunks     12 (zstd)" in out or "chunks     12 (raw, zstd)" in out
    assert "layers     2" in out
    assert "full_attention" in out and "k[2, 300, 16]" in out and "v[2, 300, 16]" in out


def test_inspect_json(synth_file, capsys):
    assert main(["inspect", "--json", str(synth_file)]) == 0
    d = json.loads(capsys.readouterr().out)
    h = kvwire.open(synth_file).header
    assert d["token_count"] == 300 and d["dtype"] == "f16" and d["chunk_tokens"] == 128
    assert d["arch"]["num_layers"] == 2 and len(d["arch"]["layers"]) == 2
    assert d["arch"]["layers"][0]["num_kv_heads"] == 2
    assert d["model"]["model_id"] == h.model.model_id
    c = d["container"]
    assert c["form"] == "file" and c["size"] == synth_file.stat().st_size and c["chunks"] == 12
    assert c["raw_bytes"] == 2 * 2 * 2 * 300 * 16 * 2
    assert 0 < c["stored_bytes"] <= c["raw_bytes"]


def test_inspect_json_of_a_rich_header(tmp_path, capsys):
    cache = forge.small_cache(metadata={"app.blob": b"\x00\xff"},
                              model=kvwire.ModelIdentity(model_id="m", config_fingerprint=b"\x01\x02"))
    path = tmp_path / "rich.kvw"
    kvwire.save(path, cache)
    assert main(["inspect", "--json", str(path)]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["metadata"] == {"app.blob": "00ff"}
    assert d["model"]["config_fingerprint"] == "0102"
    assert main(["inspect", str(path)]) == 0
    assert "metadata   app.blob = b'\\x00\\xff'" in capsys.readouterr().out


def test_validate_valid(synth_file, capsys):
    assert main(["validate", str(synth_file)]) == 0
    assert "valid" in capsys.readouterr().out


def test_validate_corrupted(synth_file, tmp_path, capsys):
    data = synth_file.read_bytes()
    off, _ = forge.layout(data).bodies[5]
    bad = tmp_path / "bad.kvw"
    bad.write_bytes(forge.xor_byte(data, off + 3))
    assert main(["validate", str(bad)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "BODY_CHECKSUM"
    assert "KVW-CSUM-1" in err[1]


def test_validate_reports_padding_that_load_ignores(tmp_path, capsys):
    data = kvwire.encode(forge.small_cache())
    start, stop = forge.layout(data).padding()[0]
    bad = tmp_path / "pad.kvw"
    bad.write_bytes(forge.set_byte(data, start, 1))
    assert main(["validate", str(bad)]) == 1
    assert capsys.readouterr().err.splitlines()[0] == "NONZERO_PADDING"


def test_inspect_invalid_file_exits_1_with_the_code(tmp_path, capsys):
    bad = tmp_path / "text.kvw"
    bad.write_bytes(kvwire.encode(forge.small_cache()).replace(b"\r\n", b"\n"))
    assert main(["inspect", str(bad)]) == 1
    assert capsys.readouterr().err.splitlines()[0] == "TEXT_MODE_MANGLED"


@pytest.mark.slow
def test_validate_as_a_subprocess(synth_file, tmp_path):
    bad = tmp_path / "trunc.kvw"
    bad.write_bytes(synth_file.read_bytes()[:-40])
    ok = subprocess.run([sys.executable, "-m", "kvwire", "validate", str(synth_file)],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    fail = subprocess.run([sys.executable, "-m", "kvwire", "validate", str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert fail.returncode == 1
    with pytest.raises(kvwire.FormatError) as info:
        forge.read_all(bad)
    assert fail.stderr.splitlines()[0] == info.value.code, fail.stderr
    assert "Traceback" not in fail.stderr


def test_demo(capsys):
    assert main(["demo", "--synthetic", "--layers", "2", "--tokens", "300"]) == 0
    out = capsys.readouterr().out
    assert "round trip bit-exact: True" in out
    assert "chunk view shares the mapping: True" in out


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        main(["synth", "-o", "x", "--dtype", "f64"])
    assert info.value.code == 2


# -- user mistakes: one line, no traceback, exit 2 (usage) / 1 (invalid input) ---------------


def _kvwire(*args, timeout=60, **kw):
    return subprocess.run([sys.executable, "-m", "kvwire", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, **kw)


def _one_line_error(proc, status, *words):
    assert proc.returncode == status, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert all(w in lines[0] for w in words), lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("make, args, words", [
    (lambda d: d / "missing.kvw", ["inspect"], ["missing.kvw", "No such file"]),
    (lambda d: d / "missing.kvw", ["validate"], ["missing.kvw", "No such file"]),
    (lambda d: d, ["inspect", "--json"], ["is a directory"]),
    (lambda d: d, ["validate"], ["is a directory"]),
])
def test_cli_unreadable_inputs_are_one_line_exit_2(tmp_path, make, args, words):
    _one_line_error(_kvwire(*args, make(tmp_path)), 2, *words)


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(__import__("os"), "mkfifo"), reason="FIFOs")
def test_cli_refuses_a_fifo_without_hanging(tmp_path):
    import os

    fifo = tmp_path / "pipe.kvw"
    os.mkfifo(fifo)
    for cmd in ("inspect", "validate"):
        _one_line_error(_kvwire(cmd, fifo, timeout=30), 2, "pipe.kvw", "FIFO")


@pytest.mark.slow
@pytest.mark.parametrize("output, words", [
    ("{d}", ["is a directory"]),
    ("{d}/no/such/dir/x.kvw", ["No such file"]),
    ("{d}/file.kvw/x.kvw", ["Not a directory"]),
])
def test_cli_unwritable_output_is_one_line_exit_2(tmp_path, output, words):
    (tmp_path / "file.kvw").write_bytes(b"x")
    _one_line_error(_kvwire("synth", "-o", output.format(d=tmp_path), "--layers", "1", "--tokens", "8"), 2, *words)


@pytest.mark.slow
@pytest.mark.parametrize("args, words", [
    (["--layers", "-1"], ["--layers", "-1", ">= 1"]),
    (["--kv-heads", "0"], ["--kv-heads", ">= 1"]),
    (["--tokens", "-5"], ["--tokens", "negative"]),
    (["--chunk-tokens", "x"], ["--chunk-tokens", "not an integer"]),
    (["--seed", "-1"], ["--seed", "negative"]),
    (["--codec", "lz9"], ["--codec", "invalid choice"]),
])
def test_cli_bad_counts_and_choices_are_one_line_exit_2(tmp_path, args, words):
    _one_line_error(_kvwire("synth", "-o", tmp_path / "x.kvw", *args), 2, *words)
    assert not (tmp_path / "x.kvw").exists()


@pytest.mark.slow
@pytest.mark.parametrize("args, words", [
    (["plan", "--prefill-tokens-per-s", "-5"], ["--prefill-tokens-per-s", "> 0"]),
    (["plan", "--prefill-tokens-per-s", "100", "--context", "0"], ["--context", ">= 1"]),
    (["plan", "--prefill-tokens-per-s", "100", "--cached-tokens", "-1"], ["--cached-tokens", "negative"]),
    (["plan", "--prefill-tokens-per-s", "100", "--latency-ms", "nan"], ["--latency-ms", ">= 0"]),
    (["fidelity", "--prompts", "-2"], ["--prompts", ">= 1"]),
    (["fidelity", "--greedy", "-1"], ["--greedy", "negative"]),
    (["conformance", "run", "--jobs", "0"], ["--jobs", ">= 1"]),
    (["conformance", "run", "--timeout", "-1"], ["--timeout", "> 0"]),
])
def test_cli_every_subcommand_checks_its_counts(args, words):
    """Counts of plan, fidelity and conformance are checked when parsed: one line, exit 2."""
    _one_line_error(_kvwire(*args), 2, *words)


@pytest.mark.slow
def test_cli_demo_rejects_negative_counts():
    _one_line_error(_kvwire("demo", "--synthetic", "--tokens", "-3"), 2, "--tokens")


@pytest.mark.slow
def test_cli_invalid_container_exits_1(tmp_path):
    bad = tmp_path / "junk.kvw"
    bad.write_bytes(b"not a container at all, just text" * 4)
    proc = _kvwire("inspect", bad)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[0] == "BAD_MAGIC"


@pytest.mark.slow
def test_cli_closed_pipe_is_quiet(synth_file):
    """`kvwire inspect x.kvw --json | head -c 1`: no traceback; a reader that closed the pipe
    before the output was written gives 141, as a command ended by SIGPIPE."""
    proc = subprocess.Popen([sys.executable, "-m", "kvwire", "inspect", str(synth_file), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the only read end: every write fails with EPIPE
    err = proc.stderr.read().decode()
    assert proc.wait(60) == 141, err
    assert err == "", err
    shell = subprocess.run(f"set -o pipefail; '{sys.executable}' -m kvwire inspect '{synth_file}' --json | head -c 1",
                           shell=True, executable="/bin/bash", capture_output=True, text=True, timeout=60)
    assert shell.stdout == "{" and "Traceback" not in shell.stderr and "Exception" not in shell.stderr
    assert shell.returncode in (0, 141)


@pytest.mark.slow
def test_cli_help_documents_the_exit_statuses():
    out = _kvwire("--help").stdout
    assert "exit status:" in out and "invalid input" in out and "usage error" in out and "141" in out
