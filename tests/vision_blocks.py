"""Vision-transformer RoPE blocks (2-D RoPE over a patch grid), shared by the export_module and fuse tests.

Third-party blocks are built from transformers' own classes, as its models call them: DINOv3 ViT
(the whole tiny model: cls and register tokens skipped by its ``apply_rotary_pos_emb``, cos/sin
computed from the image size and folded to constants by the export) and Pixtral's attention layer
(axial H/W frequencies, ``unsqueeze_dim=0`` tables, patch positions as an input).

The planted blocks are written here to trap a verification that can be fooled:

* ``HalfSwitch``: a timm-style ``apply_rot_embed(x, cos, sin, half=False)`` whose default rotates
  interleaved pairs while the block calls it with ``half=True`` (rotate-half), per-axis 2-D angles;
* ``PerHead``: learned per-head 2-D frequencies (RoPE-Mixed), tables ``[H, N, D]`` broadcast over
  the batch; with batch = heads the tables have a per-token cache's shape.

Each block maps ``(x [B, N, C], coords [N, 2] int64)`` (or pixels) to ``(out, rotated keys)``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

B, GRID, HEADS, HEAD_DIM = 2, 4, 2, 16
N = GRID * GRID
HIDDEN = HEADS * HEAD_DIM


def grid_coords(grid: int = GRID, offset: int = 0) -> torch.Tensor:
    """[N, 2] int64 (row, col) of each patch, row-major."""
    rows, cols = torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="ij")
    return torch.stack((rows.flatten(), cols.flatten()), dim=-1) + offset


def example(batch: int = B, grid: int = GRID, offset: int = 0, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(batch, grid * grid, HIDDEN, generator=torch.Generator().manual_seed(seed))
    return x, grid_coords(grid, offset)


# -- planted blocks -----------------------------------------------------------------------------------

def rot_pairs(x):
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def rot_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rot_embed(x, cos, sin, half=False):
    """timm-style: pairs (2i, 2i+1) by default, rotate-half with ``half=True``."""
    return x * cos + (rot_half(x) if half else rot_pairs(x)) * sin


def apply_rope_qk(q, k, cos, sin):
    return q * cos + rot_half(q) * sin, k * cos + rot_half(k) * sin


class _Attention(nn.Module):
    """q/k/v/o projections; ``rotate(q, k, coords)`` is the block's RoPE ([B, H, N, D] tensors)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.qkv, self.proj = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=generator) * 0.2

    def forward(self, x, coords):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.rotate(q, k, coords)
        weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM), dim=-1)
        return self.proj((weights @ v).transpose(1, 2).reshape(b, n, HIDDEN)), k


