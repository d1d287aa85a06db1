"""The file under check, opened without its weights and refused early when it cannot be checked.

``ModelFile.open`` reads the graph and the metadata (``onnx.load(..., load_external_data=False)``),
checks that every external-data file the graph names is there and long enough, and sums the weight
bytes from the tensors' dims, all before any work starts. The weights themselves are read only by
the runners that need a ModelProto (onnx.reference, the CPU twin), one tensor at a time by the
cache-row proof, and never by onnxruntime, whose sessions read them from the path.
"""

from __future__ import annotations

import functools
import gc
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from rope_export.common.bounds import format_bytes
from rope_export.op import onnx_op  # noqa: F401  (registers the rope_export schema for onnx.checker)

METADATA_PREFIX = "rope_export."
PROTOBUF_LIMIT = 2**31 - 2**20  # a ModelProto past this cannot be serialized
BIG_WEIGHTS = 64 * 2**20  # past this, memory is collected between the reference and each runner


class CheckError(ValueError):
    """A check that cannot start (bad file, bad flags, mismatched reference); the message names the fix."""


@dataclass(frozen=True)
class TensorSpec:
    """A graph input or output: name, ONNX element type, dims (int static, str symbolic, None unknown)."""

    name: str
    elem_type: int
    dims: tuple | None  # None: rank unknown

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(helper.tensor_dtype_to_np_dtype(self.elem_type))

    @property
    def type_name(self) -> str:
        return onnx.TensorProto.DataType.Name(self.elem_type).lower()

    @property
    def is_float(self) -> bool:
        return self.elem_type in FLOAT_ELEM_TYPES


FLOAT_ELEM_TYPES = {onnx.TensorProto.FLOAT: "fp32", onnx.TensorProto.FLOAT16: "fp16",
                    onnx.TensorProto.BFLOAT16: "bf16", onnx.TensorProto.DOUBLE: "fp64"}


def tensor_spec(value: onnx.ValueInfoProto) -> TensorSpec:
    tensor_type = value.type.tensor_type
    if not tensor_type.HasField("shape"):
        return TensorSpec(value.name, tensor_type.elem_type, None)
    dims = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor_type.shape.dim)
    return TensorSpec(value.name, tensor_type.elem_type, dims)


def tensor_nbytes(tensor: onnx.TensorProto) -> int:
    try:
        itemsize = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type)).itemsize
    except (KeyError, TypeError, ValueError):
        itemsize = 1
    return math.prod(tensor.dims) * itemsize


