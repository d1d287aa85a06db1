"""The runners ``check`` drives, built one at a time for a ModelFile, each skipped with its reason.

* ``onnx-reference``: onnx.reference (our op by a NumPy kernel); needs the ModelProto in memory,
  so it is skipped above ``max_in_memory`` bytes of weights.
* ``cpu-twin``: the same with every rotary node run by the plugin's CPU twin (same limit).
* ``onnxruntime-cpu`` / ``-cuda``: a session on the file's path (weights never pass through a
  ModelProto); a custom-op file is lowered to the standard op in memory, the graph only, and its
  session reads the weights from the original folder. When one CPU session would take more than
  ``Limits.memory`` (or ``--piece-limit``), the model runs in consecutive pieces, one session at a
  time (``pieces.py``).
* ``tensorrt``: an engine built with the rotary plugin, where TensorRT and a GPU are present.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from rope_export.check.graph import rotary_nodes
from rope_export.check.model_file import CheckError, ModelFile
from rope_export.check.names import RUNNERS
from rope_export.check.pieces import StreamedRunner, plan_pieces, session_costs
from rope_export.common.bounds import format_bytes

MAX_IN_MEMORY = 1 << 30  # weights above this stay on disk: runners that need a ModelProto are skipped
PIECE_LIMIT = 4 << 30  # onnxruntime CPU in pieces (when one session does not fit): at most this per piece


@dataclass(frozen=True)
class Limits:
    """The memory the runners may take."""

    memory: int | None = None  # --memory-limit: no session (or piece) estimated above this is opened
    max_in_memory: int = MAX_IN_MEMORY  # --max-in-memory: above this the runners that need a ModelProto skip
    piece: int | None = None  # --piece-limit: onnxruntime CPU runs in pieces of this when one session is larger

    def piece_budget(self, session: int) -> int | None:
        """None: one session of ``session`` bytes; else the most each piece's session may take."""
        if self.piece is not None and session > self.piece:
            return self.piece
        if self.memory is not None and session > self.memory:
            return min(self.memory, PIECE_LIMIT)
        return None


CONTRIB_SKIP = {  # why a runner cannot run a file with onnxruntime's contrib ops
    "onnx-reference": "onnx.reference has no kernels for",
    "cpu-twin": "the CPU twin runs the file's other nodes on onnx.reference, which has no kernels for",
    "tensorrt": "TensorRT's ONNX parser has no importers for",
}


class Skip(Exception):
    """This runner cannot run this file here; the message says why (and what can)."""


def check_runner_names(names) -> None:
    for name in names:
        if name not in RUNNERS:
            raise CheckError(f"unknown runner {name!r}; choose from {', '.join(RUNNERS)}")


def _kinds(mf: ModelFile) -> set[str]:
    return {r.kind for r in rotary_nodes(mf.proto.graph)}


def _needs_proto(mf: ModelFile, name: str, max_in_memory: int) -> None:
    if mf.external and mf.weight_bytes > max_in_memory:
        raise Skip(f"{name} needs the whole model in memory as a ModelProto ({format_bytes(mf.weight_bytes)} of "
                   f"weights, more than the {format_bytes(max_in_memory)} check loads; --max-in-memory GB raises it); "
                   "onnxruntime runs this file from its path")


def make_runner(name: str, mf: ModelFile, *, plugin_library: str | None = None, cases=(), limits: Limits = Limits()):
    """(a polygraphy runner, or a StreamedRunner, and a note on how it runs the file), or raise Skip."""
    from rope_export.runtimes.contract_runners import CpuTwinRunner, OnnxReferenceRunner

    kinds = _kinds(mf)
    if name in ("onnx-reference", "tensorrt"):
        _contrib_skip(mf, name)
    if name == "onnx-reference":
        gathers = any(n.op_type == "GatherElements" and n.domain in ("", "ai.onnx") for n in mf.proto.graph.node)
        runner, how = _reference_runner(mf, name, OnnxReferenceRunner, limits)
        return runner, how + (" (GatherElements by np.take_along_axis: onnx.reference's np.choose takes at most 64 "
                              "rows)" if gathers else "")
    if name == "cpu-twin":
        if not kinds & {"rope_export", "trt-plugin"}:
            raise Skip("no rope_export or trt-plugin rotary node for the twin to run (the file was lowered to "
                       "another target)")
        _contrib_skip(mf, name)
        from rope_export.kernels import cpu_twin

        try:
            cpu_twin.twin()
        except (FileNotFoundError, OSError) as exc:
            raise Skip(str(exc)) from None
        return _reference_runner(mf, name, CpuTwinRunner, limits)
    if name in ("onnxruntime-cpu", "onnxruntime-cuda"):
        return _onnxruntime(mf, name, kinds, limits)
    if name == "tensorrt":
        from rope_export.runtimes import trt

        reason = trt.tensorrt_unavailable_reason()
        if reason:
            raise Skip(reason)
        _needs_proto(mf, name, limits.max_in_memory)
        return _tensorrt_runner(mf, plugin_library, cases), " (engine built with the rotary plugin)"
    raise CheckError(f"unknown runner {name!r}; choose from {', '.join(RUNNERS)}")


