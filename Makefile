# Two commands for a newcomer: `make demo` and `make test`. Each sets itself up.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed-$(shell cat pyproject.toml | sha256sum | cut -c1-12)
RUNS    := runs/demo

.PHONY: setup demo demo-vl test test-all lint bench bench-phone fuzz clean

# Debian packages the native runner's builds and tests need (docs/runner.md), where missing
DEBS    := g++ g++-aarch64-linux-gnu qemu-user nlohmann-json3-dev adb time ccache libpng-dev libjpeg62-turbo-dev
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
	# the rest through uv (Astral's installer, from PyPI: 5 s here against pip's 55), pip where uv fails.
	# uv reads no pip configuration (index, find-links): torch is installed above by pip for that reason,
	# and uv keeps it (its 2.13.0+cpu satisfies the pin)
	$(BIN)/pip install -q uv==0.13.9 && $(BIN)/uv pip install -q --python $(BIN)/python -e '.[test]' \
	    || { echo "note: uv failed; installing with pip"; $(BIN)/pip install -q -e '.[test]'; }
	# what the native runner's arm64 and tokenizer builds download on first use, fetched now into the
	# runner cache (docs/runner.md); a failure here only defers the download to the first build
	$(BIN)/python -c "from android_runner.build import executorch_aarch64_package as a, tokenizers_source as t; a(print); t(print)" \
	    || echo "note: the executorch aarch64 wheel / pytorch-tokenizers sdist will be downloaded on first use"
	rm -f $(VENV)/.installed-* && touch $@

setup: $(STAMP)

## demo: the whole chain on the embedded default model, to a stand-in phone's report (DEMO_QNN=1: also QNN)
demo: $(STAMP)
	$(BIN)/specprefetch info embedded
	$(BIN)/specprefetch trace embedded --data toolkit/embedded/heldout.jsonl --out $(RUNS)/trace \
	    --max-sequences 160 --prompt-tokens 128 --decode-tokens 32 --heldout-frac 0.2 --overwrite
	$(BIN)/python -m toolkit.traces.summary $(RUNS)/trace --out $(RUNS)/routing
	$(BIN)/specprefetch train $(RUNS)/trace --out $(RUNS)/adapter --steps 400 --overwrite
	$(BIN)/specprefetch eval $(RUNS)/trace --adapter $(RUNS)/adapter --json $(RUNS)/eval.json --overwrite
	$(BIN)/specprefetch store embedded --dtype fp16 --out $(RUNS)/experts-fp16.spx --overwrite
	$(BIN)/specprefetch simulate $(RUNS)/trace --adapter $(RUNS)/adapter --profile snapdragon-8-elite \
	    --pool-mib 4,8,16 --window 2 --json $(RUNS)/simulate.json --overwrite
	$(BIN)/specprefetch run embedded --store $(RUNS)/experts-fp16.spx --adapter $(RUNS)/adapter \
	    --policy adapter+prediction --pool-mib 8 --prompt "The kernel's memory allocator" \
	    --prompt "To open a file for reading, use" --json $(RUNS)/run.json --events $(RUNS)/events.log --overwrite
	$(BIN)/specprefetch export embedded --adapter $(RUNS)/adapter --target executorch --quant 8da8w \
	    --out $(RUNS)/bundle-executorch --overwrite
	$(BIN)/specprefetch inspect $(RUNS)/bundle-executorch
	$(BIN)/specprefetch run $(RUNS)/bundle-executorch --policy adapter+prediction \
	    --prompt "The kernel's memory allocator" --json $(RUNS)/run-executorch.json --events $(RUNS)/events-executorch.log --overwrite
	$(BIN)/specprefetch runner build $(RUNS)/bundle-executorch --abi host
	$(BIN)/specprefetch run $(RUNS)/bundle-executorch --engine native --policy adapter+prediction --check \
	    --prompt "The kernel's memory allocator" --json $(RUNS)/run-native.json --events $(RUNS)/events-native.log --overwrite
	$(BIN)/python -m toolkit.device.demo $(RUNS)/bundle-executorch --json $(RUNS)/device-bench.json --overwrite
	@echo; cat $(RUNS)/device-bench.md
