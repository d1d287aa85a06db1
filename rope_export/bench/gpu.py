"""Section 4: RoPE alone on a GPU. NOT YET MEASURED anywhere: no GPU was lent to the sessions that
wrote it; without a GPU the section reports ``skipped`` with the reason, never zeros.

Cases (issue 17): prefill B=1 S=4096 and decode B=64 S=1, q 32 heads and k 8 heads of 128, fp16 and
bf16 X with float32 caches. Runners (rope_export.bench.gpu_kernels, .gpu_onnx): the plugin's kernels
through librope_export_cuda.so (one launch per tensor, q+k in one launch, and for decode that launch
replayed from a CUDA graph beside an empty kernel launch), PyTorch eager and torch.compile, FlashInfer
when it imports, onnxruntime's CUDA provider and TensorRT when installed, and a device copy of the
same bytes. Every runner is first checked against rope_export.op.reference on the same tensors, then
all are timed with CUDA events on PyTorch's current stream in interleaved rounds; a figure is a
median. Achieved bandwidth = bytes / median (read and write q and k, read each token's cos/sin row
once); fraction of peak = achieved / (2 x memory clock x bus width of the device).

Targets (reported, never asserted): prefill q+k launch >= 85% of peak and at least as fast as
FlashInfer; decode q+k within 2x of an empty kernel launch; 0 sanitizer errors (scripts/gpu_check.sh).

Also a program for a bare GPU machine (torch, numpy, onnx only; no polygraphy, rich or TensorRT):
    python -m rope_export.bench.gpu --out DIR [--quick | --smoke]   -> DIR/gpu_bench.json, .md
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Callable
from dataclasses import asdict

from rope_export.bench import gpu_kernels, gpu_onnx
from rope_export.bench.gpu_kernels import GpuCase
from rope_export.bench.timing import interleaved, ratio

TITLE = "GPU: the plugin's kernels (no TensorRT needed) beside PyTorch, FlashInfer, onnxruntime CUDA, TensorRT"
LABELS = {**gpu_kernels.LABELS, **gpu_onnx.LABELS}
BASELINE = "torch_eager"
PREFILL = dict(batch=1, seq=4096, q_heads=32, kv_heads=8, head_dim=128)
DECODE = dict(batch=64, seq=1, q_heads=32, kv_heads=8, head_dim=128)
CASES = {
    mode: [GpuCase(phase, **shape, dtype=dtype) for phase, shape in (("prefill", PREFILL), ("decode", DECODE))
           for dtype in ("float16", "bfloat16")]
    for mode in ("full", "quick")
}
CASES["smoke"] = [GpuCase("prefill", 1, 64, 4, 2, 64, "float16"), GpuCase("decode", 4, 1, 4, 2, 64, "bfloat16")]
ROUNDS = {"full": 41, "quick": 15, "smoke": 3}
TARGETS = {"prefill_fraction_of_peak": 0.85, "decode_vs_empty_launch": 2.0}


def unavailable_reason() -> str | None:
    """Why there is no GPU section here, or None when the kernels can run on a CUDA device."""
    try:
        from rope_export.kernels import cuda
    except ImportError as exc:
        return f"the CUDA binding does not import: {exc}"
    return cuda.unavailable_reason()


def cuda_event_clock(fn: Callable[[], object], inner: int) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(inner):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def peak_bandwidth() -> tuple[float | None, str]:
    """Theoretical DRAM bandwidth in bytes/s and where it came from."""
    from rope_export.kernels import cuda

    peak = cuda.device_info().peak_bandwidth
    if peak:
        return peak, "2 x memory clock x bus width (cudaDeviceGetAttribute)"
    return None, "unknown: the device reports no memory clock or bus width"


def _agrees(result, expected, dtype: str) -> bool:
    from rope_export.op.tolerances import tolerance

    tol = tolerance("block", dtype)  # other implementations round in X's dtype at other steps
    return all(tol.allclose(r.float().cpu().numpy(), e.float().cpu().numpy()) for r, e in zip(result, expected,
                                                                                             strict=True))


def measure_case(case: GpuCase, rounds: int, say: Callable[[str], None], peak: float | None) -> dict:
    import torch

    say(f"GPU {case.phase} {case.dtype}: tensors and runners ({case.shape_text()})")
    t = gpu_kernels.make_tensors(case)
    expected = gpu_kernels.reference_outputs(case, t)
    run, skipped, notes = gpu_kernels.runners(case, t)
    agrees: dict[str, bool] = {}
    with gpu_onnx.workdir() as tmp:
        from pathlib import Path

        more, more_skipped = gpu_onnx.runners(case, t, Path(tmp), say)
        skipped.update(more_skipped)
        for vid, fn in list(run.items()) + list(more.items()):  # the ONNX runners share t.q_out/t.k_out
            try:
                result = fn()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - a failing runner is reported, the others still run
                skipped[vid] = f"failed: {str(exc).splitlines()[0][:200]}"
                run.pop(vid, None)
                continue
            if result is not None:
                agrees[vid] = _agrees(result, expected, case.dtype)
            run[vid] = fn
        say(f"GPU {case.phase} {case.dtype}: timing {len(run)} runners with CUDA events, {rounds} interleaved rounds")
        timings = interleaved(run, rounds, target_s=0.002, warmup=3, clock=cuda_event_clock)
    nbytes = case.rope_bytes()
    base = timings[BASELINE].median_s if BASELINE in timings else None
    copy = timings["copy"].median_s if "copy" in timings else None
    variants = {}
    for vid, timing in timings.items():
        achieved = nbytes / timing.median_s
        variants[vid] = {"label": LABELS[vid], **timing.to_dict(), "gb_per_s": achieved / 1e9,
                         "fraction_of_peak_bandwidth": ratio(achieved, peak),
                         "speedup_vs_torch_eager": ratio(base, timing.median_s),
                         "fraction_of_copy": ratio(copy, timing.median_s)}
        if vid in agrees:
            variants[vid]["agrees"] = agrees[vid]
    for vid, why in skipped.items():
        variants[vid] = {"label": LABELS[vid], "skipped": why}
    return {"case": asdict(case), "shape": case.shape_text(), "bytes": nbytes, "baseline": BASELINE,
            "notes": notes, "variants": variants}


def goals(cases: list[dict]) -> list[dict]:
    """Issue 17's targets as measured in this run (reported, not asserted)."""
    out = []
    for c in cases:
        v, label = c["variants"], f"{c['case']['phase']} {c['case']['dtype']}"
        ours = v.get("ours_qk", {})
        if c["case"]["phase"] == "prefill" and "median_ms" in ours:
            frac = ours.get("fraction_of_peak_bandwidth")
            out.append({"goal": f"{label}: q+k launch >= {TARGETS['prefill_fraction_of_peak']:.0%} of peak HBM",
                        "value": frac, "met": frac is not None and frac >= TARGETS["prefill_fraction_of_peak"]})
            flashinfer = [v[k]["median_ms"] for k in ("flashinfer_cos_sin_cache", "flashinfer_pos_ids")
                          if "median_ms" in v.get(k, {})]
            if flashinfer:
                best = min(flashinfer)
                out.append({"goal": f"{label}: q+k launch at least as fast as FlashInfer (its time / ours)",
                            "value": best / ours["median_ms"], "met": ours["median_ms"] <= best})
        if c["case"]["phase"] == "decode" and "median_ms" in ours and "median_ms" in v.get("empty_launch", {}):
            r = ours["median_ms"] / v["empty_launch"]["median_ms"]
            out.append({"goal": f"{label}: q+k launch within {TARGETS['decode_vs_empty_launch']:.0f}x of an empty "
                                "kernel launch", "value": r, "met": r <= TARGETS["decode_vs_empty_launch"]})
    return out


