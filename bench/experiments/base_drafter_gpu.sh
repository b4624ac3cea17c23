#!/usr/bin/env bash
# The base drafter's GPU run (bench/recipe.py --base: DSpine and DFlash in lockstep on the same regenerated data) in
# device calls of at most 10 minutes on one H200. Before: ../shared/tools/device-carry-target, the shipped drafter
# moved out of the working tree (it and the target's half exceed the 64 MiB a call carries), and one call taking
# .carry/m1:  mkdir -p /tmp/target && cp .carry/m1/* /tmp/target/
# Then, back to back, each a call taking .carry/m2 and .carry/whl:
#   bash bench/experiments/base_drafter_gpu.sh stage DIR       copy what an earlier run brought back (carried in DIR: data.tar.*,
#                                                  dspine.part*, dflash.part* and *_config.json) into place: the
#                                                  packed data (regen then has nothing left to answer) and both
#                                                  drafters to warm-start from (several calls when over 64 MiB)
#   bash bench/experiments/base_drafter_gpu.sh regen S         regenerate (bf16) until S seconds after the call began, nothing
#                                                  else; what it answered comes back as data.tar.* (a device lent
#                                                  too briefly to train still advances the data: `stage` it next
#                                                  time and regeneration goes on from there)
#   bash bench/experiments/base_drafter_gpu.sh start S [MORE]  regenerate (bf16) what is not there yet (the new pools of
#                                                  the recipe's added_workload too), pick the batch size
#                                                  (bench/train_step.py --pick; BS=N skips it), then train until
#                                                  S seconds after the call began — from the staged drafters'
#                                                  weights when there are both; the cosine spans this call's
#                                                  training + MORE seconds
#   bash bench/experiments/base_drafter_gpu.sh more S          resume training until S seconds after the call began
#   bash bench/experiments/base_drafter_gpu.sh eval [S]        the 7-benchmark τ table (T = 0 and 1, DSpine vs DFlash) to $OUT,
#                                                  the DSpine drafter in the shipped format in 15 MB pieces;
#                                                  TREE=SPEC adds both drafters decoded through that draft tree
#                                                  (rows dspine_t, dflash_t; ~1.6x the eval's time), e.g. session
#                                                  28's T = 0 pick (bench/results/tree_profile_t0.md, 32 nodes)
#   bash bench/experiments/base_drafter_gpu.sh back dflash     the DFlash twin (shipped format) and the packed data in 15 MB
#                                                  pieces, for the next run's `stage` (the lockstep continues)
#   bash bench/experiments/base_drafter_gpu.sh back dspine     the DSpine drafter likewise (a run that skips `eval`)
#   `back` ships each method's best checkpoint (by held-out τ_sim), WHICH=last the pair where training stopped.
# A cosine across sessions: BUDGET=S (the whole schedule's training seconds) for `start`; this session trains part
# of it and `back` (WHICH=last) brings the pair home; the next session stages it and starts with the same BUDGET
# and OFFSET=the seconds already trained (train_report.json's last elapsed_s): the schedule continues there.
# PRESET=levers NAME=ratio_levers: issue 50's levers instead (RecipeConfig.levers: DSpine, DFlash and the lever
# variants in lockstep from fresh weights; `eval` replays 30 items x 512 tokens per benchmark and writes
# $OUT/ratio_levers.{json,md,svg} and the train report, nothing shipped); the same stages otherwise, with BS=N
# given (the batch-size probe, bench/train_step.py, times the base pair, not the ten drafters of the levers).
# Its evaluation (30 items x 512 tokens, ten drafters) ran past one call in session 44: `eval S` stops starting
# drafters' replays S - 40 s into the call (exit status 3), keeps the answers and each replayed drafter in
# $W/eval_cache, and `eval S` again on the same warm machine goes on from there.
# Two seeds in one lockstep (same data, batches and anchors; one regeneration and one evaluation for both): each
# drafter's twin under another initialisation seed as an ablation NAME_s1, paired with its own seed's twin, e.g.
#   EXTRA='ablations={"dspine_split":{"loss":{"redo_split":0.5}},"dspine_s1":{"seed":1},"dflash_s1":{"method":"dflash","seed":1},"dspine_split_s1":{"loss":{"redo_split":0.5},"seed":1}} eval_pairs={"dspine":"dflash","dspine_split":"dflash","dspine_s1":"dflash_s1","dspine_split_s1":"dflash_s1"}'
# then here `python bench/recipe.py --stage seeds --reports ratio_levers.json --out bench/results/ratio_levers.json`
# (split_seed_variants: one document per seed, combined over both).
# PROFILE=1 with BS=N: `start` profiles N's step (bench/train_step.py --profile) instead of probing sizes.
# EXTRA="key=value ...": more recipe overrides for every stage of the call (e.g. sampled_num_prompts=600 for a
# shorter regeneration, eval_temperatures=[0.0]); give a call the same ones as the calls before it.
# .carry/ is git-ignored: a session that starts on a new checkout finds it gone (sessions 19 and 33), and with it the
# pair and data an earlier run brought back; the run then starts fresh.
# A continued run (gpu3's lockstep pair and data, kept in .carry/base1 and .carry/base2 of the development checkout):
#   1 carry .carry/m1 (as above); 2 carry .carry/base1: `stage .carry/base1`; 3 carry .carry/base2: `stage
#   .carry/base2`; then start (no regeneration left), more, eval, back as above.
# Carry limits (64 MiB a call): the tracked tree is ~20 MB, a target half 47 MB, so for the calls that carry one,
# move workloads/data/office (7 MB, unused here) and the shipped drafter out of the working tree, back after.
# That leaves ~3 MB beside a target half: packed data larger than that travels in pieces, one beside each half
# (call 1 also `cp .carry/PIECES_A/* /tmp/stage/`; call 2 `cp .carry/PIECES_B/* /tmp/stage/; bash $0 stage
# /tmp/stage`, then `start` in the same command).
# Calls chain within the machine's 30 s idle release: have the next command ready; a machine given back between
# `start` and `more` loses /tmp/base (session 29 lost a regeneration so) — hence `start` returns the data it
# regenerated, as data.tar.* in $OUT, for `stage`.
# Everything lives in /tmp/base on the machine (kept while it stays warm; WORK=DIR another folder); what comes back
# is in $OUT. A second seed on the same data, on the same warm machine: WORK=/tmp/s2 DATA_FROM=/tmp/base
# EXTRA=train.seed=1 with `start` (its data sets are linked from DATA_FROM, so nothing is regenerated), then `eval`
# with the same WORK and EXTRA and another NAME. BUDGET=S gives both seeds the same training seconds.
set -euo pipefail
t0=$(date +%s)
[ "$1" = stage ] || [ -f /tmp/target/SmolLM2-135M-Instruct.Q4_1.gguf ] || bash .carry/m2/join
export PYTHONPATH=/tmp/site:$PWD
W=${WORK:-/tmp/base}
mkdir -p $W
if [ -n "${DATA_FROM:-}" ]; then
  for d in "$DATA_FROM"/data*; do [ -e "$W/$(basename "$d")" ] || ln -s "$d" "$W/"; done
