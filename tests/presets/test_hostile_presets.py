"""Every preset field with out-of-range, non-finite and wrongly typed values (issue 16).

Before the fix ``factor = inf`` or ``rope_theta = inf`` loaded and turned RoPE off (every
frequency 0), ``num_heads = true`` built a 1-head block, and llama3 ``low_freq_factor = 0``,
longrope ``original_max_position_embeddings = 0``, dynamic with ``rotary_dim = 2`` or YaRN with a
negative original length ended in a ZeroDivisionError or ValueError traceback. Each must now be
one PresetError naming the file and the field; sizes a machine cannot hold say what they would
allocate before anything is allocated.
"""

from __future__ import annotations

import math

import pytest
import torch

from rope_export.cli import main
from rope_export.common import bounds
from rope_export.op.rope_types import RopeConfig, RopeConfigError, build_caches
from rope_export.presets import PresetError, load_preset

ATTENTION = {"hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16}
# Valid [rope] tables per scheme; each hostile value below replaces one field of one of them.
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0, "max_position_embeddings": 512},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32.0,
             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "attention_factor": 1.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 64, "max_position_embeddings": 256,
                 "short_factor": [1.0] * 8, "long_factor": [2.0] * 8},
}
NON_FINITE = ["inf", "-inf", "nan"]
# (scheme, field, TOML values that must be refused)
NUMBER_FIELDS = [
    ("default", "rope_theta", NON_FINITE + ["0.0", "-1.0", "true", '"1e4"']),
    ("default", "partial_rotary_factor", NON_FINITE + ["0.0", "1.5", "-0.5"]),
    ("linear", "factor", NON_FINITE + ["0.0", "-2.0", "false"]),
    ("yarn", "attention_factor", NON_FINITE + ["0.0", "-1.0"]),
    ("yarn", "beta_fast", NON_FINITE + ["0.0", "-32.0"]),
    ("yarn", "beta_slow", NON_FINITE + ["0.0", "-1.0"]),
    ("yarn", "mscale", NON_FINITE + ['"1"']),
    ("yarn", "mscale_all_dim", NON_FINITE),
    ("llama3", "low_freq_factor", NON_FINITE + ["0.0", "-1.0"]),
    ("llama3", "high_freq_factor", NON_FINITE + ["0.0", "0.5"]),
    ("llama3", "factor", NON_FINITE + ["0.0"]),
]
INT_FIELDS = [
    ("default", "max_position_embeddings", ["0", "-1", "2147483648", "512.0", "true", "9223372036854775807"]),
    ("default", "rotary_dim", ["0", "-2", "7", "18", "8.0", "true"]),
    ("yarn", "original_max_position_embeddings", ["0", "-128", "1.5", "true"]),
    ("longrope", "original_max_position_embeddings", ["0", "-64", "1"]),
    ("llama3", "original_max_position_embeddings", ["0", "-64"]),
]
ATTENTION_FIELDS = [
    ("hidden_size", ["0", "-64", "true", "64.0", '"64"', "2147483648"]),
    ("num_heads", ["0", "-4", "true", "4.5", "inf", "nan"]),
    ("num_kv_heads", ["0", "true", "3"]),
    ("head_dim", ["0", "-16", "true", "16777218"]),
    ("softmax_scale", NON_FINITE + ["0.0", "-0.1", "true"]),
    ("qkv_bias", ["1", '"yes"']),
]


def _toml(attention: dict, rope: dict) -> str:
    def value(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str) and not v.startswith(("inf", "-inf", "nan")) and not v.startswith('"'):
            return f'"{v}"'
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return str(v)

    lines = ['name = "hostile"', "[attention]"] + [f"{k} = {value(v)}" for k, v in attention.items()]
    lines += ["[rope]"] + [f"{k} = {value(v)}" for k, v in rope.items()]
    return "\n".join(lines) + "\n"


