#!/usr/bin/env bash
# Soft labels against hard labels at equal data and steps (bench/recipe.py, one H200): a small fresh lockstep run
# of three DSpine drafters — train.soft_labels 0 (the recipe's), 0.5 and 1 — on the same regenerated pools (chat,
# math, code; greedy and T = 1 answers), then the 7-benchmark τ at T = 0 and T = 1 through the engine.
# Before: ../shared/tools/device-carry-target, and one call taking .carry/m1:
#   mkdir -p /tmp/target && cp .carry/m1/* /tmp/target/
# Then, back to back, each a call taking .carry/m2 and .carry/whl:
#   bash bench/experiments/soft_labels_gpu.sh train S     regenerate (bf16), then train until S seconds after the call began
#   bash bench/experiments/soft_labels_gpu.sh eval        the τ table to $OUT (acceptance.json / .md) and the train report
set -euo pipefail
t0=$(date +%s)
[ -f /tmp/target/SmolLM2-135M-Instruct.Q4_1.gguf ] || bash .carry/m2/join
export PYTHONPATH=/tmp/site:$PWD
W=/tmp/soft
pools=sharegpt_3k+gsm8k_train+mbpp_train
cfg=(target=/tmp/target/SmolLM2-135M-Instruct.Q4_1.gguf regen_dtype=bfloat16 regen_batch=1536
  workload=$pools num_prompts=${PROMPTS:-1200} sampled_workload=$pools sampled_num_prompts=${PROMPTS:-1200}
  'methods=["dspine"]' 'ablations={"dspine_soft05": {"loss": {"soft_labels": 0.5}}, "dspine_soft1": {"loss": {"soft_labels": 1.0}}}'
  eval_ablations=true eval_limit=${LIMIT:-8} eval_workers=16 train.batch_size=32 train.time_budget_s=${BUDGET:-300})
case "$1" in
train)
  timeout $(( $2 / 2 )) python bench/recipe.py --stage regen --work $W --no-progress "${cfg[@]}" | tail -c 800 || true
  s=$(( $2 - ($(date +%s) - t0) - 40 ))
  python bench/recipe.py --stage train --work $W --no-progress "${cfg[@]}" train.stop_after_s=$s | tail -c 2500 ;;
eval)
  python bench/recipe.py --stage eval --work $W --no-progress "${cfg[@]}" --out $OUT/acceptance.json | tail -c 3000
  cp $W/train_report.json $OUT/ ;;
*) echo "soft_labels_gpu.sh: train S | eval" >&2; exit 2 ;;
esac
ls -la $OUT
