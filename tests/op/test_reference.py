"""The PyTorch reference of the rotary op, against independent implementations and properties.

Independent references: the NumPy twin (rope_export.op.onnx_op.rotary_numpy, written separately),
onnx.reference running the standard ai.onnx RotaryEmbedding-23 through its function body, and
transformers' apply_rotary_pos_emb (Llama / GPT-NeoX rotate-half, GPT-J interleaved). Properties
come from the math of a rotation: norms kept, q.k depends only on the offset, R(-m) R(m) = 1.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator
from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb as neox_apply_rotary_pos_emb
from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb as gptj_apply_rotary_pos_emb
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_apply_rotary_pos_emb

from rope_export.op.onnx_op import rotary_numpy
from rope_export.op.reference import rotary_embedding
from rope_export.op.tolerances import tolerance
from rope_export.runtimes.contract_runners import to_numpy

HALF_DTYPES = [torch.float16, torch.bfloat16]
NUMPY_DTYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: ml_dtypes.bfloat16}


# -- inputs --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Geometry:
    batch: int
    heads: int
    seq: int
    head_dim: int
    rotary_dim: int  # the rotated width
    rotary_attr: int  # the attribute: 0 (whole head) or rotary_dim
    interleaved: bool
    layout: str  # "bhsd" (4-D X) or "bsd" (3-D X)
    max_pos: int
    seed: int

    @property
    def half(self) -> int:
        return self.rotary_dim // 2

    def attrs(self) -> dict:
        return {
            "interleaved": self.interleaved,
            "num_heads": self.heads if self.layout == "bsd" else 0,
            "rotary_embedding_dim": self.rotary_attr,
        }


@st.composite
def geometries(draw, interleaved=None, layout=None, partial=None):
    half = draw(st.integers(1, 6))
    tail = draw(st.integers(0, 3)) if partial is None else (draw(st.integers(1, 3)) if partial else 0)
    rotary_dim = 2 * half
    rotary_attr = draw(st.sampled_from([0, rotary_dim])) if tail == 0 else rotary_dim
    return Geometry(
        batch=draw(st.integers(1, 2)),
        heads=draw(st.integers(1, 3)),
        seq=draw(st.integers(1, 5)),
        head_dim=rotary_dim + tail,
        rotary_dim=rotary_dim,
        rotary_attr=rotary_attr,
        interleaved=draw(st.booleans()) if interleaved is None else interleaved,
        layout=draw(st.sampled_from(["bhsd", "bsd"])) if layout is None else layout,
        max_pos=draw(st.integers(1, 12)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def to_layout(x4: torch.Tensor, layout: str) -> torch.Tensor:
    """[B, H, S, D] -> X in the given layout."""
    if layout == "bhsd":
        return x4
    b, h, s, d = x4.shape
    return x4.transpose(1, 2).reshape(b, s, h * d)


def to_bhsd(x: torch.Tensor, heads: int) -> torch.Tensor:
    if x.dim() == 4:
        return x
    b, s, hd = x.shape
    return x.reshape(b, s, heads, hd // heads).transpose(1, 2)


def random_x(g: Geometry, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(g.seed)
    x4 = torch.rand(g.batch, g.heads, g.seq, g.head_dim, generator=gen) * 4 - 2
    return to_layout(x4, g.layout).to(dtype)


def random_caches(g: Geometry, per_token: bool, scale: float = 1.0, dtype=torch.float32):
    """cos/sin of random angles: [max_pos, rd/2], or [B, S, rd/2] when per_token."""
    gen = torch.Generator().manual_seed(g.seed + 1)
    shape = (g.batch, g.seq, g.half) if per_token else (g.max_pos, g.half)
    angles = (torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1) * 50.0
    return (torch.cos(angles) * scale).to(dtype), (torch.sin(angles) * scale).to(dtype)


def random_positions(g: Geometry, out_of_range: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(g.seed + 2)
    if not out_of_range:
        return torch.randint(0, g.max_pos, (g.batch, g.seq), generator=gen)
    choices = torch.tensor([-(2**63), -(2**40), -3, -1, 0, g.max_pos - 1, g.max_pos, g.max_pos + 1, 2**62])
    in_range = torch.randint(0, g.max_pos, (g.batch, g.seq), generator=gen)
    picked = choices[torch.randint(0, len(choices), (g.batch, g.seq), generator=gen)]
    mask = torch.rand(g.batch, g.seq, generator=gen) < 0.5
    return torch.where(mask, picked, in_range)


def formula_caches(max_pos: int, rotary_dim: int, theta: float = 10000.0):
    """The RoPE paper's table: angle(p, i) = p * theta^(-2i/d), in float64, stored as float32."""
    inv_freq = theta ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    angles = np.outer(np.arange(max_pos, dtype=np.float64), inv_freq)
    return torch.from_numpy(np.cos(angles)).float(), torch.from_numpy(np.sin(angles)).float()


