#!/usr/bin/env bash
# The GPU tier's measuring call (docs/benchmarks.md section 9), run from the repository root on a
# machine with one CUDA GPU: a tiny-model smoke bench; a 1.2 B Qwen3-MoE trained, its expert store,
# routing traces, the adapter and the bench; the same model widened to large experts (the copy-bound
# regime: `specprefetch widen`, exact, so its routing is the trained model's) with its own store,
# traces, adapter and bench; a trace split over the GPU and host memory (--max-memory) checked against
# the one-GPU trace; and the CUDA tests.
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
# Knobs: SKIP_TRAIN=1 (reuse WORK/model), SKIP_TINY=1 (no smoke bench), WORK (scratch, /tmp/g9),
# TB (training seconds, 140), BT (bench timeout, 300), FR (pool fractions, 0.1,0.25,0.5), WFFN (the widened experts' FFN, 6144:
# 36 MiB per fp16 expert), WFR (its pool fractions, 0.1,0.25), WBT (its bench timeout, 420), WNT (its
# new tokens, 48), WKS (its draft Ks, 4,8,12), STAGES (default "base wide split tests"), DEV (cuda),
# POL (the benches' policies), TESTK (the tests stage's pytest -k expression); the batched stage (the
# base model's draft verified in one pass, after the base stage): VFR (pool fractions, 0.25), VK (its K, 8),
# VBT (its timeout, 150); the lookahead stage (after the base stage: its model's eviction bounds with
# --draft-lookahead EBD (default 2,5), the draft's model on the GPU; LBT its timeout, 300); the compiled
# stage (the base bench with --compile inductor): CBT (its timeout, default BT). KS (the base bench's
# draft Ks, 2,4,6,8,12); PROF=1: each bench also profiles an
# all-resident decode token (gpu_bench --profile-resident: kernels and their device time per token);
# BX: more gpu_bench options for every policy bench (base, compiled, wide), e.g.
# BX="--compile inductor --variant candidate_threshold=0.1 --variant queue_depth=4".
# Where one command may run 10 minutes at most, run it twice on the same warm machine (docs/benchmarks.md
# section 9 ran these):
#   STAGES="base tests split" BT=260 OUT=... bash ...
#   SKIP_TRAIN=1 SKIP_TINY=1 STAGES="wide split" WBT=330 OUT=... bash ...
# The resident stage (STAGES=resident: no corpus, no training, about 4 minutes on a fresh H100): the
# all-resident bound on random weights of the base model's geometry and of its widening to WFFN, compiled,
# with the step's kernels profiled (gpu-bench-resident-rand*.json; RBT: each bench's timeout, 200; BX
# reaches these benches too; RWIDE=0: the base geometry only; RK="fused model": the fused attention and router
# against the model's, interleaved over RR rounds, 2, each bench's files named -fused-rN / -model-rN; RK's
# fused-plain: the fused kernels launched without programmatic dependent launch (SPECPREFETCH_PDL=0), -fused-plain-rN;
# RK's fused-base: the fused kernels as an earlier tree has them, the bench run from BASE (a directory holding that
# tree: git archive COMMIT | tar -x -C DIR --exclude='*.safetensors'), -fused-base-rN
# (RK's fused kinds need the GPU's fp16: a DEV=cpu smoke run refuses them in each bench's log; every kind but
# fused-plain takes the call's own SPECPREFETCH_PDL, if set):
#   STAGES="resident tests" RK="fused model" RWIDE=0 OUT=... bash toolkit/runtime/gpu_bench_call.sh
#   STAGES=resident RK="fused fused-plain" RWIDE=0 OUT=... bash toolkit/runtime/gpu_bench_call.sh   (section 33's A/B)
#   STAGES=resident RK="fused fused-base" BASE=runs/base RWIDE=0 OUT=... bash toolkit/runtime/gpu_bench_call.sh).
# SMOKE=1 runs every stage on tiny sizes (a random tiny model, no training, one short prompt) to check
# the commands before a measuring call.
# Output under OUT: log (the whole call's), and all.tgz (re-packed after every stage, so a call cut
# short still returns what it finished): gpu-bench-STAGE.json/.md/.png and bench-STAGE.log per bench,
# eviction-bounds-NAME.json/.md/.png per model (`specprefetch eviction-bounds` of its trace and adapter at
# the bench's pools, 10 held-out sequences, run after the bench on the host's CPU; EB=0: not run), the
# lookahead stage's eviction-bounds-lookahead-base.json/.md/.png,
# tiny.json, train_log.json, split.json: this call's only (a model trained again also drops the
# stores, traces and adapters made from the last one); a failed step is logged as FAILED and ends its
# stage.
set -u -o pipefail

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
PDLV=1   # SPECPREFETCH_PDL as the toolkit reads it: 0 or 1, whitespace around allowed
if [ -n "${SPECPREFETCH_PDL+x}" ]; then
  PDLV=$(printf %s "$SPECPREFETCH_PDL" | tr -d '[:space:]')
  case "$PDLV" in 0|1) ;; *) echo "error: SPECPREFETCH_PDL='$SPECPREFETCH_PDL': 0 or 1" >&2; exit 2 ;; esac
