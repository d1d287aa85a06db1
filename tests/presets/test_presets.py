"""Model presets: every shipped file loads and its scaled-down block runs; bad files are named."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from rope_export.op.tolerances import tolerance
from rope_export.presets import DEFAULT_PRESET, Preset, PresetError, load_preset, preset_names
from rope_export.presets.modules import RoPEAttention

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

MODELS_DIR = Path(__file__).resolve().parents[2] / "models"
SHIPPED = sorted(p.stem for p in MODELS_DIR.glob("*.toml"))


def test_every_file_in_models_is_a_preset():
    assert SHIPPED, "no presets found in models/"
    assert preset_names() == SHIPPED
    assert DEFAULT_PRESET in SHIPPED


@pytest.mark.parametrize("name", SHIPPED)
def test_preset_loads_and_scaled_down_block_runs(name):
    preset = load_preset(name)
    assert preset.name == name
    assert preset.family and preset.source
    assert preset.rope.head_dim == preset.attention.head_dim
    # the loader reads what the file says
    raw = tomllib.loads((MODELS_DIR / f"{name}.toml").read_text(encoding="utf-8"))
    for key, value in raw["attention"].items():
        assert getattr(preset.attention, key) == value
    for key, value in raw["rope"].items():
        expected = tuple(value) if isinstance(value, list) else value
        assert getattr(preset.rope, key) == expected

    small = preset.scaled_down()
    assert small.rope == preset.rope and small.attention.head_dim == preset.attention.head_dim
    assert small.attention.num_heads % small.attention.num_kv_heads == 0
    block = small.build_block(cache_len=min(preset.rope.max_position_embeddings, 512))
    assert isinstance(block, RoPEAttention) and not block.training
    hidden = torch.randn(2, 5, small.attention.hidden_size, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(5).expand(2, 5)
    with torch.no_grad():
        out, key, value = block(hidden, positions)
        # one decode step with the cache gives the prefill's last token
        _, k4, v4 = block(hidden[:, :4], positions[:, :4])
        last, _, _ = block(hidden[:, 4:], positions[:, 4:], k4, v4)
    assert out.shape == hidden.shape and torch.isfinite(out).all()
    assert key.shape == (2, small.attention.num_kv_heads, 5, small.attention.head_dim)
    assert tolerance("block", "float32").allclose(last, out[:, 4:])


@pytest.mark.parametrize("name", SHIPPED)
def test_preset_to_dict_round_trips(name):
    preset = load_preset(name)
    assert Preset.from_dict(preset.to_dict()) == preset


def test_scaled_down_keeps_the_query_to_kv_ratio_where_it_fits():
    llama3 = load_preset("llama-3.1-8b")  # 32 q heads / 8 kv heads
    small = llama3.scaled_down(num_heads=8, hidden_size=32)
    assert (small.attention.num_heads, small.attention.num_kv_heads, small.attention.hidden_size) == (8, 2, 32)
    mha = load_preset("llama-2-7b").scaled_down(num_heads=3)
    assert (mha.attention.num_heads, mha.attention.num_kv_heads) == (3, 3)


def test_build_block_is_seeded_and_typed():
    preset = load_preset("tiny")
    a, b = preset.build_block(seed=3), preset.build_block(seed=3)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name
    c = preset.build_block(seed=4)
    assert not torch.equal(a.q_proj.weight, c.q_proj.weight)
    half = preset.build_block(dtype=torch.float16)
    assert half.q_proj.weight.dtype == torch.float16


def test_load_preset_from_a_path(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text((MODELS_DIR / "phi-2.toml").read_text(encoding="utf-8").replace('name = "phi-2"', 'name = "mine"'))
    preset = load_preset(path)
    assert preset.name == "mine" and preset.rope.partial_rotary_factor == 0.4
    assert load_preset(str(path)) == preset


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(PresetError) as info:
        load_preset("llama-9")
    message = str(info.value)
    assert "'llama-9'" in message
    for name in SHIPPED:
        assert name in message


# -- bad files -------------------------------------------------------------------------------------

GOOD = """\
name = "bad"
family = "llama"
source = "test"

[attention]
hidden_size = 64
num_heads = 4
num_kv_heads = 2
head_dim = 16

