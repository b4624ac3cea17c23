#!/usr/bin/env bash
# The adaptation measured at volume on one H200 (issue: τ(adapted)/τ(base) per workload × thinking level on
# held-out episodes): the shipped drafter fine-tuned on collected agent traces in several variants side by side
# (adapt/finetune.py, in-process: the machine has no Ray), each replayed through the engine by adapt/evaluate.py.
# Before, here: the traces packed into .carry/traces (tar -C runs -cf - NAME | split -b 15000000 -d -
# .carry/traces/traces.tar.), the target as in bench/base_drafter_gpu.sh (device-carry-target: .carry/m1, m2, whl),
# and the shipped drafter taken to /tmp in the first call, before it is moved out of the working tree:
#   1 (working tree as is)        bash bench/adapt_gpu.sh drafter
#   2 (carry .carry/m1)           mkdir -p /tmp/target && cp .carry/m1/* /tmp/target/
#   3 (carry .carry/m2, .carry/whl, .carry/traces)
#                                 bash bench/adapt_gpu.sh run S [VARIANT ...]
# `run` trains the variants one after another, each for TRAIN_S seconds (default 60), evaluates each (held-out
# rows of every cell, the seven benchmarks at LIMIT items, default 3), and stops starting new ones S seconds after
# the call began; $OUT gets adapt_<variant>.{json,md} and the fine-tunes' finetune.json. A variant is
# NAME:OVERRIDE,OVERRIDE,... of FinetuneConfig (adapt/finetuning.py); the default set compares one drafter for all
# traces vs one per workload × level, full fine-tune vs LoRA, and two learning rates.
set -euo pipefail
t0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - t0) )); }
W=/tmp/adapt
mkdir -p $W
case "$1" in
drafter)
  mkdir -p /tmp/builtin && cp drafters/smollm2-135m-instruct/dspine/{config.json,model.safetensors} /tmp/builtin/
  sha256sum /tmp/builtin/model.safetensors ;;
run)
  [ -n "${TARGET:-}" ] || [ -f /tmp/target/SmolLM2-135M-Instruct.Q4_1.gguf ] || bash .carry/m2/join
  export PYTHONPATH=/tmp/site:$PWD
  [ -d $W/traces ] || { mkdir -p $W/traces && cat .carry/traces/traces.tar.* | tar x -C $W/traces --strip-components 1; }
  S=$2; shift 2
  V=("$@")
  [ ${#V[@]} -gt 0 ] || V=("all-full:per=all,mode=full,train.lr=1e-4" "cell-full:per=workload_level,mode=full,train.lr=1e-4"
    "all-lora:per=all,mode=lora,train.lr=1e-3" "all-full-lr3:per=all,mode=full,train.lr=3e-4")
  for v in "${V[@]}"; do
    name=${v%%:*}; ovr=${v#*:}
    if [ "$(left "$S")" -lt $(( ${TRAIN_S:-60} + 150 )) ]; then echo "$name: not started (time)"; continue; fi
    echo "== $name: ${ovr//,/ }"
    python adapt/finetune.py --traces $W/traces --out $W/$name --target ${TARGET:-/tmp/target/SmolLM2-135M-Instruct.Q4_1.gguf} --base /tmp/builtin --workers 0 --device ${DEVICE:-cuda} \
      train.time_budget_s=${TRAIN_S:-60} train.steps=100000 train.batch_size=8 train.max_len=2048 \
      train.anchors_per_seq=64 train.eval_every=50 train.warmup_steps=20 ${ovr//,/ } 2>&1 | grep -v "Loading weights" | tail -n 15
    python adapt/evaluate.py --finetune $W/$name --out $OUT/adapt_$name.json limit=${LIMIT:-3} workers=8 \
      2>&1 | grep -v "Loading weights" | tail -n 25 || true
    cp $W/$name/finetune.json $OUT/finetune_$name.json
  done ;;
esac
ls -la $OUT 2>/dev/null || true
