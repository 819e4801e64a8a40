#!/usr/bin/env bash
# The GPU tier's measuring call (docs/benchmarks.md section 9), run from the repository root on a
# machine with one CUDA GPU: a tiny-model smoke bench, then a 1.2 B Qwen3-MoE trained, its expert
# store, routing traces, the adapter, the bench, and the CUDA tests.
#
# Inputs: CORPUS (default build/gpu-bench-corpus), a directory made from the embedded corpus
# recipe's output by this script's --prepare step (about 20 s):
#
#   python -m toolkit.embedded.corpus --out build/corpus     # writes build/corpus/{train,heldout}.jsonl
#   CORPUS=build/gpu-bench-corpus bash toolkit/runtime/gpu_bench_call.sh --prepare build/corpus
#
# which writes into CORPUS (documents are the lines of build/corpus/train.jsonl, counted from 0):
#   train.jsonl.xz   every 4th train document (0, 4, 8, ...): the model's training text
#   trace.jsonl      the first 256 of documents 2, 6, 10, ...: train-split text outside that quarter,
#                    for the adapter's traces (128 are traced)
#   heldout.jsonl    build/corpus/heldout.jsonl (the same documents as toolkit/embedded/heldout.jsonl):
#                    the training script's held-out loss
#
# Measuring (OUT required): OUT=DIR bash toolkit/runtime/gpu_bench_call.sh
# Knobs: SKIP_TRAIN=1 (reuse WORK/model), WORK (scratch, /tmp/g9), TB (training seconds, 140),
# BT (bench timeout, 300), FR (pool fractions, 0.1,0.25,0.5).
# Output under OUT: log, tiny.json, gpu-bench.json (+ .md, .png), bench.log, train_log.json.
set -u

C=${CORPUS:-build/gpu-bench-corpus}

if [ "${1:-}" = --prepare ]; then
  SRC=${2:-build/corpus}
  [ -f "$SRC/train.jsonl" ] && [ -f "$SRC/heldout.jsonl" ] || {
    echo "error: $SRC has no train.jsonl / heldout.jsonl: run python -m toolkit.embedded.corpus --out $SRC" >&2
    exit 2; }
  mkdir -p "$C" || exit 2
  python - "$SRC" "$C" <<'EOF' || exit 2
import lzma, shutil, sys
from pathlib import Path

src, dst = Path(sys.argv[1]), Path(sys.argv[2])
docs = [line for line in (src / "train.jsonl").read_text(encoding="utf-8").split("\n") if line.strip()]
with lzma.open(dst / "train.jsonl.xz", "wt", encoding="utf-8") as f:
    f.write("".join(d + "\n" for d in docs[0::4]))
(dst / "trace.jsonl").write_text("".join(d + "\n" for d in docs[2::4][:256]), encoding="utf-8")
shutil.copyfile(src / "heldout.jsonl", dst / "heldout.jsonl")
print(f"{dst}: train.jsonl.xz {len(docs[0::4])} documents, trace.jsonl {len(docs[2::4][:256])}, heldout.jsonl")
EOF
  exit 0
fi

: "${OUT:?set OUT to the directory the results go to}"
mkdir -p "$OUT" || exit 2
for f in train.jsonl.xz trace.jsonl heldout.jsonl; do
  [ -f "$C/$f" ] || { echo "error: $C/$f missing: make CORPUS with --prepare (see the header)" >&2; exit 2; }
done
export PYTHONPATH=. OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TQDM_DISABLE=1 HF_HUB_DISABLE_PROGRESS_BARS=1
R=${WORK:-/tmp/g9}; L=$OUT/log; B="python -m toolkit.cli"
mkdir -p "$R" || exit 2
python -c "import torch,transformers,triton;print(torch.__version__,transformers.__version__,triton.__version__,torch.cuda.get_device_name())" 2>&1 | tee "$L"
T=$R/tiny
[ -d "$T" ] || $B tiny qwen3_moe --out "$T" >/dev/null 2>&1
[ -f "$T.spx" ] || $B store "$T" --out "$T.spx" >/dev/null 2>&1
timeout 120 python -m toolkit.runtime.gpu_bench "$T" --store "$T.spx" --fractions 0.25 --prompts 1 --prompt-tokens 8 --new-tokens 12 --repeats 1 --draft-k 2,3 --policies on-demand+lru,next-gate+prediction,draft+prediction,oracle+belady --report-mismatches --json "$OUT/tiny.json" > "$R/tiny.log" 2>&1; rc=$?
grep -v Loading "$R/tiny.log" | tail -25 | tee -a "$L"
[ $rc = 0 ] || exit 3
if [ "${SKIP_TRAIN:-0}" = 1 ]; then
  [ -f "$R/model/config.json" ] || { echo "error: SKIP_TRAIN=1 but no $R/model" | tee -a "$L" >&2; exit 4; }
else
  (timeout 200 python -m toolkit.embedded.train --corpus "$C" --tokenizer toolkit/embedded/model/tokenizer.json --out "$R/model" --hidden-size 1024 --num-attention-heads 16 --num-key-value-heads 4 --head-dim 64 --num-experts 32 --num-experts-per-tok 4 --moe-intermediate-size 1536 --steps 400 --batch-size 32 --lr 1e-3 --warmup 40 --eval-every 400 --eval-batches 4 --time-budget "${TB:-140}" 2>&1 | tail -4) | tee -a "$L"
fi
[ -f "$R/e.spx" ] || $B store "$R/model" --out "$R/e.spx" 2>&1 | tail -1 | tee -a "$L"
[ -d "$R/trace" ] || $B trace "$R/model" --data "$C/trace.jsonl" --out "$R/trace" --device cuda --dtype float16 --max-sequences 128 --prompt-tokens 128 --decode-tokens 32 --heldout-frac 0.25 2>&1 | tail -2 | tee -a "$L"
[ -d "$R/adapter" ] || $B train "$R/trace" --out "$R/adapter" --device cuda --steps 600 2>&1 | tail -2 | tee -a "$L"
cp "$R/model/train_log.json" "$OUT/" 2>/dev/null
timeout "${BT:-300}" python -m toolkit.runtime.gpu_bench "$R/model" --store "$R/e.spx" --adapter "$R/adapter" --policies on-demand+lru,next-gate+prediction,adapter+prediction,draft+prediction,oracle+belady --fractions "${FR:-0.1,0.25,0.5}" --prompts 3 --new-tokens 64 --repeats 2 --report-mismatches --json "$OUT/gpu-bench.json" > "$OUT/bench.log" 2>&1; echo "rc=$?"
grep -v Loading "$OUT/bench.log" | tail -40
timeout 60 python -m pytest -q -x tests/test_gpu_tier.py -k "cuda or triton" 2>&1 | tail -8