fi
# each method's drafter in the shipped format (bf16, no derived buffers), once: WHICH=best (default) or last
ship() { [ -d $W/ship ] || python -c "from dspine.train.recipe import RecipeConfig as R, ship_drafters as s
s(R.base_drafter(), '$W', '$W/ship', which='${WHICH:-best}')"; }
left() { echo $(( $1 - ($(date +%s) - t0) )); }
warm() { [ -f $W/warm/dspine/model.safetensors ] && [ -f $W/warm/dflash/model.safetensors ] && echo warm_from=$W/warm || true; }
# what `start` settles (budget, batch size, a warm start's peak LR) is kept in $W so that `more` resumes alike
ovr() { echo target=/tmp/target/SmolLM2-135M-Instruct.Q4_1.gguf regen_dtype=bfloat16 \
  train.time_budget_s=$(cat $W/budget_s 2>/dev/null || echo 1000) train.batch_size=$(cat $W/batch_size 2>/dev/null || echo 16) \
  $([ -f $W/lr ] && echo train.lr=$(cat $W/lr) || true) \
  $([ -f $W/offset ] && echo train.schedule_offset_s=$(cat $W/offset) || true) ${EXTRA:-}; }
common() { echo --${PRESET:-base} --work $W --no-progress $(ovr); }
# the regenerated data, packed, in 15 MB pieces to $OUT (data, data_t1, and the added pools' data_added*)
pack() {
  rm -rf $W/pack
  # only sets with answers: a regeneration stopped early leaves later sets absent or empty
  sets=$(cd $W && for d in data data_*; do if ls $d/part-* > /dev/null 2>&1; then echo $d; fi; done)
  for f in $sets; do python -c "from dspine.train.data import pack_dataset as p; p('$W/$f', '$W/pack/$f')"; done
  tar c -C $W/pack $sets | split -b 15000000 -d - $OUT/data.tar.
}
# regenerate (bf16) what is not there yet until $1 seconds after the call began; what it answered comes back at
# once (counted in parts, so answers added to a staged set count too): a machine lost before `back` need not
# regenerate it (stage DIR)
parts() { (ls $W/data*/part-* 2> /dev/null || true) | wc -l; }  # none yet is 0, not a failure under pipefail
regen_until() {
  had=$(parts)
  timeout "$(left "$1")" python bench/recipe.py --stage regen $(common) | tail -c 1200 || true
  if [ "$(parts)" != "$had" ]; then pack; fi
}
case "$1" in
stage)
  for m in dspine dflash; do
    if ls "$2"/$m.part* > /dev/null 2>&1; then
      mkdir -p $W/warm/$m && cat "$2"/$m.part* > $W/warm/$m/model.safetensors && cp "$2"/${m}_config.json $W/warm/$m/config.json
    fi
  done
  if ls "$2"/data.tar.* > /dev/null 2>&1; then cat "$2"/data.tar.* | tar x -C $W; fi
  find $W -maxdepth 3 -type f | sort ;;
