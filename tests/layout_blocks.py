"""Real third-party blocks in the layouts the op does not take natively (issue #25), for
tests/blocks/test_layout_blocks.py and tests/passes/test_passes_lower_layouts.py.

megatron-core and timm cannot be test dependencies (they pull torchvision / torch builds we cannot
install), so their RoPE code is transcribed here, unchanged but for the names, what needs a GPU or a
process group, and the lint's spelling of annotations (``list``, ``X | None``) and of ``assert False``:

* Megatron-LM ``megatron/core/models/common/embeddings/rope_utils.py`` at commit
  00c51e13247685110aec81e60aa3db91cbdbff7d: ``_rotate_half`` and ``_apply_rotary_pos_emb_bshd`` (the
  unfused path ``apply_rotary_pos_emb`` takes without ``cu_seqlens`` and without ``apply_rope_fusion``);
  ``megatron/core/models/common/embeddings/rotary_pos_embedding.py`` at commit
  00caa53af30912914981c86f39db123961678bbd: ``RotaryEmbedding.__init__`` (``rotary_percent``,
  ``rotary_interleaved``; no llama-3 scaling), ``get_freqs_non_repeated``, ``get_emb`` (freqs
  ``[S, 1, 1, D]``) and ``forward`` without its ``lru_cache`` (torch.export cannot hash a symbolic
  length), the CUDA move and context-parallel slicing. Megatron's attention rotates q and k as
  ``[S, B, H, D]`` with ``rotary_pos_emb = self.rotary_pos_emb(rotary_seq_len)``, the sequence length
  read from the ``[S, B, hidden]`` hidden states (``MegatronAttention`` below does that).
* timm ``timm/layers/pos_embed_sincos.py`` at commit 0647e283021a2a7b0c7dc989d10564aa55bbf5e7:
  ``rot``, ``rope_rotate_half``, ``apply_rot_embed_cat``, ``init_random_2d_freqs``, ``get_mixed_grid``,
  ``get_mixed_freqs`` and ``RotaryEmbeddingMixed`` (learnable per-head, per-depth 2-D frequencies, the
  RoPE-Mixed of naver-ai/rope-vit), used as timm's Eva ViT uses it with ``rope_mixed``: one
  ``get_embed()`` of ``[depth, heads, N, 2 * head_dim]``, block ``i`` given ``rot_pos_embed[i]`` and
  rotating the patch tokens of q and k ``[B, H, 1 + N, D]`` past the cls token with
  ``apply_rot_embed_cat(..., half=False)``.

Planted variants (``PLANTED``) are what a naive fusion would get wrong: Megatron-style sequence-first
tensors whose positions differ per batch row (freqs ``[S, B, 1, D]``, as Megatron's multimodal RoPE
makes them), and timm's per-head table applied with ``half=True`` (its channels are laid out for
interleaved pairs, so the arithmetic is no rotation).
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import warnings

import onnx
import torch
from torch import Tensor, nn

S, B, H, D = 5, 2, 4, 16  # Megatron: [S, B, H, D]
HIDDEN = H * D
GRID, DEPTH = 3, 2  # timm: a GRID x GRID patch grid after one cls token, DEPTH blocks

# -- Megatron-LM (transcribed) -----------------------------------------------------------------------


def megatron_rotate_half(x: Tensor, rotary_interleaved: bool) -> Tensor:
    if not rotary_interleaved:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    else:
        x1 = x[:, :, :, ::2]
        x2 = x[:, :, :, 1::2]
        x_new = torch.stack((-x2, x1), dim=-1)
        return x_new.view(x_new.shape[0], x_new.shape[1], x_new.shape[2], -1)


def megatron_apply_rotary_pos_emb_bshd(t: Tensor, freqs: Tensor, rotary_interleaved: bool = False,
                                       mla_rotary_interleaved: bool = False, mscale: float = 1.0,
                                       inverse: bool = False, mla_output_remove_interleaving: bool = False) -> Tensor:
    if freqs.dim() == t.dim() + 1 and freqs.size(-2) == 1:
        freqs = freqs.squeeze(-2)

    rot_dim = freqs.shape[-1]

    # ideally t_pass is empty so rotary pos embedding is applied to all tensor t
    t, t_pass = t[..., :rot_dim], t[..., rot_dim:]

    if mla_rotary_interleaved:
        x1 = t[..., 0::2]
        x2 = t[..., 1::2]
        t = torch.cat((x1, x2), dim=-1)

    # first part is cosine component
    # second part is sine component, need to change signs with _rotate_half method
    cos_ = (torch.cos(freqs) * mscale).to(t.dtype)
    sin_ = (torch.sin(freqs) * mscale).to(t.dtype)
    if inverse:
        sin_ = -sin_

    t = (t * cos_) + (megatron_rotate_half(t, rotary_interleaved) * sin_)

    if mla_rotary_interleaved and mla_output_remove_interleaving:
        x1, x2 = torch.chunk(t, 2, dim=-1)
        t = torch.stack((x1, x2), dim=-1).flatten(start_dim=-2)

    return torch.cat((t, t_pass), dim=-1)


class MegatronRotaryEmbedding(nn.Module):
    def __init__(self, kv_channels: int, rotary_percent: float, rotary_interleaved: bool = False,
                 seq_len_interpolation_factor: float = None, rotary_base: int = 10000) -> None:
        super().__init__()

        dim = kv_channels
        if rotary_percent < 1.0:
            dim = int(dim * rotary_percent)
        self.rotary_interleaved = rotary_interleaved

        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.inv_freq = 1.0 / (
            rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
        )

    def get_freqs_non_repeated(self, max_seq_len: int, offset: int = 0) -> Tensor:
        seq = (
            torch.arange(max_seq_len, device=self.inv_freq.device, dtype=self.inv_freq.dtype)
            + offset
        )

        if self.seq_len_interpolation_factor is not None:
            seq *= 1 / self.seq_len_interpolation_factor

        freqs = torch.outer(seq, self.inv_freq)  # [seq len, dim]

        return freqs

    def get_emb(self, max_seq_len: int, offset: int = 0) -> Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        # first part even vector components, second part odd vector components,
        #  2 * dim in dimension size
        if not self.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(
                freqs.shape[0], -1
            )
        # emb [seq_length, .., dim]
        emb = emb[:, None, None, :]
        return emb

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False) -> Tensor:
        emb = self.get_emb(max_seq_len, offset)
        return emb


# -- the Megatron-style attention (written here: projections and core attention) ----------------------


class MegatronLayer(nn.Module):
    """One Megatron self-attention: fused qkv projection, q/k/v ``[S, B, H, D]``, ``apply_rotary_pos_emb``
    on q and k, dot-product attention, a residual output ``[S, B, hidden]`` and the rotated keys."""

    def __init__(self, rotary_interleaved: bool, mscale: float):
        super().__init__()
        self.rotary_interleaved, self.mscale = rotary_interleaved, mscale
        self.linear_qkv, self.linear_proj = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: Tensor, rotary_pos_emb: Tensor) -> tuple[Tensor, Tensor]:
        s, b, _ = x.shape
        query, key, value = self.linear_qkv(x).view(s, b, H, 3 * D).split(D, dim=-1)
        query = megatron_apply_rotary_pos_emb_bshd(query, rotary_pos_emb, self.rotary_interleaved, mscale=self.mscale)
        key = megatron_apply_rotary_pos_emb_bshd(key, rotary_pos_emb, self.rotary_interleaved, mscale=self.mscale)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [B, H, S, D]
        weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D), dim=-1)
        return x + self.linear_proj((weights @ v).permute(2, 0, 1, 3).reshape(s, b, HIDDEN)), key


class MegatronAttention(nn.Module):
    """Megatron's decoder on ``hidden_states [S, B, hidden]``: the freqs ``[S, 1, 1, D]`` of
    ``RotaryEmbedding(rotary_seq_len)`` made once and handed to every layer (``layers.N``), as
    megatron-core's GPTModel does; returns the output and the last layer's rotated keys ``[S, B, H, D]``."""

    def __init__(self, rotary_interleaved: bool = False, rotary_percent: float = 1.0, layers: int = 1,
                 mscale: float = 1.0, seed: int = 0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.rotary_pos_emb = MegatronRotaryEmbedding(D, rotary_percent, rotary_interleaved)
        self.rotary_interleaved = rotary_interleaved
        self.layers = nn.ModuleList(MegatronLayer(rotary_interleaved, mscale) for _ in range(layers))
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=generator) * 0.2

    def freqs(self, hidden_states: Tensor, position_ids: Tensor | None) -> Tensor:
        return self.rotary_pos_emb(hidden_states.size(0))

    def forward(self, hidden_states: Tensor, position_ids: Tensor | None = None):
        rotary_pos_emb = self.freqs(hidden_states, position_ids)
        x, key = hidden_states, None
        for layer in self.layers:
            x, key = layer(x, rotary_pos_emb)
        return x, key


class MegatronBatchPositions(MegatronAttention):
    """Planted: sequence-first tensors whose positions differ per batch row. ``position_ids [S, B]`` is an
    input, and the freqs are ``[S, B, 1, D]`` (the shape Megatron's ``MultimodalRotaryEmbedding`` returns).
    Fusing it as the plain Megatron block (a position table along the first axis) would rotate every batch
    row by the first row's positions."""

    def freqs(self, hidden_states: Tensor, position_ids: Tensor | None) -> Tensor:
        freqs = position_ids.float()[..., None] * self.rotary_pos_emb.inv_freq  # [S, B, rd/2]
        if not self.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs, freqs), dim=-1).flatten(-2)
        return emb[..., None, :]  # [S, B, 1, rd]


