"""Error after every decoder layer: the file's residual stream against the layer-streamed reference's.

The file's hidden state after layer ``i`` is found by torch.onnx's name scopes (node metadata
``pkg.torch.onnx.name_scopes``, e.g. ``['', 'model', 'model.model', 'model.model.layers.2', 'add_865']``):
among the values made by nodes of layer ``i``'s scope and read by nodes outside it (the next
layer, or the final norm), not graph outputs (the presents are) and carrying data of the token ids
(the masks and cos/sin a layer shares with the next do not), the one made last. Those values become
graph outputs of the in-memory graph only (``ModelFile.add_outputs``), so every runner, the
piece-wise onnxruntime run included, returns them beside the file's own outputs.

Per layer and case, each runner's error (max abs over the hidden state, against the float32
reference) is held to PyTorch's own in the file's dtype by ``tolerances.against_pytorch`` at the
hidden state's scale (the envelope); the first layer where a case leaves it is named, and each layer
is reported by its case closest to (or furthest past) its bound.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field

import numpy as np
import onnx

from rope_export.op.tolerances import AgainstPyTorch

NAME_SCOPES = "pkg.torch.onnx.name_scopes"
LAYER_SCOPE = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)$")
PREFIX = "rope_export.layer."  # never a name the exporters write: the added outputs are ours


def _layer_of(node: onnx.NodeProto) -> int | None:
    for prop in node.metadata_props:
        if prop.key == NAME_SCOPES:
            try:
                scopes = ast.literal_eval(prop.value)
            except (ValueError, SyntaxError):
                return None
            for scope in scopes if isinstance(scopes, list) else ():
                match = LAYER_SCOPE.search(str(scope))
                if match:
                    return int(match.group(1))
    return None


def layer_outputs(graph: onnx.GraphProto, layers: int) -> tuple[list[str], str]:
    """The value after each of ``layers`` decoder layers, in order; or ([], why not)."""
    owner: dict[str, tuple[int, int]] = {}  # value -> (layer, position of the node that makes it)
    last: dict[int, tuple[int, str]] = {}  # layer -> the crossing value made last
    for position, node in enumerate(graph.node):
        layer = _layer_of(node)
        if layer is not None:
            owner.update((out, (layer, position)) for out in node.output if out)
    if not owner:
        return [], "the file's nodes carry no torch.onnx name scopes (pkg.torch.onnx.name_scopes)"
    graph_outputs = {o.name for o in graph.output}
    tokens = _token_data(graph)
    for node in graph.node:
        layer = _layer_of(node)
        for name in node.input:
            made_by, made_at = owner.get(name, (None, -1))
            if made_by is not None and made_by != layer and name not in graph_outputs and name in tokens:
                if made_by not in last or last[made_by][0] < made_at:
                    last[made_by] = (made_at, name)
    found = [last[i][1] if i in last else None for i in range(layers)]
    if None in found or len(last) != layers:
        missing = [i for i, name in enumerate(found) if name is None]
        return [], (f"the output of decoder layer(s) {missing[:4]} was not found by name scope" if missing else
                    f"the name scopes name {len(last)} decoder layers, the file has {layers}")
    return found, ""


SHAPE_ONLY = {"Shape", "Size"}  # their outputs say how big a value is, not what it holds


def _token_data(graph: onnx.GraphProto) -> set[str]:
    """Values that carry data of the token ids (not only their shape): the residual stream does, the masks and
    the cos/sin a layer shares with the next do not, so they are never taken for a layer's output."""
    carried = {"input_ids"} | {i.name for i in graph.input if i.name.startswith("inputs_embeds")}
    for node in graph.node:  # the nodes are in topological order (ONNX requires it)
        if node.op_type not in SHAPE_ONLY and any(i in carried for i in node.input):
            carried.update(o for o in node.output if o)
    return carried


def added_output_name(layer: int) -> str:
    return f"{PREFIX}{layer}"


def add_layer_outputs(graph: onnx.GraphProto, names: list[str], elem_type: int) -> list[str]:
    """Make each layer's value a graph output under a name of ours (an Identity), in place; returns the names."""
    from onnx import helper

    added = []
    for layer, name in enumerate(names):
        out = added_output_name(layer)
        graph.node.append(helper.make_node("Identity", [name], [out], name=f"{PREFIX}identity.{layer}"))
        graph.output.append(helper.make_tensor_value_info(out, elem_type, None))
        added.append(out)
    return added


@dataclass
class LayerErrors:
    """One runner's error after each layer beside PyTorch's and the bound, each layer's from the case closest to
    (or furthest past) the bound, and the first layer where a case leaves the envelope."""

    runner: str
    errors: list[float]
    pytorch: list[float]
    bounds: list[float]
    worst_cases: list[str] = field(default_factory=list)
    first_outside: int | None = None
    cases_outside: list[str] = field(default_factory=list)

    @property
    def worst_ratio(self) -> float:
        return max((e / b for e, b in zip(self.errors, self.bounds, strict=True) if b > 0), default=0.0)


def _max_abs(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return float("inf")
    diff = np.abs(np.where(np.isfinite(a), a, 0.0) - np.where(np.isfinite(b), b, 0.0))
    return float(diff.max(initial=0.0))


def _rms(a) -> float:
    a = np.asarray(a, np.float64)
    a = a[np.isfinite(a)]
    return float(np.sqrt(np.mean(a * a))) if a.size else 0.0


def pytorch_layer_errors(reference: list[list[np.ndarray]], pytorch: list[list[np.ndarray]]) -> list[list[float]]:
    """[case][layer] error of PyTorch in the file's dtype against the reference."""
    return [[_max_abs(p, r) for p, r in zip(pc, rc, strict=True)] for pc, rc in zip(pytorch, reference, strict=True)]


def compare_layers(runner: str, actual: list[dict], case_names: list[str], reference: list[list[np.ndarray]],
                   pytorch_errors: list[list[float]], rule: AgainstPyTorch) -> LayerErrors | None:
    """Per layer: the runner's error against the reference, PyTorch's, and the envelope (module doc)."""
    layers = len(reference[0]) if reference else 0
    if not layers or any(added_output_name(i) not in got for got in actual for i in range(layers)):
        return None
    errors, pytorch, bounds, worst = [0.0] * layers, [0.0] * layers, [float("inf")] * layers, [""] * layers
    first, outside = None, []
    for case, got, ref_states, pt_errors in zip(case_names, actual, reference, pytorch_errors, strict=True):
        for i in range(layers):
            err = _max_abs(got[added_output_name(i)], ref_states[i])
            bound = rule.bound(pt_errors[i], _rms(ref_states[i]))
            if not worst[i] or err * bounds[i] > errors[i] * bound:  # err / bound above the worst so far
                errors[i], pytorch[i], bounds[i], worst[i] = err, pt_errors[i], bound, case
            if err > bound:
                if first is None or i < first:
                    first = i
                if case not in outside:
                    outside.append(case)
    return LayerErrors(runner, errors, pytorch, bounds, worst, first, outside)
