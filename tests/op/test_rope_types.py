"""RoPE configurations and the rope-type registry, against Hugging Face transformers.

Every rope type is built twice from one parameter dict (our field names are transformers'
``rope_parameters`` names): once as our RopeConfig, once as a tiny offline transformers config.
Inverse frequencies and the magnitude factor (attention_scaling) are compared with transformers'
ROPE_INIT_FUNCTIONS, and the cos/sin caches with the rotary modules' output (cos/sin already
multiplied by attention_scaling, duplicated to the full rotary width). Our caches are built in
float64, transformers' in float32, so the cache tolerance grows with the position.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from transformers import GPTNeoXConfig, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS as HF_ROPE_INIT_FUNCTIONS
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_apply_rotary_pos_emb

from rope_export.op.rope_types import (
    ROPE_INIT_FUNCTIONS,
    RopeConfig,
    RopeConfigError,
    build_caches,
    inv_freq_and_scaling,
)
from rope_export.presets import load_preset
from rope_export.presets.modules import RotaryEmbedding

# -- building the transformers side --------------------------------------------------------------


def hf_config(head_dim: int, max_pos: int, params: dict, heads: int = 4):
    """A tiny transformers config carrying ``params`` as its rope_parameters."""
    params = dict(params)
    partial = params.pop("partial_rotary_factor", None)
    if params.get("rope_type", "default") == "default" and partial is not None:
        # Llama's default RoPE ignores partial_rotary_factor; GPT-NeoX's honours it.
        config = GPTNeoXConfig(
            hidden_size=heads * head_dim,
            num_attention_heads=heads,
            max_position_embeddings=max_pos,
            rope_parameters={**params, "partial_rotary_factor": partial},
        )
        return config, GPTNeoXRotaryEmbedding
    extra = {} if partial is None else {"partial_rotary_factor": partial}
    config = LlamaConfig(
        hidden_size=64,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rope_parameters=params,
        **extra,
    )
    return config, LlamaRotaryEmbedding


def hf_cos_sin(config, module_cls, position_ids: torch.Tensor):
    """cos/sin [B, S, rd] from a fresh transformers rotary module (fresh: dynamic types keep state)."""
    rotary = module_cls(config)
    return rotary(torch.zeros(1, dtype=torch.float32), position_ids)


def position_tolerance(position_ids: torch.Tensor) -> torch.Tensor:
    """Per-token absolute tolerance [B, S, 1]: float32 angle rounding grows with the position."""
    return (1e-6 + 2e-7 * position_ids.double().abs()).unsqueeze(-1)


def assert_halves_match(hf: torch.Tensor, ours: torch.Tensor, position_ids: torch.Tensor) -> None:
    """transformers' cos/sin [B, S, rd] = cat(c, c); ours [B, S, rd/2] (or a [L, rd/2] cache)."""
    half = hf.shape[-1] // 2
    assert torch.equal(hf[..., :half], hf[..., half:]), "transformers duplicates the half; did that change?"
    if ours.dim() == 2:
        ours = ours[position_ids]
    assert ours.shape == hf[..., :half].shape
    error = (hf[..., :half].double() - ours.double()).abs()
    tol = position_tolerance(position_ids)
    assert (error <= tol).all(), f"max error {error.max().item():.3g}, worst excess {(error - tol).max().item():.3g}"


# -- the cases -----------------------------------------------------------------------------------


def preset_case(name: str):
    rope = load_preset(name).rope
    params = {k: v for k, v in rope.to_dict().items() if k not in ("head_dim", "max_position_embeddings")}
    return pytest.param(rope.head_dim, rope.max_position_embeddings, params, id=f"preset-{name}")


STATIC_CASES = [
    pytest.param(64, 2048, {"rope_type": "default", "rope_theta": 10000.0}, id="default"),
    pytest.param(32, 2048, {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                 id="default-partial"),
    pytest.param(64, 2048, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}, id="linear"),
    pytest.param(64, 2048, {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0, "partial_rotary_factor": 0.5},
                 id="linear-partial"),
    pytest.param(64, 2048, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 512}, id="yarn"),
    pytest.param(64, 2048, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 512, "mscale": 1.0, "mscale_all_dim": 0.8},
                 id="yarn-mscale-mscale_all_dim"),
    pytest.param(64, 2048, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 512, "mscale": 0.707},
                 id="yarn-mscale-alone-is-ignored"),
    pytest.param(64, 2048, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 512, "beta_fast": 16.0, "beta_slow": 2.0},
                 id="yarn-beta"),
    pytest.param(64, 2048, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 512, "truncate": False}, id="yarn-no-truncate"),
    pytest.param(64, 2048, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 512, "attention_factor": 0.9},
                 id="yarn-attention-factor"),
    pytest.param(64, 2048, {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 512, "partial_rotary_factor": 0.5},
                 id="yarn-partial"),
    pytest.param(64, 2048, {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 256}, id="llama3"),
    preset_case("llama-3.1-8b"),
    preset_case("qwen2.5-7b-yarn"),
    preset_case("qwen2.5-7b"),
    preset_case("phi-2"),
]

