"""A pipeline's other components, exported as they are: the VAE's decoder (latents to pixels) and a text
encoder (token ids to its last hidden state).

They go through ``export_module`` like any module, so their rotations are counted: a VAE, CLIP and T5
perform none and the file is a plain export (the summary says "no RoPE"); a text encoder that is a RoPE
language model (Lumina 2's Gemma 2, HunyuanVideo's Llama, QwenImage's Qwen2.5-VL) gets one rotary node
per rotation like any transformers model.
"""

from __future__ import annotations

import torch

from rope_export.blocks.export import export_module
from rope_export.diffusion.folders import Component, DiffusersFolderError


class VaeDecoder(torch.nn.Module):
    """``vae.decode(latent)``: what a pipeline runs after the last denoising step."""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, latent: torch.Tensor) -> torch.Tensor:
        return self.vae.decode(latent, return_dict=False)[0]


class TextEncoder(torch.nn.Module):
    """A transformers encoder: token ids to the last hidden state the pipeline conditions on."""

    def __init__(self, encoder):
        super().__init__()
        self.encoder = encoder

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.encoder(input_ids=input_ids, return_dict=True).last_hidden_state


def _vae_example(vae, dtype):
    config = vae.config
    channels = getattr(config, "latent_channels", None) or getattr(config, "z_dim", None)
    if not isinstance(channels, int):
        raise DiffusersFolderError(f"{type(vae).__name__}: no latent_channels in its config; rope-export exports the "
                                   "decoders of image and video VAEs that name it")
    video = "3d" in type(vae).__name__.lower() or hasattr(config, "temperal_downsample") or \
        hasattr(config, "temporal_compression_ratio")
    shape = (2, channels, 2, 4, 4) if video else (2, channels, 4, 4)  # not 1: torch.export takes 1 for static
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(dtype)


def export_component(model, component: Component, output, *, opset=23, allow_decomposed=False, external="auto",
                     progress=None, verbose=False) -> str:
    """Export a VAE's decoder or a text encoder; returns the summary's text."""
    dtype = next(model.parameters()).dtype
    shapes = "auto"
    if hasattr(model, "decode") and component.library == "diffusers":
        latent = _vae_example(model, dtype)
        module, args, names, what = VaeDecoder(model), (latent,), (["latent"], ["sample"]), "the VAE's decoder"
        axes = ("batch", "frames", "height", "width") if latent.dim() == 5 else ("batch", "height", "width")
        shapes = ({axis: torch.export.Dim(name) for axis, name in zip((0, *range(2, latent.dim())), axes,
                                                                        strict=True)},)  # all but the channels
    elif component.library == "transformers":
        vocab = getattr(model.config, "vocab_size", 2) or 2
        ids = torch.randint(0, vocab, (2, 7), generator=torch.Generator().manual_seed(0))
        module, args, names, what = TextEncoder(model), (ids,), (["input_ids"], ["last_hidden_state"]), \
            "the text encoder"
    else:
        raise DiffusersFolderError(f"{component.label}: rope-export exports a pipeline's denoiser, its VAE's decoder "
                                   "and its transformers text encoders; this component is none of them")
    result = export_module(module, args, output=output, opset=opset, input_names=names[0], output_names=names[1],
                           dynamic_shapes=shapes, allow_decomposed=allow_decomposed, external=external,
                           progress=progress, verbose=verbose)
    rotations = len(result.census.plain)
    if rotations == 0:
        verdict = f"{what} ({component.class_name}) performs no rotary position embedding: exported as it is (no RoPE)"
    else:
        verdict = f"{what} ({component.class_name}) rotates: {result.rotary_nodes} rotary node(s) for {rotations}"
    return f"{result.as_text()}\n{verdict}: {output}"
