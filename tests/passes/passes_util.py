"""Helpers for the graph-pass tests: small models with the custom node, runners, references.

Runners: onnxruntime CPU (``run_ort``) and onnx.reference (``run_reference``, which also knows the
rope_export node, the ``trt-plugin`` node and ``com.microsoft`` RotaryEmbedding through the OpRun
classes below). References: ``rope_export.op.reference`` (PyTorch) for the custom op's contract.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from rope_export.op.contract import DOMAIN, RotaryAttrs
from rope_export.op.nodes import PLUGIN_NAME, TRT_PLUGIN_DOMAIN
from rope_export.op.onnx_op import RotaryEmbedding as RopeOpRun
from rope_export.op.onnx_op import make_rotary_node, rotary_numpy
from rope_export.op.reference import rotary_embedding
from rope_export.runtimes.contract_runners import to_numpy, to_torch

NP_TYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
ONNX_TYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
TORCH_TYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class TrtPluginRotary(OpRun):
    """The trt-plugin node for onnx.reference: the contract, ignoring the routing attributes."""

    op_domain = TRT_PLUGIN_DOMAIN
    op_name = PLUGIN_NAME

    def _run(self, X, cos_cache, sin_cache, position_ids=None, interleaved=None, num_heads=None,
             rotary_embedding_dim=None, plugin_namespace=None, plugin_version=None):
        assert plugin_namespace == "rope_export" and plugin_version == "1"
        return (rotary_numpy(X, cos_cache, sin_cache, position_ids, interleaved=interleaved or 0,
                             num_heads=num_heads or 0, rotary_embedding_dim=rotary_embedding_dim or 0),)


TrtPluginRotary.__name__ = PLUGIN_NAME


class MsRotary(OpRun):
    """com.microsoft RotaryEmbedding as onnxruntime's CPU kernel computes it (written from its
    schema and kernel, checked against onnxruntime in test_passes_lower_ort.py), for bfloat16."""

    op_domain = "com.microsoft"

    def _run(self, X, position_ids, cos_cache, sin_cache, interleaved=None, num_heads=None,
             rotary_embedding_dim=None, scale=None, is_packed_batching=None):
        assert cos_cache.dtype == X.dtype == sin_cache.dtype, "the contrib op needs caches of X's type"
        assert cos_cache.ndim == 2
        if X.ndim == 4:
            batch, heads, seq, head = X.shape
            xs = np.transpose(X, (0, 2, 1, 3))
        else:
            batch, seq, hidden = X.shape
            heads = num_heads or hidden // (2 * cos_cache.shape[1])
            head = hidden // heads
            xs = X.reshape(batch, seq, heads, head)
        rd = rotary_embedding_dim or 2 * cos_cache.shape[1]
        if position_ids.size == 1:
            pos = np.arange(seq)[None, :] + int(position_ids.reshape(-1)[0])
            pos = np.broadcast_to(pos, (batch, seq))
        else:
            pos = position_ids
        if pos.min() < 0 or pos.max() >= cos_cache.shape[0]:
            raise ValueError("position_ids out of range")
        cos = cos_cache[pos].astype(np.float32)[:, :, None, :]
        sin = sin_cache[pos].astype(np.float32)[:, :, None, :]
        rot = xs[..., :rd].astype(np.float32)
        x1, x2 = (rot[..., 0::2], rot[..., 1::2]) if interleaved else (rot[..., : rd // 2], rot[..., rd // 2 :])
        y1, y2 = x1 * cos - x2 * sin, x1 * sin + x2 * cos
        out = xs.copy()
        if interleaved:
            out[..., 0:rd:2], out[..., 1:rd:2] = y1.astype(X.dtype), y2.astype(X.dtype)
        else:
            out[..., : rd // 2], out[..., rd // 2 : rd] = y1.astype(X.dtype), y2.astype(X.dtype)
        if X.ndim == 4:
            return (np.ascontiguousarray(np.transpose(out, (0, 2, 1, 3))),)
        return (out.reshape(X.shape),)


MsRotary.__name__ = "RotaryEmbedding"


def run_reference(model, feeds: dict) -> list[np.ndarray]:
    return ReferenceEvaluator(model, new_ops=[RopeOpRun, TrtPluginRotary, MsRotary]).run(None, feeds)


def session(model) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else model
    return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])


def run_ort(model, feeds: dict) -> list[np.ndarray]:
    return session(model).run(None, feeds)


def reference_output(x, cos, sin, pos, attrs: RotaryAttrs) -> np.ndarray:
    """rope_export.op.reference (PyTorch) on NumPy inputs; returns X's NumPy dtype."""
    def t(a):
        return None if a is None else to_torch(a)

    y = rotary_embedding(t(x), t(cos), t(sin), t(pos), interleaved=attrs.interleaved, num_heads=attrs.num_heads,
                         rotary_embedding_dim=attrs.rotary_embedding_dim)
    return to_numpy(y)