ifeq ($(DEMO_QNN),1)
	$(BIN)/specprefetch export embedded --adapter $(RUNS)/adapter --target qnn --soc SM8750 --quant fp16 \
	    --out $(RUNS)/bundle-qnn-sm8750 --overwrite
	$(BIN)/specprefetch inspect $(RUNS)/bundle-qnn-sm8750
	$(BIN)/specprefetch run $(RUNS)/bundle-qnn-sm8750 --policy adapter+prediction \
	    --prompt "The kernel's memory allocator" --json $(RUNS)/run-qnn.json --overwrite
endif

## demo-vl: images end to end on `embedded-vl`, the shipped vision-language demo model (the embedded model,
## frozen, with a vision tower trained here on generated pictures; docs/embedded-model.md): ask it what a picture
## shows in both engines, trace pictures, train the adapter on the image trace, export a bundle with the vision
## method, and stream an image prompt's experts through the native runner. 11 minutes on 2 cores here, the native
## runner's first build included.
VL := $(RUNS)/vl
VL_ASK := --prompt " This picture shows" --max-new-tokens 6
demo-vl: $(STAMP)
	$(BIN)/specprefetch info embedded-vl
	$(BIN)/python -m toolkit.embedded.pictures $(VL)/pictures --n 200 --side 96 --seed 1 --overwrite
	$(BIN)/specprefetch run embedded-vl --image $(VL)/pictures/p0.png $(VL_ASK) --policy on-demand+lru \
	    --pool-mib 2 --json $(VL)/run.json --overwrite
	$(BIN)/specprefetch trace embedded-vl --data $(VL)/pictures/pairs.jsonl --out $(VL)/trace --prompt-tokens 16 \
	    --decode-tokens 12 --heldout-frac 0.2 --overwrite
	$(BIN)/specprefetch train $(VL)/trace --out $(VL)/adapter --steps 300 --overwrite
	$(BIN)/specprefetch eval $(VL)/trace --adapter $(VL)/adapter --json $(VL)/eval.json --overwrite
	$(BIN)/specprefetch export embedded-vl --adapter $(VL)/adapter --target executorch --quant 8da8w --max-seq 64 \
	    --out $(VL)/bundle --overwrite
	$(BIN)/specprefetch run $(VL)/bundle --engine native --image $(VL)/pictures/p4.png $(VL_ASK) \
	    --policy adapter+reuse --pool-mib 2 --check --json $(VL)/run-native.json --overwrite