def megatron_example(seq: int = S, batch: int = B, seed: int = 1) -> tuple[Tensor]:
    return (torch.randn(seq, batch, HIDDEN, generator=torch.Generator().manual_seed(seed)),)


def batch_positions_example(seq: int = S, batch: int = B, offset: int = 0, seed: int = 1) -> tuple[Tensor, Tensor]:
    """hidden_states [S, B, hidden] and position_ids [S, B]: row b starts at offset + 3 * b."""
    (x,) = megatron_example(seq, batch, seed)
    pos = torch.arange(seq)[:, None] + offset + 3 * torch.arange(batch)[None, :]
    return x, pos


# -- timm (transcribed) -------------------------------------------------------------------------------


def timm_rot(x):
    # x:   [ x0  x1  x2  x3  x4  x5]
    # out: [-x1  x0 -x3  x2 -x5  x4]
    return torch.stack([-x[..., 1::2], x[..., ::2]], -1).reshape(x.shape)


def timm_rope_rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def timm_apply_rot_embed_cat(x: torch.Tensor, emb: torch.Tensor, half: bool = False) -> torch.Tensor:
    sin_emb, cos_emb = emb.chunk(2, -1)
    if half:
        return x * cos_emb + timm_rope_rotate_half(x) * sin_emb
    else:
        return x * cos_emb + timm_rot(x) * sin_emb


