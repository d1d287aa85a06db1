"""Tiny random-weight vision-language models: configs, the image size each is exported for, and a folder as
``save_pretrained`` writes it with a tokenizer onnxruntime-genai and transformers both read.

The tokenizer is a byte-level BPE trained here on two sentences (``tokenizers``), with the special tokens of the
Qwen-VL and Mistral 3 prompts added; every config's token ids are that tokenizer's."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import transformers

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>", "[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]", "[IMG_END]", "<|image|>")


@functools.cache
def tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.trainers import BpeTrainer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["describe the image please", "a small picture of a cat on a mat"],
                            BpeTrainer(vocab_size=290, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return tok


def token(text: str) -> int:
    return tokenizer().token_to_id(text)


VOCAB = tokenizer().get_vocab_size()
EOS, PAD = token("<|im_end|>"), token("<|endoftext|>")
TEXT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, eos_token_id=EOS, pad_token_id=PAD, bos_token_id=PAD)


def _rope(**extra):
    return {"rope_type": "default", "rope_theta": 10000.0, **extra}


def _qwen_tokens() -> dict:
    return dict(image_token_id=token("<|image_pad|>"), video_token_id=token("<|video_pad|>"),
                vision_start_token_id=token("<|vision_start|>"), vision_end_token_id=token("<|vision_end|>"))


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
    "qwen3_vl_moe": lambda: transformers.Qwen3VLMoeConfig(
        text_config=dict(**TEXT, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                         decoder_sparse_step=1, rope_parameters=_rope(mrope_section=[2, 1, 1], mrope_interleaved=True)),
        vision_config=dict(depth=3, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=32,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                           deepstack_visual_indexes=[0, 1]),
        **_qwen_tokens()),
    "mistral3": lambda: transformers.Mistral3Config(
        text_config=dict(model_type="mistral", **TEXT, head_dim=8),
        vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, head_dim=16, patch_size=8, image_size=64),
        image_token_index=token("[IMG]"), spatial_merge_size=2, vision_feature_layer=-1),
    "llama4": lambda: transformers.Llama4Config(
        text_config=dict(**TEXT, head_dim=8, intermediate_size_mlp=64, num_local_experts=2, no_rope_layers=[1, 0],
                         attention_chunk_size=64, interleave_moe_layer_step=1),
        # pixel shuffle: intermediate_size = hidden_size / pixel_shuffle_ratio**2 (the MLP after the shuffle)
        vision_config=dict(hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=8, vision_output_dim=32, projector_input_dim=32,
                           projector_output_dim=32, pixel_shuffle_ratio=0.5),
        image_token_index=token("<|image|>")),
}
# height x width in pixels, on each type's merged-token grid, not square (a transposed grid would not fit)
IMAGE_SIZES = {"qwen2_vl": "56x84", "qwen2_5_vl": "112x84", "qwen3_vl": "64x96", "qwen3_vl_moe": "64x96",
               "mistral3": "32x48", "llama4": "32x32", "glm4v": "56x84", "glm4v_moe": "56x84", "glm46v": "56x84",
               "glm_ocr": "56x84", "glmga": "56x84", "cosmos3_omni": "64x96"}


def tiny_config(model_type: str):
    return CONFIGS[model_type]()


def trained_like(model, factor: float = 8.0):
    """The weight matrices scaled by ``factor``: transformers' initialisation (std 0.02) leaves attention almost
    uniform in a tiny model, so positions barely move the outputs (a transposed vision grid changed Qwen2.5-VL's
    image features by 5e-6 of 0.1); scaled, attention logits are large as in trained models and a position fault
    changes them by percents."""
    import torch

    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.mul_(factor)
    return model


def save_folder(model, folder: Path) -> Path:
    """``model.save_pretrained(folder)`` and the tokenizer files beside it."""
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer().save(str(folder / "tokenizer.json"))
    added = {str(token(s)): {"content": s, "special": True, "lstrip": False, "rstrip": False, "normalized": False,
                             "single_word": False} for s in SPECIALS}
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
         "model_max_length": 512, "added_tokens_decoder": added}))
    return folder
