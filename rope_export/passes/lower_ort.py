"""Lowering rule ``ort``: onnxruntime's contrib op ``com.microsoft`` RotaryEmbedding (version 1).

Its schema (onnxruntime ``bert_defs.cc``): inputs ``input`` (3-D [B, S, H*D] or 4-D [B, H, S, D]),
``position_ids`` (int64, [B, S] or a 1-element offset), ``cos_cache``/``sin_cache`` 2-D
[max_pos, rd/2] of X's type (with float32 caches under half X the op runs in float32 between two
Casts of X, see ``_lower_base.math_dtype``); attributes ``interleaved``, ``num_heads`` (required when
``rotary_embedding_dim`` is set), ``rotary_embedding_dim``, ``scale``, ``is_packed_batching``.

Position ids are mandatory and the caches must be 2-D, so per-token caches (the contract's form
without position_ids, and the guarded form) are flattened to [B*S, rd/2] (``Flatten``) and indexed
with ids ``b*S + s`` built by broadcasting (no Reshape: a Reshape to [B, S] or [-1, rd/2] fails
at batch 0 or seq 0 without ``allowzero``); at batch 0 the rows get S zero rows appended, since the
kernel refuses a cache with fewer rows than tokens per sequence. Guarding works as in the ``onnx`` lowering (a select
of X for out-of-range tokens); with
``guard_positions=False`` and position_ids present the op gets them directly (onnxruntime's CPU
kernel then rejects out-of-range positions, its CUDA kernel passes the token through).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from rope_export.passes._lower_base import LowerRotary, RotarySite, SiteError, cast_if, const, math_dtype
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
                "com.microsoft RotaryEmbedding has a bfloat16 kernel on onnxruntime's CUDA provider only"
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
            batch = op.Gather(shape, const(op, 0), axis=0)
            seq = op.Gather(shape, const(op, 1), axis=0)
            rows = op.Unsqueeze(op.Mul(op.Range(const(op, 0), batch, const(op, 1)), seq), const(op, [1]))
            cols = op.Unsqueeze(op.Range(const(op, 0), seq, const(op, 1)), const(op, [0]))
            ids = op.Add(rows, cols)  # [B, S] = b*S + s, also when B or S is 0
            # The kernel refuses fewer cache rows than tokens per sequence (B*S < S only at batch 0):
            # append S zero rows then (never read: there is no token). Costs a copy of the rows.
            spare = op.Mul(seq, op.Cast(op.Equal(batch, const(op, 0)), to=ir.DataType.INT64))
            width = op.Slice(shape, const(op, [2]), const(op, [3]), const(op, [0]))
            zero = op.Constant(value=ir.tensor(np.zeros((1, 1), dtype=dtype.numpy())))  # any dtype, unlike
            zeros = op.Expand(zero, op.Concat(op.Unsqueeze(spare, const(op, [0])), width, axis=0))  # ConstantOfShape
            self._memo[key] = (ids, op.Concat(op.Flatten(cos, axis=2), zeros, axis=0),
                               op.Concat(op.Flatten(sin, axis=2), zeros, axis=0))
        ids, rows_cos, rows_sin = self._memo[key]
        y = op.RotaryEmbedding(x, ids, rows_cos, rows_sin, _domain=MS_DOMAIN, _version=1, _name=name, **attrs)
        return self.select_and_cast(op, site, y, dtype)

    @classmethod
    def prepare(cls, model: ir.Model) -> ir.Model:
        require_onnx_opset(model, 13, "the ort lowering")
        return model
