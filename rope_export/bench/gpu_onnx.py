"""The GPU benchmark's ONNX runtimes, each where installed: onnxruntime's CUDA execution provider on
the ``onnx`` and ``ort`` lowerings, and TensorRT on the ``trt-plugin`` lowering (our plugin) and the
``onnx`` one (TensorRT's own RotaryEmbedding, >= 10.15).

The model rotates q and k of the case with two rope_export::RotaryEmbedding nodes (3-D X with
num_heads, float32 caches as initializers, int64 positions), lowered per target. Inputs and outputs
are the benchmark's device tensors (IO binding / tensor addresses), work runs on PyTorch's stream.
polygraphy, onnxruntime and TensorRT are imported only here and only when present.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

from rope_export.bench.gpu_kernels import GpuCase, Tensors

LABELS = {
    "ort_cuda_onnx": "onnxruntime CUDA, onnx lowering (RotaryEmbedding-23)",
    "ort_cuda_ort": "onnxruntime CUDA, ort lowering (com.microsoft RotaryEmbedding)",
    "trt_plugin": "TensorRT + rope_export plugin (trt-plugin lowering)",
    "trt_native": "TensorRT RotaryEmbedding (onnx lowering)",
}
NATIVE_ROTARY_TRT = (10, 15)  # first TensorRT with the ONNX RotaryEmbedding-23 importer


def rotary_model(case: GpuCase, t: Tensors):
    """The custom-op model of one q+k rotation for this case (before lowering)."""
    import onnx
    from onnx import helper, numpy_helper

    from rope_export.op.contract import DOMAIN, RotaryAttrs
    from rope_export.op.onnx_op import make_rotary_node

    elem = {"float32": onnx.TensorProto.FLOAT, "float16": onnx.TensorProto.FLOAT16,
            "bfloat16": onnx.TensorProto.BFLOAT16}[case.dtype]
    b, s = case.batch, case.seq
    io = [("q", case.q_heads), ("k", case.kv_heads)]
    inputs = [helper.make_tensor_value_info(n, elem, [b, s, h * case.head_dim]) for n, h in io]
    inputs.append(helper.make_tensor_value_info("position_ids", onnx.TensorProto.INT64, [b, s]))
    outputs = [helper.make_tensor_value_info(f"{n}_rot", elem, [b, s, h * case.head_dim]) for n, h in io]
    caches = [numpy_helper.from_array(t.cos.float().cpu().numpy(), "cos"),
              numpy_helper.from_array(t.sin.float().cpu().numpy(), "sin")]
    nodes = [make_rotary_node(n, "cos", "sin", "position_ids", f"{n}_rot", RotaryAttrs(False, h, 0), name=f"rope_{n}")
             for n, h in io]
    graph = helper.make_graph(nodes, "rope_qk", inputs, outputs, initializer=caches)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(DOMAIN, 1)])


def _bindings(t: Tensors):
    return [("q", t.q), ("k", t.k), ("position_ids", t.pos)], [("q_rot", t.q_out), ("k_rot", t.k_out)]


def _ort_cuda(model, t: Tensors) -> Callable[[], object]:
    import onnxruntime as ort
    import torch

    options = ort.SessionOptions()
    options.log_severity_level = 3
    stream = torch.cuda.current_stream().cuda_stream
    provider = ("CUDAExecutionProvider", {"device_id": torch.cuda.current_device(), "user_compute_stream": str(stream)})
    session = ort.InferenceSession(model.SerializeToString(), options, providers=[provider])
    import onnx

    elem = {torch.float32: onnx.TensorProto.FLOAT, torch.float16: onnx.TensorProto.FLOAT16,
            torch.bfloat16: onnx.TensorProto.BFLOAT16, torch.int64: onnx.TensorProto.INT64}
    binding = session.io_binding()
    ins, outs = _bindings(t)
    for name, tensor in ins:
        binding.bind_input(name, "cuda", tensor.device.index or 0, elem[tensor.dtype], list(tensor.shape),
                           tensor.data_ptr())
    for name, tensor in outs:
        binding.bind_output(name, "cuda", tensor.device.index or 0, elem[tensor.dtype], list(tensor.shape),
                            tensor.data_ptr())

    def run():
        session.run_with_iobinding(binding)
        return t.q_out, t.k_out

    return run


class _TrtRunner:
    """One engine, its tensors bound to the benchmark's, enqueued on PyTorch's current stream."""

    def __init__(self, model, plugins: list[str], t: Tensors, workdir: Path, name: str):
        from rope_export.passes import save_model
        from rope_export.runtimes.trt import build_engine, load_engine

        onnx_path = workdir / f"{name}.onnx"
        save_model(model, onnx_path)
        ins, outs = _bindings(t)
        shapes = {n: (tuple(x.shape),) * 3 for n, x in ins}
        self.engine = load_engine(build_engine(onnx_path, workdir / f"{name}.engine", plugins, shapes), plugins)
        self.context = self.engine.create_execution_context()
        for n, x in ins:
            self.context.set_input_shape(n, tuple(x.shape))
        for n, x in ins + outs:
            self.context.set_tensor_address(n, x.data_ptr())
        self.outs = [x for _, x in outs]

    def __call__(self):
        import torch

        self.context.execute_async_v3(torch.cuda.current_stream().cuda_stream)
        return tuple(self.outs)


def runners(case: GpuCase, t: Tensors, workdir: Path, say) -> tuple[dict[str, Callable[[], object]], dict[str, str]]:
    """(runners, skipped runner -> reason). Each writes t.q_out/t.k_out: run and check one at a time."""
    run: dict[str, Callable[[], object]] = {}
    skipped: dict[str, str] = {}
    model = rotary_model(case, t)
    try:
        import onnxruntime as ort

        has_cuda = "CUDAExecutionProvider" in ort.get_available_providers()
    except ImportError:
        has_cuda = False
    from rope_export.passes import lower

    for target in ("onnx", "ort"):
        vid = f"ort_cuda_{target}"
        if not has_cuda:
            skipped[vid] = "onnxruntime has no CUDAExecutionProvider here (install onnxruntime-gpu)"
            continue
        try:
            run[vid] = _ort_cuda(lower(model, target), t)
        except Exception as exc:  # noqa: BLE001 - one runtime failing must not hide the others
            skipped[vid] = f"onnxruntime CUDA failed: {str(exc).splitlines()[0][:200]}"
    _tensorrt(case, t, model, workdir, run, skipped, say)
    return run, skipped


def _tensorrt(case, t, model, workdir, run, skipped, say) -> None:
    from rope_export.passes import lower
    from rope_export.runtimes.trt import default_plugin_library, tensorrt_unavailable_reason

    reason = tensorrt_unavailable_reason()
    if reason:
        skipped["trt_plugin"] = skipped["trt_native"] = reason
        return
    import tensorrt

    plans = {}
    plugin = default_plugin_library()
    if plugin.is_file():
        plans["trt_plugin"] = (lower(model, "trt-plugin"), [str(plugin)])
    else:
        skipped["trt_plugin"] = f"{plugin} not built (rope-export build-plugin with TensorRT headers)"
    version = tuple(int(p) for p in tensorrt.__version__.split(".")[:2])
    if version >= NATIVE_ROTARY_TRT:
        plans["trt_native"] = (lower(model, "onnx"), [])
    else:
        skipped["trt_native"] = f"TensorRT {tensorrt.__version__} has no RotaryEmbedding importer (needs >= 10.15)"
    for vid, (lowered, plugins) in plans.items():
        say(f"GPU {case.phase} {case.dtype}: building the {vid} engine")
        try:
            run[vid] = _TrtRunner(lowered, plugins, t, workdir, vid)
        except Exception as exc:  # noqa: BLE001
            skipped[vid] = f"engine build failed: {str(exc).splitlines()[0][:300]}"


def workdir():
    return tempfile.TemporaryDirectory(prefix="rope-bench-gpu-")