numpy_of = to_numpy  # torch -> NumPy, ml_dtypes bfloat16 included


def gathered(cos, sin, pos):
    """Per-token [B, S, rd/2] from a [max_pos, rd/2] cache (in-range positions only)."""
    return (cos[pos], sin[pos]) if pos is not None else (cos, sin)


# -- agreement with independent implementations --------------------------------------------------


@given(
    g=geometries(),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    caches_fp32=st.booleans(),
    mode=st.sampled_from(["positions", "out-of-range", "per-token"]),
    scale=st.sampled_from([1.0, 0.75, 1.3]),
)
def test_matches_numpy_twin(g, dtype, caches_fp32, mode, scale):
    cache_dtype = torch.float32 if caches_fp32 else dtype
    x = random_x(g, dtype)
    cos, sin = random_caches(g, per_token=mode == "per-token", scale=scale, dtype=cache_dtype)
    pos = None if mode == "per-token" else random_positions(g, out_of_range=mode == "out-of-range")
    ours = rotary_embedding(x, cos, sin, pos, **g.attrs())
    twin = rotary_numpy(
        numpy_of(x), numpy_of(cos), numpy_of(sin), None if pos is None else pos.numpy(), **g.attrs()
    )
    assert ours.dtype == dtype and ours.shape == x.shape
    assert twin.dtype == NUMPY_DTYPES[dtype]
    tol = tolerance("op", dtype)
    assert tol.allclose(ours.float().numpy(), twin.astype(np.float32))