CACHE_LEN = 4096  # positions compared for the presets with very long contexts


@pytest.mark.parametrize(("head_dim", "max_pos", "params"), STATIC_CASES)
def test_inv_freq_and_attention_scaling_match_transformers(head_dim, max_pos, params):
    ours = RopeConfig.from_dict(params, head_dim=head_dim, max_position_embeddings=max_pos)
    config, module_cls = hf_config(head_dim, max_pos, params)
    if ours.rope_type == "default":
        hf_inv_freq, hf_scaling = module_cls.compute_default_rope_parameters(config)
    else:
        hf_inv_freq, hf_scaling = HF_ROPE_INIT_FUNCTIONS[ours.rope_type](config)
    inv_freq, scaling = inv_freq_and_scaling(ours)
    assert inv_freq.dtype == torch.float64
    assert inv_freq.shape == hf_inv_freq.shape == (ours.rotary_embedding_dim // 2,)
    torch.testing.assert_close(inv_freq, hf_inv_freq.double(), rtol=1e-6, atol=0)
    assert math.isclose(scaling, hf_scaling, rel_tol=1e-9)


@pytest.mark.parametrize(("head_dim", "max_pos", "params"), STATIC_CASES)
def test_caches_match_transformers_rotary_module(head_dim, max_pos, params):
    ours = RopeConfig.from_dict(params, head_dim=head_dim, max_position_embeddings=max_pos)
    config, module_cls = hf_config(head_dim, max_pos, params)
    length = min(max_pos, CACHE_LEN)
    position_ids = torch.arange(length)[None]
    hf_cos, hf_sin = hf_cos_sin(config, module_cls, position_ids)
    cos, sin = build_caches(ours, cache_len=length)
    assert cos.dtype == sin.dtype == torch.float32
    assert cos.shape == (length, ours.rotary_embedding_dim // 2)
    assert_halves_match(hf_cos, cos, position_ids)
    assert_halves_match(hf_sin, sin, position_ids)
    # the static module holds exactly these caches
    module = RotaryEmbedding(ours, cache_len=length)
    assert torch.equal(module.cos_cache, cos) and torch.equal(module.sin_cache, sin)


def test_magnitude_factor_is_folded_into_the_caches():
    """cos^2 + sin^2 = attention_scaling^2 at every position (YaRN's formula 0.1 ln(s) + 1)."""
    cfg = RopeConfig(head_dim=32, rope_type="yarn", factor=4.0, original_max_position_embeddings=128)
    cos, sin = build_caches(cfg, cache_len=300)
    expected = 0.1 * math.log(4.0) + 1.0
    torch.testing.assert_close(cos.double() ** 2 + sin.double() ** 2, torch.full_like(cos.double(), expected**2))


def test_default_caches_match_the_paper_formula():
    cfg = RopeConfig(head_dim=16, rope_theta=500.0, max_position_embeddings=1000)
    cos, sin = build_caches(cfg)
    angles = np.outer(np.arange(1000.0), 500.0 ** (-np.arange(0, 16, 2) / 16))
    np.testing.assert_allclose(cos.numpy(), np.cos(angles), atol=1e-7, rtol=0)
    np.testing.assert_allclose(sin.numpy(), np.sin(angles), atol=1e-7, rtol=0)


# -- schemes that depend on the sequence length --------------------------------------------------

DYNAMIC = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}


@pytest.mark.parametrize("seq_len", [None, 10, 64, 65, 200, 1000])
def test_dynamic_inv_freq_matches_transformers(seq_len):
    ours = RopeConfig.from_dict(DYNAMIC, head_dim=32, max_position_embeddings=64)
    config, _ = hf_config(32, 64, DYNAMIC)
    hf_inv_freq, hf_scaling = HF_ROPE_INIT_FUNCTIONS["dynamic"](config, seq_len=seq_len)
    inv_freq, scaling = inv_freq_and_scaling(ours, seq_len)
    torch.testing.assert_close(inv_freq, hf_inv_freq.double(), rtol=1e-6, atol=0)
    assert scaling == hf_scaling == 1.0
    # in-graph form: seq_len as a 0-d tensor gives the same frequencies in float32
    if seq_len is not None:
        in_graph, _ = inv_freq_and_scaling(ours, torch.tensor(seq_len))
        assert in_graph.dtype == torch.float32
        torch.testing.assert_close(in_graph.double(), inv_freq, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "position_ids",
    [
        pytest.param(torch.arange(40)[None], id="below-max-pos"),
        pytest.param(torch.arange(64)[None], id="at-max-pos"),
        pytest.param(torch.arange(200)[None], id="above-max-pos"),
        pytest.param(torch.stack((torch.arange(100), torch.arange(50, 150))), id="batch-above-max-pos"),
        pytest.param(torch.tensor([[3, 700, 20, 5]]), id="sparse-far"),
    ],
)
def test_dynamic_ntk_module_matches_fresh_transformers_module(position_ids):
    ours = RopeConfig.from_dict(DYNAMIC, head_dim=32, max_position_embeddings=64)
    config, module_cls = hf_config(32, 64, DYNAMIC)
    hf_cos, hf_sin = hf_cos_sin(config, module_cls, position_ids)
    module = RotaryEmbedding(ours)
    cos, sin, pos = module.cos_sin(position_ids)
    assert pos is None  # per-token caches, computed from the positions
    assert_halves_match(hf_cos, cos, position_ids)
    assert_halves_match(hf_sin, sin, position_ids)

    # and the module's output is transformers' rotation with transformers' cos/sin
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(position_ids.shape[0], 3, position_ids.shape[1], 32, generator=gen)
    expected, _ = llama_apply_rotary_pos_emb(q, q, hf_cos, hf_sin)
    got = module(q, position_ids)
    scale = q.abs().amax(dim=(1, 3), keepdim=True)  # [B, 1, S, 1]
    tol = 2 * position_tolerance(position_ids)[:, None] * scale + 1e-6
    assert ((got - expected).abs() <= tol).all()


def test_dynamic_above_max_pos_really_rescales():
    """The comparisons above would be vacuous if dynamic NTK never changed the frequencies."""
    ours = RopeConfig.from_dict(DYNAMIC, head_dim=32, max_position_embeddings=64)
    default = RopeConfig(head_dim=32, max_position_embeddings=1024)
    cos_dyn, _, _ = RotaryEmbedding(ours).cos_sin(torch.arange(200)[None])
    cos_def, _ = build_caches(default, 200)
    assert (cos_dyn[0] - cos_def).abs().max() > 0.1
    cos_short, _, _ = RotaryEmbedding(ours).cos_sin(torch.arange(64)[None])
    torch.testing.assert_close(cos_short[0], cos_def[:64], atol=1e-5, rtol=0)


def longrope_params():
    rope = load_preset("phi-3.5-mini-128k").rope
    params = rope.to_dict()
    params = {k: v for k, v in params.items() if k not in ("head_dim", "max_position_embeddings")}
    return rope.head_dim, rope.max_position_embeddings, params


@pytest.mark.parametrize(
    ("position_ids", "regime"),
    [
        pytest.param(torch.arange(64)[None], "short", id="short"),
        pytest.param(torch.linspace(0, 4095, 48).long()[None], "short", id="short-at-original-minus-one"),
        pytest.param(torch.linspace(0, 4096, 48).long()[None], "long", id="long-at-original"),
        pytest.param(torch.stack((torch.arange(32), torch.arange(6000, 6032))), "long", id="long-batch"),
    ],
)
def test_longrope_module_matches_transformers_both_regimes(position_ids, regime):
    head_dim, max_pos, params = longrope_params()
    ours = RopeConfig.from_dict(params, head_dim=head_dim, max_position_embeddings=max_pos)
    config, module_cls = hf_config(head_dim, max_pos, params)
    hf_cos, hf_sin = hf_cos_sin(config, module_cls, position_ids)
    cos, sin, pos = RotaryEmbedding(ours).cos_sin(position_ids)
    assert pos is None
    assert_halves_match(hf_cos, cos, position_ids)
    assert_halves_match(hf_sin, sin, position_ids)
    # the regime really is the one named: compare with a cache built from that factor list
    factors = torch.tensor(ours.long_factor if regime == "long" else ours.short_factor, dtype=torch.float64)
    inv_freq = 1.0 / (factors * ours.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    scaling = math.sqrt(1 + math.log(max_pos / 4096) / math.log(4096))
    expected = torch.cos(position_ids.double()[..., None] * inv_freq) * scaling
    assert ((cos.double() - expected).abs() <= position_tolerance(position_ids)).all()


@pytest.mark.parametrize("seq_len", [None, 100, 4096, 4097, 10000])
def test_longrope_inv_freq_and_scaling_match_transformers(seq_len):
    head_dim, max_pos, params = longrope_params()
    ours = RopeConfig.from_dict(params, head_dim=head_dim, max_position_embeddings=max_pos)
    config, _ = hf_config(head_dim, max_pos, params)
    hf_inv_freq, hf_scaling = HF_ROPE_INIT_FUNCTIONS["longrope"](config, seq_len=seq_len)
    inv_freq, scaling = inv_freq_and_scaling(ours, seq_len)
    torch.testing.assert_close(inv_freq, hf_inv_freq.double(), rtol=1e-6, atol=0)
    assert math.isclose(scaling, hf_scaling, rel_tol=1e-9)


def test_longrope_explicit_factor_and_attention_factor():
    params = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 256,
              "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 4.0, 8.0, 16.0], "factor": 8.0}
    for extra in ({}, {"attention_factor": 1.25}):
        ours = RopeConfig.from_dict({**params, **extra}, head_dim=8, max_position_embeddings=1024)
        config, _ = hf_config(8, 1024, {**params, **extra})
        for seq_len in (None, 1000):
            hf_inv_freq, hf_scaling = HF_ROPE_INIT_FUNCTIONS["longrope"](config, seq_len=seq_len)
            inv_freq, scaling = inv_freq_and_scaling(ours, seq_len)
            torch.testing.assert_close(inv_freq, hf_inv_freq.double(), rtol=1e-6, atol=0)
            assert math.isclose(scaling, hf_scaling, rel_tol=1e-9)


def test_seq_len_dependent_flags():
    flags = {name: scheme.seq_len_dependent for name, scheme in ROPE_INIT_FUNCTIONS.items()}
    assert flags == {"default": False, "linear": False, "dynamic": True, "yarn": False, "longrope": True,
                     "llama3": False}


# -- bad configurations --------------------------------------------------------------------------

# Each type's required fields, as transformers' _validate_<type>_rope_parameters require them
# (yarn's original_max_position_embeddings defaults to max_position_embeddings there and here).
VALID = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                 "original_max_position_embeddings": 512},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 512},
}
REQUIRED = {
    "linear": ["factor"],
    "dynamic": ["factor"],
    "yarn": ["factor"],
    "longrope": ["short_factor", "long_factor", "original_max_position_embeddings"],
    "llama3": ["factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"],
}


