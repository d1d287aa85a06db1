"""The ops of one decoder layer, in the file and in PyTorch: where each one's result is, and the precision it states.

A decoder layer's ops are found in the file by torch.onnx's name scopes (``layer_errors``): each leaf module
under ``...layers.N`` (its norms, its q/k/v/o and MLP projections, its activation) is one op, whose result
is the value made last in that scope and read outside it; the rotary nodes (``rotation (q)``, ``rotation
(k)``: the one whose result reaches ``present.N.key``) and the attention's Softmax (its input, ``attention
scores``, and its result, ``softmax``; the softmax inside an ONNX ``Attention``, whose result the file does not
hold) are ops of their own. ``recording(layer)`` takes the same results from
PyTorch while the layer runs: a forward hook on each submodule (by the same relative name), and transformers'
``eager_attention_forward`` (the rotated query and key) and ``softmax`` (its input, result and dtype) wrapped
for the call.

Each op also says the precision the file states for its arithmetic (``Stage.stated``): a norm's statistics
are computed in its input's type when that is float32, else in its ``stash_type`` (float32 by default), a
norm written out in plain ops in the type of its ReduceMean; a Softmax in its input's type, an ONNX Attention's
softmax in its ``softmax_precision`` (else in its inputs' type); our rotary op in
float32 (the contract); a MatMul in its inputs' type. PyTorch's precision for the same op
(``pytorch_precision``): float32 for a norm's statistics (transformers' norms upcast; torch's LayerNorm
accumulates half inputs in float32), the dtype its softmax was called with (eager attention: float32), the
model's dtype otherwise.
"""

from __future__ import annotations

import ast
import contextlib
import sys
from dataclasses import dataclass
from types import SimpleNamespace

import onnx

from rope_export.check.graph import rotary_nodes
from rope_export.check.layer_errors import LAYER_SCOPE, NAME_SCOPES, _layer_of

BITS = {"bfloat16": 8, "float16": 11, "float32": 24, "float64": 53}  # significand bits: which is more precise
TYPE_NAMES = {onnx.TensorProto.FLOAT16: "float16", onnx.TensorProto.BFLOAT16: "bfloat16",
              onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.DOUBLE: "float64"}
NORM_OPS = ("RMSNormalization", "LayerNormalization", "SimplifiedLayerNormalization")
CONTRACT_KINDS = ("rope_export", "trt-plugin")  # rotary nodes that compute in float32 by the op contract


@dataclass(frozen=True)
class Stage:
    """One op of a layer: its name, kind, the graph value of its result, the key of PyTorch's, its precision."""

    name: str  # "input_layernorm", "self_attn.q_proj", "rotation (k)", "attention scores", "softmax", ...
    kind: str  # "norm", "projection", "rotation", "scores", "softmax", "other"
    value: str
    torch_key: str
    stated: str  # the precision the file states for its arithmetic: "float32", "float16", ...
    how: str  # in words: "RMSNormalization on a float32 input", "Softmax on float16", ...


def _scopes(node: onnx.NodeProto) -> list[str]:
    for prop in node.metadata_props:
        if prop.key == NAME_SCOPES:
            try:
                scopes = ast.literal_eval(prop.value)
            except (ValueError, SyntaxError):
                return []
            return [str(s) for s in scopes] if isinstance(scopes, list) else []
    return []


def _module_path(node: onnx.NodeProto, layer: int) -> str:
    """The node's innermost module relative to decoder layer ``layer`` ("" for the layer itself)."""
    scopes = _scopes(node)
    base = next((s for s in scopes if (m := LAYER_SCOPE.search(s)) and int(m.group(1)) == layer), None)
    if base is None:
        return ""
    inner = [s[len(base) + 1:] for s in scopes if s.startswith(base + ".")]
    return inner[-1] if inner else ""


def _type_name(types, name: str) -> str:
    spec = types(name)
    return TYPE_NAMES.get(spec.elem_type, "") if spec is not None else ""


