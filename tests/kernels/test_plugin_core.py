"""The TensorRT-free half of the plugin (plugins/core), through the CPU twin library's C ABI.

Shape and dtype rules are held against rope_export.op.contract (messages included); plugin fields
against what a hostile or damaged engine could carry; format rules against the dtype contract.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rope_export.kernels import cpu_twin
from rope_export.kernels.build import ensure_built
from rope_export.kernels.cpu_twin import BUILD, RUNTIME, PluginField, PluginFieldError
from rope_export.op import contract
from rope_export.op.contract import RotaryAttrs, RotaryContractError


@pytest.fixture(scope="module", autouse=True)
def _built_twin():
    ensure_built()


def _outcome(fn, *args):
    try:
        return "ok", fn(*args)
    except RotaryContractError as exc:
        return "error", str(exc)


# --- shapes -----------------------------------------------------------------------------------------


@st.composite
def rotary_shapes(draw):
    """Mostly valid geometries, then zero or more of the mistakes people make."""
    b, s, h = draw(st.integers(0, 4)), draw(st.integers(0, 5)), draw(st.integers(1, 4))
    d = 2 * draw(st.integers(0, 8))
    rd_attr = draw(st.sampled_from([0, d, min(2, d)]))
    four_d = draw(st.booleans())
    num_heads = draw(st.sampled_from([0, h])) if four_d else h
    x = (b, h, s, d) if four_d else (b, s, h * d)
    rd = rd_attr or d
    with_pos = draw(st.booleans())
    max_pos = draw(st.integers(1, 6))
    cos = (max_pos, rd // 2) if with_pos else (b, s, rd // 2)
    sin = cos
    pos = (b, s) if with_pos else None
    mutations = ["x_dim", "x_rank", "cos_dim", "sin", "pos", "cache_rank", "heads", "rotary_dim", "max_pos"]
    mutation = draw(st.sampled_from(["none"] * len(mutations) + mutations))
    if mutation == "heads":
        num_heads = draw(st.sampled_from([-1, 0, h + 1]))
    elif mutation == "rotary_dim":
        rd_attr = draw(st.sampled_from([-2, 3, d + 2]))
    elif mutation == "max_pos" and with_pos:
        cos = sin = (0, rd // 2)
    elif mutation == "x_dim":
        i = draw(st.integers(0, len(x) - 1))
        x = x[:i] + (x[i] + draw(st.integers(1, 3)),) + x[i + 1 :]
    elif mutation == "x_rank":
        x = draw(st.sampled_from([x[:2], x + (2,), ()]))
    elif mutation == "cos_dim":
        i = draw(st.integers(0, len(cos) - 1))
        cos = cos[:i] + (cos[i] + 1,) + cos[i + 1 :]
        sin = cos if draw(st.booleans()) else sin
    elif mutation == "sin":
        sin = sin + (1,)
    elif mutation == "pos":
        pos = draw(st.sampled_from([(b,), (b, s + 1), (b, s, 1), (s, b)]))
    elif mutation == "cache_rank":
        cos = sin = (1,) + cos
    attrs = RotaryAttrs(interleaved=draw(st.booleans()), num_heads=num_heads, rotary_embedding_dim=rd_attr)
    return x, cos, sin, pos, attrs


@settings(max_examples=100, deadline=None)
@given(rotary_shapes())
def test_cpp_shape_rules_agree_with_contract(case):
    x, cos, sin, pos, attrs = case
    expected = _outcome(contract.resolve_shape, x, cos, sin, pos, attrs)
    got = _outcome(cpu_twin.resolve_shape, x, cos, sin, pos, attrs)
    assert got == expected


def test_shape_rules_cover_both_outcomes():
    # The property above is only as good as its cases: valid and invalid ones both occur.
    ok = cpu_twin.resolve_shape((2, 8, 5, 64), (16, 32), (16, 32), (2, 5), RotaryAttrs(False, 0, 0))
    assert ok == contract.RotaryShape(2, 5, 8, 64, 64, "bhsd", 16)
    with pytest.raises(RotaryContractError, match="rotary_embedding_dim=66 is larger than head_dim=64"):
        cpu_twin.resolve_shape((2, 8, 5, 64), (16, 33), (16, 33), (2, 5), RotaryAttrs(False, 0, 66))


def test_cpp_shape_rules_reject_what_the_kernels_cannot_address():
    big = 1 << 40
    with pytest.raises(RotaryContractError, match="too many elements"):
        cpu_twin.resolve_shape((big, big, 8, 64), (big, 8, 32), (big, 8, 32), None, RotaryAttrs())
    with pytest.raises(RotaryContractError, match="negative or unknown dimension"):
        cpu_twin.resolve_shape((1, -1, 8, 64), (1, 8, 32), (1, 8, 32), None, RotaryAttrs())


@settings(max_examples=100, deadline=None)
@given(rotary_shapes())
def test_rank_checks_are_necessary_conditions_of_the_contract(case):
    x, cos, sin, pos, attrs = case
    ranks = (len(x), len(cos), len(sin), -1 if pos is None else len(pos))
    contract_ok = _outcome(contract.resolve_shape, x, cos, sin, pos, attrs)[0] == "ok"
    ranks_ok = _check_ranks(*ranks, attrs) is None
    if contract_ok:
        assert ranks_ok
    if not ranks_ok:
        assert not contract_ok


def _check_ranks(x_rank, cos_rank, sin_rank, pos_rank, attrs):
    """The C++ rank check's message, or None when it passes."""
    try:
        cpu_twin.check_ranks(x_rank, cos_rank, sin_rank, None if pos_rank < 0 else pos_rank, attrs)
    except RotaryContractError as exc:
        return str(exc)
    return None


