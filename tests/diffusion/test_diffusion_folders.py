"""diffusers folders (``rope_export.diffusion.folders``) and the command line's refusals: fast, no export."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("diffusers")

from tiny_configs import tiny  # noqa: E402

from rope_export.cli import main  # noqa: E402
from rope_export.diffusion.folders import DiffusersFolderError, build_component, find_component  # noqa: E402


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """A pipeline folder: model_index.json naming a transformer (with weights) and a VAE (config only)."""
    root = tmp_path_factory.mktemp("pipeline")
    tiny("FluxTransformer2DModel").save_pretrained(root / "transformer")
    (root / "vae").mkdir()
    (root / "vae" / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKL", "latent_channels": 4}))
    (root / "model_index.json").write_text(json.dumps({
        "_class_name": "FluxPipeline", "transformer": ["diffusers", "FluxTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"], "scheduler": [None, None]}))
    return root


def test_the_denoiser_is_the_default_component_and_its_weights_are_read(pipeline):
    component = find_component(pipeline)
    assert (component.name, component.class_name) == ("transformer", "FluxTransformer2DModel")
    assert component.weights == pipeline / "transformer"
    built = build_component(component)
    saved = tiny("FluxTransformer2DModel")
    assert all((a == b).all() for a, b in zip(built.state_dict().values(), saved.state_dict().values(), strict=True))
    vae = find_component(pipeline, "vae")
    assert vae.class_name == "AutoencoderKL" and vae.weights is None  # random weights then
    own = find_component(pipeline / "transformer")
    assert (own.name, own.class_name) == ("", "FluxTransformer2DModel")


@pytest.mark.parametrize("where,component,message", [
    ("missing", None, "no such folder"),
    ("pipeline", "unet", "has no component 'unet'; its components: transformer, vae"),
    ("transformer", "vae", "is one model's folder, not a pipeline's"),
])
def test_a_folder_or_component_that_is_not_there_is_named(pipeline, where, component, message):
    path = {"missing": pipeline / "nothing", "pipeline": pipeline, "transformer": pipeline / "transformer"}[where]
    with pytest.raises(DiffusersFolderError, match=message):
        find_component(path, component)


def test_the_command_line_refuses_with_exit_2(pipeline, tmp_path, capsys):
    assert main(["export", "--component", "vae", "-o", str(tmp_path / "x.onnx")]) == 2
    assert "--component and --diffusers-family need --diffusers DIR" in capsys.readouterr().err
    assert main(["export", "--diffusers", str(pipeline), "--component", "unet", "-o", str(tmp_path / "x.onnx")]) == 2
    assert "has no component 'unet'" in capsys.readouterr().err
    assert not (tmp_path / "x.onnx").exists()
