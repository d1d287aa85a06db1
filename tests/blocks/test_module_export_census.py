"""Rotations whose cos/sin tables run no trig op in the counted forward (kind 5 of issue 25): tables made
before the forward (transformers' pre-4.38 Llama ``cos_cached``/``sin_cached``, flash-attn's warmed
``_cos_cached``, a module-level ``lru_cache`` no module owns) and tables with an all-zero padding row.

Each is counted by the eager census (2 rotations: q and k), exported by export_module and fused from its
plain export with one rotary node per rotated tensor, and the ``onnx`` lowering equals the eager block on
onnxruntime (fp32, 1e-5) at batch 3, with positions further on and, for the padded tables, padding
tokens (which come out as zeros in both). Planted: a padding row that is not zero (a scaled rotation:
counted, refused, nothing fused) and a table whose sin is of other angles than its cos (not a rotation)."""

from __future__ import annotations

import census_blocks as cb
import numpy as np
import pytest
import rope_blocks as rb
import torch
from test_module_export_vision import assert_equal_to_eager, n_rotary, run_lowered

import rope_export
from rope_export.detect import count_rotations
from rope_export.detect.tables import _pair_table
from rope_export.passes import FusionReport, fuse

PADDED = ("zero_row", "zero_row_last")


def cases(name: str) -> list[tuple]:
    """Inputs the file must match the block on: another batch, positions further on, padding tokens."""
    pad = 2 if name in PADDED else 0
    return [cb.example(batch=3, seq=4, offset=6, seed=4), cb.example(batch=3, seq=7, pad=pad, seed=5)]


@pytest.mark.parametrize("name", list(cb.BLOCKS))
def test_the_census_counts_rotations_by_tables_made_before_the_forward(name):
    census = count_rotations(cb.block(name), cb.example(pad=2 if name in PADDED else 0))
    assert (len(census.plain), len(census.scaled)) == (2, 0), census.as_text()
    assert {s.module_path for s in census.sites} == {"rope"}


@pytest.mark.parametrize("name", list(cb.BLOCKS))
def test_export_module_fuses_them_exactly(name):
    block = cb.block(name)
    result = rope_export.export_module(block, cb.example())
    assert result.rotary_nodes == 2 and result.count.ok and result.count.expected == 2, result.as_text()
    for inputs in cases(name):
        assert_equal_to_eager(result.model, block, inputs)


@pytest.mark.parametrize("name", list(cb.BLOCKS))
def test_fuse_of_the_plain_export_fuses_them_exactly(name):
    block = cb.block(name)
    report = FusionReport()
    fused = fuse(rb.export_plain(block, cb.example()), report=report, validate=True)
    assert n_rotary(fused) == 2 and (report.found, report.num_fused, report.left) == (2, 2, 0), report.as_text()
    for inputs in cases(name):
        assert_equal_to_eager(fused, block, inputs)


@pytest.mark.parametrize("name", PADDED)
def test_padding_tokens_come_out_as_zeros_from_the_op_as_from_the_block(name):
    """A zero cache row is not cos/sin of an angle: the op gives zeros for its tokens, and so does the block's
    x * 0 + rot(x) * 0. Checked on the file's rotated keys, not assumed."""
    block = cb.block(name)
    x, pos = cb.example(batch=3, seq=6, pad=3, seed=7)
    fused = fuse(rb.export_plain(block, (x, pos)), validate=True)
    keys = run_lowered(fused, (x, pos))[1]  # [B, H, S, D]
    assert np.all(keys[0, :, :3] == 0) and np.abs(keys[0, :, 3:]).min() >= 0 and np.abs(keys[1]).max() > 0.1
    with torch.no_grad():
        np.testing.assert_allclose(keys, block(x, pos)[1].numpy(), rtol=1e-5, atol=1e-5)


def test_a_padding_row_that_is_not_zero_is_a_scaled_rotation_and_refused():
    """Row 0 holds 0.5 in cos and sin: c² + s² = 0.5 there, 1 elsewhere. Counted as 2 scaled rotations (not
    RoPE), nothing fused by either path, and the written file is the block as it is."""
    block = cb.block("bad_pad_row")
    census = count_rotations(block, cb.example(pad=2))
    assert (len(census.plain), len(census.scaled)) == (0, 2), census.as_text()
    result = rope_export.export_module(block, cb.example())
    assert result.rotary_nodes == 0 and len(result.count.refused) == 2, result.as_text()
    assert "cos² + sin² is not constant (from 0.5 to 1)" in result.as_text()
    report = FusionReport()
    fused = fuse(rb.export_plain(block, cb.example()), report=report, validate=True)
    assert n_rotary(fused) == 0 and report.num_fused == 0, report.as_text()
    for inputs in [cb.example(batch=3, seq=7, pad=2, seed=5)]:
        assert_equal_to_eager(result.model, block, inputs)
        assert_equal_to_eager(fused, block, inputs)


def test_a_table_whose_sin_has_other_angles_is_not_a_rotation():
    block = cb.block("other_angles")
    assert count_rotations(block, cb.example()).total == 0
    result = rope_export.export_module(block, cb.example())
    assert result.rotary_nodes == 0 and result.count.expected == 0
    assert "cos² + sin² is not constant" in result.as_text()  # the fusion looked at it and said why not
    assert_equal_to_eager(result.model, block, cb.example(batch=3, seed=5))


def test_tables_with_zeros_in_part_of_a_row_or_a_mask_are_not_cos_sin():
    """A zero padding row is whole; a row zero in some channels only is not a padding row, and a 0/1 mask with
    its complement (m² + (1 - m)² = 1) is not a cos/sin pair."""
    freqs = torch.arange(8.0)[:, None] * torch.tensor([1.0, 0.3, 0.1, 0.01])
    cos, sin = freqs.cos(), freqs.sin()
    assert _pair_table(cos, sin) == "unit"
    padded_cos, padded_sin = torch.cat((torch.zeros(1, 4), cos)), torch.cat((torch.zeros(1, 4), sin))
    assert _pair_table(padded_cos, padded_sin) == "unit"
    partial_cos, partial_sin = padded_cos.clone(), padded_sin.clone()
    partial_cos[0, :2], partial_sin[0, :2] = 1.0, 0.0
    assert _pair_table(partial_cos, partial_sin) is None
    scaled_cos, scaled_sin = padded_cos.clone(), padded_sin.clone()
    scaled_cos[0], scaled_sin[0] = 0.5, 0.5
    assert _pair_table(scaled_cos, scaled_sin) == "rows"
    mask = (torch.rand(8, 4, generator=torch.Generator().manual_seed(0)) > 0.5).float()
    assert _pair_table(mask, 1 - mask) is None
