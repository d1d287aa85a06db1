"""The PyTorch blocks: RoPEAttention against transformers' attention layers, and the other modules.

For each family a one-layer transformers causal LM is built offline from a tiny config (eager
attention), its attention layer's weights are copied into our RoPEAttention, and both are run on
the same hidden states and positions: the transformers layer through ``rope_export.hf``'s
``AttentionWithCache``, the way ``export --hf --layer`` runs it (position embeddings from the
model's rotary module, an additive causal mask, an empty past), so a change in how transformers
calls its attention layers is handled in one place, the product.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
from transformers import (
    GemmaConfig,
    GPTJConfig,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PhiConfig,
    Qwen2Config,
)

from rope_export import hf
from rope_export.op.rope_types import RopeConfig
from rope_export.op.tolerances import tolerance
from rope_export.presets import Preset, load_preset
from rope_export.presets.modules import (
    AttentionConfig,
    AttentionConfigError,
    RoPEAttention,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
)

BLOCK_TOL = tolerance("block", "float32")
CACHE_LEN = 8192  # rows of our static caches: enough for every position used here


# -- helpers ---------------------------------------------------------------------------------------


def hf_attention(config):
    """(the attention layer of a one-layer causal LM of ``config``, hidden, position_ids -> that layer's output).

    The layer runs inside ``hf.AttentionWithCache`` with an empty past: its own projections and
    attention, position embeddings from the model's rotary module, a causal mask.
    """
    config.num_hidden_layers, config.vocab_size, config.pad_token_id = 1, 16, None  # Phi-3's pad id is past 16
    if hasattr(config, "intermediate_size"):
        config.intermediate_size = 16  # the MLP is not compared: keep the model small
    model = hf.build_hf_model(config, seed=1)
    wrapper = hf.AttentionWithCache(model, 0).eval()
    (layer_io,) = hf.cache_layout(model).layers

    def run(hidden, position_ids):
        past_key, past_value = (torch.zeros(shape) for shape in layer_io.shapes(hidden.shape[0], 0))
        return wrapper(hidden, position_ids, past_key, past_value)[0]

    return wrapper.attention, run


def rope_parameters(preset: Preset) -> dict:
    """Our RoPE fields as transformers' rope_parameters (same names)."""
    data = preset.rope.to_dict()
    for key in ("head_dim", "max_position_embeddings", "rotary_dim", "interleaved", "partial_rotary_factor"):
        data.pop(key, None)
    data.setdefault("rope_theta", preset.rope.rope_theta)
    return data


def copy_linear(dst: torch.nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    assert dst.weight.shape == weight.shape, (dst.weight.shape, weight.shape)
    with torch.no_grad():
        dst.weight.copy_(weight)
        if dst.bias is not None or bias is not None:
            assert dst.bias is not None and bias is not None, "bias layout differs"
            dst.bias.copy_(bias)


def copy_separate(block: RoPEAttention, q, k, v, o) -> None:
    for dst, src in ((block.q_proj, q), (block.k_proj, k), (block.v_proj, v), (block.o_proj, o)):
        copy_linear(dst, src.weight, src.bias)


def hidden_and_positions(preset: Preset, batch: int, seq: int, offsets: tuple[int, ...], seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, preset.attention.hidden_size, generator=gen)
    positions = torch.stack([torch.arange(seq) + offsets[b % len(offsets)] for b in range(batch)])
    return hidden, positions


# Each builder returns (our block, a function hidden, position_ids -> transformers' output).
Builder = Callable[[Preset], tuple[RoPEAttention, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]]


def llama_like(config_cls, o_name: str = "o_proj", **extra) -> Builder:
    """Families with separate q/k/v projections."""

    def build(preset: Preset):
        a = preset.attention
        config = config_cls(
            hidden_size=a.hidden_size,
            num_attention_heads=a.num_heads,
            num_key_value_heads=a.num_kv_heads,
            head_dim=a.head_dim,
            max_position_embeddings=preset.rope.max_position_embeddings,
            rope_parameters=rope_parameters(preset),
            **extra,
        )
        layer, run = hf_attention(config)
        block = preset.build_block(cache_len=CACHE_LEN)
        copy_separate(block, layer.q_proj, layer.k_proj, layer.v_proj, getattr(layer, o_name))
        return block, run

    return build


def build_phi3(preset: Preset):
    a = preset.attention
    config = Phi3Config(
        hidden_size=a.hidden_size,
        num_attention_heads=a.num_heads,
        num_key_value_heads=a.num_kv_heads,
        max_position_embeddings=preset.rope.max_position_embeddings,
        original_max_position_embeddings=preset.rope.original_max_position_embeddings,
        rope_parameters=rope_parameters(preset),
    )
    assert a.hidden_size // a.num_heads == a.head_dim  # Phi-3 derives head_dim from these
    layer, run = hf_attention(config)
    block = preset.build_block(cache_len=CACHE_LEN)
    q_size, kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    w = layer.qkv_proj.weight  # rows: [q | k | v]
    copy_linear(block.q_proj, w[:q_size], None)
    copy_linear(block.k_proj, w[q_size : q_size + kv_size], None)
    copy_linear(block.v_proj, w[q_size + kv_size :], None)
    copy_linear(block.o_proj, layer.o_proj.weight, None)
    return block, run


def build_gpt_neox(preset: Preset):
    a = preset.attention
    assert a.hidden_size == a.num_heads * a.head_dim and a.num_kv_heads == a.num_heads
    config = GPTNeoXConfig(
        hidden_size=a.hidden_size,
        num_attention_heads=a.num_heads,
        max_position_embeddings=preset.rope.max_position_embeddings,
        rope_parameters={**rope_parameters(preset), "partial_rotary_factor": preset.rope.partial_rotary_factor},
        attention_bias=a.qkv_bias,
    )
    layer, run = hf_attention(config)
    block = preset.build_block(cache_len=CACHE_LEN)
    # query_key_value is fused per head: output rows laid out [H, 3, D]
    h, d = a.num_heads, a.head_dim
    w = layer.query_key_value.weight.view(h, 3, d, a.hidden_size)
    b = layer.query_key_value.bias.view(h, 3, d)
    for i, dst in enumerate((block.q_proj, block.k_proj, block.v_proj)):
        copy_linear(dst, w[:, i].reshape(h * d, a.hidden_size), b[:, i].reshape(h * d))
    copy_linear(block.o_proj, layer.dense.weight, layer.dense.bias)
    return block, run


def build_gptj(preset: Preset):
    a, rope = preset.attention, preset.rope
    assert a.hidden_size == a.num_heads * a.head_dim and rope.interleaved and rope.rope_theta == 10000.0
    config = GPTJConfig(
        n_embd=a.hidden_size, n_head=a.num_heads, rotary_dim=rope.rotary_dim, n_positions=rope.max_position_embeddings
    )
    layer, run = hf_attention(config)  # GPT-J's sinusoid table: its rotary module since transformers 5.24
    block = preset.build_block(cache_len=CACHE_LEN)
    copy_separate(block, layer.q_proj, layer.k_proj, layer.v_proj, layer.out_proj)
    return block, run


FAMILIES = {
    "llama": llama_like(LlamaConfig, attention_bias=False),
    "mistral": llama_like(MistralConfig),
    "qwen2": llama_like(Qwen2Config),
    "gemma": llama_like(GemmaConfig, attention_bias=False),
    "phi3": build_phi3,
    "gpt_neox": build_gpt_neox,
    "gptj": build_gptj,
}


def scaled(name: str, **kwargs) -> Preset:
    return load_preset(name).scaled_down(**kwargs)


def with_rope(preset: Preset, **fields) -> Preset:
    return dataclasses.replace(preset, rope=dataclasses.replace(preset.rope, **fields))


def with_heads(preset: Preset, heads: int, kv_heads: int) -> Preset:
    return dataclasses.replace(
        preset, attention=dataclasses.replace(preset.attention, num_heads=heads, num_kv_heads=kv_heads)
    )


BLOCK_CASES = [
    # (family, preset, position offsets per batch row)
    pytest.param("llama", scaled("llama-2-7b"), (0, 3), id="llama-2-default-mha"),
    pytest.param("llama", scaled("llama-3.1-8b"), (0, 5000), id="llama-3.1-llama3-gqa"),
    pytest.param("llama", with_heads(scaled("tiny"), 4, 1), (0, 7), id="llama-tiny-mqa"),
    pytest.param("llama", with_heads(scaled("tiny"), 4, 2), (2, 0), id="llama-tiny-gqa"),
    pytest.param("llama", with_rope(scaled("tiny"), rope_type="linear", factor=4.0), (0, 100), id="llama-linear"),
    pytest.param("llama", with_rope(scaled("tiny"), rope_type="dynamic", factor=2.0, max_position_embeddings=64),
                 (0, 100), id="llama-dynamic-above-max-pos"),
    pytest.param("mistral", scaled("mistral-7b"), (0, 11), id="mistral"),
    pytest.param("qwen2", scaled("qwen2.5-7b"), (0, 4), id="qwen2.5-qkv-bias"),
    pytest.param("qwen2", scaled("qwen2.5-7b-yarn"), (0, 3000), id="qwen2.5-yarn-magnitude"),
    pytest.param("gemma", scaled("gemma-7b"), (0, 9), id="gemma-head-dim-256"),
    pytest.param("phi3", scaled("phi-3.5-mini-128k", num_heads=4, hidden_size=384), (0, 2), id="phi3-longrope-short"),
    pytest.param("phi3", scaled("phi-3.5-mini-128k", num_heads=4, hidden_size=384), (4090, 4200),
                 id="phi3-longrope-long"),
    pytest.param("gpt_neox", scaled("gpt-neox-20b", num_heads=2, hidden_size=192), (0, 6), id="gpt-neox-fused-partial"),
    pytest.param("gptj", scaled("gpt-j-6b", num_heads=2, hidden_size=512), (0, 8), id="gptj-interleaved-rotary-dim"),
]


@pytest.mark.parametrize(("family", "preset", "offsets"), BLOCK_CASES)
def test_block_matches_transformers_attention(family, preset, offsets):
    block, run_hf = FAMILIES[family](preset)
    hidden, position_ids = hidden_and_positions(preset, batch=2, seq=7, offsets=offsets)
    with torch.no_grad():
        ours, _, _ = block(hidden, position_ids)
        expected = run_hf(hidden, position_ids)
    assert ours.shape == expected.shape == hidden.shape
    assert BLOCK_TOL.allclose(ours, expected), f"max abs error {(ours - expected).abs().max().item():.3g}"
    # the comparison is not vacuous: other relative positions give another output
    with torch.no_grad():
        stretched, _, _ = block(hidden, position_ids * 2)
    assert not BLOCK_TOL.allclose(stretched, expected)


@pytest.mark.parametrize(
    "preset",
    [pytest.param(scaled("tiny"), id="default"), pytest.param(scaled("gpt-j-6b", num_heads=2, hidden_size=64),
                                                              id="interleaved-partial"),
     pytest.param(scaled("qwen2.5-7b-yarn"), id="yarn")],
)
def test_block_output_depends_only_on_relative_positions(preset):
    """Static RoPE: shifting every position by the same amount leaves attention unchanged."""
    block = preset.build_block(cache_len=2048)
    hidden, position_ids = hidden_and_positions(preset, batch=2, seq=6, offsets=(0, 3))
    with torch.no_grad():
        out, _, _ = block(hidden, position_ids)
        shifted, _, _ = block(hidden, position_ids + 1000)
    assert BLOCK_TOL.allclose(shifted, out)


@pytest.mark.parametrize("offsets", [(0, 3), (1000, 0)])
def test_phi_block_matches_transformers_attention(offsets):
    """Phi-2: partial rotary (0.4 of head_dim 80), q/k/v biases, output projection named `dense`."""
    preset = scaled("phi-2")
    a = preset.attention
    config = PhiConfig(
        hidden_size=a.hidden_size,
        num_attention_heads=a.num_heads,
        num_key_value_heads=a.num_kv_heads,
        head_dim=a.head_dim,
        max_position_embeddings=preset.rope.max_position_embeddings,
        partial_rotary_factor=preset.rope.partial_rotary_factor,
        rope_parameters=rope_parameters(preset),
        qk_layernorm=False,
    )
    layer, run = hf_attention(config)
    assert layer.rotary_ndims == preset.rope.rotary_embedding_dim == 32
    block = preset.build_block(cache_len=CACHE_LEN)
    copy_separate(block, layer.q_proj, layer.k_proj, layer.v_proj, layer.dense)
    hidden, position_ids = hidden_and_positions(preset, batch=2, seq=6, offsets=offsets)
    with torch.no_grad():
        expected = run(hidden, position_ids)
        ours, _, _ = block(hidden, position_ids)
    assert BLOCK_TOL.allclose(ours, expected), f"max abs error {(ours - expected).abs().max().item():.3g}"


# -- KV cache --------------------------------------------------------------------------------------

DECODE_PRESETS = [
    pytest.param(scaled("tiny"), id="tiny-gqa"),
    pytest.param(scaled("llama-3.1-8b"), id="llama3"),
    pytest.param(scaled("qwen2.5-7b-yarn"), id="yarn"),
    pytest.param(scaled("phi-2"), id="phi-2-partial"),
    pytest.param(scaled("gpt-j-6b", num_heads=2, hidden_size=128), id="gptj-interleaved"),
    pytest.param(scaled("phi-3.5-mini-128k"), id="longrope-short"),
    pytest.param(with_rope(scaled("tiny"), rope_type="dynamic", factor=2.0), id="dynamic-below-max-pos"),
]


@pytest.mark.parametrize("preset", DECODE_PRESETS)
def test_kv_cache_decode_equals_full_prefill(preset):
    block = preset.build_block(cache_len=256)
    hidden, position_ids = hidden_and_positions(preset, batch=2, seq=10, offsets=(0, 4))
    with torch.no_grad():
        full, full_k, full_v = block(hidden, position_ids)
        split = 6
        out, key, value = block(hidden[:, :split], position_ids[:, :split])
        pieces = [out]
        for step in range(split, hidden.shape[1]):
            out, key, value = block(hidden[:, step : step + 1], position_ids[:, step : step + 1], key, value)
            pieces.append(out)
    decoded = torch.cat(pieces, dim=1)
    assert BLOCK_TOL.allclose(decoded, full)
    assert BLOCK_TOL.allclose(key, full_k) and BLOCK_TOL.allclose(value, full_v)
    # decoding the last token alone, without the cache, is different (it would see only itself)
    with torch.no_grad():
        alone, _, _ = block(hidden[:, -1:], position_ids[:, -1:])
    assert not BLOCK_TOL.allclose(alone, full[:, -1:])


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (4, 1), (6, 3)], ids=["mha", "gqa", "mqa", "gqa-6-3"])
def test_attention_shapes(heads, kv_heads):
    attention = AttentionConfig(hidden_size=48, num_heads=heads, num_kv_heads=kv_heads, head_dim=8)
    block = RoPEAttention(attention, RopeConfig(head_dim=8, max_position_embeddings=64)).eval()
    assert block.q_proj.weight.shape == (heads * 8, 48)
    assert block.k_proj.weight.shape == block.v_proj.weight.shape == (kv_heads * 8, 48)
    assert block.o_proj.weight.shape == (48, heads * 8)
    hidden = torch.randn(3, 5, 48)
    positions = torch.arange(5).expand(3, 5)
    with torch.no_grad():
        out, key, value = block(hidden, positions)
        assert out.shape == (3, 5, 48)
        assert key.shape == value.shape == (3, kv_heads, 5, 8)
        out2, key2, value2 = block(hidden[:, :2], positions[:, :2] + 5, key, value)
    assert out2.shape == (3, 2, 48)
    assert key2.shape == value2.shape == (3, kv_heads, 7, 8)


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_grouped_query_equals_mha_with_shared_kv_weights(kv_heads):
    """Query head h reads kv head h // (H / Hkv): the same as MHA whose k/v rows repeat per group."""
    heads, d, hidden_size = 4, 8, 32
    rope = RopeConfig(head_dim=d, max_position_embeddings=64)
    torch.manual_seed(0)
    gqa = RoPEAttention(AttentionConfig(hidden_size, heads, kv_heads, d), rope).eval()
    mha = RoPEAttention(AttentionConfig(hidden_size, heads, heads, d), rope).eval()
    group = heads // kv_heads
    with torch.no_grad():
        mha.q_proj.weight.copy_(gqa.q_proj.weight)
        mha.o_proj.weight.copy_(gqa.o_proj.weight)
        for proj in ("k_proj", "v_proj"):
            w = getattr(gqa, proj).weight.view(kv_heads, 1, d, hidden_size).expand(kv_heads, group, d, hidden_size)
            getattr(mha, proj).weight.copy_(w.reshape(heads * d, hidden_size))
        hidden = torch.randn(2, 6, hidden_size)
        positions = torch.arange(6).expand(2, 6)
        assert BLOCK_TOL.allclose(gqa(hidden, positions)[0], mha(hidden, positions)[0])