def _attribute(node: onnx.NodeProto, name: str, default):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _norm_precision(nodes: list[onnx.NodeProto], types) -> tuple[str, str]:
    for node in nodes:
        if node.op_type in NORM_OPS:
            given = _type_name(types, node.input[0])
            if given == "float32":
                return "float32", f"{node.op_type} on a float32 input"
            stash = TYPE_NAMES.get(int(_attribute(node, "stash_type", 1)), "float32")
            return stash, f"{node.op_type} on {given or 'its input'} with stash_type {stash}"
    reduced = [_type_name(types, n.input[0]) for n in nodes if n.op_type.startswith("Reduce") or n.op_type == "Pow"]
    reduced = [t for t in reduced if t]
    if reduced:
        lowest = min(reduced, key=BITS.get)
        return lowest, f"its statistics in plain ops on {lowest}"
    return "", "no norm op found"


def _kind(path: str, nodes: list[onnx.NodeProto]) -> str:
    leaf = path.rsplit(".", 1)[-1].lower()
    if "norm" in leaf:
        return "norm"
    if any(n.op_type in ("MatMul", "Gemm") for n in nodes):
        return "projection"
    return "other"


def _key_rotation(graph, consumers: dict, value: str, layer: int) -> bool:
    """Whether ``value`` reaches present.<layer>.key within a few value-preserving hops (the keys' rotation)."""
    frontier = [value]
    for _ in range(5):
        if f"present.{layer}.key" in frontier:
            return True
        frontier = [o for v in frontier for k in consumers.get(v, ()) if graph.node[k].op_type in
                    ("Concat", "Identity", "Cast", "Transpose", "Reshape") for o in graph.node[k].output]
    return False


def _module_stage(path: str, nodes: list[onnx.NodeProto], value: str, types) -> Stage:
    kind = _kind(path, nodes)
    if kind == "norm":
        stated, how = _norm_precision(nodes, types)
    else:
        inputs = [t for n in nodes if n.op_type in ("MatMul", "Gemm") for t in [_type_name(types, n.input[0])] if t]
        stated = inputs[0] if inputs else _type_name(types, value)
        how = f"{'MatMul' if inputs else 'its ops'} on {stated}"
    return Stage(path, kind, value, path, stated, how)


def _stages_of(graph, layer: int, positions: list[int], consumers: dict, producers: dict, outputs: set, types):
    by_path: dict[str, list[int]] = {}
    for k in positions:
        by_path.setdefault(_module_path(graph.node[k], layer), []).append(k)
    found: list[tuple[float, Stage]] = []
    for path, members in by_path.items():
        if not path or any(other.startswith(path + ".") for other in by_path):
            continue  # the layer itself, or a module with modules inside: its leaves are the ops
        inside = set(members)
        value = next((out for k in reversed(members) for out in graph.node[k].output if out and (
            out in outputs or any(c not in inside for c in consumers.get(out, ())))), None)
        if value is not None:  # the value made last and read outside the module
            found.append((members[-1], _module_stage(path, [graph.node[k] for k in members], value, types)))
    rotary = {rn.node.output[0]: rn for rn in rotary_nodes(SimpleNamespace(node=[graph.node[k] for k in positions]))}
    for k in positions:
        node = graph.node[k]
        if node.output and node.output[0] in rotary:
            rn = rotary[node.output[0]]
            which = "k" if _key_rotation(graph, consumers, node.output[0], layer) else "q"
            x_type = _type_name(types, rn.x)
            contract = rn.kind in CONTRACT_KINDS
            found.append((k, Stage(f"rotation ({which})", "rotation", node.output[0], f"rotation.{which}",
                                   "float32" if contract else x_type,
                                   "the rotary op (float32 by the op contract)" if contract else
                                   f"{rn.kind} on {x_type}")))
        elif node.op_type == "Softmax" and not any(s.kind == "softmax" for _, s in found):
            stated = _type_name(types, node.input[0])
            cast = producers.get(node.input[0])
            scores = cast.input[0] if cast is not None and cast.op_type == "Cast" else node.input[0]
            computed = _type_name(types, scores)
            found.append((k - 0.5, Stage("attention scores", "scores", scores, "softmax.input", computed,
                                         f"the scores computed in {computed}")))
            found.append((k, Stage("softmax", "softmax", node.output[0], "softmax.output", stated,
                                   f"Softmax on {stated}")))
        elif node.op_type == "Attention" and not any(s.kind == "softmax" for _, s in found):
            found.append((k, _attention_softmax(node, types)))
    return [stage for _, stage in sorted(found, key=lambda item: item[0])]


