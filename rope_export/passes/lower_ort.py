"""Lowering rule ``ort``: onnxruntime's contrib op ``com.microsoft`` RotaryEmbedding (version 1).

Its schema (onnxruntime ``bert_defs.cc``): inputs ``input`` (3-D [B, S, H*D] or 4-D [B, H, S, D]),
``position_ids`` (int64, [B, S] or a 1-element offset), ``cos_cache``/``sin_cache`` 2-D
[max_pos, rd/2] of X's type (with float32 caches under half X the op runs in float32 between two
Casts of X, see ``_lowering.math_dtype``); attributes ``interleaved``, ``num_heads`` (required when
``rotary_embedding_dim`` is set), ``rotary_embedding_dim``, ``scale``, ``is_packed_batching``.

Position ids are mandatory and the caches must be 2-D, so per-token caches (the contract's form
without position_ids, and the guarded form) are flattened to [B*S, rd/2] and indexed with
``arange(B*S).reshape(B, S)``. Guarding works as in the ``onnx`` lowering; with
``guard_positions=False`` and position_ids present the op gets them directly (onnxruntime's CPU
kernel then rejects out-of-range positions, its CUDA kernel passes the token through).
"""

from __future__ import annotations

import onnx_ir as ir

from rope_export.passes._lowering import LowerRotary, RotarySite, SiteError, cast_if, const, math_dtype
from rope_export.passes._model import require_onnx_opset

MS_DOMAIN = "com.microsoft"


class LowerToOrt(LowerRotary):
    target = "ort"

    def check_site(self, site: RotarySite) -> None:
        if site.partial and site.rank == 4 and site.heads is None:
            raise SiteError(
                "the ort target needs num_heads for partial rotary, and this 4-D X has no static head count; "
                "use --target onnx or --target decomposed (or give X a static head dimension)"
            )
        if math_dtype(site) == ir.DataType.BFLOAT16:
            self.log.note(
                "com.microsoft RotaryEmbedding has a bfloat16 kernel on onnxruntime's CUDA provider only; for "
                "onnxruntime CPU lower with --target decomposed"
            )

    def emit(self, op, site: RotarySite) -> ir.Value:
        attrs = {"interleaved": int(site.attrs.interleaved)}
        heads = site.attrs.num_heads or site.heads
        if heads:
            attrs["num_heads"] = int(heads)
        if site.partial:
            attrs["rotary_embedding_dim"] = int(site.attrs.rotary_embedding_dim)
        name = site.node.name or None
        dtype = math_dtype(site)
        x = cast_if(op, site.x, site.x_dtype, dtype)
        if site.position_ids is not None and not self.guard_positions:
            cos = cast_if(op, site.cos, site.cache_dtype, dtype)
            sin = cast_if(op, site.sin, site.cache_dtype, dtype)
            y = op.RotaryEmbedding(x, site.position_ids, cos, sin, _domain=MS_DOMAIN, _version=1, _name=name, **attrs)
            return cast_if(op, y, dtype, site.x_dtype)
        key = ("ort-rows", site.cos, site.sin, site.position_ids, dtype)
        if key not in self._memo:
            cos, sin = self.per_token(op, site, dtype)  # [B, S, rd/2]
            shape = op.Shape(cos)
            flat = op.Concat(const(op, [-1]), op.Slice(shape, const(op, [2]), const(op, [3]), const(op, [0])), axis=0)
            batch_seq = op.Slice(shape, const(op, [0]), const(op, [2]), const(op, [0]))
            count = op.ReduceProd(batch_seq, keepdims=0)
            ids = op.Reshape(op.Range(const(op, 0), count, const(op, 1)), batch_seq)  # [B, S] = b*S + s
            self._memo[key] = (ids, op.Reshape(cos, flat), op.Reshape(sin, flat))
        ids, rows_cos, rows_sin = self._memo[key]
        y = op.RotaryEmbedding(x, ids, rows_cos, rows_sin, _domain=MS_DOMAIN, _version=1, _name=name, **attrs)
        return cast_if(op, y, dtype, site.x_dtype)

    @classmethod
    def prepare(cls, model: ir.Model) -> ir.Model:
        require_onnx_opset(model, 13, "the ort lowering")
        return model
