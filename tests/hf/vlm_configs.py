"""Tiny random-weight configs of the vision-language types, and the image size each is exported for."""

from __future__ import annotations

import transformers

VOCAB = 160
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 150, 151, 152, 153
TEXT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)


def _rope(**extra):
    return {"rope_type": "default", "rope_theta": 10000.0, **extra}


def _qwen_tokens() -> dict:
    return dict(image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
                vision_end_token_id=VISION_END)


CONFIGS = {
    "qwen2_vl": lambda: transformers.Qwen2VLConfig(
        text_config=dict(**TEXT, rope_parameters=_rope(mrope_section=[2, 1, 1])),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2),
        **_qwen_tokens()),
    "qwen2_5_vl": lambda: transformers.Qwen2_5_VLConfig(
        text_config=dict(**TEXT, rope_parameters=_rope(mrope_section=[2, 1, 1])),
        vision_config=dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=32,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[1]),
        **_qwen_tokens()),
    "qwen3_vl": lambda: transformers.Qwen3VLConfig(
        text_config=dict(**TEXT, head_dim=8, rope_parameters=_rope(mrope_section=[2, 1, 1], mrope_interleaved=True)),
        vision_config=dict(depth=3, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=32,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                           deepstack_visual_indexes=[0, 1]),
        **_qwen_tokens()),
    "mistral3": lambda: transformers.Mistral3Config(
        text_config=dict(model_type="mistral", **TEXT, head_dim=8),
        vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, head_dim=16, patch_size=8, image_size=64),
        image_token_index=IMAGE_TOKEN, spatial_merge_size=2, vision_feature_layer=-1),
    "llama4": lambda: transformers.Llama4Config(
        text_config=dict(**TEXT, head_dim=8, intermediate_size_mlp=64, num_local_experts=2, no_rope_layers=[1, 0],
                         attention_chunk_size=64, interleave_moe_layer_step=1),
        # pixel shuffle: intermediate_size = hidden_size / pixel_shuffle_ratio**2 (the MLP after the shuffle)
        vision_config=dict(hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=8, vision_output_dim=32, projector_input_dim=32,
                           projector_output_dim=32, pixel_shuffle_ratio=0.5),
        image_token_index=IMAGE_TOKEN),
}
IMAGE_SIZES = {"qwen2_vl": "56x84", "qwen2_5_vl": "112x84", "qwen3_vl": "64x96", "mistral3": "32x48", "llama4": "32x32"}


def tiny_config(model_type: str):
    return CONFIGS[model_type]()
