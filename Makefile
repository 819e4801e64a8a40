# Two commands for a newcomer: `make demo` and `make test`. Each sets itself up.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed-$(shell cat pyproject.toml | sha256sum | cut -c1-12)
RUNS    := runs/demo

.PHONY: setup demo test test-all bench fuzz clean

# Debian packages the native runner's builds and tests need (docs/runner.md), where missing
DEBS    := g++ g++-aarch64-linux-gnu qemu-user nlohmann-json3-dev adb time
DEB_STAMP := $(VENV)/.debs-$(shell echo $(DEBS) | sha256sum | cut -c1-8)

$(DEB_STAMP):
	@missing=$$(for p in $(DEBS); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; \
	  else echo "note: missing Debian packages $$missing (sudo apt-get install $$missing): the native runner's builds need g++ and nlohmann-json3-dev, its arm64 tests the cross compiler and qemu-user"; fi; fi
	mkdir -p $(VENV) && touch $@

# order-only: the Debian packages must be there, but a change to their list reinstalls nothing of pip's
$(STAMP): pyproject.toml | $(DEB_STAMP)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch 2.13.0 first, alone, so pip takes the CPU build (see docs/setup.md)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# what the native runner's arm64 and tokenizer builds download on first use, fetched now into the
	# runner cache (docs/runner.md); a failure here only defers the download to the first build
	$(BIN)/python -c "from android_runner.build import executorch_aarch64_package as a, tokenizers_source as t; a(print); t(print)" \
	    || echo "note: the executorch aarch64 wheel / pytorch-tokenizers sdist will be downloaded on first use"
	rm -f $(VENV)/.installed-* && touch $@

setup: $(STAMP)

## demo: the whole chain on the embedded default model (stages are added as they land)
demo: $(STAMP)
	$(BIN)/specprefetch info embedded
	$(BIN)/specprefetch trace embedded --data toolkit/embedded/heldout.jsonl --out $(RUNS)/trace \
	    --max-sequences 160 --prompt-tokens 128 --decode-tokens 32 --heldout-frac 0.2 --overwrite
	$(BIN)/python -m toolkit.traces.summary $(RUNS)/trace --out $(RUNS)/routing
	$(BIN)/specprefetch train $(RUNS)/trace --out $(RUNS)/adapter --steps 400 --overwrite
	$(BIN)/specprefetch eval $(RUNS)/trace --adapter $(RUNS)/adapter --json $(RUNS)/eval.json
	$(BIN)/specprefetch store embedded --dtype fp16 --out $(RUNS)/experts-fp16.spx --overwrite
	$(BIN)/specprefetch simulate $(RUNS)/trace --adapter $(RUNS)/adapter --profile snapdragon-8-elite \
	    --pool-mib 4,8,16 --window 2 --json $(RUNS)/simulate.json
	$(BIN)/specprefetch run embedded --store $(RUNS)/experts-fp16.spx --adapter $(RUNS)/adapter \
	    --policy adapter+prediction --pool-mib 8 --prompt "The kernel's memory allocator" \
	    --prompt "To open a file for reading, use" --json $(RUNS)/run.json --events $(RUNS)/events.log
	$(BIN)/specprefetch export embedded --adapter $(RUNS)/adapter --target executorch --quant 8da8w \
	    --out $(RUNS)/bundle-executorch --overwrite
	$(BIN)/specprefetch inspect $(RUNS)/bundle-executorch
	$(BIN)/specprefetch export embedded --adapter $(RUNS)/adapter --target qnn --soc SM8750 --quant fp16 \
	    --out $(RUNS)/bundle-qnn-sm8750 --overwrite
	$(BIN)/specprefetch inspect $(RUNS)/bundle-qnn-sm8750
	$(BIN)/specprefetch run $(RUNS)/bundle-executorch --policy adapter+prediction \
	    --prompt "The kernel's memory allocator" --json $(RUNS)/run-executorch.json --events $(RUNS)/events-executorch.log
	$(BIN)/specprefetch run $(RUNS)/bundle-qnn-sm8750 --policy adapter+prediction \
	    --prompt "The kernel's memory allocator" --json $(RUNS)/run-qnn.json

## test: the CI suite (what .ci/run calls)
test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

test-all: $(STAMP)
	$(BIN)/python -m pytest -q

## bench: the figures in docs/benchmarks.md and docs/predictors.md, measured side by side
BENCH := runs/bench
bench: $(STAMP)
	$(BIN)/specprefetch trace embedded --data toolkit/embedded/heldout.jsonl --out $(BENCH)/trace \
	    --prompt-tokens 256 --decode-tokens 32 --heldout-frac 0.2 --hidden-sample 0.5 --overwrite
	$(BIN)/specprefetch train $(BENCH)/trace --out $(BENCH)/adapter --steps 3000 --overwrite
	$(BIN)/specprefetch eval $(BENCH)/trace --adapter $(BENCH)/adapter --json $(BENCH)/eval.json
	$(BIN)/specprefetch simulate $(BENCH)/trace --adapter $(BENCH)/adapter --profile snapdragon-8-elite \
	    --policies on-demand+lru,next-gate+prediction,adapter+prediction,adapter+lru,oracle+belady \
	    --pool-mib 4,8,16 --window 1,2,4 --max-sequences 60 --json $(BENCH)/simulate-phone.json
	$(BIN)/specprefetch bench --adapter $(BENCH)/adapter --pool-mib 4,8 --json $(BENCH)/runtime.json
	$(BIN)/specprefetch bench --adapter $(BENCH)/adapter --pool-mib 4,8 --flash-profile snapdragon-8-elite \
	    --no-simulate --json $(BENCH)/runtime-emulated.json
	$(BIN)/specprefetch export embedded --adapter $(BENCH)/adapter --target executorch --quant fp32 --max-seq 128 \
	    --out $(BENCH)/bundle-executorch --overwrite
	$(BIN)/specprefetch bench $(BENCH)/bundle-executorch --pool-mib 4,8 --no-simulate --json $(BENCH)/runtime-bundle.json
	$(BIN)/specprefetch runner bench $(BENCH)/bundle-executorch --json $(BENCH)/native.json
	$(BIN)/python -m export.report --model embedded --adapter $(BENCH)/adapter --json $(BENCH)/export.json

## fuzz: libFuzzer + ASan + UBSan on the native runner's readers of untrusted files (docs/runner.md)
FUZZ      := runs/fuzz
FUZZ_SECS ?= 600
FUZZ_CXX  := clang++ -std=c++17 -g -O1 -fsanitize=fuzzer,address,undefined -I android_runner/src -I /usr/include
fuzz: $(STAMP)
	command -v clang++ >/dev/null || { [ "$$(id -u)" = 0 ] || { echo "make fuzz needs clang: sudo apt-get install clang"; exit 1; }; \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q clang; }
	mkdir -p $(FUZZ)/corpus-manifest $(FUZZ)/corpus-store $(FUZZ)/corpus-safetensors
	test -f $(FUZZ)/bundle/manifest.json || $(BIN)/specprefetch export embedded --target executorch --max-seq 32 \
	    --out $(FUZZ)/bundle
	cp $(FUZZ)/bundle/manifest.json $(FUZZ)/corpus-manifest/seed.json
	$(BIN)/python -c "import struct,sys; d=open('$(FUZZ)/bundle/experts.spx','rb').read(); \
	    o=struct.unpack_from('<Q',d,56)[0]; sys.stdout.buffer.write(struct.pack('<Q',len(d))+d[:o])" \
	    > $(FUZZ)/corpus-store/seed.bin
	head -c 4096 $(FUZZ)/bundle/host.safetensors > $(FUZZ)/corpus-safetensors/seed.bin
	$(FUZZ_CXX) android_runner/fuzz/fuzz_manifest.cpp android_runner/src/bundle.cpp android_runner/src/sha256.cpp \
	    -o $(FUZZ)/fuzz_manifest
	$(FUZZ_CXX) android_runner/fuzz/fuzz_store_index.cpp android_runner/src/expert_store.cpp \
	    android_runner/src/crc32.cpp -o $(FUZZ)/fuzz_store_index
	$(FUZZ_CXX) android_runner/fuzz/fuzz_safetensors.cpp android_runner/src/safetensors.cpp -o $(FUZZ)/fuzz_safetensors
	$(FUZZ)/fuzz_manifest -max_total_time=$(FUZZ_SECS) -max_len=16384 -print_final_stats=1 $(FUZZ)/corpus-manifest
	$(FUZZ)/fuzz_store_index -max_total_time=$(FUZZ_SECS) -max_len=65536 -print_final_stats=1 $(FUZZ)/corpus-store
	$(FUZZ)/fuzz_safetensors -max_total_time=$(FUZZ_SECS) -max_len=4096 -print_final_stats=1 $(FUZZ)/corpus-safetensors

clean:
	rm -rf runs build .pytest_cache
