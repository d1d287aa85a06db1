"""rope_export.exporting.meta: Meta-style complex RoPE, and the other reference forms, through the rotary op.

The user-side code below is written the way its sources write it (Meta's LLaMA reference
``model.py``, transformers' Llama ``rotate_half``, GPT-J-style stack/flatten, a torchtune-style
rotary module with explicit positions). It lives in this test module, as it would in a user's
own module: the hooks find and swap it here, export, and put it back.
"""

from __future__ import annotations

import sys
import warnings

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from onnx.reference import ReferenceEvaluator
from torch import nn

from rope_export import hf
from rope_export.exporting import meta
from rope_export.exporting.core import count_rotary_nodes, custom_translation_table
from rope_export.op.contract import DOMAIN, OP_TYPE
from rope_export.op.onnx_op import RotaryEmbedding
from rope_export.op.rope_types import RopeConfig, build_caches
from rope_export.op.tolerances import tolerance

THIS_MODULE = sys.modules[__name__]
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# -- Meta's LLaMA reference code (complex RoPE), as a user's module holds it --------------------

def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)  # complex64


def reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor):
    ndim = x.ndim
    assert freqs_cis.shape == (x.shape[1], x.shape[-1])
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


MetaApply = apply_rotary_emb  # the original, kept to compare with


def causal_sdpa(xq, xk, xv, n_rep):
    """[B, S, H, D] q and [B, S, Hkv, D] k/v -> [B, S, H*D]."""
    xk, xv = xk.repeat_interleave(n_rep, dim=2), xv.repeat_interleave(n_rep, dim=2)
    out = F.scaled_dot_product_attention(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), is_causal=True)
    return out.transpose(1, 2).flatten(2)


