#!/usr/bin/env bash
# End-to-end deployment of a RoPE attention block: export -> lower -> build the plugin ->
# build the TensorRT engine (where TensorRT and a GPU are present) -> check against PyTorch.
# Copy it and change the defaults; every step stops the script with a clear line if it fails.
#
#   scripts/deploy.sh [--preset NAME|FILE.toml] [--dtype fp32|fp16|bf16] [--out DIR] [--cache-len N]
#
# Outputs in DIR: model.onnx (custom op), model.<target>.onnx per lowering, model.engine (with
# TensorRT), report/ (check.json, check.md, error_vs_position.png per artefact).
set -euo pipefail

preset=tiny dtype=fp16 out=deploy cache_len=
while [ $# -gt 0 ]; do
  case "$1" in
    --preset) preset=$2; shift 2 ;;
    --dtype) dtype=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --cache-len) cache_len=$2; shift 2 ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "deploy.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

rope=${ROPE_EXPORT:-rope-export}  # the CLI; set ROPE_EXPORT to use another install
python=${PYTHON:-python3}
step() { printf '\n==> %s\n' "$*"; }
fail() { printf 'deploy.sh: step "%s" failed; fix that and run again (earlier steps are kept in %s/)\n' "$1" "$out" >&2; exit 1; }

command -v "$rope" >/dev/null || { echo "deploy.sh: '$rope' not found; run 'make setup' and activate .venv, or set ROPE_EXPORT" >&2; exit 1; }
mkdir -p "$out/report"

step "1/5 export $preset ($dtype) with one rotary node per rotated tensor"
"$rope" export --preset "$preset" --dtype "$dtype" --decode ${cache_len:+--cache-len "$cache_len"} \
  -o "$out/model.onnx" || fail export

step "2/5 lower to every target"
for target in trt-plugin onnx ort decomposed; do
  "$rope" lower "$out/model.onnx" --target "$target" -o "$out/model.$target.onnx" || fail "lower --target $target"
done

step "3/5 build the plugin (CPU twin always; CUDA kernels, TensorRT glue and library where available)"
"$rope" build-plugin || fail build-plugin

step "4/5 build the TensorRT engine"
if "$python" -c "import tensorrt" 2>/dev/null && command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  "$rope" build "$out/model.trt-plugin.onnx" -o "$out/model.engine" || fail "build engine"
else
  echo "skipped: TensorRT or a GPU is not present on this machine; the trt-plugin file is checked with the CPU twin"
fi

step "5/5 check every artefact against PyTorch"
for file in model.onnx model.trt-plugin.onnx model.onnx.onnx model.ort.onnx model.decomposed.onnx; do
  name=${file%.onnx}
  "$rope" check "$out/$file" --report "$out/report/$name" || fail "check $file"
done

step "done: artefacts and reports in $out/"
