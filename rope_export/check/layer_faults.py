"""Which op of a decoder layer loses precision, and whether the file or the runner is at fault.

When a runner leaves PyTorch's envelope (after a decoder layer, or on that layer's present key/value),
the first such layer is looked into: the runner runs the failing cases once more with the results of
the layer's ops (``layer_ops.layer_stages``) as extra outputs of the in-memory graph, and the
layer-streamed reference runs that layer once more in both precisions from its own inputs, recording the
same results (``LayerStream.rerun_layer``, ``layer_ops.recording``). Each op's error against the
higher-precision reference is held to PyTorch's own error there by the same envelope as a layer's
(``tolerances.against_pytorch`` at the op's scale); the first op outside it is named.

Who is at fault: where the file states less precision for that op than PyTorch computes it in (a softmax
in float16 where transformers computes float32), **the file loses precision there**; where it states as
much (a norm with float32 statistics), **the runner computes it less precisely than the file states**,
and that is reported as the runner's fault, not as a FAIL of the file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import numpy_helper

from rope_export.check.layer_ops import BITS, Stage, all_layer_stages, layer_stages, pytorch_precision, recording
from rope_export.op.tolerances import AgainstPyTorch

MASKED = -3e4  # attention scores at or below this are masked positions (-65504, float32's min): not compared


@dataclass
class OpError:
    stage: Stage
    error: float
    pytorch: float
    bound: float
    case: str
    pytorch_precision: str = ""

    @property
    def outside(self) -> bool:
        return self.error > self.bound


@dataclass
class LayerFault:
    """The ops of the first layer that left the envelope, their errors, the first outside and whose fault it is."""

    runner: str
    layer: int
    ops: list[OpError] = field(default_factory=list)
    fault: str = ""  # "file", "runner", or "" (no op alone outside the envelope, or none could be compared)
    why: str = ""  # when nothing could be compared
    float32_checked: bool = False  # the file made float32 ran too (on onnx.reference)
    float32_first: OpError | None = None  # the first op where even that leaves the envelope
    defect: bool = False  # the file computes the op differently, not only less precisely

    @property
    def first(self) -> OpError | None:
        return next((op for op in self.ops if op.outside), None)

    def sentence(self) -> str:
        op = self.first
        if op is None:
            return (f"in decoder layer {self.layer}, " + (self.why or "every op stays within PyTorch's envelope on "
                    "its own (the error builds up across ops or comes from the residual stream)"))
        numbers = f"error {op.error:.3g}, PyTorch's {op.pytorch:.3g}, bound {op.bound:.3g}, case {op.case}"
        if self.defect:
            exact = self.float32_first
            return (f"the file computes {exact.stage.name} in decoder layer {self.layer} differently from PyTorch, "
                    f"not only less precisely: made float32 it is still outside PyTorch's envelope there (error "
                    f"{exact.error:.3g}, PyTorch's {exact.pytorch:.3g}, bound {exact.bound:.3g}, case {exact.case})")
        confirmed = ("; made float32 the file stays within PyTorch's envelope there" if self.float32_checked else
                     "; not confirmed by running the file in float32 (it does not fit --max-in-memory or has contrib "
                     "ops)")
        if not self.fault:
            return (f"{op.stage.name} in decoder layer {self.layer} leaves PyTorch's envelope ({self.runner}: "
                    f"{numbers}); the precision the file states there could not be read")
        if self.fault == "file":
            return (f"the file loses precision at {op.stage.name} in decoder layer {self.layer}: it states "
                    f"{op.stage.how}, PyTorch computes it in {op.pytorch_precision} ({self.runner}: {numbers}"
                    f"{confirmed})")
        return (f"runner {self.runner} computes {op.stage.name} in decoder layer {self.layer} less precisely than "
                f"the file states ({op.stage.how}; PyTorch: {op.pytorch_precision}; {numbers}{confirmed})")


def _as_float(value) -> np.ndarray:
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().to(torch.float64).numpy()
    return np.asarray(value, dtype=np.float64)


def _aligned(actual: np.ndarray, reference: np.ndarray) -> np.ndarray | None:
    """``actual`` in the reference's layout: the same shape, or [B, S, H*D] for a [B, H, S, D] reference."""
    if actual.shape == reference.shape:
        return actual
    if actual.size == reference.size and reference.ndim == 4 and actual.ndim == 3:
        b, h, s, d = reference.shape
        return actual.reshape(b, s, h, d).transpose(0, 2, 1, 3)
    return None


