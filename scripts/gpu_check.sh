#!/usr/bin/env bash
# The GPU check, for a bare GPU machine (an H100/H200 with CUDA 13 nvcc, CMake, ninja,
# compute-sanitizer, PyTorch with CUDA, numpy, onnx, onnxruntime, onnxscript, pytest; no network,
# no TensorRT, polygraphy or rich needed). Run from a checkout, with the Python that has torch:
#
#   scripts/gpu_check.sh [--out DIR] [--archs "90"] [--build-dir DIR | --prebuilt DIR] [--quick]
#                        [--no-sanitizer] [--no-bench] [--python PY]
#
# Steps: build the CUDA library and its sanitizer sweep (CMake; the device's own architecture unless
# --archs; --prebuilt: use a build folder that has them), run the GPU tests
# (tests/kernels/test_gpu_kernels.py, marker gpu, and tests/kernels/test_gpu_binding.py), the compute-sanitizer memcheck sweep, and the GPU
# benchmark (python -m rope_export.bench.gpu). Writes DIR/gpu_check.json and DIR/gpu_check.md
# (steps, times, results; the benchmark's own gpu_bench.json/.md beside them). Without a CUDA device
# it builds, collects the GPU tests and stops there (exit 3): a dry run.
# Exit status: 0 all steps passed, 1 a step failed, 2 bad arguments, 3 no CUDA device.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; }
out=out/gpu_check
archs=""
build_dir=build/gpu-check
bench_mode=full
sanitizer=1
bench=1
prebuilt=0
python=${PYTHON:-python3}
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) out=${2:?--out needs a folder}; shift 2 ;;
    --archs) archs=${2:?--archs needs SM numbers such as 90}; shift 2 ;;
    --build-dir) build_dir=${2:?--build-dir needs a folder}; shift 2 ;;
    --prebuilt) build_dir=${2:?--prebuilt needs a build folder}; prebuilt=1; shift 2 ;;
    --python) python=${2:?--python needs an interpreter}; shift 2 ;;
    --quick) bench_mode=quick; shift ;;
    --no-sanitizer) sanitizer=0; shift ;;
    --no-bench) bench=0; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
if [[ -n "$archs" && ! "$archs" =~ ^[0-9]+([,\;][0-9]+)*$ ]]; then
  echo "gpu_check.sh: --archs '$archs': give SM numbers such as 90 or 80,90" >&2; exit 2
fi
command -v "$python" >/dev/null || { echo "gpu_check.sh: no Python '$python' (use --python)" >&2; exit 2; }
if [[ $prebuilt == 1 ]]; then
  [[ -f "$build_dir/librope_export_cuda.so" ]] || {
    echo "gpu_check.sh: --prebuilt $build_dir has no librope_export_cuda.so; build it or drop --prebuilt" >&2; exit 2; }
else
  for tool in cmake nvcc; do
    command -v "$tool" >/dev/null || { echo "gpu_check.sh: $tool not found on PATH; the CUDA library needs it" >&2; exit 2; }
  done
fi
mkdir -p "$out" "$build_dir" || exit 2
out=$(cd "$out" && pwd)
build_dir=$(cd "$build_dir" && pwd)
steps="$out/steps.tsv"
: > "$steps"
started=$(date +%s)

# step NAME COMMAND...: runs it, logs to $out/NAME.log, records status and seconds.
step() {
  local name=$1; shift
  local t0=$(date +%s)
  echo "== $name: $*"
  "$@" > "$out/$name.log" 2>&1
  local rc=$?
  local secs=$(( $(date +%s) - t0 ))
  printf '%s\t%s\t%s\n' "$name" "$rc" "$secs" >> "$steps"
  tail -n 3 "$out/$name.log"
  echo "   -> exit $rc in ${secs}s (log: $out/$name.log)"
  return $rc
}

