"""The rotary op in ONNX: the ``rope_export`` domain schema and an ``onnx.reference`` kernel.

``register_schema()`` (idempotent, called on import of this module) makes ``onnx.checker`` (full
check) and ``onnx.shape_inference`` understand ``rope_export::RotaryEmbedding`` version 1, and lets
onnxscript build the node. ``RotaryEmbedding`` is an ``OpRun`` so that
``ReferenceEvaluator(model, new_ops=[RotaryEmbedding])`` runs our files with no lowering; it is
a NumPy implementation of the contract written separately from the PyTorch reference, so the two
check each other.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import defs, helper
from onnx.reference.op_run import OpRun

from rope_export.op.contract import (
    DOMAIN,
    OP_TYPE,
    OP_VERSION,
    RotaryAttrs,
    RotaryContractError,
    check_dtypes,
    resolve_shape,
)

_FLOAT_TYPES = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]


def _infer(ctx) -> None:
    # The output has X's type and shape; the checks on shapes live in the contract and kernels.
    ctx.set_output_type(0, ctx.get_input_type(0))


def _schema() -> defs.OpSchema:
    P = defs.OpSchema.FormalParameter
    Option = defs.OpSchema.FormalParameterOption
    schema = defs.OpSchema(
        OP_TYPE,
        DOMAIN,
        OP_VERSION,
        doc=(
            "Rotary position embedding with the semantics of ai.onnx RotaryEmbedding-23, plus: caches may be "
            "float32 under float16/bfloat16 X, and positions outside [0, max_pos) pass the token through "
            "unchanged (see rope_export.op.contract)."
        ),
        inputs=[
            P("X", "T", "[B, H, S, D], or [B, S, H*D] with num_heads"),
            P("cos_cache", "U", "[max_pos, rd/2] with position_ids, else [B, S, rd/2]"),
            P("sin_cache", "U", "same shape as cos_cache"),
            P("position_ids", "M", "int64 [B, S]", param_option=Option.Optional),
        ],
        outputs=[P("Y", "T", "X rotated; same shape and type as X")],
        type_constraints=[
            ("T", _FLOAT_TYPES, "X and Y"),
            ("U", _FLOAT_TYPES, "caches: X's type or float32"),
            ("M", ["tensor(int64)"], "position ids"),
        ],
        attributes=[
            defs.OpSchema.Attribute("interleaved", helper.make_attribute("interleaved", 0), "1: pairs (2i, 2i+1)"),
            defs.OpSchema.Attribute("num_heads", helper.make_attribute("num_heads", 0), "needed for 3-D X"),
            defs.OpSchema.Attribute(
                "rotary_embedding_dim", helper.make_attribute("rotary_embedding_dim", 0), "0: the whole head"
            ),
        ],
    )
    schema.set_type_and_shape_inference_function(_infer)
    return schema


def register_schema() -> None:
    try:
        defs.get_schema(OP_TYPE, OP_VERSION, DOMAIN)
    except defs.SchemaError:
        defs.register_schema(_schema())


register_schema()


def make_rotary_node(
    x: str, cos: str, sin: str, position_ids: str | None, output: str, attrs: RotaryAttrs, name: str | None = None
) -> onnx.NodeProto:
    inputs = [x, cos, sin] + ([position_ids] if position_ids else [])
    return helper.make_node(OP_TYPE, inputs, [output], name=name, domain=DOMAIN, **attrs.as_onnx_attributes())


def rotary_numpy(x, cos_cache, sin_cache, position_ids=None, *, interleaved=0, num_heads=0, rotary_embedding_dim=0):
    """The op contract in NumPy (any float storage, float32 math)."""
    attrs = RotaryAttrs(bool(interleaved), int(num_heads or 0), int(rotary_embedding_dim or 0))
    shape = resolve_shape(
        x.shape, cos_cache.shape, sin_cache.shape, None if position_ids is None else position_ids.shape, attrs
    )
    if cos_cache.dtype != sin_cache.dtype:
        raise RotaryContractError(
            f"cos_cache ({cos_cache.dtype.name}) and sin_cache ({sin_cache.dtype.name}) must have the same dtype"
        )
    check_dtypes(x.dtype.name, cos_cache.dtype.name, None if position_ids is None else position_ids.dtype.name)
    cos, sin = cos_cache.astype(np.float32), sin_cache.astype(np.float32)
    valid = None  # [B, S]: tokens whose position lies in the cache; None: all (per-token caches)
    if position_ids is not None:
        valid = (position_ids >= 0) & (position_ids < shape.max_pos)
        rows = np.where(valid, position_ids, 0)
        cos, sin = cos[rows], sin[rows]
    # [B, S, H, D] view of X; cos/sin [B, S, 1, rd/2]
    if shape.layout == "bhsd":
        xs = np.transpose(x, (0, 2, 1, 3))
    else:
        xs = x.reshape(shape.batch, shape.seq, shape.heads, shape.head_dim)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    rd, half = shape.rotary_dim, shape.rotary_dim // 2
    rot = xs[..., :rd].astype(np.float32)
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
    y1, y2 = x1 * cos - x2 * sin, x1 * sin + x2 * cos
    out = np.array(xs, copy=True)
    if interleaved:
        out[..., 0:rd:2], out[..., 1:rd:2] = y1.astype(x.dtype), y2.astype(x.dtype)
    else:
        out[..., :half], out[..., half:rd] = y1.astype(x.dtype), y2.astype(x.dtype)
    if valid is not None:  # the contract's pass-through is a copy (inf and nan bit for bit), not a rotation
        out = np.where(valid[:, :, None, None], out, xs)
    if shape.layout == "bhsd":
        return np.ascontiguousarray(np.transpose(out, (0, 2, 1, 3)))
    return out.reshape(x.shape)


class RotaryEmbedding(OpRun):
    """``onnx.reference`` kernel for rope_export::RotaryEmbedding (pass in ``new_ops``)."""

    op_domain = DOMAIN

    def _run(self, X, cos_cache, sin_cache, position_ids=None, interleaved=None, num_heads=None,
             rotary_embedding_dim=None):
        return (
            rotary_numpy(
                X,
                cos_cache,
                sin_cache,
                position_ids,
                interleaved=interleaved or 0,
                num_heads=num_heads or 0,
                rotary_embedding_dim=rotary_embedding_dim or 0,
            ),
        )