def test_rank_check_messages_name_the_fix():
    assert "needs the num_heads attribute" in _check_ranks(3, 2, 2, 2, RotaryAttrs())
    assert "got a rank-3 tensor" in _check_ranks(4, 3, 3, 2, RotaryAttrs())
    assert "pass position_ids" in _check_ranks(4, 2, 2, -1, RotaryAttrs())


# --- dtypes and formats -----------------------------------------------------------------------------

NAMES = ["float32", "float16", "bfloat16", "float64", "int64", "int32", "uint8"]


def test_cpp_dtype_rules_agree_with_contract():
    for x, cache, pos in itertools.product(NAMES, NAMES, [None, *NAMES]):
        assert _outcome(cpu_twin.check_dtypes, x, cache, pos) == _outcome(contract.check_dtypes, x, cache, pos)


def _contract_allows(dtypes: list[str]) -> bool:
    x, cos, sin, *rest = dtypes[:-1]
    out = dtypes[-1]
    try:
        contract.check_dtypes(x, cos, rest[0] if rest else None)
    except RotaryContractError:
        return False
    return cos == sin and out == x


@pytest.mark.parametrize("nb_inputs", [3, 4])
def test_format_combinations_are_exactly_the_contract(nb_inputs):
    names = ["float32", "float16", "bfloat16", "int64", "int32"]
    for dtypes in itertools.product(names, repeat=nb_inputs + 1):
        dtypes = list(dtypes)
        linear = [True] * len(dtypes)
        # TensorRT asks position by position; a combination is usable when every answer is yes.
        accepted = all(cpu_twin.supports_combination(p, dtypes, linear, nb_inputs, 1) for p in range(len(dtypes)))
        assert accepted == _contract_allows(dtypes), dtypes
    good = ["float16", "float32", "float32"] + ["int64"] * (nb_inputs == 4) + ["float16"]
    for p in range(len(good)):
        non_linear = [True] * len(good)
        non_linear[p] = False
        assert not cpu_twin.supports_combination(p, good, non_linear, nb_inputs, 1)
    assert not cpu_twin.supports_combination(len(good), good, [True] * len(good), nb_inputs, 1)
    assert not cpu_twin.supports_combination(0, good, [True] * len(good), nb_inputs, 2)


def test_output_dtype_follows_x_and_rejects_like_the_contract():
    assert cpu_twin.output_dtype(["bfloat16", "float32", "float32", "int64"]) == "bfloat16"
    assert cpu_twin.output_dtype(["float16", "float16", "float16"]) == "float16"
    with pytest.raises(RotaryContractError, match=r"position_ids must be int64, got int32; cast them with \.long\(\)"):
        cpu_twin.output_dtype(["float16", "float16", "float16", "int32"])
    with pytest.raises(RotaryContractError, match="must have the same dtype"):
        cpu_twin.output_dtype(["float16", "float16", "float32"])
    with pytest.raises(RotaryContractError, match="takes 3 inputs"):
        cpu_twin.output_dtype(["float16", "float16"])


# --- plugin fields ---------------------------------------------------------------------------------


def test_identity_matches_the_contract():
    # The name is the trt-plugin op type (one no TensorRT importer claims), not the contract's op type.
    name, version, namespace = cpu_twin.plugin_identity()
    assert (version, namespace) == (str(contract.OP_VERSION), contract.DOMAIN)
    assert name != contract.OP_TYPE and name.endswith(contract.OP_TYPE)