# One report from the steps' table and logs (JSON + Markdown), written atomically.
report() {
  local device=$1
  "$python" - "$out" "$device" "$(( $(date +%s) - started ))" <<'EOF'
import json, os, sys, tempfile
out, device, total = sys.argv[1], sys.argv[2], int(sys.argv[3])
steps = []
for line in open(os.path.join(out, "steps.tsv")):
    name, rc, secs = line.rstrip("\n").split("\t")
    log = open(os.path.join(out, f"{name}.log"), errors="replace").read().strip().splitlines()
    steps.append({"step": name, "exit": int(rc), "seconds": int(secs), "tail": log[-5:]})
bench = os.path.join(out, "gpu_bench.json")
result = {"device": device, "total_seconds": total, "steps": steps,
          "status": "no-device" if device == "none" else ("passed" if all(s["exit"] == 0 for s in steps) else "failed"),
          "benchmark": json.load(open(bench)) if os.path.isfile(bench) else None}
md = [f"# GPU check: {result['status']}", "", f"Device: {device}. Total {total} s.", "",
      "| step | exit | seconds | last line |", "|---|---:|---:|---|"]
md += [f"| {s['step']} | {s['exit']} | {s['seconds']} | {(s['tail'] or [''])[-1].replace('|', '/')} |" for s in steps]
if device == "none":
    md += ["", "No CUDA device: the GPU tests, the sanitizer sweep and the benchmark did not run. No GPU figure."]
bench_md = os.path.join(out, "gpu_bench.md")
if os.path.isfile(bench_md):
    md += ["", open(bench_md).read()]
for name, text in (("gpu_check.json", json.dumps(result, indent=2) + "\n"), ("gpu_check.md", "\n".join(md) + "\n")):
    fd, tmp = tempfile.mkstemp(dir=out, prefix=f".{name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(out, name))
print(f"wrote {out}/gpu_check.json and {out}/gpu_check.md: {result['status']}")
EOF
}

# The device (torch decides, as the tests and the benchmark will), and its architecture.
device=$("$python" -c "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'none')" 2>/dev/null || echo none)
if [[ -z "$archs" ]]; then
  if [[ "$device" != none ]]; then
    archs=$("$python" -c "import torch; print('%d%d' % torch.cuda.get_device_capability())")
  else
    archs=$("$python" -c "import sys; sys.path.insert(0, '.'); from rope_export.kernels.libraries import CUDA_ARCHS; print(';'.join(map(str, CUDA_ARCHS)))")
  fi
fi
archs=${archs//,/;}
[[ $prebuilt == 1 ]] && archs="(prebuilt: $(cat "$build_dir/rope_cuda_archs.h" 2>/dev/null | grep -o '"[0-9,]*"'))"
echo "gpu_check: device: $device; kernels for sm $archs; output in $out"

generator=()
command -v ninja >/dev/null && [[ ! -f "$build_dir/CMakeCache.txt" ]] && generator=(-G Ninja)
failed=0
if [[ $prebuilt == 0 ]]; then
  step configure cmake -S plugins -B "$build_dir" "${generator[@]}" -DROPE_EXPORT_CUDA_ARCHS="$archs" \
    -DROPE_EXPORT_SANITIZE=OFF -DROPE_EXPORT_WERROR=ON -DROPE_EXPORT_NVCC_THREADS=0 -DTENSORRT_INCLUDE_DIR= || failed=1
  [[ $failed == 0 ]] && { step build cmake --build "$build_dir" -j "$(nproc)" || failed=1; }
fi
[[ -f "$build_dir/librope_export_cuda.so" ]] || { echo "gpu_check: librope_export_cuda.so was not built" >&2; failed=1; }
export ROPE_EXPORT_PLUGIN_DIR="$build_dir" PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
# --noconftest and no plugin autoload: the suite's conftest wants hypothesis, which a bare GPU machine
# may lack, and whatever plugins it has are not needed.
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
pytest_args=(--noconftest -p no:cacheprovider tests/kernels/test_gpu_kernels.py tests/kernels/test_gpu_binding.py)
[[ $failed == 0 ]] && { step collect "$python" -m pytest --collect-only -q "${pytest_args[@]}" || failed=1; }

if [[ "$device" == none ]]; then
  echo "gpu_check: no CUDA device visible to PyTorch: built and collected; the GPU tests, the sanitizer sweep and the benchmark need one (dry run ends here)"
  report none
  exit 3
fi
# The sanitizer sweep runs once, as its own step below, not again inside pytest.
[[ $failed == 0 ]] && { step gpu_tests "$python" -m pytest -q -rs "${pytest_args[@]}" -k "not compute_sanitizer" \
  --junitxml="$out/gpu_tests.xml" || failed=1; }
if [[ $sanitizer == 1 ]]; then
  if command -v compute-sanitizer >/dev/null; then
    step sanitizer compute-sanitizer --tool memcheck --error-exitcode 1 --print-limit 100 \
      "$build_dir/rope_export_cuda_sanitize" || failed=1
  else
    printf 'sanitizer\t1\t0\n' >> "$steps"; echo "compute-sanitizer not found on PATH" > "$out/sanitizer.log"; failed=1
  fi
fi
if [[ $bench == 1 ]]; then
  step bench "$python" -m rope_export.bench.gpu --out "$out" $([[ $bench_mode == quick ]] && echo --quick) || failed=1
fi
report "$device"
exit $failed