def timm_init_random_2d_freqs(head_dim: int, depth: int, num_heads: int, temperature: float = 10.0,
                              rotate: bool = True, *, device=None, dtype=torch.float32) -> torch.Tensor:
    mag = 1.0 / (temperature ** (torch.arange(0, head_dim, 4, device=device, dtype=dtype) / head_dim))
    mag = mag.unsqueeze(0).unsqueeze(0)  # (1,1,L)
    if rotate:
        angles = torch.rand(depth, num_heads, 1, device=device, dtype=dtype) * 2 * torch.pi
    else:
        angles = torch.zeros(depth, num_heads, 1, device=device, dtype=dtype)
    fx = torch.cat([mag * torch.cos(angles), mag * torch.cos(angles + torch.pi / 2)], dim=-1)
    fy = torch.cat([mag * torch.sin(angles), mag * torch.sin(angles + torch.pi / 2)], dim=-1)
    return torch.stack([fx, fy], dim=0)


def timm_swap_shape_xy(seq: list[int]) -> list[int]:
    if len(seq) < 2:
        return seq
    return [seq[1], seq[0]] + list(seq[2:])


def timm_get_mixed_grid(shape: list[int], grid_indexing: str = 'ij', device: torch.device | None = None,
                        dtype: torch.dtype = torch.float32):
    if grid_indexing == 'xy':
        shape = timm_swap_shape_xy(shape)
    x_pos, y_pos = torch.meshgrid(
        torch.arange(shape[0], device=device, dtype=torch.float32),
        torch.arange(shape[1], device=device, dtype=torch.float32),
        indexing=grid_indexing,
    )
    t_x = x_pos.to(dtype).flatten()
    t_y = y_pos.to(dtype).flatten()
    return t_x, t_y


