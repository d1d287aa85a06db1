"""Complex rotations in the spellings of other libraries (issue #25), for tests/blocks/test_module_export_complex.py.

Each rotation module plugs into ``rope_blocks.Block`` (``forward(q, k, pos)``, a ``layout``). The
third-party functions are transcribed here, unchanged but for the names, because their packages cannot
be installed without pulling torch into dependency resolution (mistral-inference needs xformers) or
are not released as a small pure-Python package (gpt-fast, torchtitan's model files):

* torchtitan ``torchtitan/models/llama3/model/model.py`` at commit 018740b7aae7846d24954539244c78215dbd181f:
  ``precompute_freqs_cis`` (without the Llama 3.1 scaling), ``reshape_for_broadcast``, ``apply_rotary_emb``;
* mistral-inference ``src/mistral_inference/rope.py`` at commit 4304e4f991a70050444cf4441ef0affb3caa8925
  (release 1.6.0): ``precompute_freqs_cis``, ``apply_rotary_emb``; its model rotates ``[T, H, D]`` tokens
  with ``freqs_cis[positions]``;
* gpt-fast ``model.py`` at commit 870415262cf12f7144d93359317acb24629e6dfd: ``precompute_freqs_cis``
  (its dtype argument) and ``apply_rotary_emb``: the real 5-D view of the complex product, no complex dtype.

transformers' Llama 4 ``apply_rotary_emb`` is the installed package's own function (``Llama4Indexed``).
"""

from __future__ import annotations

import torch
from rope_blocks import MAX_POS, D
from torch import Tensor, nn
from transformers.models.llama4 import modeling_llama4

# -- torchtitan (transcribed) --------------------------------------------------------------------


def titan_precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)  # complex64
    return freqs_cis


def titan_reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor, positions: torch.Tensor | None = None
                                ) -> torch.Tensor:
    ndim = x.ndim
    assert ndim > 1
    seqlen = x.shape[1]
    if positions is None:
        freqs_cis = freqs_cis[0:seqlen]
        assert freqs_cis.shape == (seqlen, x.shape[-1])
        shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
        return freqs_cis.view(*shape)
    elif positions.size(0) == 1:
        assert positions.shape == (1, seqlen)
        freqs_cis = freqs_cis[positions.squeeze(0)]
        assert freqs_cis.shape == (seqlen, x.shape[-1])
        shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
        return freqs_cis.view(*shape)
    else:
        assert positions.shape == (x.shape[0], seqlen)
        freqs_cis_expanded = freqs_cis[None, :, None, :].expand(x.shape[0], -1, -1, -1)
        freqs_cis = torch.gather(
            freqs_cis_expanded,
            dim=1,
            index=positions.view(x.shape[0], seqlen, 1, 1).expand(
                x.shape[0], seqlen, 1, freqs_cis_expanded.shape[-1]
            ),
        )
        return freqs_cis


def titan_apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor,
                           positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = titan_reshape_for_broadcast(freqs_cis, xq_, positions)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


# -- mistral-inference (transcribed) ---------------------------------------------------------------


def mistral_precompute_freqs_cis(dim: int, end: int, theta: float) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)  # complex64


def mistral_apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis[:, None, :]
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(-2)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(-2)
    return xq_out.type_as(xq), xk_out.type_as(xk)


# -- gpt-fast (transcribed) ---------------------------------------------------------------------------