regen)
  regen_until $(($2 - 20)) ;;
start)
  regen_until "$2"
  # written beside, then renamed: ovr() reads batch_size, which a redirection would empty before python starts
  # BS=N skips the probe (a continued run on the same GPU kind: the size the last probe picked)
  if [ -n "${BS:-}" ]; then
    echo $BS > $W/bs.new
    if [ -n "${PROFILE:-}" ]; then
      python bench/train_step.py --work $W --batches $BS --steps 4 --warmup 2 --profile --out $OUT/train_step.json $(ovr) \
        2>&1 >/dev/null | tail -n 32 || true
    fi
  else
    (python bench/train_step.py --work $W --pick --profile --out $OUT/train_step.json $(ovr) || echo 16) | tail -n 1 > $W/bs.new
  fi
  mv $W/bs.new $W/batch_size
  # a warm start (weights only, a new cosine) peaks at LR (default 5e-4, half a fresh run's: it continues);
  # with OFFSET it continues the earlier run's cosine, whose peak was the recipe's own LR (default: unset)
  if [ -n "$(warm)" ] && [ -z "${OFFSET:-}" -o -n "${LR:-}" ]; then echo ${LR:-5e-4} > $W/lr; fi
  echo "batch size: $(cat $W/batch_size); $(warm) $(ovr | grep -o 'train.lr=[^ ]*' || true)"
  s=$(left $(($2 - 45)))  # the target's load and the checkpoint writes
  echo ${BUDGET:-$(( (s > 60 ? s : 0) + ${3:-450} ))} > $W/budget_s
  if [ -n "${OFFSET:-}" ]; then echo $OFFSET > $W/offset; fi
  echo "training budget: $(cat $W/budget_s) s"
  if [ "$s" -gt 60 ]; then python bench/recipe.py --stage train $(common) $(warm) train.stop_after_s=$s | tail -c 2500; fi ;;
more)
  r=$([ -f $W/train_report.json ] && echo --resume || true)
  python bench/recipe.py --stage train $r $(common) train.stop_after_s=$(left $(($2 - 45))) | tail -c 2500 ;;
eval)
  # eval S: no drafter's replay starts after S - 40 seconds into the call (the levers' replay evaluation); what
  # was replayed stays in $W/eval_cache and the next `eval` call goes on from there (exit status 3 until done)
  python bench/recipe.py --stage eval $(common) ${TREE:+"eval_trees={\"t\":\"$TREE\"}"} \
    ${2:+eval_budget_s=$(left $(($2 - 40)))} --out $OUT/${NAME:-acceptance}.json | tail -c 3000
  cp $W/train_report.json $OUT/
  [ "${PRESET:-base}" = base ] || exit 0  # the levers: the table and the report, no drafter to ship
  ship
  split -b 15000000 -d $W/ship/dspine/model.safetensors $OUT/dspine.part
  cp $W/ship/dspine/config.json $OUT/dspine_config.json ;;
back)
  ship
  case "${2:-dflash}" in
  dflash)
    pack
    split -b 15000000 -d $W/ship/dflash/model.safetensors $OUT/dflash.part
    cp $W/ship/dflash/config.json $OUT/dflash_config.json ;;
  dspine)
    cp $W/train_report.json $OUT/
    split -b 15000000 -d $W/ship/dspine/model.safetensors $OUT/dspine.part
    cp $W/ship/dspine/config.json $OUT/dspine_config.json ;;
  *) echo "back: dflash or dspine, not $2" >&2; exit 2 ;;
  esac ;;
esac
ls -la $OUT