@pytest.mark.parametrize("rope_type", sorted(VALID))
def test_valid_configs_build(rope_type):
    cfg = RopeConfig.from_dict(VALID[rope_type], head_dim=16, max_position_embeddings=4096)
    cos, sin = build_caches(cfg, cache_len=10)
    assert cos.shape == sin.shape == (10, 8)


@pytest.mark.parametrize(
    ("rope_type", "field"), [(t, f) for t, fields in sorted(REQUIRED.items()) for f in fields]
)
def test_missing_required_field_is_named(rope_type, field):
    data = {k: v for k, v in VALID[rope_type].items() if k != field}
    with pytest.raises(RopeConfigError) as info:
        RopeConfig.from_dict(data, head_dim=16, max_position_embeddings=4096)
    assert f"'{field}'" in str(info.value)
    assert rope_type in str(info.value)


@pytest.mark.parametrize(
    ("fields", "named", "words"),
    [
        pytest.param({"head_dim": 15}, "head_dim", ["even", "15"], id="odd-head-dim"),
        pytest.param({"head_dim": 0}, "head_dim", ["positive"], id="zero-head-dim"),
        pytest.param({"rotary_dim": 32}, "rotary_dim", ["32", "head_dim=16"], id="rotary-dim-too-large"),
        pytest.param({"rotary_dim": 7}, "rotary_dim", ["odd", "7"], id="odd-rotary-dim"),
        pytest.param({"head_dim": 20, "partial_rotary_factor": 0.25}, "partial_rotary_factor", ["odd", "5"],
                     id="partial-gives-odd-width"),
        pytest.param({"partial_rotary_factor": 1.5}, "partial_rotary_factor", ["(0, 1]"], id="partial-above-one"),
        pytest.param({"partial_rotary_factor": 0.0}, "partial_rotary_factor", ["(0, 1]"], id="partial-zero"),
        pytest.param({"rope_type": "ntk-by-parts"}, "rope_type", ["ntk-by-parts", "llama3", "yarn"],
                     id="unknown-type-lists-known"),
        pytest.param({"rope_theta": 0.0}, "rope_theta", ["> 0"], id="theta-zero"),
        pytest.param({"max_position_embeddings": 0}, "max_position_embeddings", ["positive"], id="max-pos-zero"),
        pytest.param({"rope_type": "linear", "factor": -2.0}, "factor", ["> 0"], id="negative-factor"),
        pytest.param({**VALID["longrope"], "short_factor": [1.0] * 7}, "short_factor", ["8", "7"],
                     id="short-factor-length"),
        pytest.param({**VALID["longrope"], "long_factor": [1.0] * 9}, "long_factor", ["8", "9"],
                     id="long-factor-length"),
        pytest.param({**VALID["llama3"], "high_freq_factor": 1.0}, "high_freq_factor", ["low_freq_factor"],
                     id="llama3-high-not-above-low"),
        # wrong types: named, never silently taken as truthy or failing later in arithmetic
        pytest.param({"rope_theta": "10000"}, "rope_theta", ["number"], id="theta-string"),
        pytest.param({"rope_type": "linear", "factor": "2"}, "factor", ["number"], id="factor-string"),
        pytest.param({"max_position_embeddings": 2048.0}, "max_position_embeddings", ["integer"],
                     id="max-pos-float"),
        pytest.param({"rotary_dim": "8"}, "rotary_dim", ["integer"], id="rotary-dim-string"),
        pytest.param({"interleaved": "no"}, "interleaved", ["true or false"], id="interleaved-string"),
        pytest.param({**VALID["yarn"], "truncate": "false"}, "truncate", ["true or false"], id="truncate-string"),
        pytest.param({"rope_theta": True}, "rope_theta", ["number"], id="theta-bool"),
        pytest.param({**VALID["longrope"], "long_factor": ["a"] * 8}, "long_factor", ["list of numbers"],
                     id="factor-list-of-strings"),
        pytest.param({**VALID["longrope"], "short_factor": "1.0"}, "short_factor", ["list of numbers"],
                     id="factor-list-a-string"),
        pytest.param({"rope_type": 3}, "rope_type", ["string"], id="rope-type-int"),
    ],
)
def test_bad_config_names_the_field(fields, named, words):
    data = {"head_dim": 16, **fields}
    with pytest.raises(RopeConfigError) as info:
        RopeConfig.from_dict(data)
    message = str(info.value)
    assert f"'{named}'" in message
    for word in words:
        assert word in message