def timm_get_mixed_freqs(freqs: torch.Tensor, t_x: torch.Tensor, t_y: torch.Tensor) -> torch.Tensor:
    dtype = freqs.dtype
    freqs = freqs.float()
    freqs_x = (t_x.unsqueeze(-1) @ freqs[0].unsqueeze(-2))
    freqs_y = (t_y.unsqueeze(-1) @ freqs[1].unsqueeze(-2))
    combined = freqs_x + freqs_y  # shape: (num_heads, N, dim//4)
    sin_emb = torch.sin(combined).repeat_interleave(2, -1)  # (N, dim//2)
    cos_emb = torch.cos(combined).repeat_interleave(2, -1)  # (N, dim//2)
    rope_embeds = torch.cat([sin_emb, cos_emb], dim=-1)  # (num_heads, H*W, head_dim)
    return rope_embeds.to(dtype)


class TimmRotaryEmbeddingMixed(nn.Module):
    def __init__(self, dim: int, depth: int, num_heads: int, temperature: float = 10.0,
                 feat_shape: list[int] | None = None, grid_indexing: str = 'xy', device=None, dtype=None):
        super().__init__()
        self.dim = dim
        self.depth = depth
        self.num_heads = num_heads
        self.temperature = temperature
        self.feat_shape = feat_shape
        self.grid_indexing = grid_indexing

        head_dim = dim // num_heads
        assert head_dim % 4 == 0, f"head_dim must be divisible by 4, got {head_dim}"

        freqs = timm_init_random_2d_freqs(head_dim, depth, num_heads, temperature=temperature, rotate=True,
                                          device=device, dtype=dtype)  # (2, depth, num_heads, head_dim//2)
        self.freqs = nn.Parameter(freqs)

        if feat_shape is not None:
            num_pos = 1
            for s in feat_shape:
                num_pos *= s
            self.register_buffer('t_x', torch.empty(num_pos, device=device, dtype=dtype), persistent=False)
            self.register_buffer('t_y', torch.empty(num_pos, device=device, dtype=dtype), persistent=False)
            self._init_buffers()
        else:
            self.t_x = self.t_y = None

    def _init_buffers(self) -> None:
        if self.feat_shape is not None:
            t_x, t_y = timm_get_mixed_grid(self.feat_shape, grid_indexing=self.grid_indexing,
                                           device=self.freqs.device)
            self.t_x.copy_(t_x)
            self.t_y.copy_(t_y)

    def get_embed(self, shape: list[int] | None = None) -> torch.Tensor:
        if shape is not None:
            t_x, t_y = timm_get_mixed_grid(shape, grid_indexing=self.grid_indexing, device=self.freqs.device)
        elif self.t_x is not None and self.t_y is not None:
            t_x, t_y = self.t_x, self.t_y
        else:
            raise AssertionError("get_embed() requires pre-computed t_x/t_y or valid shape")
        return timm_get_mixed_freqs(self.freqs, t_x, t_y)


# -- the Eva-style ViT around it (written here: projections and attention) -----------------------------


