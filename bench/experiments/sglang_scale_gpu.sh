#!/usr/bin/env bash
# bench/experiments/sglang_scale.py on one H200 in device calls of at most 10 minutes. Here, first:
#   bash ../shared/tools/device-carry-sglang        -> .carry/sgl1 .. sgl3 (SGLang 0.5.17, trimmed)
#   bash bench/experiments/sglang_scale_gpu.sh tok [qwen3]      -> .carry/tok: the built-in tokenizer's files (qwen3: Qwen3's real
#                                                                 tokenizer, so the shapes get its 151,936-row head) and the kernel JSONs
# and move the shipped drafter and workloads/data/office out of the working tree (git update-index --skip-worktree,
# then remove; restore after) so a call's tree + carry stays under 64 MiB. Then, back to back (the machine goes
# back 30 s after a call; /tmp survives while it is warm):
#   1 carry .carry/sgl1, 2 carry .carry/sgl2:  mkdir -p /tmp/sglwhl && cp .carry/sglK/*.whl /tmp/sglwhl/
#   3.. carry the last .carry/sglN (it holds `install`) + .carry/tok, DSPINE_GIT_SHA exported:
#   bash bench/experiments/sglang_scale_gpu.sh pre                 GPU kernel tests + bench/kernels.py at 4096 (VOCAB=151936: Qwen3's head) (-> /tmp/scale)
#   bash bench/experiments/sglang_scale_gpu.sh kernels             bench/kernels.py alone
#   bash bench/experiments/sglang_scale_gpu.sh SHAPE LIMIT ARGS..  bench/experiments/sglang_scale.py --shape SHAPE under LIMIT seconds, the
#                                                      ARGS added (e.g. --taus 2,3,4.8 --group 3 --profile 2 --out
#                                                      /tmp/scale/sglang_scale.json: a rerun skips what is measured)
# The first call of 3.. installs the wheels into /tmp/site and writes the plugin's entry-point record. JSON, MD and
# the servers' log tails come back in $OUT.
# FA3 (--attention-backend fa3; the carried sgl_kernel lacks flash_ops.abi3.so, 1.1 GB): here
#   bash bench/experiments/sglang_scale_gpu.sh fa3 MIB1 MIB2 ..  -> .carry/fa3p1 .. fa3pN: the .so zstd-compressed, split into
#                                                      parts of those MiB (the rest in the last part, with the
#                                                      zstandard wheel and the .so's sha256)
# and there, each part carried once (beside sgl1/sgl2 or alone): mkdir -p /tmp/fa3 && cp .carry/fa3pK/* /tmp/fa3/
# The first call of 3.. after all parts assembles the .so into /tmp/site/sgl_kernel.
set -uo pipefail
if [ "${1:-}" = tok ]; then
  rm -rf .carry/tok && mkdir -p .carry/tok
  if [ "${2:-}" = qwen3 ]; then  # Qwen3's real tokenizer: the shapes get its 151,936-row head (shape_scale.tokenizer_rows)
    cp ../shared/data/qwen3_tokenizer/tokenizer.json ../shared/data/qwen3_tokenizer/tokenizer_config.json .carry/tok/
    gzip -9 .carry/tok/tokenizer.json  # 11 MB -> 2.5: it fits beside the last SGLang folder (unpacked there)
  else
    tgt=$(python3 -c "from dspine.target import DEFAULT_TARGET, resolve_target_path; print(resolve_target_path(DEFAULT_TARGET))")
    for f in "$tgt"/tokenizer* "$tgt"/special_tokens* "$tgt"/vocab* "$tgt"/merges* "$tgt"/chat_template* "$tgt"/config.json; do
      [ -f "$f" ] && cp "$f" .carry/tok/
    done
  fi
  cp bench/results/kernels_qwen3-8b.json bench/results/kernels_qwen3-4b.json .carry/tok/
  ls .carry/tok
  exit 0
fi
if [ "${1:-}" = fa3 ]; then
  shift
  cache=${SGL_CACHE:-$HOME/.cache/device-carry-sglang}
  w=$(mktemp -d)
  unzip -q "$cache"/dl/sglang_kernel-0.4.5-*.whl sgl_kernel/flash_ops.abi3.so -d "$w"
  sha256sum "$w"/sgl_kernel/flash_ops.abi3.so | cut -d' ' -f1 > "$w/flash_ops.sha256"
  zstd -q -T0 -19 --long=27 -o "$w/fo.zst" "$w"/sgl_kernel/flash_ops.abi3.so
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 -d "$w" zstandard==0.25.0
  rm -rf .carry/fa3p*
  python3 -c "
