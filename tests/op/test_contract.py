"""The op contract: shape rules, dtype rules, and error messages that name the problem.

Each rule is checked on ``resolve_shape``/``check_dtypes`` directly and through the two Python
implementations of the op (the PyTorch reference and the NumPy twin), which must both refuse.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from rope_export.op import contract
from rope_export.op.contract import RotaryAttrs, RotaryContractError, check_dtypes, resolve_shape
from rope_export.op.onnx_op import rotary_numpy
from rope_export.op.reference import rotary_embedding


def test_constants_name_the_canonical_node():
    assert (contract.DOMAIN, contract.OP_TYPE, contract.OP_VERSION) == ("rope_export", "RotaryEmbedding", 1)
    assert contract.TORCH_OP_NAME == "rope_export::rotary_embedding"
    assert contract.OUT_OF_RANGE == "pass-through"
    assert set(contract.STORAGE_DTYPES) == {"float32", "float16", "bfloat16"}


def test_attrs_as_onnx_attributes_are_ints():
    attrs = RotaryAttrs(interleaved=True, num_heads=4, rotary_embedding_dim=8).as_onnx_attributes()
    assert attrs == {"interleaved": 1, "num_heads": 4, "rotary_embedding_dim": 8}
    assert all(type(v) is int for v in attrs.values())
    assert RotaryAttrs().as_onnx_attributes() == {"interleaved": 0, "num_heads": 0, "rotary_embedding_dim": 0}


# -- geometry ------------------------------------------------------------------------------------


def test_resolve_4d_with_positions():
    shape = resolve_shape((2, 3, 5, 16), (64, 8), (64, 8), (2, 5), RotaryAttrs())
    assert shape == contract.RotaryShape(2, 5, 3, 16, 16, "bhsd", 64)


def test_resolve_3d_partial_without_positions():
    shape = resolve_shape((2, 5, 3 * 10), (2, 5, 2), (2, 5, 2), None, RotaryAttrs(num_heads=3, rotary_embedding_dim=4))
    assert shape == contract.RotaryShape(2, 5, 3, 10, 4, "bsd", None)


def test_4d_accepts_num_heads_equal_to_h():
    assert resolve_shape((1, 4, 2, 8), (9, 4), (9, 4), (1, 2), RotaryAttrs(num_heads=4)).heads == 4


def test_odd_rotary_width_is_allowed_in_a_wider_odd_head():
    # Channels past rotary_embedding_dim pass through, so the head itself may be odd.
    shape = resolve_shape((1, 1, 2, 7), (4, 3), (4, 3), (1, 2), RotaryAttrs(rotary_embedding_dim=6))
    assert (shape.head_dim, shape.rotary_dim) == (7, 6)


BAD_SHAPES = [
    # (x shape, cache shape, position_ids shape, attrs, words the message must contain)
    pytest.param((1, 2, 3, 7), (8, 3), (1, 3), RotaryAttrs(), ["even", "7"], id="odd-head-dim"),
    pytest.param((1, 2, 3, 8), (8, 8), (1, 3), RotaryAttrs(rotary_embedding_dim=16), ["16", "head_dim=8"],
                 id="rotary-dim-larger-than-head"),
    pytest.param((1, 2, 3, 8), (8, 2), (1, 3), RotaryAttrs(rotary_embedding_dim=5), ["even", "5"], id="odd-rotary-dim"),
    pytest.param((1, 3, 12), (8, 2), (1, 3), RotaryAttrs(), ["num_heads", "3-D"], id="3d-without-num-heads"),
    pytest.param((1, 3, 12), (8, 2), (1, 3), RotaryAttrs(num_heads=5), ["12", "num_heads=5"],
                 id="3d-hidden-not-multiple"),
    pytest.param((1, 2, 3, 8), (8, 4), (1, 3), RotaryAttrs(num_heads=3), ["num_heads=3", "H=2"],
                 id="4d-num-heads-mismatch"),
    pytest.param((6, 8), (8, 4), (6, 1), RotaryAttrs(num_heads=2), ["4-D", "3-D", "[6, 8]"], id="x-rank-wrong"),
    pytest.param((1, 2, 3, 8), (8, 4), (1,), RotaryAttrs(), ["position_ids", "[1, 3]"], id="position-ids-1d"),
    pytest.param((1, 2, 3, 8), (8, 4), (1, 4), RotaryAttrs(), ["position_ids", "[1, 3]", "[1, 4]"],
                 id="position-ids-wrong-seq"),
    pytest.param((1, 2, 3, 8), (8, 8), (1, 3), RotaryAttrs(), ["max_pos", "4"], id="cache-full-width"),
    pytest.param((1, 2, 3, 8), (1, 8, 4), (1, 3), RotaryAttrs(), ["max_pos"], id="cache-3d-with-positions"),
    pytest.param((1, 2, 3, 8), (0, 4), (1, 3), RotaryAttrs(), ["no rows"], id="cache-empty"),
    pytest.param((1, 2, 3, 8), (8, 4), None, RotaryAttrs(), ["per token", "[1, 3, 4]"],
                 id="cache-2d-without-positions"),
    pytest.param((2, 2, 3, 8), (1, 3, 4), None, RotaryAttrs(), ["[2, 3, 4]"], id="cache-batch-wrong"),
    pytest.param((1, 2, 3, 8), (8, 4), (1, 3), RotaryAttrs(num_heads=-1), [">= 0"], id="negative-attr"),
]


@pytest.mark.parametrize(("x_shape", "cache_shape", "pos_shape", "attrs", "words"), BAD_SHAPES)
def test_resolve_shape_names_the_problem(x_shape, cache_shape, pos_shape, attrs, words):
    with pytest.raises(RotaryContractError) as info:
        resolve_shape(x_shape, cache_shape, cache_shape, pos_shape, attrs)
    for word in words:
        assert word in str(info.value)


def test_cos_and_sin_shapes_must_agree():
    with pytest.raises(RotaryContractError, match=r"cos_cache \[8, 4\] and sin_cache \[8, 2\]"):
        resolve_shape((1, 2, 3, 8), (8, 4), (8, 2), (1, 3), RotaryAttrs())


def test_contract_error_is_a_value_error():
    assert issubclass(RotaryContractError, ValueError)


# -- dtypes --------------------------------------------------------------------------------------


@pytest.mark.parametrize("x_dtype", ["float32", "float16", "bfloat16"])
def test_caches_may_be_x_dtype_or_float32(x_dtype):
    check_dtypes(x_dtype, x_dtype, "int64")
    check_dtypes(x_dtype, "float32", None)


@pytest.mark.parametrize(
    ("x_dtype", "cache_dtype", "pos_dtype", "words"),
    [
        ("float64", "float64", "int64", ["X must be one of", "float64"]),
        ("int32", "float32", "int64", ["X must be one of", "int32"]),
        ("float32", "float16", "int64", ["caches", "float32", "float16"]),
        ("float16", "bfloat16", "int64", ["caches", "float16", "bfloat16"]),
        ("float32", "float64", "int64", ["caches", "float64"]),
        ("float32", "float32", "int32", ["position_ids must be int64", "int32"]),
    ],
)
def test_check_dtypes_names_the_problem(x_dtype, cache_dtype, pos_dtype, words):
    with pytest.raises(RotaryContractError) as info:
        check_dtypes(x_dtype, cache_dtype, pos_dtype)
    for word in words:
        assert word in str(info.value)


# -- both Python implementations enforce the contract --------------------------------------------


def _torch_impl(x, cos, sin, pos, **attrs):
    return rotary_embedding(x, cos, sin, pos, **attrs)


def _numpy_impl(x, cos, sin, pos, **attrs):
    return rotary_numpy(
        x.numpy(), cos.numpy(), sin.numpy(), None if pos is None else pos.numpy(), **attrs
    )


IMPLEMENTATIONS = [pytest.param(_torch_impl, id="reference"), pytest.param(_numpy_impl, id="numpy-twin")]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize(("x_shape", "cache_shape", "pos_shape", "attrs", "words"), BAD_SHAPES)
def test_implementations_refuse_bad_shapes(impl, x_shape, cache_shape, pos_shape, attrs, words):
    x = torch.zeros(x_shape)
    cos = torch.zeros(cache_shape)
    pos = None if pos_shape is None else torch.zeros(pos_shape, dtype=torch.int64)
    kwargs = {"interleaved": attrs.interleaved, "num_heads": attrs.num_heads,
              "rotary_embedding_dim": attrs.rotary_embedding_dim}
    with pytest.raises(RotaryContractError) as info:
        impl(x, cos, cos.clone(), pos, **kwargs)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize(
    ("x_dtype", "cache_dtype", "pos_dtype", "pattern"),
    [
        (torch.float32, torch.float16, torch.int64, "caches must have X's dtype"),
        (torch.float16, torch.bfloat16, torch.int64, "caches must have X's dtype"),
        (torch.float32, torch.float64, torch.int64, "caches must have X's dtype"),
        (torch.float64, torch.float64, torch.int64, "X must be one of"),
        (torch.float32, torch.float32, torch.int32, "position_ids must be int64"),
    ],
)
def test_reference_refuses_bad_dtypes(x_dtype, cache_dtype, pos_dtype, pattern):
    x = torch.zeros(1, 2, 3, 8, dtype=x_dtype)
    cache = torch.zeros(8, 4, dtype=cache_dtype)
    with pytest.raises(RotaryContractError, match=pattern):
        rotary_embedding(x, cache, cache, torch.zeros(1, 3, dtype=pos_dtype))


@pytest.mark.parametrize(
    ("x_dtype", "cache_dtype", "pos_dtype", "pattern"),
    [
        (np.float32, np.float16, np.int64, "caches must have X's dtype"),
        (np.float16, ml_dtypes.bfloat16, np.int64, "caches must have X's dtype"),
        (np.float32, np.float64, np.int64, "caches must have X's dtype"),
        (np.float64, np.float64, np.int64, "X must be one of"),
        (np.float32, np.float32, np.int32, "position_ids must be int64"),
    ],
)
def test_numpy_twin_refuses_bad_dtypes(x_dtype, cache_dtype, pos_dtype, pattern):
    x = np.zeros((1, 2, 3, 8), x_dtype)
    cache = np.zeros((8, 4), cache_dtype)
    with pytest.raises(RotaryContractError, match=pattern):
        rotary_numpy(x, cache, cache, np.zeros((1, 3), pos_dtype))


@pytest.mark.parametrize("x_dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_numpy_twin_accepts_float32_caches_under_any_storage_dtype(x_dtype):
    x = np.ones((1, 1, 1, 2), x_dtype)
    cos, sin = np.zeros((1, 1), np.float32), np.ones((1, 1), np.float32)  # a quarter turn
    y = rotary_numpy(x, cos, sin, np.zeros((1, 1), np.int64))
    assert y.dtype == x.dtype
    np.testing.assert_array_equal(y.astype(np.float32), [[[[-1.0, 1.0]]]])


def test_implementations_refuse_cos_sin_of_different_dtypes_numpy():
    x = np.zeros((1, 2, 3, 8), np.float16)
    with pytest.raises(RotaryContractError, match="same dtype"):
        rotary_numpy(x, np.zeros((8, 4), np.float32), np.zeros((8, 4), np.float16), np.zeros((1, 3), np.int64))


def test_reference_refuses_cos_sin_of_different_dtypes():
    x = torch.zeros(1, 2, 3, 8, dtype=torch.float16)
    with pytest.raises(RotaryContractError, match="same dtype"):
        rotary_embedding(x, torch.zeros(8, 4), torch.zeros(8, 4, dtype=torch.float16), torch.zeros(1, 3).long())


def test_numpy_twin_checks_shapes_before_touching_data():
    # A cache with too few columns must be refused, not silently broadcast.
    x = np.zeros((1, 2, 3, 8), np.float32)
    with pytest.raises(RotaryContractError):
        rotary_numpy(x, np.zeros((8, 1), np.float32), np.zeros((8, 1), np.float32), np.zeros((1, 3), np.int64))
