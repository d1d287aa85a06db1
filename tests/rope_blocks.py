"""A zoo of small attention blocks, one per way of writing RoPE, shared by the detection, fusion
and export_module tests.

Third-party code is the package's own, installed as a test dependency (the ``dev`` extra):
torchtune's ``RotaryPositionalEmbeddings`` (its module file is loaded by path: ``import
torchtune`` needs torchao), Meta's reference ``precompute_freqs_cis``/``apply_rotary_emb`` from
``llama_models/llama3/model.py`` (the functions are taken from the installed file: its module
imports fairscale), lucidrains' ``rotary_embedding_torch`` (einops), and transformers' GLM and
NanoChat ``apply_rotary_pos_emb``. The other forms are written here, one per spelling the fusion
must find. ``FORMS`` maps a name to (rotation module factory, layout, expectation).

Every block computes ``q, k, v`` projections of ``x [B, S, HIDDEN]``, rotates q and k with its form
(positions ``pos [B, S]``), runs attention and returns ``(output, rotated keys)``.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib.util
import io
import math
import types
import warnings
from dataclasses import dataclass
from pathlib import Path

import onnx
import torch
import torch.nn.functional as F
from torch import nn

B, S, H, KV, D, MAX_POS = 2, 5, 4, 2, 16, 32
HIDDEN = H * D
THETA = 10000.0


# -- third-party code, loaded from the installed packages ----------------------------------------

def _package_file(package: str, relative: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"{package} is not installed (pip install -e '.[dev]')")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise ImportError(f"{path} not found in the installed {package}")
    return path


def torchtune_rope_class():
    """torchtune.modules.position_embeddings.RotaryPositionalEmbeddings, loaded from its file."""
    path = _package_file("torchtune", "modules/position_embeddings.py")
    spec = importlib.util.spec_from_file_location("torchtune_position_embeddings", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.RotaryPositionalEmbeddings


def meta_reference() -> types.SimpleNamespace:
    """precompute_freqs_cis, reshape_for_broadcast, apply_rotary_emb of Meta's reference model
    (llama_models/llama3/model.py), compiled from the installed file's own source."""
    path = _package_file("llama_models", "llama3/model.py")
    tree = ast.parse(path.read_text())
    wanted = {"precompute_freqs_cis", "apply_scaling", "reshape_for_broadcast", "apply_rotary_emb"}
    body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    namespace = {"torch": torch, "Tuple": tuple, "Optional": None}
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), namespace)  # noqa: S102
    return types.SimpleNamespace(**{name: namespace[name] for name in wanted})


# -- helpers shared by the hand-written forms ------------------------------------------------------

def inv_freq(dim: int = D) -> torch.Tensor:
    return 1.0 / (THETA ** (torch.arange(0, dim, 2).float() / dim))


def angles(pos: torch.Tensor, dim: int = D) -> torch.Tensor:
    """[B, S, dim/2] rotation angles for positions [B, S]."""
    return pos[..., None].float() * inv_freq(dim)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


# -- the forms ----------------------------------------------------------------------------------------

class Torchtune(nn.Module):
    """torchtune's module: reshape to pairs, stacked [max_pos, D/2, 2] cache indexed by input_pos."""

    layout = "bshd"

    def __init__(self):
        super().__init__()
        self.rope = torchtune_rope_class()(D, max_seq_len=MAX_POS)

    def forward(self, q, k, pos):
        return self.rope(q, input_pos=pos), self.rope(k, input_pos=pos)


class Meta(nn.Module):
    """Meta's reference apply_rotary_emb: view_as_complex times a polar freqs_cis table."""

    layout = "bshd"

    def __init__(self):
        super().__init__()
        self.ref = meta_reference()
        self.freqs_cis = self.ref.precompute_freqs_cis(D, MAX_POS)

    def forward(self, q, k, pos):
        # Meta's model takes freqs_cis[start_pos : start_pos + seqlen]; rows of the real view are taken
        # here (torch.onnx cannot index complex tensors) so the start can be a tensor.
        rows = pos[0, 0] + torch.arange(q.shape[1])
        freqs_cis = torch.view_as_complex(torch.view_as_real(self.freqs_cis)[rows])
        return self.ref.apply_rotary_emb(q, k, freqs_cis)


