"""PyTorch building blocks: the rotary embedding module, a RoPE attention block, and the classic
additive sinusoidal position encoding (for comparisons).

Every rotation goes through ``rope_export.kernels.torch_op.rotary_embedding`` (the custom op), so an eager
run and an export execute the same op.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from rope_export.common import bounds
from rope_export.kernels import torch_op as ops
from rope_export.op.rope_types import RopeConfig, build_caches, cache_build_bytes, cache_rows, inv_freq_and_scaling


class AttentionConfigError(ValueError):
    """An attention shape that cannot be built; the message names the field (also in ``field``)."""

    def __init__(self, message: str, field: str | None = None, problem: str | None = None):
        super().__init__(message)
        self.field, self.problem = field, problem


def _attention_fail(field: str, problem: str):
    raise AttentionConfigError(f"attention field '{field}': {problem}", field, problem)


@dataclass(frozen=True)
class AttentionConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    o_bias: bool = False
    softmax_scale: float | None = None  # default head_dim ** -0.5

    def __post_init__(self) -> None:
        # Types, ranges and finiteness through rope_export.common.bounds: num_heads = true is not 1 head.
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim"):
            high = bounds.MAX_HEAD_DIM if name == "head_dim" else bounds.INT32_MAX
            bounds.check_int(name, getattr(self, name), 1, high, fail=_attention_fail)
        for name in ("qkv_bias", "o_bias"):
            bounds.check_bool(name, getattr(self, name), fail=_attention_fail)
        if self.softmax_scale is not None:
            bounds.check_number("softmax_scale", self.softmax_scale, 0.0, low_open=True, fail=_attention_fail)
        if self.num_heads % self.num_kv_heads:
            _attention_fail(
                "num_kv_heads", f"{self.num_kv_heads} does not divide num_heads={self.num_heads} "
                "(grouped-query attention shares each kv head among a whole number of query heads)"
            )

    @property
    def scale(self) -> float:
        return self.softmax_scale if self.softmax_scale is not None else self.head_dim**-0.5


class RotaryEmbedding(nn.Module):
    """Holds a RoPE configuration and applies it through the custom op.

    Static schemes keep float32 caches ``[cache_len, rd/2]`` as non-persistent buffers and pass
    ``position_ids`` to the op. Seq-len-dependent schemes (dynamic NTK, LongRoPE) compute per-token
    caches from ``position_ids`` (in-graph when exported) and call the op without positions.
    """

    def __init__(self, config: RopeConfig, cache_len: int | None = None):
        super().__init__()
        self.config = config
        # "custom-op": one rope_export::RotaryEmbedding per rotated tensor (eager and export alike).
        # "decomposed": the same math written as plain torch ops, the way transformers writes it,
        # so a plain torch.onnx.export of the block shows what a decomposed RoPE costs.
        self.mode = "custom-op"
        if not config.seq_len_dependent:
            cos, sin = build_caches(config, cache_len)
            self.register_buffer("cos_cache", cos, persistent=False)
            self.register_buffer("sin_cache", sin, persistent=False)

    def _apply(self, fn, recurse=True):
        # .to(float16) on the block must not round the caches: they stay float32 (precision at
        # long positions; the op contract allows float32 caches under half-precision X).
        caches = {name: buf for name, buf in self._buffers.items() if name in ("cos_cache", "sin_cache")}
        super()._apply(fn, recurse)
        for name, original in caches.items():
            self._buffers[name] = original.to(device=self._buffers[name].device)
        return self

    @property
    def cache_len(self) -> int | None:
        return None if self.config.seq_len_dependent else self.cos_cache.shape[0]

    def cos_sin(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(cos, sin, position_ids-or-None) ready for the op; compute once, apply to q and k."""
        check_position_ids(position_ids)
        if not self.config.seq_len_dependent:
            return self.cos_cache, self.sin_cache, position_ids
        # max + 1 over the positions and a 0: an empty batch (B = 0) has no max of its own, and
        # a length of 1 computes the same frequencies as any length up to the trained one.
        seq_len = torch.cat((position_ids.reshape(-1), position_ids.new_zeros(1))).max() + 1
        inv_freq, scaling = inv_freq_and_scaling(self.config, seq_len)
        angles = position_ids.float().unsqueeze(-1) * inv_freq.float()
        return torch.cos(angles) * scaling, torch.sin(angles) * scaling, None

    def apply(self, x, cos, sin, position_ids, num_heads: int = 0) -> torch.Tensor:
        if self.mode == "decomposed":
            return _rotary_decomposed(x, cos, sin, position_ids, self.config, num_heads)
        return ops.rotary_embedding(
            x, cos, sin, position_ids, self.config.interleaved, num_heads, self.config.rotary_embedding_dim
        )

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, num_heads: int = 0) -> torch.Tensor:
        """Rotate ``x`` ([B, H, S, D], or [B, S, H*D] with ``num_heads``)."""
        return self.apply(x, *self.cos_sin(position_ids), num_heads=num_heads)


