"""Runners for polygraphy's ``Comparator`` that polygraphy lacks: onnx.reference with our op and
the file run with the plugin's CPU twin; plus the torch/NumPy
conversions (bfloat16 included) the checks share.

Each runner is a polygraphy ``BaseRunner``; ``rope_export.check.runners`` builds them beside
polygraphy's own onnxruntime and TensorRT runners. Optional backends are imported lazily, so this
module imports without them.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import numpy as np
import onnx
import torch
from polygraphy.backend.base import BaseRunner
from polygraphy.common import TensorMetadata

from rope_export.op import contract
from rope_export.op.nodes import PLUGIN_OP_TYPES, TRT_PLUGIN_DOMAIN
from rope_export.op.onnx_op import rotary_numpy

# (domain, op_type) of the nodes that carry the op contract: ours, and the trt-plugin form (current and
# pre-rename op type); OpRun classes are matched by these two alone.
CONTRACT_OPS = ((contract.DOMAIN, contract.OP_TYPE), *((TRT_PLUGIN_DOMAIN, t) for t in PLUGIN_OP_TYPES))


def to_torch(array: np.ndarray) -> torch.Tensor:
    """NumPy (ml_dtypes bfloat16 included) to torch, keeping the storage dtype."""
    if str(array.dtype) == "bfloat16":  # ml_dtypes; torch.from_numpy does not know it
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)).to(torch.bfloat16)
    return torch.from_numpy(np.array(array))  # a copy: feeds may be read-only


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.detach().float().numpy().astype(ml_dtypes.bfloat16)
    return tensor.detach().numpy()


def graph_input_metadata(model: onnx.ModelProto) -> TensorMetadata:
    meta = TensorMetadata()
    initializers = {i.name for i in model.graph.initializer}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        tensor_type = value.type.tensor_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
        shape = [d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim]
        meta.add(value.name, dtype, shape)
    return meta


class _TimedRunner(BaseRunner):
    """A runner over an ONNX model's I/O whose ``run(feeds)`` returns outputs in graph order."""

    def __init__(self, model: onnx.ModelProto, name: str):
        super().__init__(name=name)
        self.model = model
        self.output_names = [o.name for o in model.graph.output]

    def get_input_metadata_impl(self):
        return graph_input_metadata(self.model)

    def infer_impl(self, feed_dict):
        start = time.perf_counter()
        outputs = self.run(feed_dict)
        self.inference_time = time.perf_counter() - start
        return OrderedDict(zip(self.output_names, outputs, strict=True))

    def run(self, feed_dict) -> list[np.ndarray]:
        raise NotImplementedError


class OnnxReferenceRunner(_TimedRunner):
    """onnx.reference's ReferenceEvaluator; rotary nodes run by ``kernel`` (default: the NumPy twin)."""

    def __init__(self, model: onnx.ModelProto, name: str = "onnx-reference", kernel=rotary_numpy):
        super().__init__(model, name)
        self.op_classes = rotary_ops(kernel)

    def activate_impl(self):
        from onnx.reference import ReferenceEvaluator

        self.evaluator = ReferenceEvaluator(self.model, new_ops=self.op_classes)

    def run(self, feed_dict):
        return self.evaluator.run(None, dict(feed_dict))

    def deactivate_impl(self):
        del self.evaluator


def _twin_kernel(X, cos_cache, sin_cache, position_ids=None, *, interleaved=0, num_heads=0, rotary_embedding_dim=0):
    from rope_export.kernels import cpu_twin

    out = cpu_twin.rotary_embedding(
        to_torch(X),
        to_torch(cos_cache),
        to_torch(sin_cache),
        None if position_ids is None else to_torch(position_ids),
        interleaved=bool(interleaved),
        num_heads=int(num_heads),
        rotary_embedding_dim=int(rotary_embedding_dim),
    )
    return to_numpy(out)


def rotary_ops(kernel) -> list[type]:
    """OpRun classes running ``kernel`` for our node and for its trt-plugin form (same contract)."""
    from onnx.reference.op_run import OpRun

    classes = []
    for domain, op_type in CONTRACT_OPS:
        def _run(self, X, cos_cache, sin_cache, position_ids=None, interleaved=None, num_heads=None,
                 rotary_embedding_dim=None, plugin_namespace=None, plugin_version=None):
            # plugin_namespace/plugin_version only select the TensorRT plugin; they change nothing.
            return (kernel(X, cos_cache, sin_cache, position_ids, interleaved=interleaved or 0,
                           num_heads=num_heads or 0, rotary_embedding_dim=rotary_embedding_dim or 0),)

        # OpRun classes are matched by class name (the op type) and op_domain.
        classes.append(type(op_type, (OpRun,), {"op_domain": domain, "_run": _run}))
    return classes


class CpuTwinRunner(OnnxReferenceRunner):
    """The file with every rotary node (ours or its trt-plugin form) run by the plugin's CPU twin."""

    def __init__(self, model: onnx.ModelProto, name: str = "cpu-twin"):
        super().__init__(model, name, kernel=_twin_kernel)


def cuda_available_for_onnxruntime() -> bool:
    try:
        import onnxruntime
    except ImportError:
        return False
    return "CUDAExecutionProvider" in onnxruntime.get_available_providers()
