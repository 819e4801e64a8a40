# Two commands for a newcomer: `make demo` and `make test`. Each sets itself up.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed-$(shell cat pyproject.toml | sha256sum | cut -c1-12)
RUNS    := runs/demo

.PHONY: setup demo test test-all clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch 2.13.0 first, alone, so pip takes the CPU build (see docs/setup.md)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	rm -f $(VENV)/.installed-* && touch $@

setup: $(STAMP)

## demo: the whole chain on the embedded default model (stages are added as they land)
demo: $(STAMP)
	$(BIN)/specprefetch info embedded
	$(BIN)/specprefetch trace embedded --data toolkit/embedded/heldout.jsonl --out $(RUNS)/trace \
	    --max-sequences 24 --prompt-tokens 128 --decode-tokens 32 --overwrite
	$(BIN)/python -m toolkit.traces.summary $(RUNS)/trace

## test: the CI suite (what .ci/run calls)
test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

test-all: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf runs build .pytest_cache