def run_section(mode: str, say: Callable[[str], None], rounds: int | None = None) -> dict:
    reason = unavailable_reason()
    if reason:
        return {"status": "skipped", "measured": False, "reason": reason, "title": TITLE}
    import torch

    from rope_export.kernels import cuda

    peak, peak_source = peak_bandwidth()
    info = cuda.device_info()
    cases = [measure_case(case, rounds or ROUNDS[mode], say, peak) for case in CASES[mode]]
    return {
        "status": "measured", "measured": True, "title": TITLE, "device": info.name,
        "capability": f"sm_{info.capability[0]}{info.capability[1]}", "driver": _driver_version(),
        "torch": torch.__version__, "cuda_runtime_of_torch": torch.version.cuda,
        "peak_bandwidth_gb_per_s": None if peak is None else peak / 1e9, "peak_bandwidth_source": peak_source,
        "timing": "CUDA events on torch's current stream, interleaved rounds, medians",
        "cases": cases, "goals": goals(cases),
    }


def _driver_version() -> str | None:
    import ctypes

    try:
        version = ctypes.c_int(0)
        ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version))
        return f"{version.value // 1000}.{version.value % 1000 // 10}"
    except OSError:
        return None


# --- reports -----------------------------------------------------------------------------------------

COLUMNS = ("case", "runner", "median ms", "GB/s", "of peak", "vs eager", "of copy", "agrees")