class Lucidrains(nn.Module):
    """rotary_embedding_torch: einops rearrange + unbind + stack((-x2, x1)), cos/sin via repeat(r=2)."""

    layout = "bhsd"

    def __init__(self, xpos: bool = False):
        super().__init__()
        from rotary_embedding_torch import RotaryEmbedding

        self.rope = RotaryEmbedding(dim=D, use_xpos=xpos)
        self.xpos = xpos

    def forward(self, q, k, pos):
        if self.xpos:  # scaled rotations (positions implicit: 0..S-1)
            return self.rope.rotate_queries_and_keys(q, k)
        from rotary_embedding_torch import apply_rotary_emb

        freqs = self.rope(pos)[:, None]  # [B, 1, S, D]
        return apply_rotary_emb(freqs, q), apply_rotary_emb(freqs, k)


class PairsStack(nn.Module):
    """Reshape to pairs, rotate pair by pair, stack and flatten (interleaved)."""

    layout = "bshd"

    def forward(self, q, k, pos):
        a = angles(pos)[:, :, None, :]
        cos, sin = a.cos(), a.sin()

        def rot(x):
            pairs = x.reshape(*x.shape[:-1], -1, 2)
            x1, x2 = pairs[..., 0], pairs[..., 1]
            return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)

        return rot(q), rot(k)


class StridedWrites(nn.Module):
    """Wan's spelling: the pairs rotated one by one and written into an empty buffer by strided slices
    (``out[..., 0::2] = x1*c - x2*s``), inside a function defined anew on every call (no hook reaches it)."""

    layout = "bshd"

    def forward(self, q, k, pos):
        a = angles(pos)[:, :, None, :]
        cos, sin = a.cos().repeat_interleave(2, -1), a.sin().repeat_interleave(2, -1)

        def rot(x, c, s):
            x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
            out = torch.empty_like(x)
            out[..., 0::2] = x1 * c[..., 0::2] - x2 * s[..., 1::2]
            out[..., 1::2] = x1 * s[..., 1::2] + x2 * c[..., 0::2]
            return out

        return rot(q, cos, sin), rot(k, cos, sin)


class ComplexPolar(nn.Module):
    """view_as_complex times torch.polar(1, angles) computed from the positions."""

    layout = "bshd"

    def forward(self, q, k, pos):
        a = angles(pos)
        freqs_cis = torch.polar(torch.ones_like(a), a)  # [B, S, D/2] complex

        def rot(x):
            xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
            fc = freqs_cis.reshape(x.shape[0], x.shape[1], 1, -1)
            return torch.view_as_real(xc * fc).flatten(3).type_as(x)

        return rot(q), rot(k)


class RearrangeUnbind(nn.Module):
    """einops rearrange to pairs + unbind + stack((-x2, x1)); cos/sin by repeat_interleave."""

    layout = "bhsd"

    def forward(self, q, k, pos):
        from einops import rearrange

        a = angles(pos).repeat_interleave(2, dim=-1)[:, None]
        cos, sin = a.cos(), a.sin()

        def rot(x):
            x1, x2 = rearrange(x, "... (d r) -> ... d r", r=2).unbind(dim=-1)
            return x * cos + rearrange(torch.stack((-x2, x1), dim=-1), "... d r -> ... (d r)") * sin

        return rot(q), rot(k)


class GPTJCache(nn.Module):
    """GPT-J's concatenated [sin | cos] cache, repeat_interleave, rotate_every_two, partial (8 of 16)."""

    layout = "bshd"
    rotary_dim = 8

    def __init__(self):
        super().__init__()
        freqs = torch.arange(MAX_POS).float()[:, None] * inv_freq(self.rotary_dim)
        self.register_buffer("embed_positions", torch.cat((freqs.sin(), freqs.cos()), dim=1), persistent=False)

    def forward(self, q, k, pos):
        sincos = self.embed_positions[pos]
        sin, cos = torch.split(sincos, sincos.shape[-1] // 2, dim=-1)
        sin = torch.repeat_interleave(sin[:, :, None, :], 2, 3)
        cos = torch.repeat_interleave(cos[:, :, None, :], 2, 3)

        def rotate_every_two(x):
            return torch.stack((-x[:, :, :, 1::2], x[:, :, :, ::2]), dim=-1).flatten(-2)

        def rot(x):
            x_rot, x_pass = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
            return torch.cat([x_rot * cos + rotate_every_two(x_rot) * sin, x_pass], dim=-1)

        return rot(q), rot(k)


class RotateHalfTable(nn.Module):
    """Llama's rotate-half with cos/sin tables indexed by the positions; ``rotary_dim`` < D is the
    GPT-NeoX/Phi partial form."""

    layout = "bhsd"

    def __init__(self, rotary_dim: int = D):
        super().__init__()
        self.rotary_dim = rotary_dim
        freqs = torch.arange(MAX_POS).float()[:, None] * inv_freq(rotary_dim)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, q, k, pos):
        cos, sin = self.cos_cached[pos][:, None], self.sin_cached[pos][:, None]
        rd = self.rotary_dim

        def rot(x):
            x_rot, x_pass = x[..., :rd], x[..., rd:]
            return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)

        return rot(q), rot(k)