fi
mkdir -p "$OUT" || exit 2
STAGES=${STAGES:-base wide split tests}
# the stages that need the trained model (and so the corpus); resident and tests need neither
TRAINED=0; for st in $STAGES; do case $st in base|compiled|wide|lookahead|batched|split) TRAINED=1 ;; esac; done
if [ $TRAINED = 1 ]; then
  for f in train.jsonl.xz trace.jsonl heldout.jsonl; do
    [ -f "$C/$f" ] || { echo "error: $C/$f missing: make CORPUS with --prepare (see the header)" >&2; exit 2; }
  done
fi
export PYTHONPATH=. OMP_NUM_THREADS=4 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TQDM_DISABLE=1 HF_HUB_DISABLE_PROGRESS_BARS=1
SMOKE=${SMOKE:-0} DEV=${DEV:-cuda}   # DEV=cpu: a smoke run of the commands on a machine without a GPU
R=${WORK:-/tmp/g9}; [ "$SMOKE" = 1 ] && R=${WORK:-/tmp/g9-smoke}
L=$OUT/log; B="python -m toolkit.cli"; RES=$R/results
rm -rf "$RES"; mkdir -p "$R" "$RES" || exit 2   # all.tgz holds this call's results only
pack() { tar czf "$OUT/all.tgz.tmp" -C "$RES" . && mv "$OUT/all.tgz.tmp" "$OUT/all.tgz"; }
POL=${POL:-on-demand+lru,next-gate+prediction,adapter+prediction,adapter+reuse,draft+prediction,oracle+belady}
if [ "$SMOKE" = 1 ]; then
  NSEQ=16 STEPS=30 NP=1 NT=8 WNT=8 FR=${FR:-0.5} WFR=${WFR:-0.5} WFFN=${WFFN:-64} SPLIT_SEQ=8 KS=${KS:-2,3} WKS=${WKS:-2,3}
else
  NSEQ=128 STEPS=600 NP=3 NT=64 WNT=${WNT:-48} FR=${FR:-0.1,0.25,0.5} WFR=${WFR:-0.1,0.25} WFFN=${WFFN:-6144}
  SPLIT_SEQ=32 KS=${KS:-2,4,6,8,12} WKS=${WKS:-4,8,12}
fi
python -c "import torch,transformers,triton,accelerate;print(torch.__version__,transformers.__version__,triton.__version__,accelerate.__version__,torch.cuda.get_device_name())" 2>&1 | tee "$L"
T=$R/tiny
[ -d "$T" ] || $B tiny qwen3_moe --out "$T" >/dev/null 2>&1
[ -f "$T.spx" ] || $B store "$T" --out "$T.spx" >/dev/null 2>&1
if [ "${SKIP_TINY:-0}" != 1 ]; then
  timeout 120 python -m toolkit.runtime.gpu_bench "$T" --device "$DEV" --store "$T.spx" --fractions 0.25 --prompts 1 --prompt-tokens 8 --new-tokens 12 --repeats 1 --draft-k 2,3 --policies on-demand+lru,next-gate+prediction,draft+prediction,oracle+belady --report-mismatches --json "$RES/tiny.json" > "$R/tiny.log" 2>&1; rc=$?
  grep -v Loading "$R/tiny.log" | tail -25 | tee -a "$L"
  [ $rc = 0 ] || exit 3
