"""Blocks whose cos/sin tables are not computed by trig ops in the counted forward (kind 5 of issue 25).

* ``legacy_llama``: transformers' ``LlamaRotaryEmbedding`` and ``apply_rotary_pos_emb`` as they were
  before 4.38 (copied from transformers 4.37.2, ``models/llama/modeling_llama.py``, Apache-2.0): the
  tables ``cos_cached``/``sin_cached`` are buffers made in ``__init__`` and sliced ``[:seq_len]`` in
  the forward, then read by ``position_ids``;
* ``flash_attn``: flash-attn's ``RotaryEmbedding`` spelling (``flash_attn/layers/rotary.py``): half-width
  ``_cos_cached``/``_sin_cached`` plain attributes filled by ``_update_cos_sin_cache`` on a warm-up call,
  so the counted forward runs no trig op; the torch path of ``apply_rotary_emb`` (``repeat`` to full
  width, rotate-half) on ``[B, S, H, D]``;
* ``zero_row``: a rotate-half table with an all-zero row at index 0 for padding tokens (positions are
  shifted by one; a padding token reads row 0 and comes out as zeros);
* ``global_cache``: tables from a module-level ``functools.lru_cache`` function warmed in ``__init__``: no
  module owns them, so they are recognised where they are used (a sum of two products with them);
* ``stacked_first_axis``: one buffer holding cos and sin along its first axis, recognised where used;
* planted: ``bad_pad_row`` (the padding row is 0.5, not zero: c² + s² is not constant there, so those
  tokens are scaled, not rotated), ``other_angles`` (sin of twice cos's angles: not a rotation).

Each block maps ``(x [B, S, HIDDEN], pos [B, S] int64)`` to ``(out, rotated keys)``.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

B, S, H, D, MAX_POS = 2, 5, 4, 16, 32
HIDDEN = H * D
BASE = 10000.0


# -- transformers 4.37.2 (pre-4.38) Llama rotary embedding, verbatim but for comments --------------

class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=2048, base=10000, device=None):
        super().__init__()

        self.dim = dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2).float().to(device) / self.dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

        # Build here to make `torch.jit.trace` work.
        self._set_cos_sin_cache(
            seq_len=max_position_embeddings, device=self.inv_freq.device, dtype=torch.get_default_dtype()
        )

    def _set_cos_sin_cache(self, seq_len, device, dtype):
        self.max_seq_len_cached = seq_len
        t = torch.arange(self.max_seq_len_cached, device=device, dtype=self.inv_freq.dtype)

        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin_cached", emb.sin().to(dtype), persistent=False)

    def forward(self, x, seq_len=None):
        # x: [bs, num_attention_heads, seq_len, head_size]
        if seq_len > self.max_seq_len_cached:
            self._set_cos_sin_cache(seq_len=seq_len, device=x.device, dtype=x.dtype)

        return (
            self.cos_cached[:seq_len].to(dtype=x.dtype),
            self.sin_cached[:seq_len].to(dtype=x.dtype),
        )


def rotate_half(x):
    """Rotates half the hidden dims of the input."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids, unsqueeze_dim=1):
    cos = cos[position_ids].unsqueeze(unsqueeze_dim)
    sin = sin[position_ids].unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


# -- flash-attn's RotaryEmbedding cache (torch path), warmed before the forward -----------------------

class FlashAttnRotary(nn.Module):
    """flash_attn.layers.rotary.RotaryEmbedding's cache: ``_cos_cached``/``_sin_cached`` ``[seqlen, D/2]``
    plain attributes, (re)built by ``_update_cos_sin_cache`` only when the sequence outgrows them."""

    def __init__(self, dim: int, base: float = BASE):
        super().__init__()
        self.dim = dim
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)),
                             persistent=False)
        self._seq_len_cached = 0
        self._cos_cached = None
        self._sin_cached = None

    def _update_cos_sin_cache(self, seqlen, device=None, dtype=None):
        if seqlen > self._seq_len_cached or self._cos_cached is None:
            self._seq_len_cached = seqlen
            t = torch.arange(seqlen, device=device, dtype=torch.float32)
            freqs = torch.outer(t, self.inv_freq)
            self._cos_cached = torch.cos(freqs).to(dtype)
            self._sin_cached = torch.sin(freqs).to(dtype)

    @staticmethod
    def apply(x, cos, sin):
        """flash_attn's apply_rotary_emb_torch (not interleaved): x [B, S, H, D], cos/sin [B, S, D/2]."""
        cos = torch.cat((cos, cos), dim=-1)[:, :, None]  # repeat(cos, "... d -> ... 1 (2 d)")
        sin = torch.cat((sin, sin), dim=-1)[:, :, None]
        return x * cos + rotate_half(x) * sin

    def forward(self, q, k, pos):
        self._update_cos_sin_cache(MAX_POS, device=q.device, dtype=q.dtype)
        cos, sin = self._cos_cached[pos], self._sin_cached[pos]
        return self.apply(q, cos, sin), self.apply(k, cos, sin)


# -- tables with a padding row --------------------------------------------------------------------------