class MLA(nn.Module):
    """DeepSeek-style MLA: only the rope part (last 8 channels) rotates; one shared key head."""

    layout = "bhsd"
    rope_dim = 8

    def forward(self, q, k, pos):
        a = angles(pos, self.rope_dim)
        emb = torch.cat((a, a), dim=-1)[:, None]
        cos, sin = emb.cos(), emb.sin()
        q_nope, q_pe = torch.split(q, [D - self.rope_dim, self.rope_dim], dim=-1)
        k_nope, k_pe = k[..., : D - self.rope_dim], k[:, :1, :, D - self.rope_dim :]
        q_pe = q_pe * cos + rotate_half(q_pe) * sin
        k_pe = k_pe * cos + rotate_half(k_pe) * sin
        return torch.cat((q_nope, q_pe), dim=-1), torch.cat((k_nope, k_pe.expand(-1, k.shape[1], -1, -1)), dim=-1)


class TransformersFunction(nn.Module):
    """transformers' own apply_rotary_pos_emb of a model family, with cos/sin as its rotary
    embedding makes them (cat(freqs, freqs), [B, S, D])."""

    layout = "bhsd"

    def __init__(self, family: str):
        super().__init__()
        import importlib

        self.apply = importlib.import_module(f"transformers.models.{family}.modeling_{family}").apply_rotary_pos_emb
        self.family = family

    def forward(self, q, k, pos):
        dim = D // 2 if self.family == "glm" else D  # GLM: partial_rotary_factor 0.5
        emb = torch.cat((angles(pos, dim), angles(pos, dim)), dim=-1)
        return self.apply(q, k, emb.cos(), emb.sin())


# -- look-alikes: not rotations ------------------------------------------------------------------------

class SwiGLU(nn.Module):
    layout = "bshd"

    def forward(self, q, k, pos):
        return F.silu(q) * q, F.silu(k) * k


class SinusoidalAdded(nn.Module):
    """Vaswani's sinusoidal table added to q and k (interleaved sin/cos columns)."""

    layout = "bshd"

    def __init__(self):
        super().__init__()
        freqs = torch.arange(MAX_POS).float()[:, None] * inv_freq()
        pe = torch.zeros(MAX_POS, D)
        pe[:, 0::2], pe[:, 1::2] = freqs.sin(), freqs.cos()
        self.register_buffer("pe", pe, persistent=False)

    def forward(self, q, k, pos):
        pe = self.pe[pos][:, :, None, :]
        return q + pe, k + pe


class SequenceFirst(nn.Module):
    """Megatron/GPT-NeoX original layout [S, B, H, D] (cos [S, 1, 1, D]): fused as [B', S', H, D] with the
    token axes swapped (per-token caches)."""

    layout = "sbhd"

    def forward(self, q, k, pos):
        a = torch.cat((angles(pos[:1]), angles(pos[:1])), dim=-1)[0][:, None, None, :]  # [S, 1, 1, D]
        cos, sin = a.cos(), a.sin()
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class PerHeadAngles(nn.Module):
    """Each head rotates by its own multiple of the angles (per-head frequencies): cos/sin [B, H, S, D]
    vary per head; fused with the heads folded into the batch (X [B*H, S, D], per-row caches)."""

    layout = "bhsd"

    def forward(self, q, k, pos):
        def rot(x):
            scale = 1.0 + 0.25 * torch.arange(x.shape[1]).float()[None, :, None, None]
            a = torch.cat((angles(pos), angles(pos)), dim=-1)[:, None] * scale
            return x * a.cos() + rotate_half(x) * a.sin()

        return rot(q), rot(k)