## test: the CI suite (what .ci/run calls), one pytest-xdist worker per core (TEST_WORKERS=0: none)
TEST_WORKERS ?= $(shell nproc 2>/dev/null || echo 2)
XDIST = $(if $(filter 0 1,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)
test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" --durations=25 $(XDIST)

test-all: $(STAMP)
	$(BIN)/python -m pytest -q $(XDIST)

## lint: ruff's checks (pyproject.toml [tool.ruff]); .ci/run runs it before the tests
lint: $(STAMP)
	$(BIN)/ruff check .

## bench: the figures in docs/benchmarks.md and docs/predictors.md, measured side by side
BENCH := runs/bench
bench: $(STAMP)
	$(BIN)/specprefetch trace embedded --data toolkit/embedded/heldout.jsonl --out $(BENCH)/trace \
	    --prompt-tokens 256 --decode-tokens 32 --heldout-frac 0.2 --hidden-sample 0.5 --overwrite
	$(BIN)/specprefetch train $(BENCH)/trace --out $(BENCH)/adapter --steps 3000 --overwrite
	$(BIN)/specprefetch eval $(BENCH)/trace --adapter $(BENCH)/adapter --json $(BENCH)/eval.json --overwrite
	$(BIN)/specprefetch simulate $(BENCH)/trace --adapter $(BENCH)/adapter --profile snapdragon-8-elite \
	    --policies on-demand+lru,next-gate+prediction,adapter+prediction,adapter+lru,oracle+belady \
	    --pool-mib 4,8,16 --window 1,2,4 --max-sequences 60 --json $(BENCH)/simulate-phone.json --overwrite
	$(BIN)/specprefetch bench cpu --adapter $(BENCH)/adapter --pool-mib 4,8 --json $(BENCH)/runtime.json --overwrite
	$(BIN)/specprefetch bench cpu --adapter $(BENCH)/adapter --pool-mib 4,8 --flash-profile snapdragon-8-elite \
	    --no-simulate --json $(BENCH)/runtime-emulated.json --overwrite
	$(BIN)/specprefetch export embedded --adapter $(BENCH)/adapter --target executorch --quant fp32 --max-seq 128 \
	    --out $(BENCH)/bundle-executorch --overwrite
	$(BIN)/specprefetch bench cpu $(BENCH)/bundle-executorch --pool-mib 4,8 --no-simulate --json $(BENCH)/runtime-bundle.json --overwrite
	$(BIN)/specprefetch runner bench $(BENCH)/bundle-executorch --json $(BENCH)/native.json --overwrite
	$(BIN)/python -m export.report --model embedded --adapter $(BENCH)/adapter --json $(BENCH)/export.json

## bench-phone: the phone-scale benchmark (docs/benchmarks.md section 10): the shipped phone-class model
## (16 MoE layers x 64 experts, top-8, trained) widened to phone-sized experts (FFN 2048: 3 MiB fp16, 0.8 MiB
## int4 each), traced on the held-out text, adapter trained, exported twice with int4 experts (the fp32-dense
## bundle the native bench has always used, and an 8da4w-dense one with room for 512-token prompts), then the
## native runner's bench, llama.cpp side by side (Q4_0 by llama-quantize; 1 and 2 threads; llama.cpp with
## default mmap and with read-around off; 128- and 512-token prompts; llama-bench at no limit) and the
## Qwen3-30B-A3B projection. The steps before the side by side took about 60 minutes on 2 cores (7 more for the
## first llama.cpp build); the side by side now runs 4 engines x 2 thread counts x 4 limits x 4 prompts (not yet
## timed in full; expect an hour or more). About 10 GB of disk (runs/bench-phone 4.6 GB, the peers cache's
## GGUFs 4.1 GB, the runner cache); root for the side by side's cgroup and drop_caches.
PHONE := runs/bench-phone
PHONE_PEER_BUNDLE := $(PHONE)/bundle-8da4w
PHONE_PEER_ARGS := --prompts 2 --prompt-tokens 128,512 --threads 1,2 --new-tokens 32 --rounds 1 \
	--limits none,1,0.5,0.25 --timeout 150
bench-phone: $(STAMP)
	$(BIN)/specprefetch widen phone --moe-intermediate-size 2048 --out $(PHONE)/model --overwrite
	$(BIN)/specprefetch trace $(PHONE)/model --data toolkit/embedded/heldout.jsonl --out $(PHONE)/trace \
	    --max-sequences 100 --prompt-tokens 128 --decode-tokens 32 --heldout-frac 0.25 --overwrite
	$(BIN)/specprefetch train $(PHONE)/trace --out $(PHONE)/adapter --steps 1500 --overwrite
	$(BIN)/specprefetch eval $(PHONE)/trace --adapter $(PHONE)/adapter --json $(PHONE)/eval.json --overwrite
	$(BIN)/specprefetch simulate $(PHONE)/trace --adapter $(PHONE)/adapter \
	    --geometry toolkit/simulate/geometries/qwen3-30b-a3b --dtype int4 --profile snapdragon-8-elite \
	    --policies on-demand+lru,next-gate+prediction,adapter+prediction,oracle+belady \
	    --pool-mib 1024,2048 --window 2 --max-sequences 10 --json $(PHONE)/simulate-qwen3-30b.json --overwrite
	$(BIN)/specprefetch export $(PHONE)/model --adapter $(PHONE)/adapter --target executorch --experts int4 \
	    --max-seq 128 --out $(PHONE)/bundle --overwrite
	$(BIN)/specprefetch export $(PHONE)/model --adapter $(PHONE)/adapter --target executorch --quant 8da4w \
	    --experts int4 --max-seq 576 --out $(PHONE_PEER_BUNDLE) --overwrite
	$(BIN)/specprefetch runner bench $(PHONE)/bundle --prompts 2 --new-tokens 16 --rounds 2 --json $(PHONE)/native.json \
	    --overwrite
	$(BIN)/specprefetch bench llama.cpp $(PHONE_PEER_BUNDLE) $(PHONE_PEER_ARGS) \
	    --json $(PHONE)/peer.json --overwrite

## fuzz: libFuzzer + ASan + UBSan on the native runner's readers of untrusted files (docs/runner.md);
## fuzz-program: only the fourth, ExecuTorch's program loading on bit flips of real bundles' model.pte
FUZZ      := runs/fuzz
FUZZ_SECS ?= 600
FUZZ_CXX  := clang++ -std=c++17 -g -O1 -fsanitize=fuzzer,address,undefined -I android_runner/src -I /usr/include
FUZZ_CLANG = command -v clang++ >/dev/null || { [ "$$(id -u)" = 0 ] || { echo "make fuzz needs clang: sudo apt-get install clang"; exit 1; }; \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q clang; }
FUZZ_BUNDLE = test -f $(FUZZ)/bundle/manifest.json || $(BIN)/specprefetch export embedded --target executorch --max-seq 32 \
	    --out $(FUZZ)/bundle
# fuzz_program links ExecuTorch's runtime compiled here from source, with the same sanitizers and libFuzzer's
# coverage: the wheel has it only as uninstrumented shared libraries (docs/runner.md, Fuzzing). ET_SRC: an
# ExecuTorch source tree with third-party/flatbuffers that the user brings (no package registry serves it); the
# schema headers come from the wheel's own flatc. ET_CORE: the runtime core's sources
# (ExecuTorch's build_variables.bzl EXECUTORCH_CORE_SRCS) and the POSIX platform layer.
ET_SRC    ?= $(FUZZ)/executorch-src
ET_CORE   := runtime/backend/interface.cpp runtime/core/device_allocator.cpp runtime/core/device_memory_buffer.cpp \
	runtime/core/evalue.cpp runtime/core/exec_aten/util/tensor_shape_to_c_string.cpp \
	runtime/core/exec_aten/util/tensor_util_portable.cpp runtime/core/portable_type/tensor_impl.cpp runtime/core/tag.cpp \
	runtime/core/tensor_layout.cpp runtime/executor/tensor_parser_portable.cpp runtime/executor/pte_data_map.cpp \
	runtime/kernel/operator_registry.cpp schema/extended_header.cpp runtime/executor/method.cpp \
	runtime/executor/method_meta.cpp runtime/executor/program.cpp runtime/executor/program_validation.cpp \
	runtime/executor/tensor_parser_exec_aten.cpp runtime/platform/abort.cpp runtime/platform/log.cpp \
	runtime/platform/platform.cpp runtime/platform/profiler.cpp runtime/platform/runtime.cpp \
	runtime/platform/default/posix.cpp
ET_CXX     = clang++ -std=c++17 -g -O1 -fsanitize=fuzzer-no-link,address,undefined -DC10_USING_CUSTOM_GENERATED_MACROS \
	-DFLATBUFFERS_MAX_ALIGNMENT=1024 -I $(FUZZ)/et -I $(FUZZ)/et/gen -I $(ET_SRC)/runtime/core/portable_type/c10 \
	-I $(ET_SRC)/third-party/flatbuffers/include
ET_PTES   := $(FUZZ)/bundle/graphs/model.pte:$(FUZZ)/bundle-8da8w/graphs/model.pte
fuzz: $(STAMP)
	$(FUZZ_CLANG)
	mkdir -p $(FUZZ)/corpus-manifest $(FUZZ)/corpus-store $(FUZZ)/corpus-safetensors
	$(FUZZ_BUNDLE)
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
	$(FUZZ)/fuzz_manifest -max_total_time=$(FUZZ_SECS) -max_len=16384 -print_final_stats=1 -artifact_prefix=$(FUZZ)/ $(FUZZ)/corpus-manifest
	$(FUZZ)/fuzz_store_index -max_total_time=$(FUZZ_SECS) -max_len=65536 -print_final_stats=1 -artifact_prefix=$(FUZZ)/ $(FUZZ)/corpus-store
	$(FUZZ)/fuzz_safetensors -max_total_time=$(FUZZ_SECS) -max_len=4096 -print_final_stats=1 -artifact_prefix=$(FUZZ)/ $(FUZZ)/corpus-safetensors
	@if [ -f $(ET_SRC)/runtime/executor/program.cpp ]; then $(MAKE) --no-print-directory fuzz-program; \
	else echo "note: fuzz-program skipped: ET_SRC=$(ET_SRC) holds no ExecuTorch source tree (make fuzz-program says how)"; fi

.PHONY: fuzz-program
fuzz-program: $(STAMP)
	$(FUZZ_CLANG)
	$(FUZZ_BUNDLE)
	test -f $(FUZZ)/bundle-8da8w/manifest.json || $(BIN)/specprefetch export embedded --target executorch --quant 8da8w \
	    --max-seq 32 --out $(FUZZ)/bundle-8da8w
	@test -f $(ET_SRC)/runtime/executor/program.cpp -a -f $(ET_SRC)/third-party/flatbuffers/include/flatbuffers/base.h || \
	    { echo "make fuzz-program: ET_SRC=$(ET_SRC) is not an ExecuTorch source tree with third-party/flatbuffers; no package registry serves ExecuTorch's sources: check out the tag of the installed executorch version with its flatbuffers submodule and pass ET_SRC=DIR (docs/runner.md, Fuzzing)"; exit 1; }
	mkdir -p $(FUZZ)/et/gen/executorch/schema $(FUZZ)/et-obj $(FUZZ)/corpus-program
	ln -sfn $(abspath $(ET_SRC)) $(FUZZ)/et/executorch
	cd $(ET_SRC)/schema && $(abspath $(BIN))/python -c "import executorch.data.bin as b, os, subprocess, sys; \
	    sys.exit(subprocess.call([os.path.join(os.path.dirname(b.__file__), 'flatc'), '--cpp', '--cpp-std', 'c++11', \
	    '--gen-mutable', '--scoped-enums', '-o', '$(abspath $(FUZZ))/et/gen/executorch/schema', 'program.fbs', \
	    'scalar_type.fbs']))"
	for f in $(ET_CORE); do o=$(FUZZ)/et-obj/$$(echo $$f | tr / _ | sed 's/cpp$$/o/'); \
	    [ $$o -nt $(ET_SRC)/$$f ] || $(ET_CXX) -c $(ET_SRC)/$$f -o $$o || exit 1; done
	$(ET_CXX) -c android_runner/fuzz/fuzz_program.cpp -o $(FUZZ)/et-obj/fuzz_program.o
	clang++ -fsanitize=fuzzer,address,undefined $(FUZZ)/et-obj/*.o -o $(FUZZ)/fuzz_program
	SPX_FUZZ_PTE=$(ET_PTES) $(FUZZ)/fuzz_program -max_total_time=$(FUZZ_SECS) -max_len=257 -timeout=30 \
	    -rss_limit_mb=4096 -print_final_stats=1 -artifact_prefix=$(FUZZ)/ $(FUZZ)/corpus-program

clean:
	rm -rf runs build .pytest_cache

# Per-expert micro-benchmark of the expert kernels (old float vs integer-dot, 1 and 2 threads, batch of
# 64) against llama.cpp's ggml kernels (test-backend-ops, when the llama.cpp peer build has it)
.PHONY: bench-kernels
KERNEL_BENCH_OUT ?= runs/kernel-bench/kernels.json
bench-kernels: $(STAMP)
	$(BIN)/python -m toolkit.peers.kernel_bench --out $(KERNEL_BENCH_OUT) --overwrite