def test_causality_future_tokens_do_not_change_the_past():
    preset = scaled("tiny")
    block = preset.build_block()
    hidden, positions = hidden_and_positions(preset, batch=1, seq=8, offsets=(0,))
    changed = hidden.clone()
    changed[:, 5:] += 1.0
    with torch.no_grad():
        a, _, _ = block(hidden, positions)
        b, _, _ = block(changed, positions)
    torch.testing.assert_close(a[:, :5], b[:, :5])
    assert not torch.allclose(a[:, 5:], b[:, 5:])


def test_softmax_scale_override():
    rope = RopeConfig(head_dim=8)
    base = AttentionConfig(hidden_size=16, num_heads=2, num_kv_heads=2, head_dim=8)
    assert math.isclose(base.scale, 8**-0.5)
    assert AttentionConfig(16, 2, 2, 8, softmax_scale=0.5).scale == 0.5
    torch.manual_seed(0)
    a = RoPEAttention(base, rope).eval()
    b = RoPEAttention(dataclasses.replace(base, softmax_scale=0.01), rope).eval()
    b.load_state_dict(a.state_dict())
    hidden, positions = torch.randn(1, 4, 16), torch.arange(4)[None]
    with torch.no_grad():
        assert not torch.allclose(a(hidden, positions)[0], b(hidden, positions)[0])