class PerHeadInterleavedPartial(nn.Module):
    """Per-head angles on [B, S, H, D] tensors, interleaved pairs over the first half of the head only:
    each (token, head) row becomes an op token ([B*S, H, D]), partial rotation kept."""

    layout = "bshd"

    def forward(self, q, k, pos):
        r = D // 2

        def rot(x):
            scale = 1.0 + 0.25 * torch.arange(x.shape[2]).float()[None, None, :, None]
            a = (angles(pos, r)[:, :, None, :] * scale).repeat_interleave(2, dim=-1)  # [B, S, H, r]
            xr, xp = x[..., :r], x[..., r:]
            every_two = torch.stack((-xr[..., 1::2], xr[..., ::2]), dim=-1).flatten(-2)
            return torch.cat((xr * a.cos() + every_two * a.sin(), xp), dim=-1)

        return rot(q), rot(k)


class PerHeadPairs(nn.Module):
    """Per-head angles against a pair axis, ``[B, H, S, D/2, 2]`` products: every pair becomes an op row
    ([N, D/2, 2], a rotate-half of width 2)."""

    layout = "bhsd"

    def forward(self, q, k, pos):
        def rot(x):
            scale = 1.0 + 0.25 * torch.arange(x.shape[1]).float()[None, :, None, None]
            a = (angles(pos)[:, None] * scale)[..., None]  # [B, H, S, D/2, 1]
            pairs = x.reshape(*x.shape[:-1], -1, 2)
            turned = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1)
            return (pairs * a.cos() + turned * a.sin()).flatten(-2)

        return rot(q), rot(k)


class FlatRows(nn.Module):
    """Every head of every token flattened to rows ``[B*H*S, D]`` and rotated there (2-D): the op has no
    form without a head axis; counted, left decomposed, and said so."""

    layout = "bhsd"

    def forward(self, q, k, pos):
        def rot(x):
            a = torch.cat((angles(pos), angles(pos)), dim=-1)[:, None].expand(x.shape).reshape(-1, D)
            rows = x.reshape(-1, D)
            return (rows * a.cos() + rotate_half(rows) * a.sin()).reshape(x.shape)

        return rot(q), rot(k)


class PerHeadStack(nn.Module):
    """Per-head angles rotated pair by pair and stacked (``PairsStack``'s spelling): heads folded into the
    batch with per-pair caches."""

    layout = "bhsd"

    def forward(self, q, k, pos):
        def rot(x):
            scale = 1.0 + 0.25 * torch.arange(x.shape[1]).float()[None, :, None, None]
            a = angles(pos)[:, None] * scale  # [B, H, S, D/2]
            cos, sin = a.cos(), a.sin()
            pairs = x.reshape(*x.shape[:-1], -1, 2)
            x1, x2 = pairs[..., 0], pairs[..., 1]
            return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)

        return rot(q), rot(k)


class TokenMajor(nn.Module):
    """Packed / flattened tokens [T, H, D] (batch and sequence merged, as vision encoders that flatten
    patches and packed sequences do) with cos/sin [T, 1, D]: fused as [1, T, H*D] with per-token caches."""

    layout = "thd"

    def forward(self, q, k, pos):
        a = torch.cat((angles(pos), angles(pos)), dim=-1).reshape(-1, 1, D)  # [T, 1, D]
        cos, sin = a.cos(), a.sin()
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class MismatchedAngles(nn.Module):
    """Rotate-half arithmetic whose sin has twice cos's angles: not a rotation."""

    layout = "bhsd"

    def forward(self, q, k, pos):
        a = torch.cat((angles(pos), angles(pos)), dim=-1)[:, None]
        cos, sin = a.cos(), (2 * a).sin()
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


# -- the block ----------------------------------------------------------------------------------------

class Block(nn.Module):
    """q/k/v/o projections around one rotation form; returns (attention output, rotated keys [B, KV, S, D])."""

    def __init__(self, rope: nn.Module, seed: int = 0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.wq, self.wk, self.wv = nn.Linear(HIDDEN, H * D), nn.Linear(HIDDEN, KV * D), nn.Linear(HIDDEN, KV * D)
        self.wo = nn.Linear(H * D, HIDDEN)
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=generator) * 0.2
        self.rope = rope
        self.layout = rope.layout

    def forward(self, x, pos):
        b, s, _ = x.shape
        q, k = self.wq(x).view(b, s, H, D), self.wk(x).view(b, s, KV, D)
        v = self.wv(x).view(b, s, KV, D).transpose(1, 2)
        if self.layout == "bhsd":
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        elif self.layout == "sbhd":
            q, k = q.transpose(0, 1), k.transpose(0, 1)
        elif self.layout == "thd":
            q, k = q.reshape(b * s, H, D), k.reshape(b * s, KV, D)
        q, k = self.rope(q, k, pos)
        if self.layout == "thd":
            q, k = q.view(b, s, H, D), k.view(b, s, KV, D)
        if self.layout in ("bshd", "thd"):
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        elif self.layout == "sbhd":
            q, k = q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3)
        k_all, v_all = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
        weights = torch.softmax(q @ k_all.transpose(-1, -2) / math.sqrt(D), dim=-1)
        out = (weights @ v_all).transpose(1, 2).reshape(b, s, H * D)
        return self.wo(out), k


