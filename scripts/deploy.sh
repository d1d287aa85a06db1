#!/usr/bin/env bash
# End-to-end deployment of a RoPE attention block or a transformers model: export -> lower ->
# build the plugin -> build the TensorRT engine (where TensorRT and a GPU are present) -> check
# against PyTorch / transformers -> Triton model repository (-> onnxruntime-genai folder).
# Copy it and change the defaults; every step stops the script with a clear line if it fails.
#
#   scripts/deploy.sh [--preset NAME|FILE.toml | --hf MODEL_DIR] [--dtype fp32|fp16|bf16] [--out DIR] [--cache-len N]
#
# --hf MODEL_DIR: a transformers model folder (config.json and weights, as save_pretrained writes
# it); the whole causal LM is exported with its weights and checked against transformers.
# Outputs in DIR: model.onnx (custom op), model.<target>.onnx per lowering, model.engine (with
# TensorRT), report/ (check.json, check.md, error_vs_position.png per artefact), triton/ (a model
# repository: NAME on onnxruntime, NAME_trt on TensorRT when the engine was built), genai/ (--hf:
# the onnxruntime-genai folder).
set -euo pipefail

preset= hf= dtype=fp16 out=deploy cache_len=
while [ $# -gt 0 ]; do
  case "$1" in
    --preset) preset=$2; shift 2 ;;
    --hf) hf=$2; shift 2 ;;
    --dtype) dtype=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --cache-len) cache_len=$2; shift 2 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "deploy.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
if [ -n "$preset" ] && [ -n "$hf" ]; then
  echo "deploy.sh: give --preset or --hf, not both" >&2; exit 2
fi
if [ -n "$hf" ] && [ -n "$cache_len" ]; then
  # an export --hf file computes its caches up to the model's max_position_embeddings
  echo "deploy.sh: --cache-len is for --preset; a --hf model serves up to its max_position_embeddings" >&2; exit 2
fi
[ -n "$hf" ] || preset=${preset:-tiny}

rope=${ROPE_EXPORT:-rope-export}  # the CLI; set ROPE_EXPORT to use another install
python=${PYTHON:-python3}
step() { printf '\n==> %s\n' "$*"; }
fail() { printf 'deploy.sh: step "%s" failed; fix that and run again (earlier steps are kept in %s/)\n' "$1" "$out" >&2; exit 1; }

command -v "$rope" >/dev/null || { echo "deploy.sh: '$rope' not found; run 'make setup' and activate .venv, or set ROPE_EXPORT" >&2; exit 1; }
mkdir -p "$out/report"

# The Triton model name: the model folder's or the preset's name, in the characters Triton takes.
if [ -n "$hf" ]; then
  source_name=$(basename -- "${hf%/}")
  step "1/7 export the transformers model in $hf ($dtype, its weights) with one rotary node per rotated tensor"
  "$rope" export --hf "$hf" --weights "$hf" --dtype "$dtype" -o "$out/model.onnx" || fail export
else
  source_name=$(basename -- "${preset%.toml}")
  step "1/7 export $preset ($dtype) with one rotary node per rotated tensor"
  "$rope" export --preset "$preset" --dtype "$dtype" --decode ${cache_len:+--cache-len "$cache_len"} \
    -o "$out/model.onnx" || fail export
fi
name=$(printf '%s' "$source_name" | tr -c 'A-Za-z0-9_-' '_')

step "2/7 lower to every target"
for target in trt-plugin onnx ort decomposed; do
  "$rope" lower "$out/model.onnx" --target "$target" -o "$out/model.$target.onnx" || fail "lower --target $target"
done

step "3/7 build the plugin (CPU twin always; CUDA kernels, TensorRT glue and library where available)"
"$rope" build-plugin || fail build-plugin

step "4/7 build the TensorRT engine"
engine=
if "$python" -c "import tensorrt" 2>/dev/null && command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  "$rope" build "$out/model.trt-plugin.onnx" -o "$out/model.engine" || fail "build engine"
  engine=$out/model.engine
else
  echo "skipped: TensorRT or a GPU is not present on this machine; the trt-plugin file is checked with the CPU twin"
fi

if [ -n "$hf" ]; then
  step "5/7 check every artefact against transformers"
  reference=(--hf "$hf" --weights "$hf")
else
  step "5/7 check every artefact against PyTorch"
  reference=()
fi
for file in model.onnx model.trt-plugin.onnx model.onnx.onnx model.ort.onnx model.decomposed.onnx; do
  "$rope" check "$out/$file" ${reference[@]+"${reference[@]}"} --report "$out/report/${file%.onnx}" || fail "check $file"
done

step "6/7 write the Triton model repository $out/triton"
# onnxruntime serves the checked onnx lowering; TensorRT the engine (with the plugin library beside it)
"$rope" package triton "$out/model.onnx.onnx" -o "$out/triton" --backend onnxruntime --name "$name" --force \
  || fail "package triton"
if [ -n "$engine" ]; then
  "$rope" package triton "$out/model.trt-plugin.onnx" -o "$out/triton" --backend tensorrt --engine "$engine" \
    --name "${name}_trt" --force || fail "package triton --backend tensorrt"
else
  echo "no TensorRT model in the repository: no engine was built (step 4)"
fi

step "7/7 write the onnxruntime-genai folder $out/genai"
if [ -z "$hf" ]; then
  echo "skipped: onnxruntime-genai runs whole causal LMs (--hf), not one attention block"
else
  # exported again from the folder, with the attention_mask input genai feeds for padded batches
  "$rope" package genai --hf "$hf" --weights "$hf" -o "$out/genai" || fail "package genai"
fi

step "done: artefacts, reports and the Triton repository in $out/"