def test_from_dict_unknown_field_lists_known_fields():
    with pytest.raises(RopeConfigError) as info:
        RopeConfig.from_dict({"head_dim": 16, "scaling_factor": 2.0})
    assert "scaling_factor" in str(info.value)
    assert "rope_theta" in str(info.value)


def test_from_dict_needs_head_dim():
    with pytest.raises(RopeConfigError, match="'head_dim'.*required"):
        RopeConfig.from_dict({"rope_type": "default"})


def test_build_caches_rejects_empty_cache():
    with pytest.raises(RopeConfigError, match="cache length"):
        build_caches(RopeConfig(head_dim=8), cache_len=0)


@pytest.mark.parametrize("rope_type", sorted(VALID))
def test_to_dict_round_trips_and_is_json(rope_type):
    cfg = RopeConfig.from_dict({**VALID[rope_type], "rope_theta": 12345.0}, head_dim=16, max_position_embeddings=4096)
    data = cfg.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert RopeConfig.from_dict(data) == cfg
    assert data["rope_type"] == rope_type and data["head_dim"] == 16 and data["rope_theta"] == 12345.0
    assert "mscale" not in data  # defaults are left out


def test_config_is_immutable_and_replace_revalidates():
    cfg = RopeConfig(head_dim=16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.head_dim = 8  # type: ignore[misc]
    with pytest.raises(RopeConfigError, match="head_dim"):
        dataclasses.replace(cfg, head_dim=9)