def _error_and_scale(actual, reference, scores: bool) -> tuple[float, float] | None:
    """(max abs difference, RMS of the reference) over the compared entries; None when the shapes differ."""
    ref = _as_float(reference)
    got = _aligned(_as_float(actual), ref)
    if got is None:
        return None
    keep = np.isfinite(ref)
    if scores:  # masked positions hold each precision's own "minus infinity"
        keep &= ref > MASKED
    if not keep.any():
        return 0.0, 0.0
    with np.errstate(invalid="ignore"):  # an inf or NaN where the reference is finite is an infinite error
        diff = np.where(np.isfinite(got[keep]), np.abs(got[keep] - ref[keep]), np.inf)
    return float(diff.max()), float(np.sqrt(np.mean(ref[keep] ** 2)))


HALF_TYPES = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)


def _promote_tensor(tensor: onnx.TensorProto, base: str) -> onnx.TensorProto:
    if tensor.data_type not in HALF_TYPES:
        return tensor
    return numpy_helper.from_array(numpy_helper.to_array(tensor, base_dir=base).astype(np.float32), tensor.name)


def float32_view(mf) -> onnx.ModelProto:
    """The file's graph with every float16/bfloat16 tensor, Cast and declared type made float32: what the file
    computes, in the reference's precision, to tell a defect (outside PyTorch's envelope in float32 too) from a
    loss of precision. Needs the weights in memory (the runners that need them have the same limit)."""
    full = mf.full_proto()
    model = onnx.ModelProto()
    model.CopyFrom(full)
    base = str(mf.base_dir) if mf.base_dir is not None else ""
    graph = model.graph
    promoted = [_promote_tensor(t, base) for t in graph.initializer]
    del graph.initializer[:]
    graph.initializer.extend(promoted)
    for node in graph.node:
        for attribute in node.attribute:
            if node.op_type == "Cast" and attribute.name == "to" and attribute.i in HALF_TYPES:
                attribute.i = onnx.TensorProto.FLOAT
            elif attribute.type == onnx.AttributeProto.TENSOR:
                attribute.t.CopyFrom(_promote_tensor(attribute.t, base))
    for value in [*graph.input, *graph.output, *graph.value_info]:
        if value.type.tensor_type.elem_type in HALF_TYPES:
            value.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
    return model


def _promoted(view):
    """``float32_view`` of a ``ModelFile.with_outputs`` view, as a ModelFile with the same added outputs."""
    from rope_export.check.model_file import ModelFile

    promoted = ModelFile(float32_view(view), view.path, weights_loaded=True)
    promoted.outputs_of = view.outputs_of
    return promoted


def _float32_cases(cases):
    from dataclasses import replace

    def promote(array):
        return array.astype(np.float32) if array.dtype.kind == "f" or str(array.dtype) == "bfloat16" else array

    return [replace(case, feeds={k: promote(v) for k, v in case.feeds.items()}) for case in cases]


def _layer_of_output(name: str) -> int | None:
    match = re.fullmatch(r"present\.(\d+)\.(?:key|value)", name)
    return int(match.group(1)) if match else None


def layer_to_look_into(report) -> int | None:
    """The first decoder layer where ``report`` (a RunnerReport) leaves PyTorch's envelope: after the layer,
    or on its present key/value; None when neither."""
    candidates = []
    if report.layers is not None and report.layers.first_outside is not None:
        candidates.append(report.layers.first_outside)
    for stats in report.cases.values():
        candidates += [layer for s in stats if not s.passed and (layer := _layer_of_output(s.output)) is not None]
    return min(candidates, default=None)


