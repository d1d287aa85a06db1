"""A pipeline's other components through ``export --diffusers --component`` (``diffusion/components.py``): the
VAE's decoder exported as it is, its summary saying it performs no rotation; a RoPE text encoder (a
transformers Llama in ``text_encoder``, as HunyuanVideo's pipeline holds one) with one rotary node per rotation.
``export_module`` checks each file against PyTorch on onnxruntime before writing it. Slow: two exports."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

from rope_export.cli import main  # noqa: E402
from rope_export.op.contract import DOMAIN, OP_TYPE  # noqa: E402

pytestmark = pytest.mark.slow

VAE = dict(block_out_channels=(8,), norm_num_groups=4, latent_channels=4, sample_size=16)
LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """A pipeline folder holding a tiny VAE and a tiny Llama text encoder (random weights, save_pretrained)."""
    import diffusers

    root = tmp_path_factory.mktemp("pipeline")
    torch.manual_seed(0)
    diffusers.AutoencoderKL(**VAE).save_pretrained(root / "vae")
    transformers.LlamaModel(transformers.LlamaConfig(**LLAMA)).save_pretrained(root / "text_encoder")
    (root / "model_index.json").write_text(json.dumps({"_class_name": "SomePipeline",
                                                       "vae": ["diffusers", "AutoencoderKL"],
                                                       "text_encoder": ["transformers", "LlamaModel"]}))
    return root


def _rotary_nodes(path) -> int:
    return sum(n.domain == DOMAIN and n.op_type == OP_TYPE for n in onnx.load(path).graph.node)


def test_the_vae_decoder_is_exported_as_it_is_and_said_to_have_no_rope(pipeline, tmp_path, capsys):
    import diffusers

    out = tmp_path / "vae_decoder.onnx"
    assert main(["export", "--diffusers", str(pipeline), "--component", "vae", "-o", str(out)]) == 0
    assert "performs no rotary position embedding: exported as it is (no RoPE)" in capsys.readouterr().out
    assert _rotary_nodes(out) == 0
    vae = diffusers.AutoencoderKL.from_pretrained(pipeline / "vae").eval()
    latent = torch.randn(1, 4, 6, 4, generator=torch.Generator().manual_seed(1))  # not the traced 4 x 4
    with torch.no_grad():
        want = vae.decode(latent, return_dict=False)[0].numpy()
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"latent": latent.numpy()})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_a_rope_text_encoder_gets_one_rotary_node_per_rotation(pipeline, tmp_path, capsys):
    out = tmp_path / "text_encoder.onnx"
    assert main(["export", "--diffusers", str(pipeline), "--component", "text_encoder", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "the text encoder (LlamaModel) rotates: 2 rotary node(s) for 2" in text, text
    assert _rotary_nodes(out) == 2