def standard_rotary_model(x_shape, cache_shape, with_positions: bool, attrs: dict) -> onnx.ModelProto:
    """One ai.onnx RotaryEmbedding-23 node (the standard op, not ours)."""
    seq = x_shape[2] if len(x_shape) == 4 else x_shape[1]
    inputs = [
        helper.make_tensor_value_info("X", TensorProto.FLOAT, list(x_shape)),
        helper.make_tensor_value_info("cos_cache", TensorProto.FLOAT, list(cache_shape)),
        helper.make_tensor_value_info("sin_cache", TensorProto.FLOAT, list(cache_shape)),
    ]
    if with_positions:
        inputs.append(helper.make_tensor_value_info("position_ids", TensorProto.INT64, [x_shape[0], seq]))
    node = helper.make_node(
        "RotaryEmbedding",
        [i.name for i in inputs],
        ["Y"],
        interleaved=int(attrs["interleaved"]),
        num_heads=int(attrs["num_heads"]),
        rotary_embedding_dim=int(attrs["rotary_embedding_dim"]),
    )
    graph = helper.make_graph(
        [node], "rotary", inputs, [helper.make_tensor_value_info("Y", TensorProto.FLOAT, list(x_shape))]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    onnx.checker.check_model(model, full_check=True)
    return model


@settings(max_examples=30)
@given(g=geometries(), per_token=st.booleans(), scale=st.sampled_from([1.0, 1.2]))
def test_matches_standard_onnx_rotary_embedding_23(g, per_token, scale):
    x = random_x(g)
    cos, sin = random_caches(g, per_token=per_token, scale=scale)
    pos = None if per_token else random_positions(g, out_of_range=False)
    model = standard_rotary_model(tuple(x.shape), tuple(cos.shape), pos is not None, g.attrs())
    feeds = {"X": x.numpy(), "cos_cache": cos.numpy(), "sin_cache": sin.numpy()}
    if pos is not None:
        feeds["position_ids"] = pos.numpy()
    (expected,) = ReferenceEvaluator(model).run(None, feeds)
    ours = rotary_embedding(x, cos, sin, pos, **g.attrs())
    assert tolerance("op", "float32").allclose(ours.numpy(), expected)


@settings(max_examples=30)
@given(g=geometries(interleaved=False, layout="bhsd"), per_token=st.booleans())
def test_matches_transformers_rotate_half(g, per_token):
    """Llama's apply_rotary_pos_emb (whole head) and GPT-NeoX's (partial): cos/sin duplicated halves."""
    q = random_x(g)
    k = random_x(dataclasses.replace(g, seed=g.seed + 7))
    cos, sin = random_caches(g, per_token=per_token, scale=1.1)
    pos = None if per_token else random_positions(g, out_of_range=False)
    c, s = gathered(cos, sin, pos)
    cos_full, sin_full = torch.cat((c, c), dim=-1), torch.cat((s, s), dim=-1)
    if g.rotary_dim == g.head_dim:
        hf_q, hf_k = llama_apply_rotary_pos_emb(q, k, cos_full, sin_full)
    else:
        hf_q, hf_k = neox_apply_rotary_pos_emb(q, k, cos_full, sin_full)
    tol = tolerance("op", "float32")
    assert tol.allclose(rotary_embedding(q, cos, sin, pos, **g.attrs()), hf_q)
    assert tol.allclose(rotary_embedding(k, cos, sin, pos, **g.attrs()), hf_k)


@settings(max_examples=30)
@given(g=geometries(interleaved=True), per_token=st.booleans())
def test_matches_transformers_gptj_interleaved(g, per_token):
    """GPT-J rotates pairs (2i, 2i+1) of the first rotary_dim channels, on [B, S, H, D]."""
    x = random_x(g)
    cos, sin = random_caches(g, per_token=per_token, scale=0.9)
    pos = None if per_token else random_positions(g, out_of_range=False)
    c, s = gathered(cos, sin, pos)
    bshd = to_bhsd(x, g.heads).transpose(1, 2)
    rd = g.rotary_dim
    hf = torch.cat((gptj_apply_rotary_pos_emb(bshd[..., :rd], s, c), bshd[..., rd:]), dim=-1)
    ours = to_bhsd(rotary_embedding(x, cos, sin, pos, **g.attrs()), g.heads).transpose(1, 2)
    assert tolerance("op", "float32").allclose(ours, hf)


# -- properties of a rotation ----------------------------------------------------------------------


def pairs(x4: torch.Tensor, rotary_dim: int, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    rot = x4[..., :rotary_dim].double()
    if interleaved:
        return rot[..., 0::2], rot[..., 1::2]
    return rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2 :]


@given(g=geometries(), per_token=st.booleans())
def test_rotation_preserves_pair_and_head_norms(g, per_token):
    x = random_x(g)
    cos, sin = random_caches(g, per_token=per_token)  # unit magnitude: a pure rotation
    pos = None if per_token else random_positions(g, out_of_range=True)
    y = rotary_embedding(x, cos, sin, pos, **g.attrs())
    x4, y4 = to_bhsd(x, g.heads), to_bhsd(y, g.heads)
    x1, x2 = pairs(x4, g.rotary_dim, g.interleaved)
    y1, y2 = pairs(y4, g.rotary_dim, g.interleaved)
    pair_x, pair_y = torch.sqrt(x1**2 + x2**2), torch.sqrt(y1**2 + y2**2)
    torch.testing.assert_close(pair_y, pair_x, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y4.double().norm(dim=-1), x4.double().norm(dim=-1), rtol=1e-5, atol=1e-6)


@given(
    head_dim=st.sampled_from([2, 4, 8, 16, 32]),
    interleaved=st.booleans(),
    m=st.integers(0, 300),
    n=st.integers(0, 300),
    t=st.integers(-300, 300),
    seed=st.integers(0, 2**31 - 1),
)
def test_dot_product_depends_only_on_relative_position(head_dim, interleaved, m, n, t, seed):
    t = max(t, -min(m, n))  # keep m + t and n + t in range
    max_pos = max(m, n) + max(t, 0) + 1
    cos, sin = formula_caches(max_pos, head_dim)
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, 1, 1, 1, head_dim, generator=gen)

    def dot(pq: int, pk: int) -> float:
        rq = rotary_embedding(q, cos, sin, torch.tensor([[pq]]), interleaved=interleaved)
        rk = rotary_embedding(k, cos, sin, torch.tensor([[pk]]), interleaved=interleaved)
        return float((rq.double() * rk.double()).sum())

    scale = float(q.norm() * k.norm())
    assert abs(dot(m, n) - dot(m + t, n + t)) <= 1e-5 * scale
    if m == n:  # same position: the rotation cancels in q.k
        assert abs(dot(m, n) - float((q.double() * k.double()).sum())) <= 1e-5 * scale


@given(g=geometries(), per_token=st.booleans())
def test_rotating_by_minus_m_inverts_rotating_by_m(g, per_token):
    x = random_x(g)
    cos, sin = random_caches(g, per_token=per_token)
    pos = None if per_token else random_positions(g, out_of_range=True)
    there = rotary_embedding(x, cos, sin, pos, **g.attrs())
    back = rotary_embedding(there, cos, -sin, pos, **g.attrs())  # cos(-a) = cos a, sin(-a) = -sin a
    torch.testing.assert_close(back, x, rtol=1e-5, atol=1e-5)
    if g.seq * g.batch and (pos is None or (pos >= 0).all() and (pos < g.max_pos).all()):
        # and it really did rotate (unless every angle is a multiple of 2*pi, which random angles never are)
        assert not torch.equal(there, x)


@given(g=geometries(partial=True), dtype=st.sampled_from([torch.float32, *HALF_DTYPES]), per_token=st.booleans())
def test_partial_rotary_leaves_the_tail_bit_identical(g, dtype, per_token):
    x = random_x(g, dtype)
    cos, sin = random_caches(g, per_token=per_token, scale=1.3)
    pos = None if per_token else random_positions(g, out_of_range=True)
    y = rotary_embedding(x, cos, sin, pos, **g.attrs())
    x4, y4 = to_bhsd(x, g.heads), to_bhsd(y, g.heads)
    assert torch.equal(y4[..., g.rotary_dim :], x4[..., g.rotary_dim :])