def test_the_trt_plugin_lowering_targets_this_plugin():
    lowering = pytest.importorskip("rope_export.passes.lower_trt_plugin")
    expected = (lowering.PLUGIN_NAME, lowering.PLUGIN_VERSION, lowering.PLUGIN_NAMESPACE)
    assert cpu_twin.plugin_identity() == expected


def test_fields_from_the_onnx_parser_are_accepted():
    # What the trt-plugin lowering's node becomes: INT attributes as INT32, strings as CHAR (no NUL).
    fields = [
        PluginField.int32("interleaved", 1),
        PluginField.int32("num_heads", 32),
        PluginField.int32("rotary_embedding_dim", 64),
        PluginField.string("plugin_namespace", "rope_export"),
        PluginField.string("plugin_version", "1"),
    ]
    assert cpu_twin.parse_fields(fields, BUILD) == RotaryAttrs(True, 32, 64)
    assert cpu_twin.parse_fields(fields, RUNTIME) == RotaryAttrs(True, 32, 64)
    assert cpu_twin.parse_fields([PluginField.int64("num_heads", 8)], BUILD) == RotaryAttrs(False, 8, 0)


def test_missing_fields_take_defaults_when_building_but_not_when_deserializing():
    assert cpu_twin.parse_fields([], BUILD) == RotaryAttrs(False, 0, 0)
    fields = [PluginField.int32("interleaved", 0), PluginField.int32("num_heads", 4)]
    with pytest.raises(PluginFieldError, match="lacks field 'rotary_embedding_dim'.*rebuild the engine"):
        cpu_twin.parse_fields(fields, RUNTIME)


@pytest.mark.parametrize(
    "field, message",
    [
        (PluginField("num_heads", "FLOAT32", b"\0\0\x80?", 1), "'num_heads' must be INT32 \\(or INT64\\), got FLOAT32"),
        (PluginField("num_heads", "CHAR", b"8", 1), "must be INT32 \\(or INT64\\), got CHAR"),
        (PluginField("num_heads", 99, b"\0\0\0\0", 1), "got an invalid type code"),
        (PluginField.int32("interleaved", 1, 1), "'interleaved' must hold exactly 1 value, got 2"),
        (PluginField("interleaved", "INT32", b"", 0), "must hold exactly 1 value, got 0"),
        (PluginField("interleaved", "INT32", None, 1), "'interleaved' has no data"),
        (PluginField.int32("interleaved", 2), "must be 0 \\(rotate-half\\) or 1 \\(interleaved\\), got 2"),
        (PluginField.int32("num_heads", -1), "'num_heads' must be in \\[0, 2147483647\\]"),
        (PluginField.int64("num_heads", 1 << 31), "'num_heads' must be in \\[0, 2147483647\\].*2147483648"),
        (PluginField.int32("rotary_embedding_dim", 63), "must be even \\(channels rotate in pairs\\), got 63"),
        (PluginField.int32("rotary_embedding_dim", -2), "'rotary_embedding_dim' must be in \\[0, 2147483647\\]"),
        (PluginField.int32("num_head", 8), "unknown field 'num_head'; the fields are interleaved, num_heads"),
        (PluginField(None, "INT32", b"\0\0\0\0", 1), "field #0 has no name"),
        (PluginField("x" * 1025, "INT32", b"\0\0\0\0", 1), "longer than 1024 bytes"),
    ],
)
def test_malformed_fields_are_rejected_with_the_reason(field, message):
    for phase in (BUILD, RUNTIME):
        with pytest.raises(PluginFieldError, match=message):
            cpu_twin.parse_fields([field], phase)


def test_duplicate_fields_are_rejected():
    with pytest.raises(PluginFieldError, match="'num_heads' is given more than once"):
        cpu_twin.parse_fields([PluginField.int32("num_heads", 8), PluginField.int32("num_heads", 4)])


@settings(max_examples=60, deadline=None)
@given(st.booleans(), st.integers(0, 2**31 - 1), st.integers(0, 2**30 - 1))
def test_serialized_fields_parse_back(interleaved, num_heads, half):
    attrs = RotaryAttrs(interleaved, num_heads, 2 * half)
    fields = cpu_twin.serialize_fields(attrs)
    assert [(f.name, f.type, f.length) for f in fields] == [
        ("interleaved", "INT32", 1),
        ("num_heads", "INT32", 1),
        ("rotary_embedding_dim", "INT32", 1),
    ]
    values = [int.from_bytes(f.data, "little", signed=True) for f in fields]
    assert values == [int(interleaved), num_heads, 2 * half]
    assert cpu_twin.parse_fields(fields, RUNTIME) == attrs
    assert cpu_twin.metadata_string(attrs) == (
        f"interleaved={int(interleaved)} num_heads={num_heads} rotary_embedding_dim={2 * half}"
    )
