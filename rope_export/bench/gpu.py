"""Section 4: RoPE alone on a GPU (runs only where one is present; NOT YET MEASURED anywhere).

Written for a machine with an NVIDIA GPU, a CUDA build of PyTorch, ``tensorrt`` (10.x/11.x) and
``onnxruntime-gpu``; every one of them is imported here, lazily, and each runner that cannot run
is listed as skipped with its reason. No figure of this section has been measured yet: the
machines this project is built on have no GPU. Without a GPU the section reports ``skipped``
with the reason, never zeros.

Runners, each rotating q and k of the same case as the CPU section, in interleaved rounds, timed
with CUDA events on PyTorch's current stream (onnxruntime is given that stream as its compute
stream; TensorRT enqueues on it):

* ``trt_plugin``: TensorRT engine of the ``trt-plugin`` lowering with our plugin library;
* ``trt_native`` / ``trt_native_trusted``: TensorRT's own RotaryEmbedding (TensorRT >= 10.15),
  from the ``onnx`` lowering, with and without the in-graph position guard;
* ``trt_decomposed``: TensorRT engine of the plain torch.onnx export (the baseline);
* ``ort_cuda_onnx`` / ``ort_cuda_decomposed``: onnxruntime's CUDA execution provider;
* ``torch_eager``: the rotate-half in torch ops on the GPU;
* ``copy``: a device-to-device copy of the same bytes (torch ``copy_``).

Achieved bandwidth = bytes / median time (bytes as in the CPU section); fraction of the device's
memory bandwidth = achieved / peak, peak = 2 x memory clock x bus width (PyTorch's device
properties, else NVML) when known. On paper RoPE is memory-bound; the best published standalone
kernel reaches about 81% of H100 HBM bandwidth.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from rope_export.bench.rope_alone import (
    RopeCase,
    copy_of,
    cross_check_tolerance,
    full_width_tables,
    make_inputs,
    rope_models,
    torch_rotate_half,
)
from rope_export.bench.timing import interleaved, ratio

BASELINE = "trt_decomposed"
NATIVE_ROTARY_TRT = (10, 15)  # first TensorRT with the ONNX RotaryEmbedding-23 importer
LABELS = {
    "trt_plugin": "TensorRT + rope_export plugin",
    "trt_native": "TensorRT RotaryEmbedding (onnx lowering, positions guarded)",
    "trt_native_trusted": "TensorRT RotaryEmbedding (onnx lowering, trusted positions)",
    "trt_decomposed": "TensorRT, plain torch.onnx export (baseline)",
    "ort_cuda_onnx": "onnxruntime CUDA, onnx lowering",
    "ort_cuda_decomposed": "onnxruntime CUDA, plain torch.onnx export",
    "torch_eager": "PyTorch eager (rotate-half, CUDA)",
    "copy": "device copy of the same bytes (torch copy_)",
}


def unavailable_reason() -> str | None:
    """Why there is no GPU section here, or None when a CUDA device is usable from PyTorch."""
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    if torch.version.cuda is None:
        from rope_export.trt import _cuda_device_problem

        device = _cuda_device_problem() or "a CUDA GPU is present"
        return f"torch {torch.__version__} is a CPU build (no CUDA); {device}"
    if not torch.cuda.is_available():
        return "PyTorch sees no CUDA device"
    return None


def cuda_event_clock(fn: Callable[[], object], inner: int) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(inner):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def peak_bandwidth(device: int = 0) -> tuple[float | None, str]:
    """Theoretical DRAM bandwidth in bytes/s (2 x memory clock x bus width) and where it came from."""
    import torch

    props = torch.cuda.get_device_properties(device)
    clock_khz, width = getattr(props, "memory_clock_rate", None), getattr(props, "memory_bus_width", None)
    if clock_khz and width:
        return 2 * clock_khz * 1e3 * width / 8, "2 x memory_clock_rate x memory_bus_width (torch device properties)"
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device)
        clock_mhz = pynvml.nvmlDeviceGetMaxClockInfo(handle, pynvml.NVML_CLOCK_MEM)
        width = pynvml.nvmlDeviceGetMemoryBusWidth(handle)
        return 2 * clock_mhz * 1e6 * width / 8, "2 x max memory clock x bus width (NVML)"
    except Exception as exc:  # noqa: BLE001 - any NVML problem just means "unknown"
        return None, f"unknown (no memory clock/bus width from torch; NVML: {exc})"


def _trt_version() -> tuple[int, int] | None:
    try:
        import tensorrt
    except ImportError:
        return None
    major, minor = (int(p) for p in tensorrt.__version__.split(".")[:2])
    return major, minor


class _TrtRunner:
    """One engine, two execution contexts (q's and k's shapes set once), enqueued on torch's stream."""

    def __init__(self, model, plugins: list[str], tensors: list[tuple], workdir: Path, name: str):
        from rope_export.export import save_model
        from rope_export.trt import build_engine, load_engine

        onnx_path = workdir / f"{name}.onnx"
        save_model(model, onnx_path)
        (x_q, pos, _), (x_k, _, _) = tensors
        lo, hi = tuple(x_k.shape), tuple(x_q.shape)
        shapes = {"x": (lo, hi, hi), "position_ids": (tuple(pos.shape),) * 3}
        engine_path = build_engine(onnx_path, workdir / f"{name}.engine", plugins, shapes)
        self.engine = load_engine(engine_path, plugins)
        self.contexts = []
        for x, p, out in tensors:
            context = self.engine.create_execution_context()
            context.set_input_shape("x", tuple(x.shape))
            context.set_input_shape("position_ids", tuple(p.shape))
            for tensor_name, t in (("x", x), ("position_ids", p), ("y", out)):
                context.set_tensor_address(tensor_name, t.data_ptr())
            self.contexts.append(context)

    def __call__(self):
        import torch

        stream = torch.cuda.current_stream().cuda_stream
        for context in self.contexts:
            context.execute_async_v3(stream)


