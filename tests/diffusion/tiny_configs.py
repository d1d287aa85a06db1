"""Tiny random configs of diffusers' transformers (a few hundred kB of weights each).

``TINY`` holds the named families of issue 39, each with the released model's axes and rotation spelling and
sizes the recipes' latents fit (diffusers' own test config of CogVideoX has no RoPE, Flux's none of the
16/56/56 split); every other class takes the config of diffusers' own model tests
(``diffusers_zoo_configs.CONFIGS``, written by ``make_zoo_configs.py``).
"""

from __future__ import annotations

TINY = {
    "FluxTransformer2DModel": dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                   attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                   pooled_projection_dim=32, axes_dims_rope=(4, 6, 6)),
    "WanTransformer3DModel": dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
                                  out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2,
                                  rope_max_seq_len=32),
    "HunyuanVideoTransformer3DModel": dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10,
                                           num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=2,
                                           patch_size_t=1, text_embed_dim=16, pooled_projection_dim=8,
                                           rope_axes_dim=(2, 4, 4)),
    "CogVideoXTransformer3DModel": dict(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
                                        time_embed_dim=8, text_embed_dim=16, num_layers=1, sample_width=8,
                                        sample_height=8, sample_frames=9, patch_size=2, temporal_compression_ratio=4,
                                        max_text_seq_length=7, use_rotary_positional_embeddings=True),
    "LTXVideoTransformer3DModel": dict(in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=12,
                                       cross_attention_dim=24, num_layers=1, caption_channels=16),
    "Lumina2Transformer2DModel": dict(sample_size=16, patch_size=2, in_channels=4, hidden_size=24, num_layers=1,
                                      num_refiner_layers=1, num_attention_heads=2, num_kv_heads=1, multiple_of=16,
                                      axes_dim_rope=(4, 4, 4), axes_lens=(32, 32, 32), cap_feat_dim=16),
}


def config(class_name: str) -> dict | None:
    """The tiny config of a class: ``TINY``'s, else diffusers' own test config, else None."""
    from diffusers_zoo_configs import CONFIGS

    if class_name in TINY:
        return TINY[class_name]
    entry = CONFIGS.get(class_name)
    return None if entry is None else entry["config"]


def tiny(class_name: str, seed: int = 0):
    import diffusers
    import torch

    found = config(class_name)
    if found is None:
        raise KeyError(f"{class_name} has no tiny config")
    torch.manual_seed(seed)
    return getattr(diffusers, class_name)(**found).eval()
