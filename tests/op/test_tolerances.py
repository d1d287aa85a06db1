"""The one table of tolerances: lookup, the allclose rule, and that the numbers mean what they say."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rope_export.op.tolerances import TOLERANCES, Tolerance, tolerance

DTYPES = ["float32", "float16", "bfloat16"]


@pytest.mark.parametrize("kind", ["op", "block"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_lookup_by_name_and_by_torch_dtype(kind, dtype):
    by_name = tolerance(kind, dtype)
    assert by_name is TOLERANCES[kind][dtype]
    assert tolerance(kind, getattr(torch, dtype)) == by_name


@pytest.mark.parametrize(("kind", "dtype"), [("op", "int8"), ("graph", "float32"), ("block", "int8")])
def test_unknown_lookup_lists_what_exists(kind, dtype):
    with pytest.raises(KeyError) as info:
        tolerance(kind, dtype)
    message = str(info.value)
    assert repr(kind) in message and repr(dtype) in message
    assert "block" in message and "op" in message and "bfloat16" in message


def test_ordering_is_sensible():
    for kind in ("op", "block"):
        tols = [tolerance(kind, d) for d in DTYPES]
        assert tols[0].atol < tols[1].atol < tols[2].atol
        assert tols[0].rtol < tols[1].rtol < tols[2].rtol
    for dtype in DTYPES:
        assert tolerance("op", dtype).atol <= tolerance("block", dtype).atol


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_op_tolerance_is_about_two_storage_ulps(dtype):
    """The docstring's claim: ~2 ulps of the storage type at 1.0 (eps is the ulp at 1.0)."""
    eps = torch.finfo(dtype).eps
    tol = tolerance("op", dtype)
    assert 2 * eps <= tol.atol <= 2.5 * eps
    assert 2 * eps <= tol.rtol <= 2.5 * eps


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rounding_once_passes_and_two_ulps_more_fails(dtype):
    gen = torch.Generator().manual_seed(0)
    exact = torch.rand(10000, generator=gen, dtype=torch.float64) * 8 - 4
    tol = tolerance("op", dtype)
    assert tol.allclose(exact.to(dtype).double(), exact)  # one rounding is well inside
    one = torch.tensor(1.0, dtype=torch.float64)
    far = one + 8 * torch.finfo(dtype).eps  # 8 ulps off at 1.0
    assert not tol.allclose(far, one)


def test_allclose_rule_is_atol_plus_rtol_times_expected():
    tol = Tolerance(atol=0.1, rtol=0.01)
    assert tol.allclose([10.0 + 0.2 - 1e-9], [10.0])  # bound 0.1 + 0.01 * 10 = 0.2
    assert not tol.allclose([10.0 + 0.2 + 1e-9], [10.0])
    # relative to the expected (second) argument, as numpy.allclose
    assert Tolerance(0.0, 0.5).allclose([1.0], [2.0]) and not Tolerance(0.0, 0.5).allclose([2.0], [1.0])
    # every element must pass; shapes broadcast like numpy
    assert not tol.allclose([0.0, 5.0], [0.0, 0.0])
    assert tol.allclose(np.zeros((2, 3)), 0.05)


def test_allclose_accepts_torch_tensors_and_rejects_nan():
    tol = tolerance("op", "float32")
    a = torch.tensor([1.0, 2.0])
    assert tol.allclose(a, a.clone())
    assert not tol.allclose(torch.tensor([float("nan")]), torch.tensor([float("nan")]))
    assert tol.allclose(a.half().float(), a)


def test_the_absolute_part_follows_an_output_whose_rms_is_above_one():
    tol = tolerance("block", "float16")
    small = np.full(8, 0.5)
    assert tol.at_scale_of(small) == tol  # order-1 outputs keep it
    logits = np.array([4.0, -4.0, 4.0, -4.0, 0.01, np.inf])  # RMS of the finite values: sqrt(12.8)
    scaled = tol.at_scale_of(logits)
    assert scaled.rtol == tol.rtol and scaled.atol == pytest.approx(tol.atol * np.sqrt(64.0001 / 5))
    near_zero = logits[4]
    assert not tol.allclose(near_zero + 2.5 * tol.atol, near_zero)
    assert scaled.allclose(near_zero + 2.5 * tol.atol, near_zero)  # a few ulps of the output's scale
    assert not scaled.allclose(near_zero + 4 * tol.atol, near_zero)


@pytest.mark.parametrize("kind", ["op", "block"])
def test_float64_is_held_to_float32s_tolerance(kind):
    """float64 tables (a file of plain ops storing them so) are at least as exact as the float32 the contract
    computes in: float32's tolerance, not a looser or a made-up one."""
    assert tolerance(kind, "float64") == tolerance(kind, "float32")
    assert tolerance(kind, torch.float64) == tolerance(kind, "float32")
