#!/usr/bin/env bash
# The GPU tier's measuring call (docs/benchmarks.md section 9), as run on one H200 through a remote
# command runner that copies this work tree and returns what is written under $OUT.
#
# Inputs: CORPUS (default .carry/g9), a directory with
#   train.jsonl.xz   every 4th train document of `python -m toolkit.embedded.corpus --out build/corpus`
#   trace.jsonl      128+ train-split documents not in that quarter (the adapter's traces)
#   heldout.jsonl    the embedded held-out documents (toolkit/embedded/heldout.jsonl)
# Knobs: SKIP_TRAIN=1 (reuse /tmp/g9/model), TB (training seconds, 140), BT (bench timeout, 300),
# FR (pool fractions, 0.1,0.25,0.5). Output under $OUT: log, tiny.json, gpu-bench.json, bench.log.
set -u
export PYTHONPATH=. OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TQDM_DISABLE=1 HF_HUB_DISABLE_PROGRESS_BARS=1
C=${CORPUS:-.carry/g9}; R=/tmp/g9; L=$OUT/log; B="python -m toolkit.cli"
python -c "import torch,transformers,triton;print(torch.__version__,transformers.__version__,triton.__version__,torch.cuda.get_device_name())" 2>&1 | tee $L
$B tiny qwen3_moe --out /tmp/t >/dev/null 2>&1; $B store /tmp/t --out /tmp/t.spx >/dev/null 2>&1
timeout 120 python -m toolkit.runtime.gpu_bench /tmp/t --store /tmp/t.spx --fractions 0.25 --prompts 1 --prompt-tokens 8 --new-tokens 12 --repeats 1 --draft-k 2,3 --policies on-demand+lru,next-gate+prediction,draft+prediction,oracle+belady --report-mismatches --json $OUT/tiny.json > /tmp/tiny.log 2>&1; rc=$?; grep -v Loading /tmp/tiny.log | tail -25 | tee -a $L
[ $rc = 0 ] || exit 3
[ "$SKIP_TRAIN" = 1 ] || (timeout 200 python -m toolkit.embedded.train --corpus $C --tokenizer toolkit/embedded/model/tokenizer.json --out $R/model --hidden-size 1024 --num-attention-heads 16 --num-key-value-heads 4 --head-dim 64 --num-experts 32 --num-experts-per-tok 4 --moe-intermediate-size 1536 --steps 400 --batch-size 32 --lr 1e-3 --warmup 40 --eval-every 400 --eval-batches 4 --time-budget ${TB:-140} 2>&1 | tail -4) | tee -a $L
[ -f $R/e.spx ] || $B store $R/model --out $R/e.spx 2>&1 | tail -1 | tee -a $L
[ -d $R/trace ] || $B trace $R/model --data $C/trace.jsonl --out $R/trace --device cuda --dtype float16 --max-sequences 128 --prompt-tokens 128 --decode-tokens 32 --heldout-frac 0.25 2>&1 | tail -2 | tee -a $L
[ -d $R/adapter ] || $B train $R/trace --out $R/adapter --device cuda --steps 600 2>&1 | tail -2 | tee -a $L
cp $R/model/train_log.json $OUT/ 2>/dev/null
timeout ${BT:-300} python -m toolkit.runtime.gpu_bench $R/model --store $R/e.spx --adapter $R/adapter --policies on-demand+lru,next-gate+prediction,adapter+prediction,draft+prediction,oracle+belady --fractions ${FR:-0.1,0.25,0.5} --prompts 3 --new-tokens 64 --repeats 2 --report-mismatches --json $OUT/gpu-bench.json > $OUT/bench.log 2>&1; echo rc=$?; grep -v Loading $OUT/bench.log | tail -40
timeout 60 python -m pytest -q -x tests/test_gpu_tier.py -k "cuda or triton" 2>&1 | tail -8