class ModelFile:
    """The graph and metadata of the file to check; weights only on request."""

    def __init__(self, proto: onnx.ModelProto, path: Path | None, weights_loaded: bool):
        self.proto = proto
        self.path = path
        self.base_dir = path.parent if path is not None else None
        self.weights_loaded = weights_loaded
        graph = proto.graph
        self.initializer_names = {t.name for t in graph.initializer}
        self.inputs = [tensor_spec(v) for v in graph.input if v.name not in self.initializer_names]
        self.outputs = [tensor_spec(v) for v in graph.output]
        self.weight_bytes = sum(tensor_nbytes(t) for t in graph.initializer)
        self.metadata = {p.key.removeprefix(METADATA_PREFIX): p.value for p in proto.metadata_props
                         if p.key.startswith(METADATA_PREFIX)}
        self._value_types: dict[str, TensorSpec] | None = None
        self._inferred = False  # shape inference ran (value_info did not type every value asked for)
        self.contrib_ops: list[str] = []  # onnxruntime's own ops in the file (set by _validate)
        self._full: onnx.ModelProto | None = proto if weights_loaded else None
        self.added_outputs: list[str] = []  # graph outputs check added in memory (``add_layer_outputs``)

    @property
    def label(self) -> str:
        return str(self.path) if self.path is not None else "<in memory>"

    @property
    def external(self) -> bool:
        return not self.weights_loaded

    @classmethod
    def open(cls, model: onnx.ModelProto | str | os.PathLike) -> ModelFile:
        if isinstance(model, onnx.ModelProto):
            loaded = not any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer)
            mf = cls(model, None, loaded)
        else:
            mf = cls._open_path(Path(model))
        mf._validate()
        return mf

    @classmethod
    def _open_path(cls, path: Path) -> ModelFile:
        if not path.exists():
            raise CheckError(f"no such file: {path}")
        if not path.is_file():
            raise CheckError(f"{path} is not a file; give the .onnx file")
        if path.stat().st_size == 0:
            raise CheckError(f"{path} is empty (0 bytes); give an .onnx file written by an exporter")
        try:
            proto = onnx.load(str(path), load_external_data=False)
        except Exception as exc:  # noqa: BLE001 - protobuf and onnx raise several types
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            raise CheckError(f"{path} is not a readable ONNX model (truncated or another format?): {first}") from None
        mf = cls(proto, path, weights_loaded=False)
        mf._check_external_data()
        if not any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer):
            mf.weights_loaded, mf._full = True, proto
        return mf

    def _validate(self) -> None:
        proto = self.proto
        if proto.ir_version < 3 or not proto.opset_import or not proto.graph.output:
            raise CheckError(
                f"{self.label} is not an ONNX model: no IR version, opset or graph output was found "
                "(a random or damaged file parses as an empty model); give an .onnx file"
            )
        self.contrib_ops = onnxruntime_contrib_ops(proto)
        # ops of onnxruntime's own in the ai.onnx domain are unknown to onnx.checker, which stops at the
        # first: it checks a weight-free view with them set aside (onnxruntime's session creation, by the
        # onnxruntime runners, validates them)
        in_onnx_domain = {op for op in self.contrib_ops if "::" not in op}
        if in_onnx_domain:
            target = _checker_view(proto, in_onnx_domain)
        else:  # from the path, the checker finds external data files (and never loads them)
            target = str(self.path) if self.path is not None else proto
        if self.path is not None or in_onnx_domain or proto.ByteSize() < PROTOBUF_LIMIT:
            try:
                onnx.checker.check_model(target)
            except Exception as exc:  # noqa: BLE001 - ValidationError and friends
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
                raise CheckError(f"{self.label} fails onnx.checker: {first}; fix or re-export the file") from None
        for spec in self.outputs:
            if spec.elem_type == onnx.TensorProto.UNDEFINED:
                raise CheckError(f"{self.label}: graph output {spec.name!r} has no type; the file is damaged")

    def _check_external_data(self) -> None:
        base = self.base_dir.resolve()
        for tensor in self.proto.graph.initializer:
            if tensor.data_location != onnx.TensorProto.EXTERNAL:
                continue
            info = {e.key: e.value for e in tensor.external_data}
            location = info.get("location", "")
            where = (base / location).resolve()
            if not location or base not in (where, *where.parents):
                raise CheckError(f"{self.label}: tensor {tensor.name!r} names external data {location!r} outside the "
                                 "model's folder; keep the data file beside the model")
            if not where.is_file():
                raise CheckError(f"{self.label}: the weights live in the external data file {location!r}, which is not "
                                 f"beside the model ({where}); copy it there")
            try:
                offset = int(info.get("offset", 0))
                length = int(info.get("length", tensor_nbytes(tensor)))
            except ValueError:
                raise CheckError(f"{self.label}: tensor {tensor.name!r} has a malformed external data offset or "
                                 "length; the file is damaged") from None
            if offset < 0 or length < 0 or offset + length > where.stat().st_size:
                raise CheckError(f"{self.label}: the external data file {location!r} is shorter than the model says "
                                 f"({where.stat().st_size} bytes, tensor {tensor.name!r} ends at {offset + length}); "
                                 "it is truncated: copy it again")

    # -- weights, on request -----------------------------------------------------------------
    def full_proto(self) -> onnx.ModelProto:
        """The ModelProto with every weight in memory (one copy, kept for the next runner that asks); outputs
        check added to the in-memory graph (``add_layer_outputs``, ``with_outputs``) are in it too."""
        if self._full is None:
            self._full = onnx.load(str(self.path))
            if self.added_outputs:  # the in-memory graph's nodes and outputs, over the file's weights
                for field in ("node", "output"):
                    del getattr(self._full.graph, field)[:]
                    getattr(self._full.graph, field).extend(getattr(self.proto.graph, field))
        return self._full

    def with_outputs(self, values: dict[str, int]) -> ModelFile:
        """A view of this file whose in-memory graph also outputs ``values`` (name -> elem type), as an Identity
        each (the file and this ModelFile are unchanged), for one more run of a runner; ``view.outputs_of`` maps
        each value to its output."""
        from onnx import helper

        proto = onnx.ModelProto()
        proto.CopyFrom(self.proto)  # the graph only, when the weights are external
        added = []
        for k, (name, elem_type) in enumerate(values.items()):
            out = f"rope_export.value.{k}"
            proto.graph.node.append(helper.make_node("Identity", [name], [out], name=f"rope_export.value.identity.{k}"))
            proto.graph.output.append(helper.make_tensor_value_info(out, elem_type, None))
            added.append(out)
        view = ModelFile(proto, self.path, self.weights_loaded)
        view.contrib_ops, view.added_outputs = self.contrib_ops, [*self.added_outputs, *added]
        view.outputs_of = dict(zip(values, added, strict=True))  # value -> the graph output that carries it
        return view

    def add_layer_outputs(self, names: list[str], elem_type: int) -> list[str]:
        """Make the values after each decoder layer graph outputs of the in-memory graph (never of the file),
        for every runner that runs it; the file's own outputs (``self.outputs``) are unchanged."""
        from rope_export.check.layer_errors import add_layer_outputs

        if self.path is None and not self.added_outputs:  # the caller's ModelProto is not ours to change
            copy = onnx.ModelProto()
            copy.CopyFrom(self.proto)
            self.proto = copy
            if self.weights_loaded:
                self._full = copy
        self.added_outputs = add_layer_outputs(self.proto.graph, names, elem_type)
        if self._full is not None and self._full is not self.proto:
            add_layer_outputs(self._full.graph, names, elem_type)
        return self.added_outputs

    def release(self) -> None:
        """Drop the in-memory weights (when they were loaded for a runner) before the next one runs."""
        if not self.weights_loaded:
            self._full = None

    def tensor(self, name: str) -> np.ndarray:
        """One initializer's values, reading its external data alone."""
        for tensor in self.proto.graph.initializer:
            if tensor.name == name:
                base = str(self.base_dir) if self.base_dir is not None else ""
                return onnx.numpy_helper.to_array(tensor, base_dir=base)
        raise KeyError(name)

    def initializer(self, name: str) -> onnx.TensorProto | None:
        return next((t for t in self.proto.graph.initializer if t.name == name), None)

    # -- static information ------------------------------------------------------------------
    def value_type(self, name: str) -> TensorSpec | None:
        """Type and dims of any value (shape inference on the weight-free graph, once)."""
        if self._value_types is not None and name not in self._value_types and not self._inferred:
            self._value_types = None  # a value the file's value_info does not type: infer them all, once
            self._inferred = True
        if self._value_types is None:
            graph = self.proto.graph
            values = list(graph.value_info)
            if self._inferred or len(values) < len(graph.node) // 2:  # sparse value_info: infer it (the graph only)
                try:
                    values = list(onnx.shape_inference.infer_shapes(_graph_only(self.proto)).graph.value_info)
                except Exception:  # noqa: BLE001 - inference is best effort here
                    pass
            types = {v.name: tensor_spec(v) for v in [*values, *graph.input, *graph.output]}
            for t in graph.initializer:
                types[t.name] = TensorSpec(t.name, t.data_type, tuple(t.dims))
            self._value_types = types
        return self._value_types.get(name)

    def nodes_by_output(self) -> dict[str, onnx.NodeProto]:
        return {out: node for node in self.proto.graph.node for out in node.output if out}


