#!/usr/bin/env bash
# bench/experiments/gpu_loop.py on this workplace's GPU machine, which has no package registry, takes at most 64 MiB a
# command (working tree + carried folders) and keeps /tmp only while it stays warm (30 s after a call). On a GPU
# box of your own, install sglang==0.5.17 and dspine[proxy,adapt] (`pip install -e .`) and run gpu_loop.py directly.
# Here, first:
#   bash ../shared/tools/device-carry-sglang            -> .carry/sgl1, sgl2 (SGLang 0.5.17, trimmed)
#   bash ../shared/tools/device-carry-target            -> .carry/m1, m2, whl (the target's GGUF in halves)
#   bash bench/experiments/gpu_loop_gpu.sh wheels        -> .carry/gwA, gwB, gwC: Ray 2.60 (its Java jar and source
#                                                          maps left out), LiteLLM's proxy, the agents' packages, as
#                                                          py3.12 wheels, less what the GPU image or SGLang's set has
#   the shipped drafter in .carry/drafter, and the working tree trimmed (skip-worktree) below 64 MiB with it.
# Then, back to back, each call carrying the folders named and running `bash bench/experiments/gpu_loop_gpu.sh put`
# (it files whatever .carry/ folders came along: wheels, GGUF halves, drafter), the last one with `install`
# appended; then one call per stage group:
#   bash bench/experiments/gpu_loop_gpu.sh run up  [gpu_loop.py options]
#   bash bench/experiments/gpu_loop_gpu.sh run collect ...
#   bash bench/experiments/gpu_loop_gpu.sh run adapt ...
#   bash bench/experiments/gpu_loop_gpu.sh run replay,deploy,report ...
#   bash bench/experiments/gpu_loop_gpu.sh run race,report ...   (AR, NGRAM ± corpus, the plugin base / adapted)
# Every run copies the loop's JSON, Markdown and log tails to $OUT.
set -uo pipefail
S=/tmp/gpuloop-stage
W=/tmp/gpuloop
GGUF=/tmp/target/SmolLM2-135M-Instruct.Q4_1.gguf
case "${1:-}" in
wheels)
  . bench/experiments/py312_wheels.sh
  dl=${GPULOOP_CACHE:-$HOME/.cache/dspine-gpuloop}
  wheels_download "$dl" "ray[default,train]==2.60.0" "litellm[proxy]==1.108.7" "mini-swe-agent>=2.4,<3" python-docx \
    openpyxl prometheus-client || exit 1
  # on the image (torch's and transformers' needs) or in SGLang's carried set, or not imported on this path
  have="numpy pyarrow tokenizers huggingface_hub hf_xet tqdm regex filelock fsspec jinja2 markupsafe packaging pyyaml
    typing_extensions sympy httpx httpcore h11 anyio certifi idna sniffio tiktoken"
  # (LiteLLM's proxy imports redis and mcp at start; mini-swe-agent needs platformdirs: those stay)
  skip="polars polars_runtime_32 datasets boto3 botocore s3transfer jmespath azure_core azure_identity azure_storage_blob
    msal msal_extensions isodate granian psycopg psycopg_binary textual py_spy virtualenv distlib python_discovery
    soundfile"
  sgl=$(wheel_names $(ls .carry/sgl*/*.whl 2> /dev/null))
  rm -rf .carry/gwA .carry/gwB .carry/gwC "$S-sel" && mkdir -p .carry/gwA .carry/gwB .carry/gwC "$S-sel"
  wheels_copy_except "$S-sel" "$have $skip $sgl" "$dl"/*.whl
  r=$(ls "$S-sel"/ray-*.whl) && zip -q -d "$r" 'ray/jars/*' 'ray/dashboard/client/build/static/js/*.map'
  python3 - "$S-sel" <<'PY'
import glob, os, shutil, sys
caps = {".carry/gwA": 56e6, ".carry/gwB": 56e6, ".carry/gwC": 1e12}
used = dict.fromkeys(caps, 0)
for f in sorted(glob.glob(sys.argv[1] + "/*.whl"), key=os.path.getsize, reverse=True):
    k = next(k for k in caps if used[k] + os.path.getsize(f) <= caps[k])
    shutil.copy(f, k)
    used[k] += os.path.getsize(f)
print({k: f"{v / 2**20:.1f} MiB" for k, v in used.items()})
PY
  (cd .carry && sha256sum gw*/*.whl | sed 's#  gw./#  #' > gwC/MANIFEST-gw)
  exit 0 ;;
put)
  mkdir -p $S/whl /tmp/target /tmp/builtin
  for d in .carry/*/; do
    case "$d" in
    *m1/ | *m2/) cp "$d"part* /tmp/target/ ;;
    *drafter/) cp "$d"config.json "$d"model.safetensors /tmp/builtin/ ;;
    *) cp "$d"*.whl $S/whl/ 2> /dev/null; cp "$d"MANIFEST* $S/ 2> /dev/null ;;
    esac
    echo "filed $d"
  done
  shift
  [ "${1:-}" = install ] || exit 0 ;;
esac
if [ "${1:-}" = install ]; then
  cat /tmp/target/part00 /tmp/target/part01 > $GGUF
  echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $GGUF" | sha256sum -c - || exit 3
  (cd $S/whl && sha256sum --quiet -c ../MANIFEST && sha256sum --quiet -c ../MANIFEST-gw) || {
    echo "wheels missing or damaged: was the machine given back between calls? redo them all" >&2; exit 3; }
  SECONDS=0
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $S/whl/*.whl
  echo "installed $(ls $S/whl | wc -l) wheels in ${SECONDS} s"
  D=/tmp/site/dspine_entry-0.1.dist-info  # the plugin's entry point, as `pip install -e .` would register it
  mkdir -p $D
  printf 'Metadata-Version: 2.1\nName: dspine-entry\nVersion: 0.1\n' > $D/METADATA
  printf '[sglang.srt.plugins]\ndspine = dspine.sglang.plugin:register\n' > $D/entry_points.txt
  PYTHONPATH=/tmp/site:$PWD python3 -c "import sglang, ray, litellm, fastapi; print('sglang', sglang.__version__, 'ray', ray.__version__)"
  exit $?
fi
if [ "${1:-}" = run ]; then
  export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 LITELLM_LOCAL_MODEL_COST_MAP=True
  shift
  stages=$1
  shift
  rc=0
  for s in ${stages//,/ }; do
    python3 bench/experiments/gpu_loop.py "$s" --work $W --target $GGUF --drafter /tmp/builtin \
      --out $W/gpu_loop_out.json "$@" || { rc=$?; break; }
  done
  mkdir -p "$OUT"/logs
  cp $W/gpu_loop.json $W/gpu_loop_out.* $W/adapt.json $W/adapt.md "$OUT"/ 2> /dev/null
  cp $W/finetune/finetune.json "$OUT"/ 2> /dev/null
  for f in $W/logs/*.log $W/proxy.log $W/backend.log; do
    [ -f "$f" ] && tail -c 60000 "$f" > "$OUT/logs/$(basename "$f")"
  done
  exit $rc
fi
echo "usage: $0 wheels | put [install] | install | run STAGE[,STAGE] [gpu_loop.py options]" >&2
exit 2