def gptfast_precompute_freqs_cis(seq_len: int, n_elem: int, base: int = 10000,
                                 dtype: torch.dtype = torch.bfloat16) -> Tensor:
    freqs = 1.0 / (base ** (torch.arange(0, n_elem, 2)[: (n_elem // 2)].float() / n_elem))
    t = torch.arange(seq_len, device=freqs.device)
    freqs = torch.outer(t, freqs)
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)
    cache = torch.stack([freqs_cis.real, freqs_cis.imag], dim=-1)
    return cache.to(dtype=dtype)


def gptfast_apply_rotary_emb(x: Tensor, freqs_cis: Tensor) -> Tensor:
    xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
    freqs_cis = freqs_cis.view(1, xshaped.size(1), 1, xshaped.size(3), 2)
    x_out2 = torch.stack(
        [
            xshaped[..., 0] * freqs_cis[..., 0] - xshaped[..., 1] * freqs_cis[..., 1],
            xshaped[..., 1] * freqs_cis[..., 0] + xshaped[..., 0] * freqs_cis[..., 1],
        ],
        -1,
    )

    x_out2 = x_out2.flatten(3)
    return x_out2.type_as(x)


# -- the rotation modules (q, k, pos) -> (q, k) ---------------------------------------------------------


class TitanPositions(nn.Module):
    """torchtitan with positions [B, S]: the complex table gathered per batch row."""

    layout = "bshd"

    def __init__(self):
        super().__init__()
        self.register_buffer("freqs_cis", titan_precompute_freqs_cis(D, MAX_POS), persistent=False)

    def forward(self, q, k, pos):
        return titan_apply_rotary_emb(q, k, self.freqs_cis, positions=pos)


class TitanSharedPositions(TitanPositions):
    """torchtitan with positions [1, S] shared by the batch: ``freqs_cis[positions.squeeze(0)]``."""

    def forward(self, q, k, pos):
        return titan_apply_rotary_emb(q, k, self.freqs_cis, positions=pos[:1])


class TitanSliced(TitanPositions):
    """torchtitan without positions: ``freqs_cis[0:seqlen]``, viewed [1, S, 1, D/2]."""

    def forward(self, q, k, pos):
        return titan_apply_rotary_emb(q, k, self.freqs_cis)


class Mistral(nn.Module):
    """mistral-inference: tokens [T, H, D], ``freqs_cis[positions]`` (its Transformer indexes the table so)."""

    layout = "thd"

    def __init__(self, rotary_dim: int = D):
        super().__init__()
        self.rotary_dim = rotary_dim
        self.register_buffer("freqs_cis", mistral_precompute_freqs_cis(rotary_dim, MAX_POS, 10000.0),
                             persistent=False)

    def forward(self, q, k, pos):
        freqs_cis = self.freqs_cis[pos.reshape(-1)]
        if self.rotary_dim == q.shape[-1]:
            return mistral_apply_rotary_emb(q, k, freqs_cis)
        rd = self.rotary_dim  # partial: the first rd channels rotated, the rest passed through
        q_rot, k_rot = mistral_apply_rotary_emb(q[..., :rd], k[..., :rd], freqs_cis)
        return torch.cat((q_rot, q[..., rd:]), -1), torch.cat((k_rot, k[..., rd:]), -1)


class GptFast(nn.Module):
    """gpt-fast: a stacked [max_pos, D/2, 2] cache indexed by ``input_pos`` [S], the 5-D real view."""

    layout = "bshd"

    def __init__(self):
        super().__init__()
        self.register_buffer("freqs_cis", gptfast_precompute_freqs_cis(MAX_POS, D, dtype=torch.float32),
                             persistent=False)

    def forward(self, q, k, pos):
        freqs_cis = self.freqs_cis[pos[0]]  # gpt-fast's Transformer: self.freqs_cis[input_pos]
        return gptfast_apply_rotary_emb(q, freqs_cis), gptfast_apply_rotary_emb(k, freqs_cis)


class Llama4Indexed(TitanPositions):
    """transformers' Llama 4 ``apply_rotary_emb`` (the installed package's function), called with a complex
    table gathered by positions in the block (``freqs_cis[pos]``: what torch.onnx cannot index)."""

    def forward(self, q, k, pos):
        return modeling_llama4.apply_rotary_emb(q, k, self.freqs_cis[pos])


class HeadsFirst(TitanPositions):
    """A user's complex rotation of [B, H, S, D] tensors: the table gathered by positions, unsqueezed at dim 1."""

    layout = "bhsd"

    def forward(self, q, k, pos):
        freqs = self.freqs_cis[pos].unsqueeze(1)  # [B, 1, S, D/2] complex

        def rot(x):
            xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
            return torch.view_as_real(freqs * xc).flatten(-2).type_as(x)

        return rot(q), rot(k)


class PerHeadComplex(nn.Module):
    """Learned per-head frequencies as a complex product: polar(1, pos * freq[h]) of shape [B, S, H, D/2]
    (no axis to broadcast over: every head is its own row of the op)."""

    layout = "bshd"

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(5)
        self.register_buffer("freq", torch.rand(4, D // 2, generator=generator) * 0.5, persistent=False)

    def forward(self, q, k, pos):
        def rot(x):
            a = pos[:, :, None, None].float() * self.freq[: x.shape[2]]
            freqs_cis = torch.polar(torch.ones_like(a), a)
            xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
            return torch.view_as_real(xc * freqs_cis).flatten(3).type_as(x)

        return rot(q), rot(k)


class GatheredAxes(nn.Module):
    """Lumina 2's spelling (diffusers' ``Lumina2RotaryPosEmbed``): one complex table per position axis, its rows
    gathered by the axis' ids ``repeat``ed over its frequencies from the table ``repeat``ed over the batch, the
    axes joined, copied into a complex ``zeros`` buffer by a slice assignment, and multiplied as Meta's."""

    layout = "bshd"

    def __init__(self):
        super().__init__()
        for i, d in enumerate((4, 6, 6)):  # 2 + 3 + 3 = D/2 frequencies (Lumina 2 holds a list: not exportable)
            self.register_buffer(f"table{i}", titan_precompute_freqs_cis(d, MAX_POS), persistent=False)

    def forward(self, q, k, pos):
        ids = torch.stack([pos, pos // 2, pos % 3], dim=-1)  # [B, S, 3]: a text axis and a 2-D grid, say
        parts = []
        for i, table in enumerate((self.table0, self.table1, self.table2)):
            index = ids[:, :, i : i + 1].repeat(1, 1, table.shape[-1])
            parts.append(torch.gather(table.unsqueeze(0).repeat(index.shape[0], 1, 1), dim=1, index=index))
        joined = torch.cat(parts, dim=-1)
        freqs = torch.zeros(*joined.shape, dtype=joined.dtype)
        freqs[:, : joined.shape[1]] = joined
        freqs = freqs.unsqueeze(2)

        def rot(x):
            xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
            return torch.view_as_real(xc * freqs).flatten(3).type_as(x)

        return rot(q), rot(k)


# -- planted: what a naive fusion would get wrong ---------------------------------------------------------


class Conjugated(TitanPositions):
    """torchtitan's spelling with the table conjugated: a rotation by -angle (sin negated)."""

    def forward(self, q, k, pos):
        return titan_apply_rotary_emb(q, k, self.freqs_cis.conj().resolve_conj(), positions=pos)


class ConjugatedProduct(TitanPositions):
    """The product written with ``.conj()`` at the multiply: ``view_as_real(xc * f.conj())``."""

    def forward(self, q, k, pos):
        f = self.freqs_cis[pos][:, :, None, :]

        def rot(x):
            xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
            return torch.view_as_real(xc * f.conj()).flatten(3).type_as(x)

        return rot(q), rot(k)


class SwappedPairs(GptFast):
    """gpt-fast's 5-D view with the stacked outputs swapped: (x1 c + x0 s, x0 c - x1 s), the swapped pair
    rotated by -angle. Fusing it as gpt-fast's rotation would be wrong."""

    def forward(self, q, k, pos):
        freqs = self.freqs_cis[pos[0]]

        def rot(x):
            xs = x.float().reshape(*x.shape[:-1], -1, 2)
            f = freqs.view(1, xs.size(1), 1, xs.size(3), 2)
            out = torch.stack([xs[..., 1] * f[..., 0] + xs[..., 0] * f[..., 1],
                               xs[..., 0] * f[..., 0] - xs[..., 1] * f[..., 1]], -1)
            return out.flatten(3).type_as(x)

        return rot(q), rot(k)


# name -> (rotation module factory, partial)
COMPLEX_FORMS = {
    "titan_positions": (TitanPositions, False),
    "titan_shared_positions": (TitanSharedPositions, False),
    "titan_sliced": (TitanSliced, False),
    "mistral": (Mistral, False),
    "mistral_partial": (lambda: Mistral(rotary_dim=D // 2), True),
    "gptfast": (GptFast, False),
    "llama4_indexed": (Llama4Indexed, False),
    "heads_first": (HeadsFirst, False),
    "per_head_complex": (PerHeadComplex, False),
    "gathered_axes": (GatheredAxes, False),
}
PLANTED = {
    "conjugated": Conjugated,
    "conjugated_product": ConjugatedProduct,
    "swapped_pairs": SwappedPairs,
}


def block(name: str, seed: int = 0):
    import rope_blocks as rb

    make = COMPLEX_FORMS[name][0] if name in COMPLEX_FORMS else PLANTED[name]
    torch.manual_seed(seed)
    return rb.Block(make(), seed).eval()