def _rotary_decomposed(x, cos, sin, position_ids, config: RopeConfig, num_heads: int) -> torch.Tensor:
    """RoPE in plain torch ops as transformers writes it (gather, rotate-half or even/odd, concat).

    Used only to measure and test against a decomposed export; positions are assumed in range.
    """
    if position_ids is not None:
        cos, sin = cos[position_ids], sin[position_ids]
    if x.dim() == 3:  # [B, S, H*D] -> [B, S, H, D], cos/sin [B, S, 1, rd/2]
        xs = x.unflatten(-1, (num_heads, -1))
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    else:  # [B, H, S, D], cos/sin [B, 1, S, rd/2]
        xs = x
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rd = config.rotary_embedding_dim
    rot, tail = xs[..., :rd].float(), xs[..., rd:]
    if config.interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    else:
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        x1, x2 = rot[..., : rd // 2], rot[..., rd // 2 :]
        rotated = rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    out = torch.cat((rotated.to(x.dtype), tail), dim=-1)
    return out.flatten(-2) if x.dim() == 3 else out


class PositionIdsError(TypeError, ValueError):
    """position_ids of the wrong dtype: a TypeError, and a ValueError so the CLI reports it as bad input."""


def check_position_ids(position_ids: torch.Tensor) -> None:
    if position_ids.dtype != torch.int64:
        raise PositionIdsError(f"position_ids must be int64, got {position_ids.dtype}; cast them with .long()")
    if position_ids.dim() != 2:
        raise ValueError(f"position_ids must be [B, S], got shape {list(position_ids.shape)}")


class RoPEAttention(nn.Module):
    """Causal self-attention with RoPE on q and k: MHA, GQA or MQA, optional KV cache.

    ``forward(hidden_states [B, S, hidden], position_ids [B, S], past_key, past_value)`` returns
    ``(output [B, S, hidden], present_key, present_value)`` with keys/values ``[B, Hkv, P+S, D]``,
    so a prefill followed by S=1 decode steps works. q and k are rotated as 3-D ``[B, S, H*D]``
    straight out of their projections (no transpose before the op).
    """

    def __init__(self, attention: AttentionConfig, rope: RopeConfig, cache_len: int | None = None):
        super().__init__()
        if rope.head_dim != attention.head_dim:
            raise AttentionConfigError(
                f"rope head_dim={rope.head_dim} differs from attention head_dim={attention.head_dim}"
            )
        self.attention = attention
        a = attention
        check_block_memory(attention, rope, cache_len)
        self.q_proj = nn.Linear(a.hidden_size, a.num_heads * a.head_dim, bias=a.qkv_bias)
        self.k_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.v_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.o_proj = nn.Linear(a.num_heads * a.head_dim, a.hidden_size, bias=a.o_bias)
        self.rotary = RotaryEmbedding(rope, cache_len)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_ids: torch.Tensor,
        past_key: torch.Tensor | None = None,
        past_value: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a = self.attention
        batch, seq, _ = hidden_states.shape
        cos, sin, pos = self.rotary.cos_sin(position_ids)
        q = self.rotary.apply(self.q_proj(hidden_states), cos, sin, pos, num_heads=a.num_heads)
        k = self.rotary.apply(self.k_proj(hidden_states), cos, sin, pos, num_heads=a.num_kv_heads)
        v = self.v_proj(hidden_states)
        q = q.view(batch, seq, a.num_heads, a.head_dim).transpose(1, 2)
        k = k.view(batch, seq, a.num_kv_heads, a.head_dim).transpose(1, 2)
        v = v.view(batch, seq, a.num_kv_heads, a.head_dim).transpose(1, 2)
        if (past_key is None) != (past_value is None):
            raise ValueError("give both past_key and past_value, or neither")
        if past_key is not None:
            k = torch.cat((past_key, k), dim=2)
            v = torch.cat((past_value, v), dim=2)
        out = causal_attention(q, repeat_kv(k, a.num_heads), repeat_kv(v, a.num_heads), a.scale)
        out = out.transpose(1, 2).reshape(batch, seq, a.num_heads * a.head_dim)
        return self.o_proj(out), k, v


def check_block_memory(attention: AttentionConfig, rope: RopeConfig, cache_len: int | None = None) -> None:
    """Refuse, before allocating, a block this machine cannot hold; say what it would allocate.

    Weights are counted in float32 (a block is built in float32, then cast); caches at the peak of
    building them in float64. A preset with 10**6 heads or a cache of 10**9 rows stops here."""
    a = attention
    projections = 2 * a.hidden_size * a.num_heads * a.head_dim + 2 * a.hidden_size * a.num_kv_heads * a.head_dim
    weights = 4 * projections
    caches = 0 if rope.seq_len_dependent else cache_build_bytes(rope, cache_rows(rope, cache_len))
    fix = ("use a smaller cache length (--cache-len)" if caches > weights
           else "use smaller hidden_size/num_heads/head_dim (a real attention layer is a few GB at most)")
    bounds.check_allocation("the attention block", {"q/k/v/o weights (float32)": weights,
                                                    "cos/sin caches (built in float64)": caches}, fix)


def repeat_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[B, Hkv, T, D] -> [B, H, T, D], each kv head shared by H/Hkv consecutive query heads."""
    batch, kv_heads, length, dim = x.shape
    if kv_heads == num_heads:
        return x
    n_rep = num_heads // kv_heads
    return x[:, :, None].expand(batch, kv_heads, n_rep, length, dim).reshape(batch, num_heads, length, dim)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention where query i (at absolute position P+i) sees keys 0..P+i; softmax in fp32."""
    seq, total = q.shape[2], k.shape[2]
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    query_pos = torch.arange(seq, device=q.device).unsqueeze(1) + (total - seq)
    key_pos = torch.arange(total, device=q.device).unsqueeze(0)
    scores = scores.masked_fill(key_pos > query_pos, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(probs, v)


class SinusoidalPositionalEncoding(nn.Module):
    """The additive encoding of "Attention Is All You Need": x + PE[position], PE in float32."""

    def __init__(self, hidden_size: int, max_positions: int = 2048, base: float = 10000.0):
        super().__init__()
        if hidden_size % 2:
            raise ValueError(f"hidden_size must be even for sin/cos pairs, got {hidden_size}")
        position = torch.arange(max_positions, dtype=torch.float64).unsqueeze(1)
        div = torch.exp(torch.arange(0, hidden_size, 2, dtype=torch.float64) * (-math.log(base) / hidden_size))
        pe = torch.zeros(max_positions, hidden_size, dtype=torch.float64)
        pe[:, 0::2] = torch.sin(position * div)
        pe[:, 1::2] = torch.cos(position * div)
        self.register_buffer("pe", pe.float(), persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        check_position_ids(position_ids)
        return (x.float() + self.pe[position_ids]).to(x.dtype)