def failing_cases(report, layer: int) -> list[str]:
    """The cases in which ``report`` leaves the envelope at ``layer`` (its cases outside after the layer, or with
    that layer's present failing); all its cases when none is named."""
    names = [case for case, stats in report.cases.items()
             if any(not s.passed and _layer_of_output(s.output) == layer for s in stats)]
    if report.layers is not None and report.layers.first_outside == layer:
        names += [c for c in report.layers.cases_outside if c not in names]
    return names or list(report.cases)


def _op_errors(stages, view, actual, cases, reference, pytorch, rule: AgainstPyTorch, dtype: str) -> list[OpError]:
    """Per op: its error in ``actual`` (outputs of ``view``) against the reference, in the case closest to (or
    furthest past) its bound, beside PyTorch's own error there."""
    found = []
    for stage in stages:
        worst = None
        out = view.outputs_of[stage.value]
        for case, got, ref, pt in zip(cases, actual, reference, pytorch, strict=True):
            if out not in got or stage.torch_key not in ref or stage.torch_key not in pt:
                continue
            mine = _error_and_scale(got[out], ref[stage.torch_key], stage.kind == "scores")
            theirs = _error_and_scale(pt[stage.torch_key], ref[stage.torch_key], stage.kind == "scores")
            if mine is None or theirs is None:
                continue
            bound = rule.bound(theirs[0], mine[1])
            if worst is None or mine[0] * worst.bound > worst.error * bound:  # the highest error / bound
                worst = OpError(stage, mine[0], theirs[0], bound, case.name, pytorch_precision(stage, pt, dtype))
        if worst is not None:
            found.append(worst)
    return found


def look_into_layer(runner: str, mf, layer: int, cases, case_indices: list[int], stream, rule: AgainstPyTorch,
                    run_runner, dtype: str, run_float32=None) -> LayerFault:
    """The ops of ``layer`` compared as the module doc says. ``run_runner(view, cases)``: the runner's outputs per
    case on a ModelFile view; ``stream``: the reference's ``LayerStream``; ``run_float32(view, cases)``: the same on
    the file made float32 (``float32_view``), or None where that cannot run (then the file's precision as stated
    decides alone)."""
    fault = LayerFault(runner, layer)
    stages = [s for s in layer_stages(mf.proto.graph, layer, mf.value_type)
              if s.value and mf.value_type(s.value) is not None]  # "": inside an op (an ONNX Attention's softmax)
    if not stages:
        fault.why = "no op of the layer was found in the file by name scope"
        return fault
    values = {s.value: mf.value_type(s.value).elem_type for s in stages}
    view = mf.with_outputs(values)
    actual = run_runner(view, cases)
    reference, pytorch = stream.rerun_layer(layer, case_indices, recording)
    fault.ops = _op_errors(stages, view, actual, cases, reference, pytorch, rule, dtype)
    if not fault.ops:
        fault.why = "no op's result could be compared with PyTorch's (different layouts or no recorded value)"
    first = fault.first
    if first is None:
        return fault
    if run_float32 is not None:
        promoted = _promoted(view)
        exact = _op_errors(stages, promoted, run_float32(promoted, _float32_cases(cases)), cases, reference, pytorch,
                           rule, dtype)
        fault.float32_first = next((op for op in exact if op.outside), None)
        fault.float32_checked = True
    order = [s.name for s in stages]
    defect = fault.float32_first is not None and order.index(fault.float32_first.stage.name) <= order.index(
        first.stage.name)
    if defect or first.stage.stated:
        below = BITS.get(first.stage.stated, 0) < BITS.get(first.pytorch_precision, 0)
        fault.fault = "file" if defect or below else "runner"
    fault.defect = defect
    return fault