[rope]
rope_type = "default"
rope_theta = 10000.0
max_position_embeddings = 512
"""


def edit(text: str, old: str, new: str) -> str:
    assert old in text
    return text.replace(old, new)


BAD_FILES = [
    # (how to break GOOD, the field the message must name, other words it must contain)
    pytest.param(lambda t: edit(t, 'source = "test"', 'source = "test"\nlicense = "MIT"'), "license",
                 ["not a preset field"], id="unknown-top-level-field"),
    pytest.param(lambda t: edit(t, "head_dim = 16\n", "head_dim = 16\nheads = 4\n"), "attention.heads",
                 ["not an attention field"], id="unknown-attention-field"),
    pytest.param(lambda t: edit(t, "max_position_embeddings = 512", "max_position_embeddings = 512\nscale = 2.0"),
                 "scale", ["unknown rope field"], id="unknown-rope-field"),
    pytest.param(lambda t: edit(t, 'name = "bad"\n', ""), "name", ["missing"], id="missing-name"),
    pytest.param(lambda t: edit(t, "num_kv_heads = 2\n", ""), "attention.num_kv_heads", ["missing"],
                 id="missing-attention-field"),
    pytest.param(lambda t: t.split("[rope]")[0], "rope", ["missing"], id="missing-rope-section"),
    pytest.param(lambda t: edit(t, "num_heads = 4", 'num_heads = "four"'), "attention.num_heads", ["positive integer"],
                 id="wrong-type-int"),
    pytest.param(lambda t: edit(t, "rope_theta = 10000.0", 'rope_theta = "10000"'), "rope_theta", ["number"],
                 id="wrong-type-rope-number"),
    pytest.param(lambda t: edit(t, "head_dim = 16\n", "head_dim = 16\nqkv_bias = \"false\"\n"),
                 "attention.qkv_bias", ["true or false"], id="wrong-type-bool"),
    pytest.param(lambda t: edit(t, 'rope_type = "default"', 'rope_type = "default"\ninterleaved = 1'),
                 "interleaved", ["true or false"], id="wrong-type-rope-bool"),
    pytest.param(lambda t: edit(t, 'rope_type = "default"', 'rope_type = "ntk"'), "rope_type", ["unknown", "yarn"],
                 id="bad-rope-type"),
    pytest.param(lambda t: edit(t, 'rope_type = "default"', 'rope_type = "yarn"'), "factor", ["required", "yarn"],
                 id="bad-rope-missing-scaling-field"),
    pytest.param(lambda t: edit(t, 'rope_type = "default"', 'rotary_dim = 7'), "rotary_dim", ["odd"],
                 id="bad-rope-odd-rotary-dim"),
    pytest.param(lambda t: edit(t, "max_position_embeddings = 512", "max_position_embeddings = 512\nhead_dim = 32"),
                 "rope.head_dim", ["differs"], id="rope-head-dim-differs"),
    pytest.param(lambda t: edit(t, "num_kv_heads = 2", "num_kv_heads = 3"), "attention.num_kv_heads",
                 ["does not divide"], id="kv-heads-do-not-divide"),
    pytest.param(lambda t: t[: t.index("[attention]")] + "attention = 5\n" + t[t.index("[rope]") :], "attention",
                 ["table"], id="attention-not-a-table"),
    pytest.param(lambda t: edit(t, "head_dim = 16\n", "head_dim = 16\n[[[\n"), None, ["not valid TOML"],
                 id="not-toml"),
]


@pytest.mark.parametrize(("mutate", "field", "words"), BAD_FILES)
def test_bad_preset_file_names_the_file_and_the_field(tmp_path, mutate, field, words):
    path = tmp_path / "broken.toml"
    path.write_text(mutate(GOOD), encoding="utf-8")
    with pytest.raises(PresetError) as info:
        load_preset(path)
    message = str(info.value)
    assert str(path) in message
    if field is not None:
        assert f"'{field}'" in message
    for word in words:
        assert word in message


def test_good_template_loads(tmp_path):
    """The template the bad files are made from is itself valid (so each failure is the edit's)."""
    path = tmp_path / "good.toml"
    path.write_text(GOOD, encoding="utf-8")
    preset = load_preset(path)
    assert preset.attention.num_kv_heads == 2 and preset.rope.max_position_embeddings == 512


def test_scaled_down_preset_is_still_a_preset():
    small = load_preset("gpt-neox-20b").scaled_down(num_heads=2, hidden_size=192)
    assert dataclasses.asdict(small.attention)["hidden_size"] == 192
    assert small.rope.rotary_embedding_dim == 24  # rotary_pct 0.25 of head_dim 96
