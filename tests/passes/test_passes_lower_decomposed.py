"""Target decomposed: primitive ops only, float32 math, out-of-range pass-through."""

from __future__ import annotations

import numpy as np
import pytest
from passes_util import as_f32, rotary_case, run_ort, run_reference

from rope_export.op.tolerances import tolerance
from rope_export.passes import lower


@pytest.mark.parametrize("interleaved", [False, True])
def test_only_primitive_ops_and_no_split_to_sequence(interleaved):
    model, _, _ = rotary_case(rd=8, interleaved=interleaved, layout="bsd")
    lowered = lower(model, "decomposed")
    domains = {n.domain for n in lowered.graph.node}
    assert domains <= {""}
    assert "SplitToSequence" not in {n.op_type for n in lowered.graph.node}
    assert {o.domain for o in lowered.opset_import} == {""}


def test_out_of_range_tokens_pass_through_bit_exactly():
    model, feeds, expected = rotary_case(layout="bhsd", max_pos=3, seq=7, seed=4)
    got = run_ort(lower(model, "decomposed"), feeds)[0]
    bad = (feeds["pos"] < 0) | (feeds["pos"] >= 3)
    assert bad.any() and (~bad).any()
    b, s = np.nonzero(bad)
    np.testing.assert_array_equal(got[b, :, s], feeds["x"][b, :, s])
    assert tolerance("op", "float32").allclose(got, expected)


def test_half_precision_math_is_float32():
    """With float32 caches under float16 X the result is the float32 rotation rounded once."""
    model, feeds, expected = rotary_case(x_dtype="float16", cache_dtype="float32", head_dim=64, max_pos=4096,
                                         out_of_range=False, seed=9)
    got = run_ort(lower(model, "decomposed"), feeds)[0]
    assert got.dtype == np.float16
    # bit-exact except where float32 rounding order flips the last fp16 bit
    diff = np.abs(as_f32(got) - as_f32(expected))
    assert (diff == 0).mean() > 0.99 and tolerance("op", "float16").allclose(got, expected)


def test_bfloat16_runs_on_the_reference_evaluator():
    model, feeds, expected = rotary_case(x_dtype="bfloat16", cache_dtype="float32", rd=8, interleaved=True)
    got = run_reference(lower(model, "decomposed"), feeds)[0]
    assert tolerance("op", "bfloat16").allclose(as_f32(got), as_f32(expected))