def _load(tmp_path, attention: dict, rope: dict, replace: tuple[str, str, str] | None = None):
    path = tmp_path / "hostile.toml"
    text = _toml(attention, rope)
    if replace is not None:
        section, field, literal = replace
        lines = text.splitlines()
        start = lines.index(f"[{section}]")
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("[")), len(lines))
        body = [line for line in lines[start + 1:end] if not line.startswith(f"{field} =")]
        lines[start + 1:end] = body + [f"{field} = {literal}"]
        text = "\n".join(lines) + "\n"
    path.write_text(text, encoding="utf-8")
    return load_preset(str(path)), path


@pytest.mark.parametrize("scheme", sorted(ROPES))
def test_the_templates_are_valid(tmp_path, scheme):
    preset, _ = _load(tmp_path, ATTENTION, ROPES[scheme])
    assert preset.rope.rope_type == scheme


def _cases():
    for scheme, field, literals in NUMBER_FIELDS + INT_FIELDS:
        for literal in literals:
            yield pytest.param("rope", scheme, field, literal, id=f"{scheme}-{field}={literal}")
    for field, literals in ATTENTION_FIELDS:
        for literal in literals:
            yield pytest.param("attention", "default", field, literal, id=f"attention-{field}={literal}")


@pytest.mark.parametrize("section, scheme, field, literal", list(_cases()))
def test_every_field_refuses_out_of_range_non_finite_and_mistyped_values(tmp_path, section, scheme, field, literal):
    with pytest.raises(PresetError) as info:
        _load(tmp_path, ATTENTION, ROPES[scheme], (section, field, literal))
    message = str(info.value)
    assert "\n" not in message and str(tmp_path / "hostile.toml") in message
    named = f"'attention.{field}'" if section == "attention" else f"'{field}'"
    assert named in message, message


@pytest.mark.parametrize(
    "scheme, changes, words",
    [
        # each of these divided by zero (or took a log of a negative) inside the scheme's math
        ("llama3", {"low_freq_factor": 0.0}, ["low_freq_factor", "> 0"]),
        ("longrope", {"original_max_position_embeddings": 0}, ["original_max_position_embeddings", "positive"]),
        ("longrope", {"original_max_position_embeddings": 1}, ["original_max_position_embeddings", ">= 2"]),
        ("dynamic", {"rotary_dim": 2}, ["rotary_dim", "at least 4"]),
        ("yarn", {"original_max_position_embeddings": -4096}, ["original_max_position_embeddings", "positive"]),
        ("yarn", {"rope_theta": 1.0}, ["rope_theta", "> 1"]),
        # field by field fine, together unusable: the scheme's own math is checked as well
        ("yarn", {"mscale": 1.0, "mscale_all_dim": -10 / math.log(4.0), "attention_factor": None},
         ["yarn", "cannot compute its frequencies", "mscale_all_dim"]),
        ("linear", {"factor": 1e-320}, ["linear", "not finite and positive", "factor"]),
    ],
)
def test_scheme_math_that_would_divide_by_zero_is_refused_naming_the_fields(scheme, changes, words):
    data = {**ROPES[scheme], **changes, "head_dim": 16}
    data = {k: v for k, v in data.items() if v is not None}
    with pytest.raises(RopeConfigError) as info:
        RopeConfig.from_dict(data)
    for word in words:
        assert word in str(info.value), str(info.value)


def test_inf_factor_and_theta_no_longer_turn_rope_off():
    """The silent failure: with factor = inf every inverse frequency was 0, cos = 1, sin = 0."""
    for changes in ({"rope_type": "linear", "factor": math.inf}, {"rope_theta": math.inf}):
        with pytest.raises(RopeConfigError, match="finite"):
            RopeConfig(head_dim=16, **changes)
    cos, sin = build_caches(RopeConfig(head_dim=16, rope_theta=1e6), cache_len=4)  # a large finite theta rotates
    assert torch.allclose(sin[:, 0], torch.sin(torch.arange(4.0)))  # channel 0 turns once per position