CONTRIB_DOMAIN = "com.microsoft"


def onnxruntime_contrib_ops(proto: onnx.ModelProto) -> list[str]:
    """The file's ops that onnx does not define and onnxruntime does (its contrib ops, as onnxruntime's
    transformer optimizer and onnxruntime-genai write them): ``com.microsoft::Op``, or ``Op`` alone for
    those onnxruntime registers in the ai.onnx domain (SimplifiedLayerNormalization)."""
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
    found = set()
    for node in proto.graph.node:
        if node.domain == CONTRIB_DOMAIN:
            found.add(f"{CONTRIB_DOMAIN}::{node.op_type}")
        elif node.domain in ("", "ai.onnx") and opset is not None \
                and not onnx.defs.has(node.op_type, opset, "") and node.op_type in _onnxruntime_onnx_domain_ops():
            found.add(node.op_type)
    return sorted(found)


@functools.cache
def _onnxruntime_onnx_domain_ops() -> frozenset[str]:
    try:
        from onnxruntime.capi import onnxruntime_pybind11_state as ort_c

        return frozenset(s.name for s in ort_c.get_all_operator_schema() if s.domain in ("", "ai.onnx"))
    except (ImportError, AttributeError):  # an onnxruntime build without schemas: the checker decides alone
        return frozenset()