class MetaAttention(nn.Module):
    def __init__(self, dim=32, n_heads=4, n_kv_heads=2):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, freqs_cis):
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        return self.wo(causal_sdpa(xq, xk, xv, self.n_heads // self.n_kv_heads))


class MetaBlock(nn.Module):
    """Meta's Transformer keeps freqs_cis as a plain attribute; ``as_buffer`` registers it instead."""

    def __init__(self, max_seq_len=64, as_buffer=False):
        super().__init__()
        torch.manual_seed(0)
        self.attention = MetaAttention()
        freqs_cis = precompute_freqs_cis(8, max_seq_len * 2)
        if as_buffer:
            self.register_buffer("freqs_cis", freqs_cis, persistent=False)
        else:
            self.freqs_cis = freqs_cis

    def forward(self, x, input_pos):
        return self.attention(x, self.freqs_cis[input_pos])


# -- other reference forms ---------------------------------------------------------------------

def rotate_half(x):  # transformers' Llama
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):  # transformers' Llama
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def apply_rotary_interleaved(x, cos, sin):  # stack/flatten on pairs (2i, 2i+1); x [B, S, H, D], cos [S, D/2]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    x1, x2 = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).type_as(x)


class TorchtuneStyleRope(nn.Module):
    """A rotary module called with explicit positions: cache [max_seq, D/2, 2], x [B, S, H, D]."""

    def __init__(self, dim=8, max_seq_len=64, base=10000.0):
        super().__init__()
        theta = 1.0 / (base ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
        idx_theta = torch.einsum("i,j->ij", torch.arange(max_seq_len).float(), theta)
        self.register_buffer("cache", torch.stack([idx_theta.cos(), idx_theta.sin()], dim=-1), persistent=False)

    def forward(self, x, input_pos):
        rope_cache = self.cache[input_pos]  # [B, S, D/2, 2]
        xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
        rope_cache = rope_cache.view(-1, xshaped.size(1), 1, xshaped.size(3), 2)
        out = torch.stack([xshaped[..., 0] * rope_cache[..., 0] - xshaped[..., 1] * rope_cache[..., 1],
                           xshaped[..., 1] * rope_cache[..., 0] + xshaped[..., 0] * rope_cache[..., 1]], -1)
        return out.flatten(3).type_as(x)


class FormBlock(nn.Module):
    """q/k projections rotated by one of the forms above; returns the attention output."""

    def __init__(self, form: str):
        super().__init__()
        torch.manual_seed(1)
        self.form = form
        self.wq, self.wk, self.wv = nn.Linear(32, 32), nn.Linear(32, 16), nn.Linear(32, 16)
        self.rope = TorchtuneStyleRope()
        cos, sin = build_caches(RopeConfig(head_dim=8, max_position_embeddings=64))
        self.register_buffer("cos", cos, persistent=False)  # [64, 4]
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x, input_pos):  # input_pos [B, S]
        b, s, _ = x.shape
        q, k, v = self.wq(x).view(b, s, 4, 8), self.wk(x).view(b, s, 2, 8), self.wv(x).view(b, s, 2, 8)
        if self.form == "rotate-half":  # transformers' layout: [B, H, S, D], cos/sin [B, S, D] duplicated halves
            cos, sin = self.cos[input_pos], self.sin[input_pos]
            cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
            qt, kt = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            q, k = qt.transpose(1, 2), kt.transpose(1, 2)
        elif self.form == "interleaved":  # positions shared by the batch: [S]
            cos, sin = self.cos[input_pos[0]], self.sin[input_pos[0]]
            q, k = apply_rotary_interleaved(q, cos, sin), apply_rotary_interleaved(k, cos, sin)
        else:  # "module": a rotary module called with explicit positions
            q, k = self.rope(q, input_pos), self.rope(k, input_pos)
        return causal_sdpa(q, k, v, 2)


# -- helpers -----------------------------------------------------------------------------------

def export_dynamic(module, inputs, names):
    batch, seq = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("seq", min=1, max=48)
    shapes = ({0: batch, 1: seq}, {0: batch, 1: seq} if inputs[1].dim() == 2 else {0: seq})
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.onnx's notes on dim names and deprecations
        program = torch.onnx.export(module, inputs, dynamo=True, input_names=names, dynamic_shapes=shapes,
                                    custom_translation_table=custom_translation_table(), verbose=False)
    return program.model_proto


def run_file(model, feeds):
    """As exported on onnx.reference (our OpRun); also lowered to ai.onnx on onnxruntime when passes exist."""
    outputs = [ReferenceEvaluator(model, new_ops=[RotaryEmbedding]).run(None, feeds)[0]]
    try:
        from rope_export.passes import lower
    except ImportError:
        return outputs
    import onnxruntime as ort

    session = ort.InferenceSession(lower(model, "onnx").SerializeToString(), providers=["CPUExecutionProvider"])
    outputs.append(session.run(None, feeds)[0])
    return outputs


def rotary_nodes(model):
    return [n for n in model.graph.node if n.domain == DOMAIN and n.op_type == OP_TYPE]


def attr(node, name):
    return next((a.i for a in node.attribute if a.name == name), 0)


# -- the drop-in -------------------------------------------------------------------------------

@given(
    batch=st.integers(1, 3), seq=st.integers(1, 6), kv_heads=st.sampled_from([1, 2]),
    head_dim=st.sampled_from([2, 8, 16]), start=st.integers(0, 50), dtype=st.sampled_from(sorted(DTYPES)),
)
def test_drop_in_matches_metas_complex_multiply(batch, seq, kv_heads, head_dim, start, dtype):
    generator = torch.Generator().manual_seed(batch * 100 + seq)
    xq = torch.randn(batch, seq, 2 * kv_heads, head_dim, generator=generator).to(DTYPES[dtype])
    xk = torch.randn(batch, seq, kv_heads, head_dim, generator=generator).to(DTYPES[dtype])
    freqs_cis = precompute_freqs_cis(head_dim, 64)[start : start + seq]
    want = MetaApply(xq, xk, freqs_cis)
    for table in (freqs_cis, torch.view_as_real(freqs_cis)):  # complex, and the form the hook stores
        got = meta.apply_rotary_emb(xq, xk, table)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape
            assert tolerance("op", dtype).allclose(g.float(), w.float())


def test_freqs_cis_as_caches_are_the_interleaved_rope_caches():
    freqs_cis = precompute_freqs_cis(16, 100, theta=500000.0)
    cos, sin = meta.freqs_cis_to_caches(freqs_cis)
    want_cos, want_sin = build_caches(RopeConfig(head_dim=16, rope_theta=500000.0, interleaved=True), 100)
    assert cos.dtype == torch.float32 and cos.shape == (100, 8)
    # Meta computes the angles in float32, rope_types in float64: they differ by float32 rounding of t*f.
    assert torch.allclose(cos, want_cos, atol=2e-5) and torch.allclose(sin, want_sin, atol=2e-5)
    assert torch.equal(meta.freqs_cis_to_caches(torch.view_as_real(freqs_cis))[0], cos)
    with pytest.raises(meta.MetaRopeError, match=r"view_as_real form \[..., D/2, 2\]"):
        meta.freqs_cis_to_caches(torch.zeros(10, 4))


# -- the Meta hook -----------------------------------------------------------------------------

@pytest.mark.parametrize("as_buffer", [False, True], ids=["attribute", "buffer"])
def test_meta_block_exports_one_node_per_tensor_and_matches(as_buffer):
    block = MetaBlock(as_buffer=as_buffer).eval()
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    with meta.meta_rope_hooked(block) as hook:
        assert hook.functions == [f"{__name__}.apply_rotary_emb"] and hook.tensors == ["freqs_cis"]
        model = export_dynamic(block, (x, torch.arange(3, 8)), ["x", "input_pos"])
    onnx.checker.check_model(model, full_check=True)
    nodes = rotary_nodes(model)
    assert len(nodes) == 2 and all(attr(n, "interleaved") == 1 for n in nodes)  # q and k, Meta's pairs
    assert all(attr(n, "num_heads") in (4, 2) for n in nodes)  # 3-D [B, S, H*D]: no transpose exported
    for batch, seq, start in ((1, 7, 0), (3, 1, 100), (2, 4, 60)):
        x = torch.randn(batch, seq, 32, generator=torch.Generator().manual_seed(seq))
        pos = torch.arange(start, start + seq)
        with torch.no_grad():
            want = block(x, pos)  # the original, complex, code path
        for got in run_file(model, {"x": x.numpy(), "input_pos": pos.numpy()}):
            assert tolerance("block", "float32").allclose(got, want.numpy()), f"B{batch} S{seq} start {start}"


def test_meta_hook_restores_everything_also_on_error():
    block = MetaBlock().eval()
    buffered = MetaBlock(as_buffer=True).eval()
    table, buffer = block.freqs_cis, buffered.freqs_cis
    x, pos = torch.randn(2, 5, 32), torch.arange(5)
    before = block(x, pos)
    with meta.meta_rope_hooked(block), meta.meta_rope_hooked(buffered):
        assert THIS_MODULE.apply_rotary_emb is meta.apply_rotary_emb
        assert block.freqs_cis.dtype == torch.float32 and block.freqs_cis.shape == (128, 4, 2)
        assert buffered.freqs_cis.shape == (128, 4, 2) and "freqs_cis" in buffered._buffers
        assert tolerance("block", "float32").allclose(block(x, pos).detach(), before.detach())
    assert THIS_MODULE.apply_rotary_emb is MetaApply
    assert block.freqs_cis is table and buffered._buffers["freqs_cis"] is buffer
    assert torch.equal(block(x, pos), before)
    with pytest.raises(ValueError, match="boom"), meta.meta_rope_hooked(block):
        raise ValueError("boom")
    assert THIS_MODULE.apply_rotary_emb is MetaApply and block.freqs_cis is table


def test_meta_hook_errors_name_the_fix():
    with pytest.raises(meta.MetaRopeError, match="no module-level function 'apply_rotary_emb'"):
        with meta.meta_rope_hooked(nn.Linear(2, 2)):
            pass
    block = MetaBlock()
    block.theta = nn.Parameter(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(meta.MetaRopeError, match="theta is a complex \\*parameter\\*"):
        with meta.meta_rope_hooked(block):
            pass
    assert THIS_MODULE.apply_rotary_emb is MetaApply
    with pytest.raises(meta.MetaRopeError, match="has no function 'rope_fn'"):
        with meta.meta_rope_hooked(MetaBlock(), function="rope_fn", modules=[THIS_MODULE]):
            pass


# -- every reference form exports through the op and matches -------------------------------------

FORMS = {
    # form: (how the user swaps it in, node interleaved, node has position_ids)
    "rotate-half": (lambda block: meta.patched([(THIS_MODULE, "apply_rotary_pos_emb", hf.rotate_half_qk)]), 0, False),
    "interleaved": (lambda block: meta.patched([(THIS_MODULE, "apply_rotary_interleaved", meta.rotate_bshd)]), 1,
                    False),
    "module": (lambda block: meta.swapped_modules(
        block, {"rope": meta.RotaryWithPositions(*split_cache(block.rope.cache), interleaved=True)}), 1, True),
}


def split_cache(cache):
    return cache[..., 0], cache[..., 1]


@pytest.mark.parametrize("form", list(FORMS))
def test_reference_form_exports_one_node_per_tensor_and_matches(form):
    swap, interleaved, with_positions = FORMS[form]
    block = FormBlock(form).eval()
    originals = (THIS_MODULE.apply_rotary_pos_emb, THIS_MODULE.apply_rotary_interleaved, block.rope)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    pos = (torch.arange(5) + 2).expand(2, 5).contiguous()
    with swap(block):
        with torch.no_grad():
            eager = block(x, pos)
        model = export_dynamic(block, (x, pos), ["x", "input_pos"])
    assert (THIS_MODULE.apply_rotary_pos_emb, THIS_MODULE.apply_rotary_interleaved, block.rope) == originals
    nodes = rotary_nodes(model)
    assert len(nodes) == 2 and count_rotary_nodes(model) == 2
    assert {attr(n, "interleaved") for n in nodes} == {interleaved}
    assert all((len(n.input) == 4 and n.input[3] != "") == with_positions for n in nodes)
    assert "Neg" not in [n.op_type for n in model.graph.node]
    with torch.no_grad():
        assert tolerance("block", "float32").allclose(eager, block(x, pos))
    for batch, seq, start in ((1, 9, 0), (3, 2, 40)):
        x = torch.randn(batch, seq, 32, generator=torch.Generator().manual_seed(seq))
        pos = (torch.arange(seq) + start).expand(batch, seq).contiguous()
        with torch.no_grad():
            want = block(x, pos).numpy()
        for got in run_file(model, {"x": x.numpy(), "input_pos": pos.numpy()}):
            assert tolerance("block", "float32").allclose(got, want), f"{form} B{batch} S{seq}: " \
                f"{np.abs(got - want).max():.3g}"


def test_rotary_with_positions_layouts_and_out_of_range():
    rope = TorchtuneStyleRope(dim=8, max_seq_len=16)
    drop_in = meta.RotaryWithPositions(*split_cache(rope.cache), interleaved=True)
    x = torch.randn(2, 3, 4, 8)
    pos = torch.tensor([[0, 5, 15], [1, 2, 3]])
    assert tolerance("op", "float32").allclose(drop_in(x, pos), rope(x, pos))
    bhsd = meta.RotaryWithPositions(*split_cache(rope.cache), interleaved=True, layout="bhsd")
    assert torch.allclose(bhsd(x.transpose(1, 2), pos).transpose(1, 2), drop_in(x, pos))
    out = drop_in(x, torch.tensor([[16, 5, -1], [1, 2, 3]]))  # outside the cache: passed through (op contract)
    assert torch.equal(out[0, 0], x[0, 0]) and torch.equal(out[0, 2], x[0, 2])
    assert drop_in.half().cos_cache.dtype == torch.float32  # caches stay float32 under .half()
