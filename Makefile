# kvwire developer entry points. `make demo` and `make test` work on a fresh clone:
# both create .venv and install the package with what they need.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test bench schemas clean fuzz

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch: take the pinned CPU wheel first; a bare `torch` requirement would resolve to a CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvwire demo

# The store tests start real Redis servers (tests/redisfix.py): install redis-server when it is missing.
test: $(STAMP)
	@command -v redis-server >/dev/null 2>&1 || { \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    echo "installing redis-server (apt-get)"; \
	    apt-get install -y -qq redis-server >/dev/null 2>&1 || \
	      { apt-get update -qq && apt-get install -y -qq redis-server >/dev/null; } || exit 1; \
	  else \
	    echo "make test needs redis-server: sudo apt-get install redis-server (or your system's package)" >&2; exit 1; \
	  fi; }
	$(PY) -m pytest -q

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
	rm -rf $(VENV) build *.egg-info python/*.egg-info .pytest_cache .hypothesis