def rows(section: dict) -> list[tuple[str, ...]]:
    """One row per case and runner, formatted (shared by the Markdown and the console table)."""
    def fmt(x, spec):
        return "-" if x is None else format(x, spec)

    out = []
    for c in section.get("cases", []):
        case = f"{c['case']['phase']} {c['case']['dtype']}"
        for v in c["variants"].values():
            if "skipped" in v:
                out.append((case, v["label"], f"skipped: {v['skipped']}", "", "", "", "", ""))
            else:
                out.append((case, v["label"], fmt(v["median_ms"], ".4f"), fmt(v["gb_per_s"], ".0f"),
                            fmt(v["fraction_of_peak_bandwidth"], ".0%"), fmt(v["speedup_vs_torch_eager"], ".2f") + "x",
                            fmt(v["fraction_of_copy"], ".2f"), {True: "yes", False: "NO"}.get(v.get("agrees"), "")))
    return out


def markdown(section: dict) -> list[str]:
    if section.get("status") != "measured":
        return [f"Skipped: {section.get('reason')}. No GPU figure has been measured.", ""]
    lines = [f"{section['device']} ({section['capability']}, driver {section['driver']}), peak "
             f"{section['peak_bandwidth_gb_per_s']:.0f} GB/s ({section['peak_bandwidth_source']}); torch "
             f"{section['torch']}. {section['timing']}.", "",
             "| " + " | ".join(COLUMNS) + " |", "|---|---|" + "---:|" * (len(COLUMNS) - 2)]
    lines += ["| " + " | ".join(r) + " |" for r in rows(section)]
    lines += ["", "| goal | value | met |", "|---|---:|---|"]
    lines += [f"| {g['goal']} | {g['value']:.2f} | {'yes' if g['met'] else 'no'} |" for g in section["goals"]]
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    from rope_export.common.fileio import atomic_write_text

    p = argparse.ArgumentParser(prog="python -m rope_export.bench.gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for gpu_bench.json and gpu_bench.md")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help=f"{ROUNDS['quick']} rounds instead of {ROUNDS['full']}")
    size.add_argument("--smoke", action="store_true", help="toy shapes, 3 rounds: checks the harness only")
    p.add_argument("--rounds", type=int, help="interleaved rounds (default by mode)")
    args = p.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        p.error(f"--rounds {args.rounds}: give 1 or more")
    from pathlib import Path

    out = Path(args.out)
    if not out.is_dir():
        p.error(f"--out {out}: no such folder; create it first")
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    section = run_section(mode, lambda m: print(m, flush=True), args.rounds)
    result = {"mode": mode, "python": platform.python_version(), "gpu": section}
    atomic_write_text(out / "gpu_bench.json", json.dumps(result, indent=2) + "\n")
    atomic_write_text(out / "gpu_bench.md", "\n".join(["# GPU benchmark", ""] + markdown(section)) + "\n")
    print(f"wrote {out / 'gpu_bench.json'} and {out / 'gpu_bench.md'}")
    if section["status"] != "measured":
        print(f"no GPU figures: {section['reason']}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