class PaddedTable(nn.Module):
    """Rotate-half tables ``[MAX_POS + 1, D]`` with one row for padding tokens (``pad`` there: 0 gives zeros
    out, anything else is not a rotation), row 0 (positions read row ``pos + 1``) or, with ``last``, row
    MAX_POS; a position below 0 is a padding token."""

    def __init__(self, pad: float = 0.0, other_angles: bool = False, last: bool = False):
        super().__init__()
        freqs = torch.arange(MAX_POS).float()[:, None] * (1.0 / (BASE ** (torch.arange(0, D, 2).float() / D)))
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), (2 * emb if other_angles else emb).sin()
        row = torch.full((1, D), pad)
        self.last = last
        self.register_buffer("cos_table", torch.cat((cos, row) if last else (row, cos)), persistent=False)
        self.register_buffer("sin_table", torch.cat((sin, row) if last else (row, sin)), persistent=False)

    def forward(self, q, k, pos):
        index = torch.where(pos < 0, MAX_POS, pos) if self.last else (pos + 1).clamp(min=0)
        cos, sin = self.cos_table[index][:, None], self.sin_table[index][:, None]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


# -- tables no module owns: a module-level cache filled on first use ----------------------------------

@functools.lru_cache
def rope_tables(seq_len: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) ``[seq_len, dim]`` (rotate-half), made once per size and kept by the cache."""
    freqs = torch.outer(torch.arange(seq_len).float(), 1.0 / (BASE ** (torch.arange(0, dim, 2).float() / dim)))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class GlobalCache(nn.Module):
    """Reads ``rope_tables`` (warmed by the constructor): no trig op in the forward, no buffer."""

    def __init__(self):
        super().__init__()
        rope_tables(MAX_POS, D)

    def forward(self, q, k, pos):
        cos, sin = rope_tables(MAX_POS, D)
        cos, sin = cos[pos][:, None], sin[pos][:, None]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class StackedFirstAxis(nn.Module):
    """One buffer ``[2, MAX_POS, D]`` holding cos and sin along its first axis (``cos, sin = table[:, pos]``):
    not a pair of tensors, not a table with cos/sin along its last axis."""

    def __init__(self):
        super().__init__()
        freqs = torch.arange(MAX_POS).float()[:, None] * (1.0 / (BASE ** (torch.arange(0, D, 2).float() / D)))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("table", torch.stack((emb.cos(), emb.sin())), persistent=False)

    def forward(self, q, k, pos):
        cos, sin = self.table[:, pos][:, :, None].unbind(0)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


# -- the attention block ----------------------------------------------------------------------------------

class LegacyLlamaRope(nn.Module):
    def __init__(self):
        super().__init__()
        self.rotary_emb = LlamaRotaryEmbedding(D, max_position_embeddings=MAX_POS)

    def forward(self, q, k, pos):  # q, k [B, H, S, D], as LlamaAttention (4.37) calls them
        cos, sin = self.rotary_emb(k, seq_len=MAX_POS)
        return apply_rotary_pos_emb(q, k, cos, sin, pos)


class Attention(nn.Module):
    """q/k/v/o projections; the rotation module takes q, k in ``layout`` and returns them rotated."""

    def __init__(self, rope: nn.Module, layout: str = "bhsd", seed: int = 0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.q_proj, self.k_proj = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.v_proj, self.o_proj = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=generator) * 0.2
        self.rope, self.layout = rope, layout

    def forward(self, x, pos):
        b, s, _ = x.shape
        q, k, v = (proj(x).view(b, s, H, D) for proj in (self.q_proj, self.k_proj, self.v_proj))
        if self.layout == "bhsd":
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        q, k = self.rope(q, k, pos)
        if self.layout == "bshd":
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D), dim=-1)
        out = (weights @ v.transpose(1, 2)).transpose(1, 2).reshape(b, s, HIDDEN)
        return self.o_proj(out), k


def _flash_attn() -> nn.Module:
    rope = FlashAttnRotary(D)
    rope._update_cos_sin_cache(MAX_POS, dtype=torch.float32)  # the warm-up call: tables made before the forward
    return Attention(rope, "bshd")


BLOCKS = {
    "legacy_llama": lambda: Attention(LegacyLlamaRope()),
    "flash_attn": _flash_attn,
    "zero_row": lambda: Attention(PaddedTable()),
    "zero_row_last": lambda: Attention(PaddedTable(last=True)),
    "global_cache": lambda: Attention(GlobalCache()),
    "stacked_first_axis": lambda: Attention(StackedFirstAxis()),
}
PLANTED = {
    "bad_pad_row": lambda: Attention(PaddedTable(pad=0.5)),
    "other_angles": lambda: Attention(PaddedTable(other_angles=True)),
}


def block(name: str) -> nn.Module:
    return (BLOCKS.get(name) or PLANTED[name])().eval()


def example(batch: int = B, seq: int = S, offset: int = 0, pad: int = 0, seed: int = 1):
    """(x, pos): positions offset + 0..seq-1; with ``pad``, the first ``pad`` tokens of row 0 are padding (-1)."""
    x = torch.randn(batch, seq, HIDDEN, generator=torch.Generator().manual_seed(seed))
    pos = (torch.arange(seq) + offset).expand(batch, seq).contiguous()
    if pad:
        pos[0, :pad] = -1
    return x, pos