class HalfSwitch(_Attention):
    """Per-axis 2-D RoPE: D/4 frequencies by row, D/4 by column, rotate-half via ``half=True``."""

    def rotate(self, q, k, coords):
        inv = 1.0 / (100.0 ** (torch.arange(0, HEAD_DIM // 2, 2).float() / (HEAD_DIM // 2)))  # [D/4]
        freqs = torch.cat((coords[:, :1].float() * inv, coords[:, 1:].float() * inv), dim=-1)  # [N, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        return apply_rot_embed(q, cos, sin, half=True), apply_rot_embed(k, cos, sin, half=True)


class PerHead(_Attention):
    """Learned per-head frequencies (RoPE-Mixed): angles[h, n] = row * fx[h] + col * fy[h], tables [H, N, D]."""

    def __init__(self, seed: int = 0):
        super().__init__(seed)
        generator = torch.Generator().manual_seed(seed + 1)
        self.freqs = nn.Parameter(torch.rand(2, HEADS, HEAD_DIM // 2, generator=generator))

    def rotate(self, q, k, coords):
        c = coords.float()
        angles = c[:, 0, None, None] * self.freqs[0] + c[:, 1, None, None] * self.freqs[1]  # [N, H, D/2]
        emb = torch.cat((angles, angles), dim=-1).transpose(0, 1)  # [H, N, D]
        return apply_rope_qk(q, k, emb.cos(), emb.sin())


PLANTED = {"half_switch": HalfSwitch, "per_head": PerHead}


def planted(name: str) -> nn.Module:
    torch.manual_seed(0)
    return PLANTED[name]().eval()


# -- transformers' vision blocks ------------------------------------------------------------------------

class PixtralBlock(nn.Module):
    """Pixtral's rotary embedding and attention layer, as PixtralTransformer calls them."""

    def __init__(self):
        super().__init__()
        from transformers import PixtralVisionConfig
        from transformers.models.pixtral.modeling_pixtral import PixtralAttentionLayer, PixtralVisionRotaryEmbedding

        config = PixtralVisionConfig(hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=1,
                                     num_attention_heads=HEADS, head_dim=HEAD_DIM, image_size=64, patch_size=8)
        config._attn_implementation = "eager"
        self.rope, self.layer = PixtralVisionRotaryEmbedding(config), PixtralAttentionLayer(config)

    def forward(self, x, coords):
        cos, sin = self.rope(x, coords)
        return self.layer(x, attention_mask=None, position_embeddings=(cos, sin))


class QwenVisionBlock(_Attention):
    """Qwen2-VL's vision attention on one image, token-major: patches flattened to x [N, C], q/k [N, H, D],
    2-D (row, column) frequencies [N, D/2] rotated by transformers' ``apply_rotary_pos_emb_vision`` (its
    ``cu_seqlens`` split by ``.tolist()``, which torch.export cannot trace, is left out: one image)."""

    def forward(self, x, coords):
        from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb_vision

        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, HEADS, HEAD_DIM).unbind(1)  # [N, H, D] each
        inv = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM // 2, 2).float() / (HEAD_DIM // 2)))  # [D/4]
        freqs = torch.cat((coords[:, :1].float() * inv, coords[:, 1:].float() * inv), dim=-1)  # [N, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        q, k = apply_rotary_pos_emb_vision(q, k, emb.cos(), emb.sin())
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [H, N, D]
        weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM), dim=-1)
        return self.proj((weights @ v).transpose(0, 1).reshape(n, HIDDEN)), k


def qwen_vision() -> nn.Module:
    torch.manual_seed(0)
    return QwenVisionBlock().eval()


def token_major_example(grid: int = GRID, offset: int = 0, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [N, C], coords [N, 2]): one image's patches, flattened."""
    return example(1, grid, offset, seed)[0][0], grid_coords(grid, offset)


def dinov3(registers: int = 4) -> tuple[nn.Module, torch.Tensor]:
    """A one-layer DINOv3 ViT (16 patches + cls + registers) and a batch of 2 images."""
    from transformers import DINOv3ViTConfig, DINOv3ViTModel

    config = DINOv3ViTConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, intermediate_size=2 * HIDDEN,
                             num_hidden_layers=1, patch_size=4, image_size=4 * GRID, num_register_tokens=registers)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    pixels = torch.randn(B, 3, 4 * GRID, 4 * GRID, generator=torch.Generator().manual_seed(2))
    return DINOv3ViTModel(config).eval(), pixels


def pixtral() -> nn.Module:
    torch.manual_seed(0)
    return PixtralBlock().eval()


# -- lucidrains' rotary-embedding-torch: tables made for the sequence length (no position input) ------------

class LucidrainsBlock(nn.Module):
    """rotary_embedding_torch's RotaryEmbedding as its README calls it: ``rotate_queries_or_keys`` (positions
    0..S-1 made inside, cos/sin folded to constants by a static export) or, ``axial``, 2-D pixel
    frequencies from ``get_axial_freqs(grid, grid)`` over a quarter of the head per axis (partial)."""

    def __init__(self, axial: bool = False, seed: int = 0):
        super().__init__()
        from rotary_embedding_torch import RotaryEmbedding

        generator = torch.Generator().manual_seed(seed)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=generator) * 0.2
        self.axial = axial
        self.rope = RotaryEmbedding(dim=HEAD_DIM // 4, freqs_for="pixel", max_freq=256) if axial else \
            RotaryEmbedding(dim=HEAD_DIM)

    def forward(self, x):
        from rotary_embedding_torch import apply_rotary_emb

        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4).unbind(0)
        if self.axial:
            grid = math.isqrt(n)
            freqs = self.rope.get_axial_freqs(grid, grid).reshape(n, -1)  # [N, D/2]: rows, then columns
            q, k = apply_rotary_emb(freqs, q), apply_rotary_emb(freqs, k)
        else:
            q, k = self.rope.rotate_queries_or_keys(q), self.rope.rotate_queries_or_keys(k)
        weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM), dim=-1)
        return (weights @ v).transpose(1, 2).reshape(b, n, HIDDEN), k


def lucidrains(axial: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return LucidrainsBlock(axial).eval()