def rotary_case(layout: str = "bhsd", x_dtype: str = "float32", cache_dtype: str = "float32", rd: int = 0,
                interleaved: bool = False, with_pos: bool = True, batch: int = 2, heads: int = 3, seq: int = 5,
                head_dim: int = 16, max_pos: int = 12, opset: int = 17, seed: int = 0, out_of_range: bool = True,
                multi_node: bool = False, static_dims: bool = True, angles: bool = False):
    """(model, feeds, expected): one custom node (or MatMul -> node -> Add) with caches as initializers.

    ``out_of_range``: positions span [-2, max_pos + 2) so the contract's pass-through is exercised.
    ``angles``: caches are cos/sin of random angles (what ``rope-export lower`` accepts), not any
    values in [-1, 1] (what the op's math alone is tested with).
    """
    rng = np.random.default_rng(seed)
    nh = heads if layout == "bsd" else 0
    attrs = RotaryAttrs(interleaved, nh, rd)
    xt, ct = ONNX_TYPES[x_dtype], ONNX_TYPES[cache_dtype]
    xshape = [batch, heads, seq, head_dim] if layout == "bhsd" else [batch, seq, heads * head_dim]
    sym = xshape if static_dims else (["b", heads, "s", head_dim] if layout == "bhsd" else ["b", "s", heads * head_dim])
    half = (rd or head_dim) // 2
    inputs, inits, nodes = [], [], []
    x_name = "x"
    if multi_node:
        inputs.append(helper.make_tensor_value_info("x_in", xt, sym))
        w = np.eye(head_dim if layout == "bhsd" else heads * head_dim).astype(NP_TYPES[x_dtype]) * 2
        inits.append(numpy_helper.from_array(w, "w"))
        nodes.append(helper.make_node("MatMul", ["x_in", "w"], ["x"], name="proj"))
    else:
        inputs.append(helper.make_tensor_value_info("x", xt, sym))
    x = (rng.standard_normal(xshape) * 0.5).astype(NP_TYPES[x_dtype])
    feeds = {"x_in" if multi_node else "x": x}
    if with_pos:
        cos, sin = _caches(rng, (max_pos, half), cache_dtype, angles)
        inits += [numpy_helper.from_array(cos, "cos"), numpy_helper.from_array(sin, "sin")]
        low, high = (-2, max_pos + 2) if out_of_range else (0, max_pos)
        pos = rng.integers(low, high, (batch, seq)).astype(np.int64)
        pos_shape = [batch, seq] if static_dims else ["b", "s"]
        inputs.append(helper.make_tensor_value_info("pos", TensorProto.INT64, pos_shape))
        feeds["pos"] = pos
    else:
        cos, sin = _caches(rng, (batch, seq, half), cache_dtype, angles)
        cshape = [batch, seq, half] if static_dims else ["b", "s", half]
        inputs += [helper.make_tensor_value_info("cos", ct, cshape), helper.make_tensor_value_info("sin", ct, cshape)]
        feeds.update(cos=cos, sin=sin)
        pos = None
    y_name = "y_rot" if multi_node else "y"
    nodes.append(make_rotary_node(x_name, "cos", "sin", "pos" if with_pos else None, y_name, attrs, name="rope_q"))
    if multi_node:
        nodes.append(helper.make_node("Add", ["y_rot", "x"], ["y"], name="residual"))
    graph = helper.make_graph(nodes, "rotary_case", inputs, [helper.make_tensor_value_info("y", xt, sym)],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(DOMAIN, 1)],
                              ir_version=10)
    x_eff = x.astype(np.float32) * 2 if multi_node else x
    x_eff = x_eff.astype(NP_TYPES[x_dtype])
    expected = reference_output(x_eff, cos, sin, pos, attrs)
    if multi_node:
        expected = (expected.astype(np.float32) + x_eff.astype(np.float32)).astype(NP_TYPES[x_dtype])
    return model, feeds, expected


def _caches(rng, shape, dtype: str, angles: bool) -> tuple[np.ndarray, np.ndarray]:
    if angles:
        theta = rng.uniform(-np.pi, np.pi, shape)
        return np.cos(theta).astype(NP_TYPES[dtype]), np.sin(theta).astype(NP_TYPES[dtype])
    return (rng.uniform(-1, 1, shape).astype(NP_TYPES[dtype]), rng.uniform(-1, 1, shape).astype(NP_TYPES[dtype]))


def ops_of(model: onnx.ModelProto) -> set[tuple[str, str]]:
    return {(n.domain or "", n.op_type) for n in model.graph.node}


def as_f32(a) -> np.ndarray:
    return np.asarray(a).astype(np.float32)