fi
M=$R/model
if [ "$SMOKE" = 1 ] || [ $TRAINED = 0 ]; then
  M=$T
elif [ "${SKIP_TRAIN:-0}" = 1 ]; then
  [ -f "$M/config.json" ] || { echo "error: SKIP_TRAIN=1 but no $M" | tee -a "$L" >&2; exit 4; }
else
  rm -rf "$R"/base.spx "$R"/base-trace "$R"/base-adapter "$R"/wide-*   # derived from the model trained before
  (timeout 200 python -m toolkit.embedded.train --corpus "$C" --tokenizer toolkit/embedded/model/tokenizer.json --out "$M" --hidden-size 1024 --num-attention-heads 16 --num-key-value-heads 4 --head-dim 64 --num-experts 32 --num-experts-per-tok 4 --moe-intermediate-size 1536 --steps 400 --batch-size 32 --lr 1e-3 --warmup 40 --eval-every 400 --eval-batches 4 --time-budget "${TB:-140}" 2>&1 | tail -4) | tee -a "$L"
  cp "$M/train_log.json" "$RES/" 2>/dev/null
fi
pack

# bench NAME MODEL FRACTIONS TIMEOUT NEW_TOKENS DRAFT_KS [REPORT [EXTRA]]: the model's fp16 store, traces,
# adapter (named NAME) and the policies' bench (gpu-bench-REPORT.json, default NAME; EXTRA: more gpu_bench
# options)
fail() { echo "FAILED: $*" | tee -a "$L"; return 1; }
# bounds REPORT TIMEOUT TRACE [eviction-bounds options]: `eviction-bounds` of TRACE, 10 held-out sequences,
# into REPORT.json/.md/.png and REPORT.log; its table into the call's log
bounds() {
  local rep=$1 limit=$2 tr=$3 t1
  shift 3
  t1=$(date +%s)
  timeout "$limit" $B eviction-bounds "$tr" --max-sequences 10 "$@" --json "$RES/$rep.json" > "$RES/$rep.log" 2>&1
  echo "$rep: rc=$? after $(( $(date +%s) - t1 )) s" | tee -a "$L"
  [ -f "$RES/$rep.md" ] && { cat "$RES/$rep.md"; echo; } | tee -a "$L"
}
bench() {
  local n=$1 m=$2 fr=$3 bt=$4 nt=$5 ks=$6 rep=${7:-$1} extra=${8:-} t0
  t0=$(date +%s)
  [ -f "$R/$n.spx" ] || $B store "$m" --out "$R/$n.spx" 2>&1 | tail -1 | tee -a "$L" || { fail "$n: store"; return; }
  [ -d "$R/$n-trace" ] || $B trace "$m" --data "$C/trace.jsonl" --out "$R/$n-trace" --device "$DEV" --dtype float16 --max-sequences $NSEQ --prompt-tokens 128 --decode-tokens 32 --heldout-frac 0.25 2>&1 | tail -2 | tee -a "$L" || { fail "$n: trace"; return; }
  [ -d "$R/$n-adapter" ] || $B train "$R/$n-trace" --out "$R/$n-adapter" --device "$DEV" --steps $STEPS 2>&1 | tail -3 | tee -a "$L" || { fail "$n: train"; return; }
  echo "$n: store, trace and adapter $(( $(date +%s) - t0 )) s" | tee -a "$L"
  timeout "$bt" python -m toolkit.runtime.gpu_bench "$m" --device "$DEV" --store "$R/$n.spx" --adapter "$R/$n-adapter" --policies "$POL" --fractions "$fr" --prompts $NP --new-tokens $nt --repeats 2 --draft-k $ks --report-mismatches $([ "${PROF:-0}" = 1 ] && echo --profile-resident) $extra ${BX:-} --json "$RES/gpu-bench-$rep.json" > "$RES/bench-$rep.log" 2>&1; echo "$rep: bench rc=$? after $(( $(date +%s) - t0 )) s" | tee -a "$L"
  grep -v Loading "$RES/bench-$rep.log" | tail -32 | tee -a "$L"
  pack
  # the eviction bounds of this model's routing at the bench's pools (the host's CPU, after the bench: not
  # beside its timed runs): what each amount of knowledge of the future reads, the policies' ceiling
  if [ "${EB:-1}" = 1 ] && [ ! -f "$RES/eviction-bounds-$n.json" ]; then
    bounds "eviction-bounds-$n" "$bt" "$R/$n-trace" --adapter "$R/$n-adapter" --pool-frac "$fr"
    pack
  fi
}

