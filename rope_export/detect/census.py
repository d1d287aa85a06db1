"""The rotations one eager forward performs, against the rotary nodes of an ONNX file.

``compare_with_file(census, model)`` counts the rotary nodes of the file in every form the project
writes or meets, as ``rope_export.op.nodes.rotary_kind`` tells them: ``rope_export::RotaryEmbedding``,
its trt-plugin form, ``ai.onnx`` RotaryEmbedding-23 and ``com.microsoft`` RotaryEmbedding. Where the
exporter's name scopes say which module a node came from (torch.onnx's dynamo exporter writes
``pkg.torch.onnx.name_scopes``; the fusion rules keep them), nodes are attributed to layers and a
shortfall names its layers; otherwise it names every rotation site of the census.

Fewer rotary nodes than plain rotations raises ``DecomposedRotationError`` (a warning with
``allow_decomposed=True``); more raises ``RotationCountError`` (something that is not a rotation
was fused, or the census missed one). xPos-style scaled rotations are not RoPE: they are
expected to stay decomposed and are listed as refused.
"""

from __future__ import annotations

import ast
import warnings
from collections import Counter
from dataclasses import dataclass, field

import onnx
import onnx_ir as ir

from rope_export.detect.witness import RotationCensus, RotationSite, layer_of
from rope_export.op.nodes import all_nodes, rotary_kind

NAME_SCOPES = "pkg.torch.onnx.name_scopes"


class RotationCountError(ValueError):
    """The file's rotary nodes do not match the rotations of the eager forward."""


class DecomposedRotationError(RotationCountError):
    """Rotations of the eager forward stayed decomposed in the file; the message names them."""


@dataclass(frozen=True)
class RotaryNode:
    name: str
    kind: str  # rope_export.op.nodes.KINDS: "rope_export", "trt-plugin", "onnx", "ort"
    module_path: str | None  # from the exporter's name scopes, when present
    layer: int | None


@dataclass
class CountReport:
    """Rotations counted in eager PyTorch against rotary nodes found in the file."""

    expected: int  # plain rotations (the scaled ones are not RoPE)
    found: int  # rotary nodes in the file
    by_kind: dict[str, int] = field(default_factory=dict)
    refused: list[RotationSite] = field(default_factory=list)  # scaled rotations, left decomposed
    missing: list[str] = field(default_factory=list)  # sites or layers left decomposed
    layers: dict = field(default_factory=dict)  # layer -> (rotations, nodes), when nodes are attributed
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.found == self.expected

    def as_text(self) -> str:
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.by_kind.items())) or "none"
        lines = [f"rotations in eager PyTorch: {self.expected}; rotary nodes in the file: {self.found} ({kinds})"]
        lines += [f"  left decomposed: {m}" for m in self.missing]
        lines += [f"  refused (not plain RoPE, left decomposed): {s.describe()}" for s in self.refused]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def rotary_nodes(model) -> list[RotaryNode]:
    """Every rotary node of the graph, its subgraphs and its local functions (``model``: an
    onnx.ModelProto or an onnx_ir.Model)."""
    found = []
    for node in all_nodes(model):
        kind = rotary_kind(node)
        if kind is not None:
            path = module_path_of(node)
            found.append(RotaryNode(node.name, kind, path, layer_of(path)))
    return found


def compare_with_file(census: RotationCensus, onnx_model, *, allow_decomposed: bool = False) -> CountReport:
    """Compare ``census`` (from ``count_rotations``) with the rotary nodes of ``onnx_model``
    (a ModelProto, an onnx_ir.Model or a path; external data is not loaded).

    Raises DecomposedRotationError when rotations stayed decomposed (with ``allow_decomposed``: a
    warning instead), RotationCountError when the file has more rotary nodes than rotations.
    """
    if not isinstance(onnx_model, (onnx.ModelProto, ir.Model)):
        onnx_model = onnx.load(str(onnx_model), load_external_data=False)
    nodes = rotary_nodes(onnx_model)
    plain = census.plain
    report = CountReport(len(plain), len(nodes), dict(Counter(n.kind for n in nodes)), census.scaled)
    report.notes += census.notes
    attributed = bool(nodes) and all(n.module_path is not None for n in nodes)
    if not nodes:
        report.missing += [s.describe() for s in plain]
    elif attributed:
        want, have = census.by_layer(plain), Counter(n.layer for n in nodes)
        report.layers = {layer: (want.get(layer, 0), have.get(layer, 0)) for layer in sorted(
            set(want) | set(have), key=lambda v: (v is None, v))}
        for layer, (w, h) in report.layers.items():
            if h < w:
                where = f"layer {layer}" if layer is not None else "outside numbered layers"
                sites = ", ".join(sorted({s.module_path or "<root>" for s in plain if s.layer == layer}))
                report.missing.append(f"{where}: {w - h} of {w} rotation(s) ({sites})")
    elif report.found < report.expected:
        report.notes.append("the file's nodes carry no module scopes, so the decomposed sites cannot be "
                            "told apart; every site of the census is listed")
        report.missing += [s.describe() for s in plain]
    if report.found > report.expected:
        raise RotationCountError(
            f"the file has {report.found} rotary node(s) but the module performs {report.expected} plain "
            f"rotation(s): something that is not a RoPE rotation was fused, or the census missed one\n"
            + report.as_text())
    if report.found < report.expected:
        message = (f"{report.expected - report.found} of {report.expected} rotation(s) stayed decomposed in the "
                   f"file\n" + report.as_text())
        if not allow_decomposed:
            raise DecomposedRotationError(message)
        warnings.warn(message, stacklevel=2)
    return report


# -- helpers ---------------------------------------------------------------------------------------



def module_path_of(node) -> str | None:
    """The module path from torch.onnx's name scopes: cumulative module names, the op last
    (``['', 'model', 'model.layers.0', 'model.layers.0.self_attn', 'mul_3']``). ``node``: an
    onnx.NodeProto or an onnx_ir.Node."""
    props = node.metadata_props
    value = props.get(NAME_SCOPES) if isinstance(props, dict) else next(
        (p.value for p in props if p.key == NAME_SCOPES), None)
    if value is None:
        return None
    try:
        scopes = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return None
    if isinstance(scopes, list) and scopes:
        return str(scopes[-2]) if len(scopes) > 1 else ""
    return None

