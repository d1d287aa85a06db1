"""The denoiser recipe of docs/diffusers.md ("Serving the denoiser"): an ``export --diffusers`` file packaged for
Triton (every config parsed by Triton's own schema), the TensorRT engine's optimization profile from the
documented ``--shape`` flags, and the file served by Triton's own server (nvidia-pytriton's tritonserver, Python
backend, loopback) against diffusers at a latent size never traced. Slow: a tiny Flux is exported first."""

from __future__ import annotations

import time

import numpy as np
import onnx
import pytest
import torch

pytest.importorskip("diffusers")
grpcclient = pytest.importorskip("tritonclient.grpc")

from test_triton import _infer, _pytriton_root, _ready, parse, tritonserver  # noqa: E402

from rope_export.diffusion.exporting import export_diffusers  # noqa: E402
from rope_export.diffusion.recipes import OTHER, Denoiser, inputs_at, recipe_for  # noqa: E402
from rope_export.op.tolerances import tolerance  # noqa: E402
from rope_export.runtimes.trt import parse_shape  # noqa: E402
from rope_export.runtimes.trt_profiles import derive_profile  # noqa: E402
from rope_export.serve import triton  # noqa: E402

pytestmark = pytest.mark.slow

FLUX = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6))


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    """(the tiny Flux transformer, its export --diffusers file)."""
    import diffusers

    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel(**FLUX).eval()
    path = tmp_path_factory.mktemp("flux") / "flux.onnx"
    export_diffusers(model, path)
    return model, path


def test_the_engine_profile_of_the_documented_shapes(flux):
    """``rope-export build flux.trt.onnx --shape hidden_states:... --shape encoder_hidden_states:...``: the two
    shapes bind every dynamic axis (batch, image_seq, text_seq) of every input, ids and timestep included."""
    _, path = flux
    model = onnx.load(path, load_external_data=False)
    given = dict(parse_shape(s) for s in ("hidden_states:1x16x4:1x64x4:2x256x4",
                                          "encoder_hidden_states:1x8x32:1x8x32:2x16x32"))
    profile, _ = derive_profile(model, given)
    assert profile["img_ids"] == ((16, 3), (64, 3), (256, 3))
    assert profile["txt_ids"] == ((8, 3), (8, 3), (16, 3))
    assert profile["timestep"] == ((1,), (1,), (2,))
    assert profile["pooled_projections"] == ((1, 32), (1, 32), (2, 32))


@pytest.mark.parametrize("backend", ["tensorrt", "onnxruntime"])
def test_configs_parse_with_tritons_schema(flux, tmp_path, backend):
    """``--max-batch 0``: the ids have no batch axis, so Triton batches nothing and every dim is the file's."""
    _, path = flux
    engine = None
    if backend == "tensorrt":
        engine = tmp_path / "flux.plan"
        engine.write_bytes(b"an engine built where TensorRT and a GPU are")
    folder = triton.write_repository(path, tmp_path / "repo", backend=backend, name=f"flux_{backend}", engine=engine,
                                     max_batch=0).folder
    config = parse(folder)
    assert config.max_batch_size == 0
    file_inputs = onnx.load(path, load_external_data=False).graph.input
    assert [i.name for i in config.input] == [i.name for i in file_inputs]
    assert list(config.input[0].dims) == [-1, -1, FLUX["in_channels"]]  # batch and image tokens dynamic


def test_served_by_tritonserver_equals_diffusers_at_a_latent_size_never_traced(flux, tmp_path):
    if _pytriton_root() is None:
        pytest.skip("no tritonserver: install nvidia-pytriton (pip install --no-deps --target build/pytriton "
                    "nvidia-pytriton==0.7.0) or set ROPE_EXPORT_PYTRITON")
    model, path = flux
    triton.write_repository(path, tmp_path / "repo", backend="python", name="flux", max_batch=0)
    recipe = recipe_for(model)
    inputs = inputs_at(model, recipe, OTHER, seed=3)
    with torch.no_grad():
        want = Denoiser(model, recipe, list(inputs.tensors))(*inputs.tensors.values()).numpy()
    with tritonserver(tmp_path / "repo", tmp_path) as (address, proc, log):
        client = grpcclient.InferenceServerClient(address)
        deadline = time.monotonic() + 120
        while not _ready(client, "flux"):
            assert proc.poll() is None, f"tritonserver exited: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"the model was not ready in 120 s: {log.read_text()[-3000:]}"
            time.sleep(0.5)
        got = _infer(client, "flux", {k: v.numpy() for k, v in inputs.tensors.items()}, ["sample"])["sample"]
        client.close()
    print(f"served by tritonserver at {OTHER.describe()}: max error {np.abs(got - want).max():.2e}")
    assert got.shape == want.shape
    assert tolerance("block", "float32").at_scale_of(want).allclose(got, want)
