"""The rotary op contract: one source of truth for names, attributes and shape rules.

Semantics are those of the standard ONNX ``RotaryEmbedding`` (opset 23), plus two extensions:
caches may be float32 under float16/bfloat16 ``X``, and positions outside the cache are defined
(see ``OUT_OF_RANGE``). Every implementation (the PyTorch reference, the onnx.reference OpRun,
each lowering, the CUDA kernel and its CPU twin) follows this module.
"""

from __future__ import annotations

from dataclasses import dataclass

DOMAIN = "rope_export"
OP_TYPE = "RotaryEmbedding"
OP_VERSION = 1
TORCH_OP_NAME = "rope_export::rotary_embedding"

# What a position outside [0, max_pos) does: the token is passed through unchanged (copied bit for
# bit, inf and nan included: a select, not an identity rotation), and no implementation reads
# outside the cache. Chosen because a GPU
# kernel cannot raise, because onnxruntime's CUDA kernel already behaves so, and because it keeps
# padding positions (often -1) harmless. ``rope-export check`` feeds such positions on purpose.
OUT_OF_RANGE = "pass-through"

STORAGE_DTYPES = ("float32", "float16", "bfloat16")


class RotaryContractError(ValueError):
    """Inputs or attributes that break the rotary op contract; the message names the fix."""


@dataclass(frozen=True)
class RotaryAttrs:
    interleaved: bool = False
    num_heads: int = 0
    rotary_embedding_dim: int = 0

    def as_onnx_attributes(self) -> dict[str, int]:
        return {
            "interleaved": int(self.interleaved),
            "num_heads": int(self.num_heads),
            "rotary_embedding_dim": int(self.rotary_embedding_dim),
        }


@dataclass(frozen=True)
class RotaryShape:
    """The resolved geometry of one rotary application."""

    batch: int
    seq: int
    heads: int
    head_dim: int
    rotary_dim: int
    layout: str  # "bhsd" for 4-D X, "bsd" for 3-D X
    max_pos: int | None  # rows of the cache when position_ids are given, else None


def resolve_shape(
    x_shape: tuple[int, ...],
    cos_shape: tuple[int, ...],
    sin_shape: tuple[int, ...],
    position_ids_shape: tuple[int, ...] | None,
    attrs: RotaryAttrs,
) -> RotaryShape:
    """Check the shapes against the contract and return the geometry, or raise RotaryContractError."""
    x_shape, cos_shape, sin_shape = tuple(x_shape), tuple(cos_shape), tuple(sin_shape)
    if attrs.num_heads < 0 or attrs.rotary_embedding_dim < 0:
        raise RotaryContractError(
            f"num_heads ({attrs.num_heads}) and rotary_embedding_dim ({attrs.rotary_embedding_dim}) "
            "must be >= 0 (0 means: infer from X / rotate the whole head)"
        )
    if len(x_shape) == 4:
        batch, heads, seq, head_dim = x_shape
        if attrs.num_heads and attrs.num_heads != heads:
            raise RotaryContractError(
                f"num_heads={attrs.num_heads} but 4-D X [B, H, S, D] has H={heads}; "
                "set num_heads to 0 or to H"
            )
        layout = "bhsd"
    elif len(x_shape) == 3:
        batch, seq, hidden = x_shape
        if attrs.num_heads <= 0:
            raise RotaryContractError(
                "3-D X [B, S, H*D] needs the num_heads attribute; pass num_heads=H or give X as [B, H, S, D]"
            )
        if hidden % attrs.num_heads:
            raise RotaryContractError(
                f"3-D X has hidden size {hidden}, not a multiple of num_heads={attrs.num_heads}"
            )
        heads, head_dim = attrs.num_heads, hidden // attrs.num_heads
        layout = "bsd"
    else:
        raise RotaryContractError(
            f"X must be 4-D [B, H, S, D] or 3-D [B, S, H*D], got shape {list(x_shape)}"
        )
    rotary_dim = attrs.rotary_embedding_dim or head_dim
    if rotary_dim > head_dim:
        raise RotaryContractError(
            f"rotary_embedding_dim={rotary_dim} is larger than head_dim={head_dim}; "
            "use a value <= head_dim (0 rotates the whole head)"
        )
    if rotary_dim % 2:
        raise RotaryContractError(
            f"the rotated dimension must be even (channels rotate in pairs), got {rotary_dim}; "
            "use an even head_dim or rotary_embedding_dim"
        )
    half = rotary_dim // 2
    if cos_shape != sin_shape:
        raise RotaryContractError(
            f"cos_cache {list(cos_shape)} and sin_cache {list(sin_shape)} must have the same shape"
        )
    if position_ids_shape is not None:
        if tuple(position_ids_shape) != (batch, seq):
            raise RotaryContractError(
                f"position_ids must be [B, S] = [{batch}, {seq}], got {list(position_ids_shape)}"
            )
        if len(cos_shape) != 2 or cos_shape[1] != half:
            raise RotaryContractError(
                f"with position_ids the caches must be [max_pos, rotary_dim/2] = [max_pos, {half}], "
                f"got {list(cos_shape)}"
            )
        max_pos = cos_shape[0]
        if max_pos < 1:
            raise RotaryContractError("the caches have no rows (max_pos = 0)")
    else:
        if cos_shape != (batch, seq, half):
            raise RotaryContractError(
                f"without position_ids the caches must be per token, [B, S, rotary_dim/2] = "
                f"[{batch}, {seq}, {half}], got {list(cos_shape)}; pass position_ids to gather "
                "from a [max_pos, rotary_dim/2] cache"
            )
        max_pos = None
    return RotaryShape(batch, seq, heads, head_dim, rotary_dim, layout, max_pos)


def check_dtypes(x_dtype: str, cache_dtype: str, position_ids_dtype: str | None) -> None:
    """Names are numpy/torch style: float32, float16, bfloat16, int64."""
    if x_dtype not in STORAGE_DTYPES:
        raise RotaryContractError(f"X must be one of {STORAGE_DTYPES}, got {x_dtype}")
    if cache_dtype not in (x_dtype, "float32"):
        raise RotaryContractError(
            f"the caches must have X's dtype ({x_dtype}) or float32, got {cache_dtype}"
        )
    if position_ids_dtype is not None and position_ids_dtype != "int64":
        raise RotaryContractError(
            f"position_ids must be int64, got {position_ids_dtype}; cast them with .long()"
        )