def _attention_softmax(node: onnx.NodeProto, types) -> Stage:
    """The softmax inside an ONNX Attention (``export --kv-buffer``): stated by ``softmax_precision``, else computed
    in the type of Q and K (the op's spec). Its result is inside the op, so it has no value to compare ("")."""
    given = _type_name(types, node.input[0])
    precision = _attribute(node, "softmax_precision", None)
    stated = TYPE_NAMES.get(int(precision), "") if precision is not None else given
    how = (f"Attention with softmax_precision {stated}" if precision is not None else
           f"Attention on {given or 'its inputs'} without softmax_precision (the softmax in the inputs' type)")
    return Stage("softmax", "softmax", "", "softmax.output", stated, how)


def all_layer_stages(graph: onnx.GraphProto, types) -> dict[int, list[Stage]]:
    """Every decoder layer's ops in graph order (module doc). ``types(name)``: a value's TensorSpec."""
    consumers: dict[str, list[int]] = {}  # value -> positions of the nodes that read it
    producers: dict[str, onnx.NodeProto] = {}
    positions: dict[int, list[int]] = {}
    for k, node in enumerate(graph.node):
        for i in node.input:
            consumers.setdefault(i, []).append(k)
        for out in node.output:
            producers[out] = node
        layer = _layer_of(node)
        if layer is not None:
            positions.setdefault(layer, []).append(k)
    outputs = {o.name for o in graph.output}
    return {layer: _stages_of(graph, layer, members, consumers, producers, outputs, types)
            for layer, members in sorted(positions.items())}


def layer_stages(graph: onnx.GraphProto, layer: int, types) -> list[Stage]:
    """Decoder layer ``layer``'s ops in graph order (``all_layer_stages``)."""
    return all_layer_stages(graph, types).get(layer, [])


def pytorch_precision(stage: Stage, recorded: dict, model_dtype: str) -> str:
    """The precision PyTorch computes ``stage`` in (module doc)."""
    if stage.kind == "norm":
        return "float32"
    if stage.kind == "softmax" and "softmax.dtype" in recorded:
        return recorded["softmax.dtype"]
    return model_dtype


# -- PyTorch's side ------------------------------------------------------------------------------

def _first_tensor(out):
    import torch

    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return next((o for o in out if isinstance(o, torch.Tensor)), None)
    return None


@contextlib.contextmanager
def recording(layer):
    """Record the results of ``layer``'s ops while it runs (module doc); yields the dict it fills, keyed as
    ``Stage.torch_key``: submodule names, "rotation.q"/"rotation.k", "softmax.input"/"softmax.output"/
    "softmax.dtype"."""
    import torch

    values: dict = {}
    handles = []
    for name, module in layer.named_modules():
        if name:
            def hook(module, args, out, name=name):
                tensor = _first_tensor(out)
                if tensor is not None:
                    values.setdefault(name, tensor.detach())
            handles.append(module.register_forward_hook(hook))
    modules = {sys.modules.get(type(m).__module__) for m in layer.modules()}
    patched = [(m, m.eager_attention_forward) for m in modules if m is not None and
               callable(getattr(m, "eager_attention_forward", None))]

    def recorded(original):
        def attention(module, query, key, *args, **kwargs):
            values.setdefault("rotation.q", query.detach())
            values.setdefault("rotation.k", key[..., key.shape[-2] - query.shape[-2]:, :].detach())
            real = torch.nn.functional.softmax

            def softmax(input, dim=None, _stacklevel=3, dtype=None):
                out = real(input, dim=dim, dtype=dtype)
                values.setdefault("softmax.input", input.detach())
                values.setdefault("softmax.output", out.detach())
                values.setdefault("softmax.dtype", str(dtype or input.dtype).removeprefix("torch."))
                return out

            torch.nn.functional.softmax = softmax
            try:
                return original(module, query, key, *args, **kwargs)
            finally:
                torch.nn.functional.softmax = real
        return attention

    try:
        for m, original in patched:
            m.eager_attention_forward = recorded(original)
        yield values
    finally:
        for handle in handles:
            handle.remove()
        for m, original in patched:
            m.eager_attention_forward = original