@dataclass(frozen=True)
class Form:
    make: type | object  # () -> rotation module
    rotations: int  # plain rotations one forward performs (q and k: 2)
    interleaved: bool | None = None  # the fused nodes' interleaved attribute (None: not fused)
    partial: bool = False
    scaled: int = 0  # xPos-style scaled rotations (counted, never fused)


FORMS: dict[str, Form] = {
    "torchtune": Form(Torchtune, 2, True),
    "meta": Form(Meta, 2, True),
    "lucidrains": Form(Lucidrains, 2, True),
    "pairs_stack": Form(PairsStack, 2, True),
    "complex_polar": Form(ComplexPolar, 2, True),
    "rearrange_unbind": Form(RearrangeUnbind, 2, True),
    "gptj_cache": Form(GPTJCache, 2, True, partial=True),
    "rotate_half_table": Form(RotateHalfTable, 2, False),
    "neox_partial": Form(lambda: RotateHalfTable(rotary_dim=8), 2, False, partial=True),
    "mla": Form(MLA, 2, False),
    "glm": Form(lambda: TransformersFunction("glm"), 2, True, partial=True),
    "nanochat_flipped": Form(lambda: TransformersFunction("nanochat"), 2, False),
    "sequence_first": Form(SequenceFirst, 2, False),
    "per_head_angles": Form(PerHeadAngles, 2, False),
    "token_major": Form(TokenMajor, 2, False),
    "per_head_interleaved_partial": Form(PerHeadInterleavedPartial, 2, True, partial=True),
    "per_head_stack": Form(PerHeadStack, 2, True),
    "per_head_pairs": Form(PerHeadPairs, 2, False),
    "strided_writes": Form(StridedWrites, 2, True),
}

# rotations the op cannot express: counted, left decomposed, and said so
UNFUSABLE: dict[str, Form] = {
    "flat_rows": Form(FlatRows, 2),
}

LOOK_ALIKES: dict[str, Form] = {
    "swiglu": Form(SwiGLU, 0),
    "sinusoidal_added": Form(SinusoidalAdded, 0),
    "mismatched_angles": Form(MismatchedAngles, 0),
    "xpos": Form(lambda: Lucidrains(xpos=True), 2, scaled=2),
}


def block(name: str, seed: int = 0) -> Block:
    form = FORMS.get(name) or LOOK_ALIKES.get(name) or UNFUSABLE[name]
    torch.manual_seed(seed)
    return Block(form.make(), seed).eval()


def example(batch: int = B, seq: int = S, offset: int = 0, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, pos): positions offset + 0..seq-1 in every row."""
    x = torch.randn(batch, seq, HIDDEN, generator=torch.Generator().manual_seed(seed))
    pos = (torch.arange(seq) + offset).expand(batch, seq).contiguous()
    return x, pos


@functools.cache
def plain_export(name: str, opset: int = 18) -> onnx.ModelProto:
    """A plain torch.onnx (dynamo) export of the block, batch and sequence dynamic (made once)."""
    return export_plain(block(name), example(), opset)


def export_plain(module: nn.Module, args: tuple, opset: int = 18) -> onnx.ModelProto:
    """torch.onnx (dynamo) export of ``module(x, pos)``, batch and sequence dynamic."""
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
    with torch.no_grad(), warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(module, args, dynamo=True, opset_version=opset, input_names=["x", "pos"],
                                    output_names=["out", "k"], dynamic_shapes=({0: batch, 1: seq},) * 2)
    return program.model_proto


def torchtune_factory():
    """For ``rope-export export --module tests/rope_blocks.py:torchtune_factory``."""
    return block("torchtune"), example()


def unfusable_factory():
    return {"module": block("flat_rows"), "args": example(), "input_names": ["x", "pos"]}