def test_num_heads_true_is_not_one_head(tmp_path):
    with pytest.raises(PresetError, match=r"'attention.num_heads': must be a positive integer, got True \(bool\)"):
        _load(tmp_path, ATTENTION, ROPES["default"], ("attention", "num_heads", "true"))


def test_factor_lists_refuse_non_finite_and_non_positive_entries():
    base = {**ROPES["longrope"], "head_dim": 16}
    for bad in (math.inf, math.nan, 0.0, -1.0, 10**400):
        with pytest.raises(RopeConfigError, match=r"'short_factor\[3\]'"):
            RopeConfig.from_dict({**base, "short_factor": [1.0, 1.0, 1.0, bad, 1.0, 1.0, 1.0, 1.0]})


# -- sizes: say what would be allocated, allocate nothing ------------------------------------------

def test_a_huge_cache_is_refused_before_it_is_built():
    with pytest.raises(bounds.AllocationError, match=r"would allocate .* TB .*--cache-len"):
        build_caches(RopeConfig(head_dim=128, max_position_embeddings=2**31 - 1))


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"num_heads": 10**8, "num_kv_heads": 10**8}, ["q/k/v/o weights", " TB", "num_heads"]),
        ({"hidden_size": 2**31 - 1}, ["q/k/v/o weights", " TB"]),
    ],
)
def test_a_huge_block_is_refused_saying_what_it_would_allocate(tmp_path, changes, words):
    preset, _ = _load(tmp_path, {**ATTENTION, **changes}, ROPES["default"])
    with pytest.raises(bounds.AllocationError) as info:
        preset.build_block()
    for word in words:
        assert word in str(info.value)


def test_the_allocation_limit_is_the_memory_available():
    assert bounds.check_allocation("x", {"a": 10, "b": 20}, "fix", limit=30) == 30
    with pytest.raises(bounds.AllocationError, match=r"x would allocate 31 B \(a 11 B, b 20 B\), "
                                                     r"more than the 30 B of memory available; fix"):
        bounds.check_allocation("x", {"a": 11, "b": 20}, "fix", limit=30)
    available = bounds.available_memory()
    assert available is None or 0 < available < 2**50


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--cache-len", "1000000000"], ["would allocate", " GB ", "--cache-len"]),
        (["--seed", str(2**80)], ["seed", "2**64 - 1", str(2**80)]),
    ],
)
def test_export_options_out_of_range_exit_2_in_one_line(tmp_path, capsys, argv, words):
    assert main(["export", "--preset", "tiny", "-o", str(tmp_path / "m.onnx"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("rope-export export: error: ")
    for word in words:
        assert word in err
    assert not (tmp_path / "m.onnx").exists()


def test_a_negative_seed_is_refused_by_the_parser(tmp_path, capsys):
    # --seed is one option of export, check and package: a whole number, as the random weights are drawn
    with pytest.raises(SystemExit) as exited:
        main(["export", "--preset", "tiny", "-o", str(tmp_path / "m.onnx"), "--seed", str(-(2**63) - 1)])
    assert exited.value.code == 2
    assert f"argument --seed: {-(2**63) - 1} is negative" in capsys.readouterr().err
    assert not (tmp_path / "m.onnx").exists()


def test_a_hostile_preset_file_through_the_cli_is_one_line(tmp_path, capsys):
    path = tmp_path / "p.toml"
    path.write_text(_toml(ATTENTION, {**ROPES["default"], "rope_theta": "inf"}), encoding="utf-8")
    for command in (["presets", str(path)], ["export", "--preset", str(path), "-o", str(tmp_path / "m.onnx")]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "'rope_theta': must be a finite number, got inf" in err


def test_a_transformers_config_with_a_huge_vocabulary_is_sized_before_it_is_built(tmp_path, capsys):
    """vocab_size = 1e10: measured on the meta device (nothing allocated), refused in one line."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=10**10, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    config.save_pretrained(tmp_path / "config")
    assert main(["export", "--hf", str(tmp_path / "config"), "-o", str(tmp_path / "m.onnx")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "the llama model would allocate 5.1 TB" in err and "vocab_size" in err