def _checker_view(proto: onnx.ModelProto, ops: set[str]) -> onnx.ModelProto:
    """What onnx.checker can read of a file with onnxruntime's ai.onnx-domain contrib ops: those nodes in
    the com.microsoft domain (the checker leaves a domain it does not know alone), every initializer a
    typed graph input (no weight is copied or read)."""
    view = onnx.ModelProto()
    view.CopyFrom(onnx.ModelProto(ir_version=proto.ir_version, opset_import=proto.opset_import,
                                  functions=proto.functions))
    graph = view.graph
    graph.name = proto.graph.name
    graph.node.extend(proto.graph.node)
    for node in graph.node:
        if node.domain in ("", "ai.onnx") and node.op_type in ops:
            node.domain = CONTRIB_DOMAIN
    if not any(o.domain == CONTRIB_DOMAIN for o in view.opset_import):
        view.opset_import.append(helper.make_opsetid(CONTRIB_DOMAIN, 1))
    declared = {v.name for v in proto.graph.input}
    graph.input.extend(proto.graph.input)
    graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                       for t in proto.graph.initializer if t.name not in declared)
    graph.output.extend(proto.graph.output)
    graph.value_info.extend(proto.graph.value_info)
    return view


def _graph_only(proto: onnx.ModelProto) -> onnx.ModelProto:
    """A copy with external-data initializers kept as references (never their bytes)."""
    if proto.ByteSize() < PROTOBUF_LIMIT:
        return proto
    raise CheckError("the model's graph alone is past protobuf's 2 GB limit; keep the weights as external data")


def memory_limit_bytes(limit_gb: float | None = None) -> int:
    """The most ``check`` lets one plan take (a case's tensors, the reference model, one onnxruntime session):
    the flag, else the memory available now (``bounds.available_memory``, as export's checks use)."""
    if limit_gb is not None:
        return int(limit_gb * 1e9)  # decimal GB, as every size check prints
    from rope_export.common.bounds import available_memory

    return available_memory() or 16 * 2**30


def require_memory(what: str, nbytes: float, limit: int) -> None:
    """Refuse, before allocating, a plan that would take more than ``limit`` bytes."""
    if nbytes > limit:
        raise CheckError(f"{what} would allocate about {format_bytes(nbytes)}, more than the "
                         f"{format_bytes(limit)} check allows here "
                         "(--memory-limit GB raises it); fix the sizes or the file's metadata")


def free_memory(weight_bytes: int) -> None:
    """Collect reference cycles now when what was just dropped held a model's weights, so the next
    runner finds the room. A full collection costs about a second once transformers is imported,
    so small files skip it."""
    if weight_bytes > BIG_WEIGHTS:
        gc.collect()
        _trim_heap()


def _trim_heap() -> None:
    """Give freed heap pages back to the system (glibc's malloc_trim), so that the next runner or piece finds the
    room that the last one's weights held (freed memory may otherwise stay resident in the allocator's arenas)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):  # not glibc: nothing to trim this way
        pass