def _reference_runner(mf: ModelFile, name: str, runner_class, limits: Limits):
    """onnx.reference (or the CPU twin on it) on the whole file in memory, or, where the file's weights are external
    and ``--memory-limit``/``--piece-limit`` keeps one in-memory copy from fitting, in consecutive pieces
    (``pieces.py``) with each piece's weights loaded alone: a half-precision file is held about twice over (the
    ModelProto and onnx.reference's arrays), as ``session_costs`` counts an onnxruntime session's."""
    def runner(model: onnx.ModelProto):
        made = runner_class(model, name=name)
        made.op_classes = [*made.op_classes, _gather_elements_op()]
        return made

    whole = ort_cpu_bytes(mf)
    budget = limits.piece_budget(whole) if mf.external else None
    if budget is None:
        _needs_proto(mf, name, limits.max_in_memory)
        return runner(mf.full_proto()), ""
    pieces = plan_pieces(mf.proto.graph, budget)
    largest = max(p.session_bytes for p in pieces)

    def open_piece(data: bytes, folder):
        from onnx.external_data_helper import load_external_data_for_model

        model = onnx.load_from_string(data)
        load_external_data_for_model(model, str(folder))
        made = runner(model)
        made.activate_impl()  # the evaluator, without polygraphy's bookkeeping
        return _Evaluated(made)

    return StreamedRunner(mf.proto, mf.base_dir, pieces, open_piece, name), (
        f" (run in {len(pieces)} pieces, each piece's weights loaded alone, the largest about {format_bytes(largest)}: "
        f"the whole file in memory would take about {format_bytes(whole)}, more than --memory-limit/--piece-limit "
        "allow)")


class _Evaluated:
    """A piece's reference runner as a session: ``run(output names, feeds)``."""

    def __init__(self, runner):
        self.runner = runner

    def run(self, names, feeds):
        return self.runner.evaluator.run(list(names), dict(feeds))


def _contrib_skip(mf: ModelFile, name: str) -> None:
    if mf.contrib_ops:
        raise Skip(f"{CONTRIB_SKIP[name]} onnxruntime's contrib ops ({', '.join(mf.contrib_ops)}); onnxruntime-cpu "
                   "runs this file")


def _gather_elements_op():
    """GatherElements for onnx.reference without np.choose, which refuses an axis of more than 64 entries
    (GPT-J's plain graph gathers its [n_positions, rotary_dim] table that way); same semantics."""
    from onnx.reference.op_run import OpRun

    class GatherElements(OpRun):
        op_domain = ""

        def _run(self, data, indices, axis=0):
            axis = int(axis) % data.ndim
            indices = np.where(indices < 0, indices + data.shape[axis], indices).astype(np.int64)
            # indices may be smaller than data on the other axes: take the corner they address
            view = data[tuple(slice(None) if d == axis else slice(0, n) for d, n in enumerate(indices.shape))]
            return (np.take_along_axis(view, indices, axis=axis),)

    return GatherElements


def ort_cpu_bytes(mf: ModelFile) -> int:
    """About what one onnxruntime CPU session on the whole file holds (``pieces.session_costs``)."""
    return sum(session_costs(mf.proto.graph).values())


def _onnxruntime(mf: ModelFile, name: str, kinds: set[str], limits: Limits):
    from polygraphy.backend.onnxrt import OnnxrtRunner

    from rope_export.runtimes.contract_runners import cuda_available_for_onnxruntime

    if name == "onnxruntime-cuda" and not cuda_available_for_onnxruntime():
        raise Skip("onnxruntime has no CUDA execution provider here (install rope-export[gpu] on a GPU machine)")
    if "trt-plugin" in kinds:
        raise Skip("onnxruntime cannot run the TensorRT plugin node; use cpu-twin or tensorrt for this file")
    if any(s.elem_type == onnx.TensorProto.BFLOAT16 for s in mf.inputs):
        from rope_export.check.runner_support import bfloat16_skip_reason

        raise Skip(bfloat16_skip_reason(mf))
    provider = "CUDAExecutionProvider" if name == "onnxruntime-cuda" else "CPUExecutionProvider"
    notes, model = [], None
    if "rope_export" in kinds:
        from rope_export.passes import lower

        try:
            model = lower(mf.proto, "onnx")  # the graph only when the weights are external
            notes.append("custom op lowered in memory to the standard op")
        except (ValueError, NotImplementedError) as exc:
            if not mf.contrib_ops:
                raise Skip(f"the custom op cannot be lowered for onnxruntime: {exc}") from None
            # onnx's version converter cannot move a file with onnxruntime's own ops to opset 23;
            # plain ops need no newer opset and keep the contract (pass-through included)
            try:
                model = lower(mf.proto, "decomposed")
            except (ValueError, NotImplementedError) as again:
                raise Skip(f"the custom op cannot be lowered for onnxruntime: {again}") from None
            notes.append("custom op lowered in memory to plain ops (the file's contrib ops keep it below opset 23)")
    # a graph given as bytes names the original data file: the session finds it in the model's folder
    folder = mf.base_dir if mf.external else None
    whole = ort_cpu_bytes(mf)
    budget = limits.piece_budget(whole) if name == "onnxruntime-cpu" else None
    if budget is not None:
        runner, why = _streamed(mf, model if model is not None else mf.proto, folder, provider, name, whole, budget,
                                limits)
        return runner, _parenthesis([*notes, why])
    if model is None and (mf.path is None or mf.added_outputs):  # the in-memory graph: the file lacks them
        model = mf.proto
    if mf.external and model is None:
        notes.append("session on the file's path; weights read from its external data")
    source = model.SerializeToString() if model is not None else str(mf.path)
    session = open_session(source, folder if model is not None else None, provider)
    return OnnxrtRunner(session, name=name), _parenthesis(notes)