for st in $STAGES; do
  case $st in
    base) bench base "$M" "$FR" "${BT:-300}" $NT $KS ;;
    compiled)
      # the base model's bench again with the static decoder's step through torch.compile (inductor),
      # beside the base stage's eager step in the same call (its store, traces and adapter)
      bench base "$M" "$FR" "${CBT:-${BT:-300}}" $NT $KS compiled "--compile inductor" ;;
    wide)
      t0=$(date +%s)
      rm -rf "$R"/wide-*   # traces and adapter of an earlier widening (another WFFN, another model)
      $B widen "$M" --moe-intermediate-size "$WFFN" --out "$R/wide-model" 2>&1 | tail -1 | tee -a "$L" || { fail "wide: widen"; continue; }
      echo "wide: widen $(( $(date +%s) - t0 )) s; $(du -sh "$R/wide-model" | cut -f1); disk free $(df -h "$R" | tail -1 | awk '{print $4}')" | tee -a "$L"
      bench wide "$R/wide-model" "$WFR" "${WBT:-420}" $WNT $WKS
      rm -rf "$R"/wide-* "$R/wide.spx" ;;
    lookahead)
      # after the base stage: its model's eviction bounds with the self-draft's look-ahead (eviction-bounds
      # --draft-lookahead, the draft's model on the GPU; alone on it, not beside a bench)
      [ -d "$R/base-adapter" ] || { fail "lookahead: no $R/base-adapter (run the base stage first)"; continue; }
      bounds eviction-bounds-lookahead-base "${LBT:-300}" "$R/base-trace" --adapter "$R/base-adapter" --pool-frac "$FR" \
        --draft-lookahead "${EBD:-2,5}" --device "$DEV"
      pack ;;
    batched)
      # the base model's draft with Specter's one-pass verification (--verify batched) beside exact, for
      # diagnosis: where its tokens leave transformers', the first differing token and transformers'
      # top-2 logit gap there
      [ -f "$R/base.spx" ] || { fail "batched: no $R/base.spx (run the base stage first)"; continue; }
      timeout "${VBT:-150}" python -m toolkit.runtime.gpu_bench "$M" --device "$DEV" --store "$R/base.spx" --policies on-demand+lru,draft+prediction --fractions "${VFR:-0.25}" --prompts $NP --new-tokens $NT --repeats 1 --draft-k "${VK:-8}" --verify batched --report-mismatches --json "$RES/gpu-bench-batched.json" > "$RES/bench-batched.log" 2>&1; echo "batched: bench rc=$?" | tee -a "$L"
      grep -v Loading "$RES/bench-batched.log" | grep -E "DIFFER|TPOT|rc=" | tail -20 | tee -a "$L"
      pack ;;
    split)
      # the same prompts traced on one GPU and split over the GPU (half the weights) and host memory
      rm -rf "$R/split-one" "$R/split-two"
      G=$(python -c "import sys; from safetensors import safe_open; import glob, math
n = 0
for f in glob.glob(sys.argv[1] + '/*.safetensors'):
    with safe_open(f, 'pt') as h:
        n += sum(math.prod(h.get_slice(k).get_shape()) for k in h.keys())
print(max(1, n // 1024))" "$M")   # KiB: half the fp16 weights
      MM="0=${G}KiB,cpu=64GiB"; [ "$DEV" = cpu ] && MM="cpu=${G}KiB"   # without a GPU: host memory + disk
      t0=$(date +%s)
      $B trace "$M" --data "$C/trace.jsonl" --out "$R/split-one" --device "$DEV" --dtype float16 --max-sequences $SPLIT_SEQ --prompt-tokens 128 --decode-tokens 32 --heldout-frac 0.25 2>&1 | tail -1 | tee -a "$L" || { fail "split: one-device trace"; continue; }
      t1=$(date +%s)
      $B trace "$M" --data "$C/trace.jsonl" --out "$R/split-two" --device auto --max-memory "$MM" --dtype float16 --max-sequences $SPLIT_SEQ --prompt-tokens 128 --decode-tokens 32 --heldout-frac 0.25 2>&1 | tail -1 | tee -a "$L" || { fail "split: split trace"; continue; }
      t2=$(date +%s)
      python - "$R/split-one" "$R/split-two" "$RES/split.json" $((t1 - t0)) $((t2 - t1)) "$MM" <<'PY' 2>&1 | tee -a "$L"
import collections, json, sys
import numpy as np
from toolkit.traces.format import TraceReader
a, b = TraceReader(sys.argv[1]), TraceReader(sys.argv[2])
fields = ("token_id", "expert_ids", "expert_weights", "router_probs", "hidden")
out = {"one_gpu_s": int(sys.argv[4]), "split_s": int(sys.argv[5]), "max_memory": sys.argv[6],
       "placement": dict(collections.Counter(b.manifest["settings"]["placement"].values())), "equal": {}}
for split in ("train", "heldout"):
    x, y = a.load(split, fields), b.load(split, fields)
    assert all(x[k].shape == y[k].shape for k in fields), split
    e = {k: bool(np.array_equal(x[k], y[k])) for k in fields}
    e["expert_ids_share"] = float((np.sort(x["expert_ids"], -1) == np.sort(y["expert_ids"], -1)).mean())
    e["token_id_share"] = float((x["token_id"] == y["token_id"]).mean())
    for k in ("router_probs", "hidden"):
        e[k + "_max_abs_diff"] = float(np.abs(x[k].astype(np.float32) - y[k].astype(np.float32)).max())
    out["equal"][split] = e
    out.setdefault("tokens", {})[split] = int(len(x["token_id"]))
json.dump(out, open(sys.argv[3], "w"), indent=1)
print("split:", json.dumps(out))
PY
      pack ;;
    resident)
      # the all-resident bound (docs/benchmarks.md section 9, "2026-12-06 (fifth)"): random weights of the
      # base model's geometry and of its widening to WFFN, no training (every routed expert is read
      # whatever was trained), compiled (aot_eager where DEV=cpu), the step's kernels profiled
      if [ "$SMOKE" = 1 ]; then
        GEO="hidden_size=64 num_attention_heads=4 num_key_value_heads=2 head_dim=16 num_experts=8 num_experts_per_tok=2 moe_intermediate_size=32 num_hidden_layers=3 intermediate_size=128"
      else
        GEO="hidden_size=1024 num_attention_heads=16 num_key_value_heads=4 head_dim=64 num_experts=32 num_experts_per_tok=4 moe_intermediate_size=1536 num_hidden_layers=8 intermediate_size=4096"
      fi
      # named by their settings, so a call with another geometry or WFFN never benches an older one
      RM=$R/rand-$(printf %s "$GEO" | md5sum | cut -c1-8); RW=$RM-w$WFFN
      SETS=""; for kv in $GEO vocab_size=4096 tie_word_embeddings=true norm_topk_prob=true 'mlp_only_layers=[]' decoder_sparse_step=1 'dtype="float16"'; do SETS="$SETS --set $kv"; done
      [ -d "$RM" ] || $B tiny qwen3_moe --out "$RM" $SETS 2>&1 | tail -1 | tee -a "$L" || { fail "resident: tiny"; continue; }
      [ -f "$RM.spx" ] || $B store "$RM" --out "$RM.spx" 2>&1 | tail -1 | tee -a "$L" || { fail "resident: store"; continue; }
      if [ "${RWIDE:-1}" = 1 ]; then
        [ -d "$RW" ] || $B widen "$RM" --moe-intermediate-size "$WFFN" --out "$RW" 2>&1 | tail -1 | tee -a "$L" || { fail "resident: widen"; continue; }
        [ -f "$RW.spx" ] || $B store "$RW" --out "$RW.spx" 2>&1 | tail -1 | tee -a "$L" || { fail "resident: store wide"; continue; }
      fi
      CB=inductor; [ "$DEV" = cpu ] && CB=aot_eager
      MS=("$RM"); [ "${RWIDE:-1}" = 1 ] && MS+=("$RW")
      for kc in ${RK:-}; do case $kc in fused|fused-plain|model) ;; fused-base) { [ -n "${BASE:-}" ] && [ -d "$BASE/toolkit" ]; } || { fail "resident: RK fused-base needs BASE, a directory holding an earlier tree (toolkit/ in it), not '${BASE:-}'"; exit 2; } ;; *) fail "resident: RK '$kc' (fused, fused-plain, fused-base or model)"; exit 2 ;; esac; done
      case " $(echo ${RK:-}) " in *" fused-plain "*) [ "$PDLV" = 0 ] && echo "note: SPECPREFETCH_PDL=0 for the whole call: RK's fused and fused-plain both launch plainly" | tee -a "$L" ;; esac
      for m in "${MS[@]}"; do
        n0=$([ "$m" = "$RM" ] && echo rand || echo rand-wide)
        # RK: the step's kernels to compare, interleaved over RR rounds (fused: --attention fused --router fused;
        # fused-plain: the same launched without PDL; model: --attention sdpa --router model), each bench named
        # -KERNELS-rROUND; unset: one bench as it is
        for r in $(seq 1 $([ -n "${RK:-}" ] && echo "${RR:-2}" || echo 1)); do
          for kc in ${RK:-default}; do
            pdl=${SPECPREFETCH_PDL-1}   # (the call's own setting, as given, but for fused-plain)
            dir=.   # (the tree the bench runs from: BASE's for fused-base)
            case $kc in fused) ko="--attention fused --router fused"; n=$n0-fused-r$r ;;
              fused-plain) ko="--attention fused --router fused"; n=$n0-fused-plain-r$r; pdl=0 ;;
              fused-base) ko="--attention fused --router fused"; n=$n0-fused-base-r$r; dir=$BASE ;;
              model) ko="--attention sdpa --router model"; n=$n0-model-r$r ;; *) ko=""; n=$n0 ;; esac
            am=$(realpath "$m"); ares=$(realpath "$RES")
            (cd "$dir" && SPECPREFETCH_PDL=$pdl timeout "${RBT:-200}" python -m toolkit.runtime.gpu_bench "$am" --device "$DEV" --store "$am.spx" --policies on-demand+lru --fractions 0.25 --prompts 1 --prompt-tokens 32 --new-tokens $([ "$SMOKE" = 1 ] && echo 8 || echo 24) --repeats 2 --compile $CB --profile-resident --report-mismatches $ko ${BX:-} --json "$ares/gpu-bench-resident-$n.json" > "$ares/bench-resident-$n.log" 2>&1); echo "resident $n: bench rc=$?" | tee -a "$L"
            grep -v Loading "$RES/bench-resident-$n.log" | grep -E "all experts resident|profile of|DIFFER" | cut -c1-400 | tee -a "$L"
          done
        done
      done
      rm -rf "$RW" "$RW.spx"   # the widening's 18 GiB (the base geometry's model is kept for the next call)
      pack ;;
    tests)
      timeout 240 python -m pytest -q -rf -p no:cacheprovider tests/test_gpu_tier.py tests/test_cuda.py -k "${TESTK:-cuda or triton or compile or reuse or split or fused or resident or lagging}" 2>&1 | tail -20 | tee -a "$L" || fail "tests" ;;
    *) fail "unknown stage '$st' (base, compiled, wide, lookahead, batched, split, resident, tests)"; exit 2 ;;
  esac
done
pack