@given(g=geometries(), dtype=st.sampled_from(HALF_DTYPES), caches_fp32=st.booleans(), per_token=st.booleans())
def test_half_precision_is_fp32_math_rounded_once(g, dtype, caches_fp32, per_token):
    x = random_x(g, dtype)
    cos, sin = random_caches(g, per_token=per_token, scale=1.2, dtype=torch.float32 if caches_fp32 else dtype)
    pos = None if per_token else random_positions(g, out_of_range=True)
    y = rotary_embedding(x, cos, sin, pos, **g.attrs())
    assert y.dtype == dtype
    expected = rotary_embedding(x.float(), cos.float(), sin.float(), pos, **g.attrs()).to(dtype)
    assert tolerance("op", dtype).allclose(y.float(), expected.float())


@given(g=geometries(), dtype=st.sampled_from([torch.float32, *HALF_DTYPES]))
def test_out_of_range_positions_pass_the_token_through(g, dtype):
    x = random_x(g, dtype)
    cos, sin = random_caches(g, per_token=False, scale=1.1, dtype=torch.float32)
    pos = random_positions(g, out_of_range=True)
    outside = (pos < 0) | (pos >= g.max_pos)
    y4 = to_bhsd(rotary_embedding(x, cos, sin, pos, **g.attrs()), g.heads)
    twin = torch.from_numpy(
        np.asarray(rotary_numpy(numpy_of(x), cos.numpy(), sin.numpy(), pos.numpy(), **g.attrs()), np.float32)
    )
    twin4 = to_bhsd(twin, g.heads)
    x4 = to_bhsd(x, g.heads)
    # tokens [B, S] outside the cache: every head, every channel unchanged
    mask = outside[:, None, :, None].expand_as(x4)
    assert torch.equal(y4[mask], x4[mask])
    assert torch.equal(twin4[mask], x4[mask].float())


@pytest.mark.parametrize("position", [-1, -(2**63), 5, 6, 2**62, 2**63 - 1])
@pytest.mark.parametrize("interleaved", [False, True])
def test_each_out_of_range_position_is_identity(position, interleaved):
    x = torch.randn(1, 2, 1, 8, generator=torch.Generator().manual_seed(3))
    cos, sin = formula_caches(5, 8)
    y = rotary_embedding(x, cos, sin, torch.tensor([[position]]), interleaved=interleaved)
    assert torch.equal(y, x)


@given(g=geometries(layout="bhsd"), dtype=st.sampled_from([torch.float32, *HALF_DTYPES]), per_token=st.booleans())
def test_3d_and_4d_layouts_agree(g, dtype, per_token):
    x4 = random_x(g, dtype)
    cos, sin = random_caches(g, per_token=per_token)
    pos = None if per_token else random_positions(g, out_of_range=True)
    y4 = rotary_embedding(x4, cos, sin, pos, **g.attrs())
    attrs3 = {**g.attrs(), "num_heads": g.heads}
    y3 = rotary_embedding(to_layout(x4, "bsd"), cos, sin, pos, **attrs3)
    assert y3.shape == (g.batch, g.seq, g.heads * g.head_dim)
    assert tolerance("op", dtype).allclose(to_bhsd(y3, g.heads).float(), y4.float())


def test_known_rotation_by_a_quarter_turn():
    """Angle pi/2 maps (x1, x2) to (-x2, x1); angle 0 leaves the pair alone."""
    x = torch.tensor([[[[1.0, 2.0, 3.0, 4.0]]]])  # rotate-half pairs (1, 3) and (2, 4)
    cos = torch.tensor([[0.0, 1.0]])
    sin = torch.tensor([[1.0, 0.0]])
    y = rotary_embedding(x, cos, sin, torch.tensor([[0]]))
    torch.testing.assert_close(y, torch.tensor([[[[-3.0, 2.0, 1.0, 4.0]]]]))
    yi = rotary_embedding(x, cos, sin, torch.tensor([[0]]), interleaved=True)  # pairs (1, 2) and (3, 4)
    torch.testing.assert_close(yi, torch.tensor([[[[-2.0, 1.0, 3.0, 4.0]]]]))


def test_reference_does_not_modify_its_inputs():
    x = torch.randn(1, 2, 3, 8)
    cos, sin = formula_caches(4, 8)
    before = (x.clone(), cos.clone(), sin.clone())
    rotary_embedding(x, cos, sin, torch.tensor([[0, 1, 3]]))
    for tensor, saved in zip((x, cos, sin), before, strict=True):
        assert torch.equal(tensor, saved)