# -- errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"num_kv_heads": 3}, ["num_kv_heads", "3", "num_heads=4"]),
        ({"num_heads": 0}, ["num_heads", "positive"]),
        ({"head_dim": -8}, ["head_dim", "positive"]),
        ({"hidden_size": 64.0}, ["hidden_size"]),
    ],
)
def test_attention_config_errors_name_the_field(fields, words):
    data = {"hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, **fields}
    with pytest.raises(AttentionConfigError) as info:
        AttentionConfig(**data)
    for word in words:
        assert word in str(info.value)


def test_block_rejects_rope_of_another_head_dim():
    with pytest.raises(AttentionConfigError, match="head_dim=8 differs from attention head_dim=16"):
        RoPEAttention(AttentionConfig(64, 4, 2, 16), RopeConfig(head_dim=8))


def test_block_needs_both_past_key_and_value():
    block = RoPEAttention(AttentionConfig(16, 2, 2, 8), RopeConfig(head_dim=8)).eval()
    hidden, positions = torch.randn(1, 3, 16), torch.arange(3)[None]
    _, key, _ = block(hidden, positions)
    with pytest.raises(ValueError, match="both past_key and past_value"):
        block(hidden[:, :1], positions[:, :1] + 3, key, None)


@pytest.mark.parametrize("rope_type", ["default", "dynamic"])
def test_rotary_module_rejects_bad_position_ids(rope_type):
    cfg = RopeConfig(head_dim=8, rope_type=rope_type, factor=2.0 if rope_type == "dynamic" else None)
    module = RotaryEmbedding(cfg)
    x = torch.randn(1, 2, 3, 8)
    with pytest.raises(TypeError, match="int64.*int32"):
        module(x, torch.arange(3, dtype=torch.int32)[None])
    with pytest.raises(TypeError, match="int64"):
        module(x, torch.arange(3.0)[None])
    with pytest.raises(ValueError, match=r"\[B, S\].*\[3\]"):
        module(x, torch.arange(3))
    with pytest.raises(ValueError, match=r"\[B, S\]"):
        module(x, torch.arange(3)[None, None])


def test_rotary_module_3d_needs_num_heads():
    module = RotaryEmbedding(RopeConfig(head_dim=8))
    with pytest.raises(ValueError, match="num_heads"):
        module(torch.randn(1, 3, 16), torch.arange(3)[None])
    y = module(torch.randn(1, 3, 16), torch.arange(3)[None], num_heads=2)
    assert y.shape == (1, 3, 16)


def test_static_rotary_module_positions_beyond_its_cache_pass_through():
    module = RotaryEmbedding(RopeConfig(head_dim=8, max_position_embeddings=16))
    assert module.cache_len == 16
    x = torch.randn(1, 2, 3, 8)
    y = module(x, torch.tensor([[16, -1, 1000]]))
    assert torch.equal(y, x)


# -- the additive sinusoidal encoding --------------------------------------------------------------


@pytest.mark.parametrize(("hidden_size", "base"), [(8, 10000.0), (64, 10000.0), (16, 500.0)])
def test_sinusoidal_encoding_matches_the_formula(hidden_size, base):
    """PE[p, 2i] = sin(p / base^(2i/d)), PE[p, 2i+1] = cos(p / base^(2i/d)) ("Attention Is All You Need")."""
    module = SinusoidalPositionalEncoding(hidden_size, max_positions=300, base=base)
    positions = torch.tensor([[0, 1, 2, 299], [7, 150, 3, 0]])
    x = torch.randn(2, 4, hidden_size)
    p = positions.numpy().astype(np.float64)[..., None]
    i = np.arange(hidden_size // 2, dtype=np.float64)
    angle = p / base ** (2 * i / hidden_size)
    pe = np.empty((2, 4, hidden_size))
    pe[..., 0::2], pe[..., 1::2] = np.sin(angle), np.cos(angle)
    np.testing.assert_allclose(module(x, positions).double().numpy(), x.double().numpy() + pe, atol=1e-6, rtol=0)
    np.testing.assert_allclose(module(torch.zeros(2, 4, hidden_size), positions).numpy(), pe, atol=1e-6, rtol=0)


def test_sinusoidal_encoding_keeps_dtype_and_checks_inputs():
    module = SinusoidalPositionalEncoding(8, max_positions=10)
    y = module(torch.zeros(1, 2, 8, dtype=torch.float16), torch.tensor([[0, 1]]))
    assert y.dtype == torch.float16
    assert y[0, 0, 1] == 1.0 and y[0, 0, 0] == 0.0  # cos(0), sin(0)
    with pytest.raises(ValueError, match="even"):
        SinusoidalPositionalEncoding(7)
    with pytest.raises(TypeError, match="int64"):
        module(torch.zeros(1, 2, 8), torch.tensor([[0, 1]], dtype=torch.int32))
