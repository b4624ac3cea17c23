#!/usr/bin/env bash
# The adaptation measured at volume on one H200 (issue: τ(adapted)/τ(base) per workload × thinking level on
# held-out episodes): the shipped drafter fine-tuned on collected agent traces in several variants side by side
# (adapt/finetune.py, in-process: the machine has no Ray), each replayed through the engine by adapt/evaluate.py.
# Before, here: the traces packed into .carry/traces (tar c -C DIR traces | split -b 15000000 -d - .carry/traces/traces.tar.,
# DIR holding the collection as traces/ — what `collect` brings back), the target as in bench/experiments/base_drafter_gpu.sh
# (device-carry-target: .carry/m1, m2, whl), and the shipped drafter taken to /tmp in the first call, before it is
# moved out of the working tree (calls of at most 64 MiB each, back to back: the machine goes back 30 s after one):
#   1 (working tree as is)        bash bench/experiments/adapt_gpu.sh drafter
#   2 (carry .carry/m1)           mkdir -p /tmp/target && cp .carry/m1/* /tmp/target/
#   3 (carry .carry/traces, .carry/mix)
#                                 bash bench/experiments/adapt_gpu.sh traces     (.carry/mix: regenerated general data, packed
#                                 as bench/experiments/base_drafter_gpu.sh brings it back — data.tar.*, mixed in by the variants
#                                 that name $mix, to hold the general benchmarks)
#   4 (carry .carry/m2, .carry/whl)
#                                 bash bench/experiments/adapt_gpu.sh run S [VARIANT ...]      (again for more variants)
# Collecting the traces there instead (the agents against `dspine serve` on the GPU; this 2-core machine manages
# about one episode a minute): after 1 and 2, a call carrying .carry/agentwhl (the serving and agent packages as
# py3.12 wheels: fastapi, uvicorn, pydantic, litellm, openai + httpx2, mini-swe-agent, python-docx, openpyxl and
# their needs; the machine has no Ray, so episodes run in local worker processes; made here, where pip reaches a
# registry, by `bash bench/experiments/adapt_gpu.sh agentwheels`, ~45 MB) runs
#   bash bench/experiments/adapt_gpu.sh wheels
# With the shipped drafter and the office tasks moved out of the working tree (they and a target half exceed the 64 MiB
# a call carries), step 1 is instead a call carrying copies of them in .carry/drafter and .carry/office:
#   mkdir -p /tmp/builtin && cp .carry/drafter/* /tmp/builtin/ && cp -r .carry/office /tmp/office
# and the `collect` call begins with `cp -r /tmp/office workloads/data/office`.
# then one carrying .carry/m2 and .carry/whl:
#   bash bench/experiments/adapt_gpu.sh collect S [EPISODES] [CONCURRENCY]     swe, tool, office × LEVELS (default low,high); traces to $OUT
# and `run` finds them in /tmp/adapt/traces (step 3 is then skipped).
# `run` trains the variants one after another, each for TRAIN_S seconds (default 60), evaluates each (held-out
# rows of every cell replayed EVAL_BATCH at a time, at most MAX_ROWS of them, 0: all; the seven benchmarks at LIMIT
# items, default 3, in GENERAL_WORKERS processes, default 4), starts none with less than TRAIN_S + EVAL_S (240) of
# its S seconds left, and cuts an evaluation at S + 20; $OUT gets each fine-tune's finetune.json as soon as it ends,
# then adapt_<variant>.{json,md}. A variant is 'NAME:OVERRIDE OVERRIDE ...' (one argument, overrides apart by spaces, so a list such as
# blend_choices=[0.5,0.7,1.0] stays whole) of FinetuneConfig (adapt/finetuning.py); the default set compares one drafter for all
# traces without and with general data mixed in, then blended with the base in weight space (blend=0.7), held
# out by episode vs by task (no held-out task trained on), one per workload × level, and LoRA.
set -euo pipefail
t0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - t0) )); }
W=/tmp/adapt
mkdir -p $W
case "$1" in
agentwheels)  # here: the serving and agent stack as py3.12 wheels, less what the GPU image has, to .carry/agentwhl
  . bench/experiments/py312_wheels.sh
  dl=${AGENTWHL_CACHE:-$HOME/.cache/dspine-agentwhl}
  wheels_download "$dl" "fastapi>=0.110" "uvicorn>=0.29" "litellm==1.108.7" "mini-swe-agent>=2.4,<3" \
    "python-docx>=1.1" "openpyxl>=3.1" || exit 1
  # on the image (its package list: the device README's KINDS.md), or not imported on this path
  have="aiohappyeyeballs aiohttp aiosignal annotated_doc anyio attrs certifi charset_normalizer click filelock frozenlist
    fsspec h11 hf_xet httpcore httpx huggingface_hub idna jinja2 lxml markdown_it_py markupsafe mdurl multidict numpy
    packaging pandas prometheus_client propcache pyarrow pygments python_dateutil pyyaml regex requests rich shellingham
    six tiktoken tokenizers tqdm typer typing_extensions urllib3 xxhash yarl zipp boto3 botocore s3transfer jmespath
    datasets dill multiprocess"
  rm -rf .carry/agentwhl && mkdir -p .carry/agentwhl
  wheels_copy_except .carry/agentwhl "$have" "$dl"/*.whl
  du -sh .carry/agentwhl ;;
drafter)
  mkdir -p /tmp/builtin && cp drafters/smollm2-135m-instruct/dspine/{config.json,model.safetensors} /tmp/builtin/
  sha256sum /tmp/builtin/model.safetensors ;;
traces)
  cat .carry/traces/traces.tar.* | tar x -C $W
  ls $W/traces/episodes | wc -l
  if [ -d .carry/mix ]; then mkdir -p $W/mix && cat .carry/mix/data.tar.* | tar x -C $W/mix && ls $W/mix; fi ;;
wheels)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .carry/agentwhl/*.whl
  PYTHONPATH=/tmp/site:$PWD python3 -c "import fastapi, uvicorn, litellm, minisweagent, docx, openpyxl, platformdirs
import dspine.serve.server, dspine.agents.swe, dspine.agents.tau, dspine.agents.office, dspine.adapt.collection
print('agents stack ok')" ;;
collect)
  [ -f /tmp/target/SmolLM2-135M-Instruct.Q4_1.gguf ] || bash .carry/m2/join
  export PYTHONPATH=/tmp/site:$PWD LITELLM_LOCAL_MODEL_COST_MAP=True  # no network: litellm's bundled price map
  python3 -m dspine.cli serve --target /tmp/target/SmolLM2-135M-Instruct.Q4_1.gguf --device cuda --drafter /tmp/builtin \
    --served-model-name smol --port 8011 --max-prompt-tokens 7000 > $W/server.log 2>&1 &
  srv=$!
  up() { python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8011/v1/models', timeout=2)" 2> /dev/null; }
  for _ in $(seq 90); do up && break; sleep 2; done
  timeout "$(left $(($2 - 40)))" python3 adapt/collect.py --endpoint http://127.0.0.1:8011/v1 --model smol \
    --out $W/traces --workloads swe,tool,office --levels ${LEVELS:-low,high} --episodes ${3:-24} --concurrency ${4:-24} \
    --executor local --max-turns 4 --max-tokens 256 2>&1 | grep -v "Loading weights" | tail -n 30 || true
  kill $srv || true
  tail -n 5 $W/server.log
  ls $W/traces/episodes | sed 's/-[0-9a-f]*-/ /; s/-[0-9]*.json//' | sort | uniq -c
  tar c -C $W traces | split -b 15000000 -d - $OUT/traces.tar. ;;
run)
  [ -n "${TARGET:-}" ] || [ -f /tmp/target/SmolLM2-135M-Instruct.Q4_1.gguf ] || bash .carry/m2/join
  export PYTHONPATH=/tmp/site:$PWD
  [ -d $W/traces ] || { echo "no traces in $W: run \`collect\` or \`traces\` first" >&2; exit 2; }
  S=$2; shift 2
  V=("$@")
  mix="mix=$W/mix/data mix_fraction=0.3"
  [ ${#V[@]} -gt 0 ] || V=("all-full:per=all mode=full train.lr=1e-4" "all-mix:per=all mode=full train.lr=1e-4 $mix"
    "all-blend:per=all mode=full train.lr=1e-4 $mix blend=0.7"
    "all-task:per=all mode=full train.lr=1e-4 split=task $mix blend=0.7" "cell-mix:per=workload_level mode=full train.lr=1e-4 $mix"
    "all-lora:per=all mode=lora train.lr=1e-3 $mix")
  for v in "${V[@]}"; do
    name=${v%%:*}; ovr=${v#*:}
    if [ "$(left "$S")" -lt $(( ${TRAIN_S:-60} + ${EVAL_S:-240} )) ]; then echo "$name: not started (time)"; continue; fi
    echo "== $name: $ovr"
    python adapt/finetune.py --traces $W/traces --out $W/$name --target ${TARGET:-/tmp/target/SmolLM2-135M-Instruct.Q4_1.gguf} --base /tmp/builtin --workers 0 --device ${DEVICE:-cuda} \
      train.time_budget_s=${TRAIN_S:-60} train.steps=100000 train.batch_size=8 train.max_len=2048 \
      train.anchors_per_seq=64 train.eval_every=50 train.warmup_steps=20 $ovr > $W/ft_$name.log 2>&1 || true
    grep -v "Loading weights" $W/ft_$name.log | tail -n 8
    cp $W/$name/finetune.json $OUT/finetune_$name.json || continue
    # bounded by the time left: the replay is batched, the rows capped (taken in turn from every cell)
    timeout "$(left $(( S + 20 )))" python adapt/evaluate.py --finetune $W/$name --out $OUT/adapt_$name.json \
      limit=${LIMIT:-3} batch_size=${EVAL_BATCH:-32} max_rows=${MAX_ROWS:-0} general_workers=${GENERAL_WORKERS:-4} > $W/ev_$name.log 2>&1 || true
    cat $OUT/adapt_$name.md 2> /dev/null || tail -c 1500 $W/ev_$name.log
  done ;;
esac
[ -z "${OUT:-}" ] || ls -la "$OUT"
