#!/usr/bin/env bash
# The base drafter's GPU run (bench/recipe.py --base: DSpine and DFlash in lockstep on the same regenerated data) in
# device calls of at most 10 minutes on one H200. Before: ../shared/tools/device-carry-target, the shipped drafter
# moved out of the working tree (it and the target's half exceed the 64 MiB a call carries), and one call taking
# .carry/m1:  mkdir -p /tmp/target && cp .carry/m1/* /tmp/target/
# Then, back to back, each a call taking .carry/m2 and .carry/whl:
#   bash bench/base_drafter_gpu.sh start S [MORE]  regenerate (bf16), then train until S seconds after the call
#                                                  began; the cosine spans this call's training + MORE seconds
#   bash bench/base_drafter_gpu.sh more S          resume training until S seconds after the call began
#   bash bench/base_drafter_gpu.sh eval            the 7-benchmark τ table (T = 0 and 1, DSpine vs DFlash) to $OUT,
#                                                  the DSpine drafter in the shipped format in 15 MB pieces
# Everything lives in /tmp/base on the machine (kept while it stays warm); what comes back is in $OUT.
set -euo pipefail
t0=$(date +%s)
[ -f /tmp/target/SmolLM2-135M-Instruct.Q4_1.gguf ] || bash .carry/m2/join
export PYTHONPATH=/tmp/site:$PWD
W=/tmp/base
mkdir -p $W
left() { echo $(( $1 - ($(date +%s) - t0) )); }
common() { echo --base --work $W --no-progress target=/tmp/target/SmolLM2-135M-Instruct.Q4_1.gguf \
  regen_dtype=bfloat16 train.time_budget_s=$(cat $W/budget_s 2>/dev/null || echo 1000); }
case "$1" in
start)
  timeout "$(left "$2")" python bench/recipe.py --stage regen $(common) | tail -c 1200 || true
  s=$(left $(($2 - 45)))  # the target's load and the checkpoint writes
  echo $(( (s > 60 ? s : 0) + ${3:-450} )) > $W/budget_s
  echo "training budget: $(cat $W/budget_s) s"
  if [ "$s" -gt 60 ]; then python bench/recipe.py --stage train $(common) train.stop_after_s=$s | tail -c 2500; fi ;;
more)
  r=$([ -f $W/train_report.json ] && echo --resume || true)
  python bench/recipe.py --stage train $r $(common) train.stop_after_s=$(left $(($2 - 45))) | tail -c 2500 ;;
eval)
  python bench/recipe.py --stage eval $(common) --out $OUT/acceptance.json | tail -c 3000
  python -c "from dspine.train.recipe import RecipeConfig as R, ship_drafters as s; s(R.base_drafter(), '$W', '$W/ship')"
  cp $W/train_report.json $OUT/
  split -b 15000000 -d $W/ship/dspine/model.safetensors $OUT/dspine.part
  cp $W/ship/dspine/config.json $OUT/dspine_config.json ;;
esac
ls -la $OUT