def diagnose(report, mf, cases, reference, rule: AgainstPyTorch, dtype: str, make_runner_for, max_in_memory: int,
             say) -> LayerFault | None:
    """For a runner ``report`` that leaves PyTorch's envelope, the fault in the first layer it leaves it at
    (``look_into_layer``); None when it stays inside or the reference kept no layer stream. A fault of the
    runner's own makes its status "runner fault" (its reason says where): the file is not failed for it.
    ``make_runner_for(name, view)``: (runner, note) for a ModelFile view, as ``runners.make_runner`` gives."""
    from rope_export.check.runners import run_cases

    layer = layer_to_look_into(report)
    stream = getattr(reference, "stream", None)
    if layer is None or stream is None:
        return None
    names = failing_cases(report, layer)
    chosen = [k for k, case in enumerate(cases) if case.name in names]
    say(f"{report.runner}: looking into decoder layer {layer}, op by op ({len(chosen)} case(s))")

    def runs(name):
        def run(view, subset):
            runner, _ = make_runner_for(name, view)
            try:
                return run_cases(runner, subset)[0]
            finally:
                del runner
        return run

    float32_fits = not mf.contrib_ops and 2 * mf.weight_bytes <= max_in_memory
    fault = look_into_layer(report.runner, mf, layer, [cases[k] for k in chosen], chosen, stream, rule,
                            runs(report.runner), dtype, runs("onnx-reference") if float32_fits else None)
    report.fault = fault
    if fault.fault == "runner":
        report.status, report.reason = "runner fault", fault.sentence()
    return fault


def fault_dict(fault: LayerFault) -> dict:
    """For check.json: the layer, whose fault, the sentence, and every op's error beside PyTorch's."""
    return {"layer": fault.layer, "fault": fault.fault or None, "verdict": fault.sentence(),
            "ops": [{"op": op.stage.name, "kind": op.stage.kind, "case": op.case, "error": op.error,
                     "pytorch_error": op.pytorch, "bound": op.bound, "outside": op.outside,
                     "file_states": op.stage.how, "file_precision": op.stage.stated,
                     "pytorch_precision": op.pytorch_precision} for op in fault.ops]}


def fault_lines(fault: LayerFault, markdown: bool) -> list[str]:
    """The verdict, and (Markdown) a table of the layer's ops."""
    lines = [f"{'- ' if markdown else ''}{fault.runner} op by op: {fault.sentence()}"]
    if markdown and fault.ops:
        lines += ["", f"Decoder layer {fault.layer} of {fault.runner}, op by op (each op's case closest to its bound):",
                  "", "| op | case | runner error | PyTorch error | bound | within | the file states | "
                  "PyTorch computes in |", "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {op.stage.name} | {op.case} | {op.error:.3g} | {op.pytorch:.3g} | {op.bound:.3g} | "
                  f"{'**no**' if op.outside else 'yes'} | {op.stage.how} | {op.pytorch_precision} |"
                  for op in fault.ops]
        lines.append("")
    return lines


def precision_findings(mf, stream, dtype: str) -> list[dict]:
    """Where the file states less precision than PyTorch computes in, op by op in every decoder layer (the file's
    side read from the graph, PyTorch's recorded while its first layer runs once more on the first case): a
    finding whether or not a runner here shows it (runners that accumulate in float32 hide a float16 softmax)."""
    stages = all_layer_stages(mf.proto.graph, mf.value_type)
    if not stages:
        return []
    _, pytorch = stream.rerun_layer(min(stages), [0], recording)
    found: dict[tuple[str, str, str], list[int]] = {}
    for layer, ops in stages.items():
        for stage in ops:
            theirs = pytorch_precision(stage, pytorch[0], dtype)
            if stage.stated and BITS.get(stage.stated, 0) < BITS.get(theirs, 0):
                found.setdefault((stage.name, stage.how, theirs), []).append(layer)
    return [{"op": name, "file_states": how, "pytorch_computes_in": theirs, "layers": layers}
            for (name, how, theirs), layers in found.items()]


def finding_line(finding: dict, layers: int) -> str:
    return (f"the file states less precision than PyTorch at {finding['op']} in {len(finding['layers'])} of {layers} "
            f"decoder layers: {finding['file_states']}, PyTorch computes it in {finding['pytorch_computes_in']} "
            "(check.layer_faults.precision_findings)")