class TimmEvaBlock(nn.Module):
    """One Eva attention block: q/k/v ``[B, H, 1 + N, D]``, the patch tokens of q and k (past the cls
    token) rotated by ``apply_rot_embed_cat(..., rope, half=half)``, attention and a residual."""

    num_prefix_tokens = 1

    def __init__(self, half: bool):
        super().__init__()
        self.qkv, self.proj, self.half = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN), half

    def forward(self, x: Tensor, rope: Tensor) -> tuple[Tensor, Tensor]:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)  # [B, H, 1 + N, D]
        npt = self.num_prefix_tokens
        q = torch.cat([q[:, :, :npt, :], timm_apply_rot_embed_cat(q[:, :, npt:, :], rope, half=self.half)],
                      dim=2).type_as(v)
        k = torch.cat([k[:, :, :npt, :], timm_apply_rot_embed_cat(k[:, :, npt:, :], rope, half=self.half)],
                      dim=2).type_as(v)
        weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D), dim=-1)
        return x + self.proj((weights @ v).transpose(1, 2).reshape(b, n, HIDDEN)), k


class TimmMixedViT(nn.Module):
    """timm's Eva with ``rope_mixed``: tokens ``[B, 1 + N, hidden]`` (cls first), ``rot_pos_embed =
    self.rope.get_embed()`` (``[DEPTH, H, N, 2 * D]``: per-head learned frequencies) and block ``i`` given
    ``rot_pos_embed[i]``. ``half``: the ``apply_rot_embed_cat`` switch (False, interleaved, is what the
    mixed table is laid out for). Returns the output tokens and the last block's rotated keys."""

    def __init__(self, half: bool = False, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)  # timm draws the per-head angles with torch.rand
        self.rope = TimmRotaryEmbeddingMixed(HIDDEN, DEPTH, H, feat_shape=[GRID, GRID])
        self.blocks = nn.ModuleList(TimmEvaBlock(half) for _ in range(DEPTH))
        generator = torch.Generator().manual_seed(seed)
        for p in self.blocks.parameters():
            p.data = torch.randn(p.shape, generator=generator) * 0.2

    def forward(self, x):
        rot_pos_embed = self.rope.get_embed()
        k = None
        for i, blk in enumerate(self.blocks):
            x, k = blk(x, rope=rot_pos_embed[i])
        return x, k


def timm_example(batch: int = B, seed: int = 1) -> tuple[Tensor]:
    return (torch.randn(batch, 1 + GRID * GRID, HIDDEN, generator=torch.Generator().manual_seed(seed)),)


# name -> (make the block, make the example (batch=...), rotary nodes expected, interleaved attribute)
BLOCKS = {
    "megatron": (lambda: MegatronAttention(), megatron_example, 2, 0),
    "megatron_interleaved_partial": (lambda: MegatronAttention(True, 0.5), megatron_example, 2, 1),
    "megatron_two_layers": (lambda: MegatronAttention(layers=2), megatron_example, 4, 0),
    "megatron_mscale": (lambda: MegatronAttention(mscale=1.2), megatron_example, 2, 0),
    "timm_mixed": (lambda: TimmMixedViT(), timm_example, 2 * DEPTH, 1),
}

PLANTED = {
    "megatron_batch_positions": (lambda: MegatronBatchPositions(), batch_positions_example, 2, 0),
    "timm_mixed_half": (lambda: TimmMixedViT(half=True), timm_example, 0, None),
}


def block(name: str) -> nn.Module:
    return (BLOCKS.get(name) or PLANTED[name])[0]().eval()


def example(name: str, **kwargs) -> tuple[Tensor, ...]:
    return (BLOCKS.get(name) or PLANTED[name])[1](**kwargs)


@functools.cache
def plain_export(name: str) -> onnx.ModelProto:
    """torch.onnx's own (dynamo) export, opset 18: Megatron's [S, B, hidden] (and position_ids [S, B]) with S
    and B dynamic; timm's grid is fixed by its feat_shape, so only the batch is."""
    args = example(name)
    if name.startswith("timm"):
        dynamic = ({0: torch.export.Dim("batch")},)
    else:
        seq, batch = torch.export.Dim("seq"), torch.export.Dim("batch")
        dynamic = ({0: seq, 1: batch},) * len(args)
    with torch.no_grad(), warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(block(name), args, dynamo=True, opset_version=18, dynamic_shapes=dynamic)
    return program.model_proto
