"""Which RoPE configuration each rotary node runs, in models whose layers differ.

Gemma 3's sliding-window layers rotate with base 10000 and its global ones with 1e6 (transformers'
``rope_parameters`` per layer type); the file's metadata records every type's configuration
(``rope_extra["rope_by_layer_type"]``) and the layer types. A node's layer is read from the module
path torch.onnx records on it (``model.layers.3.self_attn``), or else from the ``present.N.key``
output its rotated keys flow into; its layer's type names its configuration. A node whose layer
cannot be told gets no configuration: the sweep then compares it with the file's own tables or
onnx-reference, and says so.
"""

from __future__ import annotations

import re

import onnx

from rope_export.check.graph import RotaryNode, RotarySlice
from rope_export.check.model_file import ModelFile
from rope_export.detect.census import module_path_of
from rope_export.op.rope_types import RopeConfig

_LAYER_IN_PATH = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)(?:\.|$)")
_PRESENT_KEY = re.compile(r"present\.(\d+)\.key")
_MAX_HOPS = 64  # nodes between a rotated key and the present.N.key output it becomes (Transpose, Concat, ...)


def node_layer(mf: ModelFile, rn: RotaryNode, consumers: dict[str, list[onnx.NodeProto]]) -> int | None:
    """The decoder layer a rotary node belongs to, or None when the file does not say."""
    path = module_path_of(rn.node)
    match = _LAYER_IN_PATH.search(path or "")
    if match:
        return int(match.group(1))
    outputs = {s.name for s in mf.outputs}
    seen, frontier = set(), list(rn.node.output)
    for _ in range(_MAX_HOPS):
        found = {int(m.group(1)) for v in frontier if v in outputs and (m := _PRESENT_KEY.fullmatch(v))}
        if len(found) == 1:
            return found.pop()
        seen.update(frontier)
        frontier = [o for v in frontier for n in consumers.get(v, ()) for o in n.output if o not in seen]
        if not frontier:
            break
    return None


def slice_ropes(mf: ModelFile, slices: list[RotarySlice], default: RopeConfig | None,
                by_type: dict[str, RopeConfig], layer_types: list[str]) -> tuple[list[RopeConfig | None], list[str]]:
    """Each slice's RoPE configuration (``default`` where every layer rotates alike), and notes."""
    if len({repr(r) for r in by_type.values()}) <= 1:
        return [default] * len(slices), []
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in mf.proto.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    ropes, notes = [], []
    for sl in slices:
        layers = {node_layer(mf, rn, consumers) for rn in sl.nodes} - {None}
        types = {layer_types[i] for i in layers if i < len(layer_types)}
        rope = by_type.get(next(iter(types))) if len(types) == 1 else None
        if rope is None:
            why = (f"its nodes are in layers of types {sorted(types)}" if len(types) > 1 else
                   f"its layer type {sorted(types)} has no recorded RoPE parameters" if types else
                   "its layer is not recorded in the file")
            notes.append(f"{sl.label}: the layers' RoPE parameters differ by layer type and {why}; compared with "
                         "the file's own caches instead of a configuration")
        ropes.append(rope)
    return ropes, notes