def _parenthesis(notes: list[str]) -> str:
    return f" ({'; '.join(notes)})" if notes else ""


def _streamed(mf, model, folder, provider, name, whole, budget, limits: Limits):
    """onnxruntime in consecutive pieces (``pieces.py``) and how, or Skip when one node's weights alone do not fit."""
    pieces = plan_pieces(model.graph, budget)
    largest = max(p.session_bytes for p in pieces)
    if limits.memory is not None and largest > limits.memory:
        raise Skip(f"onnxruntime's CPU session would take about {format_bytes(whole)} for "
                   f"{format_bytes(mf.weight_bytes)} of weights "
                   "(it keeps a float32 copy of half-precision weights), and even run in pieces one node's weights "
                   f"take {format_bytes(largest)}, more than the {format_bytes(limits.memory)} allowed "
                   "(--memory-limit GB)")
    why = (f"--piece-limit {format_bytes(limits.piece)}" if limits.piece is not None and whole > limits.piece
           else f"the {format_bytes(limits.memory)} allowed, --memory-limit")
    how = (f"run in {len(pieces)} pieces, one session each, the largest about {format_bytes(largest)}: one "
           f"session would take about {format_bytes(whole)}, more than {why}")
    return StreamedRunner(model, folder, pieces, lambda data, where: open_session(data, where, provider), name), how


def open_session(source, folder, provider: str):
    """An onnxruntime session on a path or a serialized model whose external data lies in ``folder``; Skip
    when onnxruntime has no kernel for part of it here."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    if folder is not None:
        options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(folder))
    try:
        return ort.InferenceSession(source, options, providers=[provider])
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own types
        message = str(exc).strip().splitlines()[0][:300]
        if "NOT_IMPLEMENTED" in message:  # no kernel for an op/type here: it cannot run the file, it did not disagree
            raise Skip(f"onnxruntime has no kernel for part of this file here: {message}") from None
        raise RuntimeError(f"onnxruntime cannot load the file: {message}") from None


def _tensorrt_runner(mf: ModelFile, plugin_library: str | None, cases):
    """Lower to the plugin form, build an engine whose profile covers the cases, wrap it."""
    import tempfile

    import onnx
    from polygraphy.backend.trt import TrtRunner

    from rope_export.passes import lower
    from rope_export.runtimes import trt

    plugin = plugin_library or str(trt.default_plugin_library())
    model = mf.full_proto()
    lowered = lower(model, "trt-plugin") if "rope_export" in _kinds(mf) else model
    shapes = {}
    for name in cases[0].feeds:
        dims = np.array([case.feeds[name].shape for case in cases])
        low = tuple(int(d) for d in dims.min(axis=0))
        high = tuple(int(d) for d in dims.max(axis=0))
        shapes[name] = (low, high, high)
    with tempfile.TemporaryDirectory() as tmp:
        onnx.save_model(lowered, f"{tmp}/model.onnx", save_as_external_data=mf.external)
        engine_path = trt.build_engine(f"{tmp}/model.onnx", f"{tmp}/model.engine", [plugin], shapes)
        engine = trt.load_engine(engine_path, [plugin])
    return TrtRunner(engine, name="tensorrt")


def run_cases(runner, cases, say=lambda message: None) -> tuple[list[dict[str, np.ndarray]], float | None]:
    """Every case through polygraphy's Comparator (one warm-up), or piece by piece through a StreamedRunner;
    outputs per case and median latency (ms)."""
    if isinstance(runner, StreamedRunner):
        return runner.run_cases(cases, say)
    from polygraphy.comparator import Comparator
    from polygraphy.logger import G_LOGGER

    with G_LOGGER.verbosity(G_LOGGER.ERROR):
        results = Comparator.run([runner], data_loader=[case.feeds for case in cases], warm_up=1)
    ((_, iterations),) = results.items()
    outputs = [{k: np.asarray(v.numpy() if hasattr(v, "numpy") else v) for k, v in it.items()} for it in iterations]
    times = [it.runtime for it in iterations if it.runtime is not None]
    return outputs, (float(np.median(times)) * 1e3 if times else None)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}".rstrip(": ")
