"""Lumina 2's traceable forward (``rope_export.diffusion.trace_patches``) against diffusers' own, run eagerly.

diffusers' ``Lumina2Transformer2DModel.forward`` packs each sample's caption and image tokens by the caption's
length, read from the mask in Python; the forward traced in its place computes the same with tensor ops, the
joint sequence at a static length with padding slots masked. Both are run here on the same tiny transformer:
* eagerly (``make test``), for masks whose captions differ in length in one batch, all ones, one padding shared
  by the batch, masks with holes (diffusers takes the first ``sum(mask)`` tokens as the caption, and so does the
  replacement) and a sample with no caption token, at two latent sizes;
* through the exported file (slow): every lowering (``trt-plugin`` on the CPU twin, ``onnx``, ``ort``,
  ``decomposed``) on those masks at the traced 8 x 8 latent and at one never traced (12 x 4), against diffusers'
  forward.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")

from tiny_configs import tiny  # noqa: E402

from rope_export.diffusion.trace_patches import traceable  # noqa: E402

NAME = "Lumina2Transformer2DModel"
# (batch, text tokens, latent height, latent width): the traced latent size's and one never traced
SIZES = ((3, 6, 8, 8), (2, 9, 12, 4))


def _masks(batch: int, text: int) -> dict[str, torch.Tensor]:
    lengths = torch.arange(batch) * 2 % text + 1  # 1, 3, 5, ...: a different caption length per sample
    slots = torch.arange(text)
    holes = torch.ones(batch, text, dtype=torch.bool)
    holes[:, 1::3] = False  # not "ones then zeros": diffusers reads the first sum(mask) tokens anyway
    no_caption = (slots < text - 2).expand(batch, text).clone()
    no_caption[0] = False
    return {"ragged": slots[None, :] < lengths[:, None], "ones": torch.ones(batch, text, dtype=torch.bool),
            "same padding": (slots < text - 2).expand(batch, text).contiguous(), "holes": holes,
            "no caption": no_caption}


def _inputs(model, batch: int, text: int, height: int, width: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, model.config.in_channels, height, width, generator=g), torch.rand(batch, generator=g),
            torch.randn(batch, text, model.config.cap_feat_dim, generator=g)]


@functools.cache
def _model():
    return tiny(NAME)


def _diffusers(model, inputs, mask) -> torch.Tensor:
    with torch.no_grad():
        return model(*inputs, mask, return_dict=False)[0]


@pytest.mark.parametrize("size", SIZES, ids=lambda s: "x".join(map(str, s)))
def test_the_traced_forward_equals_diffusers_for_every_mask(size):
    model = _model()
    inputs = _inputs(model, *size)
    for name, mask in _masks(*size[:2]).items():
        want = _diffusers(model, inputs, mask)
        with traceable(model) as notes, torch.no_grad():
            got = model(*inputs, mask, return_dict=False)[0]
        assert notes and "lumina2_forward" in notes[0]
        assert got.shape == want.shape and torch.isfinite(got).all()
        # the tables are float32 in the traced forward (the rotary op's caches); diffusers' are float64 on the CPU
        error = float((got - want).abs().max())
        assert error < 1e-5 * float(want.abs().max()), f"{name} at {size}: max error {error:.3g}"
    assert "forward" not in vars(model)  # diffusers' own forward again


def test_other_classes_are_traced_as_they_are():
    flux = tiny("FluxTransformer2DModel")
    with traceable(flux) as notes:
        assert notes == [] and "forward" not in vars(flux)


@functools.cache
def _exported(tmp_root: str) -> str:
    from rope_export.diffusion.exporting import export_diffusers

    output = f"{tmp_root}/lumina2.onnx"
    result = export_diffusers(_model(), output)
    assert result.rotary_nodes == result.rotations == 6 and len(result.verified) == 2
    return output


@pytest.mark.slow
@pytest.mark.parametrize("target", ("trt-plugin", "onnx", "ort", "decomposed"))
def test_every_lowering_equals_diffusers_for_every_mask(target, tmp_path_factory):
    import onnx
    from test_diffusion_export import _run, _twin_skip

    from rope_export.op.tolerances import tolerance
    from rope_export.passes import lower

    if target == "trt-plugin":
        _twin_skip()
    lowered = lower(onnx.load(_exported(str(tmp_path_factory.getbasetemp()))), target, validate=True)
    model = _model()
    for size in SIZES:
        inputs = _inputs(model, *size, seed=1)
        for name, mask in _masks(*size[:2]).items():
            want = _diffusers(model, inputs, mask).numpy()
            feeds = dict(zip(("hidden_states", "timestep", "encoder_hidden_states", "encoder_attention_mask"),
                             [t.numpy() for t in (*inputs, mask)], strict=True))
            got = _run(lowered, target, feeds)
            error = float(np.abs(got - want).max())
            print(f"{target} {name} at {size}: max error {error:.3g}")
            assert tolerance("block", "float32").at_scale_of(want).allclose(got, want), \
                f"{target}, {name} mask at {size}: max error {error:.3g}"