def _ort_cuda_runner(model, tensors: list[tuple]):
    import numpy as np
    import onnxruntime as ort
    import torch

    options = ort.SessionOptions()
    options.log_severity_level = 3
    stream = torch.cuda.current_stream().cuda_stream
    provider = ("CUDAExecutionProvider", {"device_id": torch.cuda.current_device(), "user_compute_stream": str(stream)})
    session = ort.InferenceSession(model.SerializeToString(), options, providers=[provider])
    np_type = {torch.float32: np.float32, torch.float16: np.float16}
    bindings = []
    for x, p, out in tensors:
        b = session.io_binding()
        b.bind_input("x", "cuda", 0, np_type[x.dtype], list(x.shape), x.data_ptr())
        b.bind_input("position_ids", "cuda", 0, np.int64, list(p.shape), p.data_ptr())
        b.bind_output("y", "cuda", 0, np_type[out.dtype], list(out.shape), out.data_ptr())
        bindings.append(b)

    def run():
        for b in bindings:
            session.run_with_iobinding(b)

    return run


def measure_case(case: RopeCase, rounds: int, say: Callable[[str], None], peak: float | None) -> dict:
    import onnxruntime as ort
    import torch

    from rope_export.passes import fuse, lower
    from rope_export.trt import default_plugin_library, tensorrt_unavailable_reason

    say(f"GPU {case.phase} {case.dtype}: models and device tensors")
    models = rope_models(case)
    inputs = make_inputs(case)
    dev = torch.device("cuda")
    xq, xk = (torch.from_numpy(a).to(dev) for a in (inputs.x_q, inputs.x_k))
    pos = torch.from_numpy(inputs.position_ids).to(dev)
    cos_full, sin_full = (t.to(dev) for t in full_width_tables(inputs))
    nbytes = inputs.rope_bytes()

    outs: dict[str, list] = {}

    def io(vid: str):  # each runner writes its own outputs, kept for the cross-check
        pairs = [(xq, pos, torch.empty_like(xq)), (xk, pos, torch.empty_like(xk))]
        outs[vid] = [o for _, _, o in pairs]
        return pairs

    runners: dict[str, Callable[[], object]] = {}
    skipped: dict[str, str] = {}
    runners["torch_eager"] = lambda: (torch_rotate_half(xq, cos_full, sin_full, pos),
                                      torch_rotate_half(xk, cos_full, sin_full, pos))
    runners["copy"] = copy_of(nbytes, (xq.numel(), xk.numel()), device=dev)

    if "CUDAExecutionProvider" in ort.get_available_providers():
        runners["ort_cuda_onnx"] = _ort_cuda_runner(models["fused -> onnx"], io("ort_cuda_onnx"))
        runners["ort_cuda_decomposed"] = _ort_cuda_runner(models["decomposed (original)"], io("ort_cuda_decomposed"))
    else:
        skipped["ort_cuda_onnx"] = skipped["ort_cuda_decomposed"] = "onnxruntime has no CUDAExecutionProvider " \
                                                                     "(install onnxruntime-gpu)"
    trt_reason = tensorrt_unavailable_reason()
    with tempfile.TemporaryDirectory(prefix="rope-bench-trt-") as tmp:
        work = Path(tmp)
        if trt_reason:
            for vid in ("trt_plugin", "trt_native", "trt_native_trusted", "trt_decomposed"):
                skipped[vid] = trt_reason
        else:
            say(f"GPU {case.phase} {case.dtype}: building TensorRT engines")
            fused = fuse(models["decomposed (original)"])  # one rope_export::RotaryEmbedding node
            plans = {"trt_decomposed": (models["decomposed (original)"], [])}
            plugin = default_plugin_library()
            if plugin.is_file():
                plans["trt_plugin"] = (lower(fused, "trt-plugin"), [str(plugin)])
            else:
                skipped["trt_plugin"] = f"{plugin} not built (rope-export build-plugin with TensorRT headers and libs)"
            version = _trt_version()
            if version and version >= NATIVE_ROTARY_TRT:
                plans["trt_native"] = (models["fused -> onnx"], [])
                plans["trt_native_trusted"] = (models["fused -> onnx, trusted positions"], [])
            else:
                skipped["trt_native"] = skipped["trt_native_trusted"] = (
                    f"TensorRT {version} has no RotaryEmbedding importer (needs >= 10.15)")
            for vid, (model, plugins) in plans.items():
                try:
                    runners[vid] = _TrtRunner(model, plugins, io(vid), work, vid)
                except Exception as exc:  # noqa: BLE001 - one engine failing must not hide the others
                    skipped[vid] = f"engine build failed: {str(exc).splitlines()[0][:300]}"
        say(f"GPU {case.phase} {case.dtype}: timing {len(runners)} runners with CUDA events, {rounds} rounds")
        timings = interleaved(runners, rounds, target_s=0.002, warmup=3, clock=cuda_event_clock)
    torch.cuda.synchronize()
    expected = [torch_rotate_half(x.float(), cos_full.float(), sin_full.float(), pos).cpu().numpy() for x in (xq, xk)]
    tol = cross_check_tolerance(case.dtype)
    base = timings[BASELINE].median_s if BASELINE in timings else None
    copy = timings["copy"].median_s
    variants = {}
    for vid, timing in timings.items():
        achieved = nbytes / timing.median_s
        variants[vid] = {
            "label": LABELS[vid],
            **timing.to_dict(),
            "gb_per_s": achieved / 1e9,
            "fraction_of_peak_bandwidth": ratio(achieved, peak),
            "speedup_vs_trt_decomposed": ratio(base, timing.median_s),
            "fraction_of_copy": ratio(copy, timing.median_s),
        }
        if vid in outs:
            got = [o.float().cpu().numpy() for o in outs[vid]]
            variants[vid]["agrees"] = all(tol.allclose(g, e) for g, e in zip(got, expected, strict=True))
    for vid, why in skipped.items():
        variants[vid] = {"label": LABELS[vid], "skipped": why}
    return {"case": asdict(case), "shape": case.shape_text(), "bytes": nbytes, "baseline": BASELINE,
            "variants": variants}


def run_section(cases: list[RopeCase], rounds: dict[str, int], say: Callable[[str], None]) -> dict:
    reason = unavailable_reason()
    if reason:
        return {"status": "skipped", "measured": False, "reason": reason,
                "title": "GPU: TensorRT plugin, TensorRT RotaryEmbedding, onnxruntime CUDA, PyTorch eager"}
    import torch

    peak, peak_source = peak_bandwidth()
    return {
        "status": "measured",
        "measured": True,
        "title": "GPU: TensorRT plugin, TensorRT RotaryEmbedding, onnxruntime CUDA, PyTorch eager",
        "device": torch.cuda.get_device_name(),
        "peak_bandwidth_gb_per_s": None if peak is None else peak / 1e9,
        "peak_bandwidth_source": peak_source,
        "timing": "CUDA events on torch's current stream, interleaved rounds, medians",
        "cases": [measure_case(case, rounds[case.phase], say, peak) for case in cases],
    }