import os, sys
w, sizes = sys.argv[1], [int(x) * 2**20 for x in sys.argv[2:]]
data, k = open(os.path.join(w, 'fo.zst'), 'rb').read(), 0
for i in range(len(sizes) + 1):
    part = data[k : k + sizes[i]] if i < len(sizes) else data[k:]
    k += len(part)
    os.makedirs(f'.carry/fa3p{i + 1}')
    open(f'.carry/fa3p{i + 1}/fo.zst.{i + 1:02d}', 'wb').write(part)
" "$w" "$@"
  last=$(ls -d .carry/fa3p* | sort -V | tail -1)
  cp "$w"/flash_ops.sha256 "$w"/zstandard-*.whl "$last"/
  rm -rf "$w"
  du -sm .carry/fa3p*
  exit 0
fi
if [ ! -f /tmp/site/.ok ]; then
  inst=$(ls .carry/sgl*/install 2> /dev/null | tail -1)  # the last SGLang folder (device-carry-sglang's split varies)
  [ -n "$inst" ] || { echo "no .carry/sglN/install came along: carry the last SGLang folder in this call" >&2; exit 3; }
  bash "$inst" && touch /tmp/site/.ok || exit 1
fi
so=/tmp/site/sgl_kernel/flash_ops.abi3.so
if [ -f /tmp/fa3/flash_ops.sha256 ] && [ ! -f $so ]; then
  if command -v zstd > /dev/null; then
    cat /tmp/fa3/fo.zst.* | zstd -q -d --long=27 -o $so.tmp
  else
    python3 -m pip install -q --no-index --no-deps --target /tmp/zst /tmp/fa3/zstandard-*.whl
    cat /tmp/fa3/fo.zst.* | PYTHONPATH=/tmp/zst python3 -c "import sys, zstandard
zstandard.ZstdDecompressor(max_window_size=2**27).copy_stream(sys.stdin.buffer, open('$so.tmp', 'wb'))"
  fi
  if [ "$(sha256sum $so.tmp | cut -d' ' -f1)" = "$(cat /tmp/fa3/flash_ops.sha256)" ]; then
    mv $so.tmp $so && echo "FA3: flash_ops.abi3.so assembled in /tmp/site/sgl_kernel"
  else
    echo "flash_ops.abi3.so: parts missing or damaged (was the machine given back between calls?)" >&2
    exit 3
  fi
fi
TOK=.carry/tok
if [ -f .carry/tok/tokenizer.json.gz ]; then
  mkdir -p /tmp/tok && cp .carry/tok/* /tmp/tok/ && gunzip -f /tmp/tok/tokenizer.json.gz && TOK=/tmp/tok
fi
D=/tmp/site/dspine_entry-0.1.dist-info
mkdir -p $D /tmp/scale "$OUT"
printf 'Metadata-Version: 2.1\nName: dspine-entry\nVersion: 0.1\n' > $D/METADATA
printf '[sglang.srt.plugins]\ndspine = dspine.sglang.plugin:register\n' > $D/entry_points.txt
if [ "$1" = pre ] || [ "$1" = kernels ]; then  # kernels: the bench alone, without the GPU kernel tests
  [ "$1" = pre ] && PYTHONPATH=$PWD timeout 150 python3 -m pytest -q -m gpu tests/test_kernels.py 2>&1 | tail -3
  PYTHONPATH=$PWD timeout 150 python3 bench/kernels.py --hidden 4096 --vocab ${VOCAB:-49152} --batches 1,4,16,32 --dtypes bfloat16 \
    --out /tmp/scale/kernels_qwen3-8b.json 2>&1 | tail -8
  cp /tmp/scale/kernels_*.json "$OUT"/
  exit 0
fi
shape=$1
limit=$2
shift 2
K=$TOK/kernels_$shape.json
[ -f /tmp/scale/kernels_$shape.json ] && K=/tmp/scale/kernels_$shape.json
export PYTHONPATH=/tmp/site:$PWD
[ -f /tmp/scale/summary.json ] || cp bench/results/summary.json /tmp/scale/summary.json
timeout "$limit" python3 bench/experiments/sglang_scale.py --shape "$shape" --tokenizer $TOK --work /tmp/scale \
  --no-progress --kernels "$K" --summary /tmp/scale/summary.json "$@"
echo "bench rc=$?"
mkdir -p "$OUT"/logs
cp /tmp/scale/*.json /tmp/scale/*.md "$OUT"/ 2>/dev/null
for f in /tmp/scale/logs/*.log; do  # '@' in a name does not come back
  [ -f "$f" ] && tail -c 200000 "$f" > "$OUT/logs/$(basename "$f" | tr '@' '_')"
done
ls -la "$OUT"
