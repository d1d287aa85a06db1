"""The PyTorch reference of the rotary op contract (rope_export.op.contract).

Every other implementation is compared with this function. It is written for clarity, not
speed: resolve the geometry, gather per-token cos/sin, rotate in float32, cast back, and select
X itself for tokens whose position is outside the cache (the contract's pass-through: a select,
not an identity rotation, so inf and nan come through bit for bit: inf * 1 - x * 0 would not).
"""

from __future__ import annotations

import torch

from rope_export.op.contract import RotaryAttrs, RotaryContractError, check_dtypes, resolve_shape

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype) or str(dtype).removeprefix("torch.")


def per_token_caches(
    cos_cache: torch.Tensor, sin_cache: torch.Tensor, position_ids: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """[B, S, rd/2] float32 cos/sin and the [B, S] mask of tokens inside the cache (None: all).

    Rows of out-of-range tokens are row 0 (never used: those tokens are passed through)."""
    if position_ids is None:
        return cos_cache.float(), sin_cache.float(), None
    max_pos = cos_cache.shape[0]
    valid = (position_ids >= 0) & (position_ids < max_pos)
    safe = torch.where(valid, position_ids, torch.zeros_like(position_ids))
    return cos_cache.float()[safe], sin_cache.float()[safe], valid


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate the last dim of float32 ``x`` (rd channels) by cos/sin (rd/2 channels, broadcast)."""
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def rotary_embedding(
    x: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    *,
    interleaved: bool = False,
    num_heads: int = 0,
    rotary_embedding_dim: int = 0,
) -> torch.Tensor:
    """Apply RoPE to ``x`` exactly as the op contract says; returns a tensor of x's dtype."""
    attrs = RotaryAttrs(bool(interleaved), int(num_heads), int(rotary_embedding_dim))
    shape = resolve_shape(
        tuple(x.shape),
        tuple(cos_cache.shape),
        tuple(sin_cache.shape),
        None if position_ids is None else tuple(position_ids.shape),
        attrs,
    )
    if cos_cache.dtype != sin_cache.dtype:
        raise RotaryContractError(
            f"cos_cache ({dtype_name(cos_cache.dtype)}) and sin_cache ({dtype_name(sin_cache.dtype)}) "
            "must have the same dtype"
        )
    check_dtypes(
        dtype_name(x.dtype),
        dtype_name(cos_cache.dtype),
        None if position_ids is None else dtype_name(position_ids.dtype),
    )
    cos, sin, valid = per_token_caches(cos_cache, sin_cache, position_ids)
    # View X as [B, S, H, D] so cos/sin [B, S, 1, rd/2] broadcast over heads.
    if shape.layout == "bhsd":
        xs = x.transpose(1, 2)
    else:
        xs = x.reshape(shape.batch, shape.seq, shape.heads, shape.head_dim)
    rd = shape.rotary_dim
    rotated = rotate(xs[..., :rd].float(), cos.unsqueeze(2), sin.unsqueeze(2), attrs.interleaved)
    out = torch.cat((rotated.to(x.dtype), xs[..., rd:]), dim=-1)
    if valid is not None:
        out = torch.where(valid[:, :, None, None], out, xs)  # pass-through: X itself, bit for bit
    if shape.layout == "bhsd":
        return out.transpose(1, 2).contiguous()
    return out.reshape(x.shape)
