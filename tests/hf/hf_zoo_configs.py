"""Tiny random-weight configs for every RoPE causal-LM model type of the installed transformers.

``tiny_config(model_type)`` starts from transformers' own default config of the type and shrinks
every size field it has (``SHRINK``: one value per field name, applied where the config has the
field), then applies the type's own overrides (``OVERRIDES``: what the generic shrink cannot know,
e.g. which layers are attention layers in a hybrid). Values are chosen so that the interesting
parts stay: GQA 4:2, MLA key width != value width, a dense layer before an MoE layer, a sliding
window smaller than the test sequences, one attention and one recurrent layer in hybrids.
"""

from __future__ import annotations

import importlib
import inspect
import re

import transformers
from transformers import AutoConfig

VOCAB = 64

# field name -> tiny value; applied only where the type's default config has the field.
SHRINK = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 128,
    # mixture of experts
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    # multi-head latent attention (key width 12 = 8 nope + 4 rope, value width 8)
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 8,
    "qk_head_dim": 12,
    "v_head_dim": 8,
    # sliding attention: a window shorter than the test sequences
    "sliding_window": 4,
}

_MAMBA = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=4,
              mamba_n_groups=1)

# model_type -> overrides applied after SHRINK (constructor keywords of the type's config).
OVERRIDES: dict[str, dict] = {
    "bamba": dict(_MAMBA, attn_layer_indices=[1]),
    "falcon_h1": dict(_MAMBA, mamba_d_ssm=64),
    "granitemoehybrid": dict(_MAMBA, layer_types=["mamba", "attention"], shared_intermediate_size=16,
                             position_embedding_type="rope"),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  mamba_d_state=8, mamba_dt_rank=4, use_mamba_kernels=False),
    "zamba2": dict(layers_block_type=["mamba", "hybrid"], mamba_d_state=8, n_mamba_heads=4, mamba_headdim=16,
                   attention_head_dim=16, kv_channels=8, adapter_rank=4, use_mamba_kernels=False, chunk_size=4,
                   use_mem_rope=True),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"], lru_width=32, attention_window_size=4,
                            num_key_value_heads=2),
    "zaya": dict(num_experts_per_tok=1),
    "bailing_hybrid": dict(linear_num_heads=4, linear_head_dim=8, num_experts_per_token=2, num_expert_group=1,
                           mlp_layer_types=["dense", "sparse"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "ernie4_5_moe": dict(moe_k=2, moe_layer_start_index=1, moe_layer_end_index=1, moe_num_shared_experts=1),
    "dbrx": dict(d_model=32, n_heads=4, n_layers=2, max_seq_len=128,
                 attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2)),
    "gemma3n_text": dict(num_kv_shared_layers=0, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
                         laurel_rank=4, activation_sparsity_pattern=[0.0, 0.0], intermediate_size=[64, 64]),
    "modernbert-decoder": dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2),
    "gptj": dict(rotary_dim=4),
    "codegen": dict(rotary_dim=4),
    "cohere_compass_text": dict(rope_parameters={"full_attention": dict(rope_type="default", rope_theta=10000.0),
                                                 "sliding_attention": dict(rope_type="default", rope_theta=10000.0)}),
    "qwen4_exp_text": dict(layer_types=["linear_attention", "indexed_attention"], indexer_n_heads=2,
                           indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=8, indexer_compress_ratio=2),
    "longcat_flash": dict(num_layers=1, ffn_hidden_size=64, expert_ffn_hidden_size=16, moe_topk=2, zero_expert_num=2),
    # Dory's default config lists an "mlp" block after each layer; one input, one looped (twice), one output layer
    "dory": dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"], num_hidden_layers=3,
                 n_input_layers=1, n_recurrent_layers=1, n_output_layers=1, n_recurrent_loops=2),
    # only LaRA-mini's sliding layers rotate (its global layers are NoPE): one layer of each kind
    "lara_mini": dict(layer_types=["linear_attention", "sliding_attention", "full_attention"], num_hidden_layers=3),
    # llama3 scaling whose original length (default 8192) is below the tiny max_position_embeddings
    "apertus1p5_text": dict(rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0,
                                                 original_max_position_embeddings=16, low_freq_factor=1.0,
                                                 high_freq_factor=4.0)),
}


def _small(config, fields: dict) -> dict:
    """The fields the config has (its own or through its attribute_map aliases, e.g. GPT-J's n_embd) and sets."""
    present = dict(config.to_dict())
    present.update({alias: present[field] for alias, field in config.attribute_map.items() if field in present})
    return {k: v for k, v in fields.items() if k in present}


def _token_ids(config, vocab: int) -> dict:
    """Special token ids that point past the tiny vocabulary become its last id."""
    out = {}
    for name, value in config.to_dict().items():
        if name.endswith(("token_id", "token_ids", "token_index")):
            if isinstance(value, list):
                out[name] = [min(v, vocab - 1) if isinstance(v, int) else v for v in value]
            elif isinstance(value, int) and not isinstance(value, bool):
                out[name] = min(value, vocab - 1)
    return out


def _latent_attention(config) -> dict:
    """MLA (a kv_lora_rank field): as many key/value heads as query heads, head_dim = the rope part."""
    present = config.to_dict()
    if "kv_lora_rank" not in present:
        return {}
    out = {"num_key_value_heads": SHRINK["num_attention_heads"]} if "num_key_value_heads" in present else {}
    if "head_dim" in present:
        out["head_dim"] = SHRINK["qk_rope_head_dim"]
    return out


# layer types that hold keys and values (the rest are recurrent, convolutional or linear-attention layers)
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "attention", "indexed_attention")


def _two_layer_types(config) -> dict:
    """Two layers of different kinds of the type's own ``layer_types``: recurrent or sliding, then global attention."""
    types = config.to_dict().get("layer_types") or []  # a field of its own, not a property or alias
    if not isinstance(types, list) or not types:
        return {}
    distinct = list(dict.fromkeys(types))
    attention = [t for t in distinct if t in ATTENTION_LAYER_TYPES]
    other = [t for t in distinct if t not in ATTENTION_LAYER_TYPES]
    if "full_attention" in attention:  # the global layer last, after a sliding or recurrent one
        attention.remove("full_attention")
        attention.append("full_attention")
    chosen = (other[:1] + attention[-1:]) if other else (attention[:1] + attention[-1:])
    if len(chosen) == 1 or chosen[0] == chosen[-1]:
        chosen = [chosen[0]] * 2
    return {"layer_types": chosen, "num_hidden_layers": len(chosen)}


def tiny_config(model_type: str, **extra):
    default = AutoConfig.for_model(model_type)
    kwargs = {**_small(default, SHRINK), **_latent_attention(default), **_two_layer_types(default),
              **_token_ids(default, VOCAB),
              **OVERRIDES.get(model_type, {}), **extra}
    return AutoConfig.for_model(model_type, **kwargs)


# -- which types the zoo holds ------------------------------------------------------------------

ROTARY_SOURCE = re.compile(r"rotary|rotate_half|apply_rotary|\brope_|freqs_cis|RotaryEmbedding")


def rotary_source(class_name: str) -> bool:
    """Whether the modeling file of the transformers class ``class_name`` has a rotary function or class (a type
    whose file does not import here is not counted)."""
    try:
        source = inspect.getsource(importlib.import_module(getattr(transformers, class_name).__module__))
    except Exception:  # noqa: BLE001
        return False
    return bool(ROTARY_SOURCE.search(source))


# Every RoPE causal-LM model type of transformers 5.24 (its modeling file has a rotary function or
# class; AutoModelForCausalLM maps it), in the zoo or out of it with the reason.
ZOO_TYPES = tuple("""
afmoe apertus apertus1p5_text arcee aria_text axk1 axk2 bailing_hybrid bamba beam bitnet codegen cohere cohere2
cohere2_moe cohere_compass_text cwm dbrx deepseek_v2 deepseek_v3 deepseek_v32 deepseek_v4 diffllama doge dory dots1
ernie4_5 ernie4_5_moe exaone exaone4 exaone_moe falcon falcon_h1 flex_olmo flint gemma gemma2 gemma3_text
gemma3n_text gemma4_text gemma4_unified_text glm glm4 glm4_moe glm4_moe_lite glm_moe_dsa gpt_neox gpt_neox_japanese
gpt_oss gptj granite granite_swa granitemoe granitemoe_swa granitemoehybrid granitemoeshared helium hrm_text
hunyuan_v1_dense hunyuan_v1_moe hy_v3 hy_v4 hyperclovax inkling2_text internlm3 iquestcoder jais2 jamba jetmoe
kolibri1 laguna lara_mini lfm2 lfm2_moe lfm3 llama llama4_text longcat_flash mellum mimo_v2_flash minicpm3 minimax
minimax_m2 minimax_m3_vl_text ministral ministral3 mistral mixtral modernbert-decoder moshi nanochat nemotron olmo
olmo2 olmo3 olmo_hybrid olmoe persimmon phi phi3 phi4_multimodal phimoe qwen2 qwen2_moe qwen3 qwen3_5_moe_text
qwen3_5_text qwen3_moe qwen3_next qwen4_exp_text recurrent_gemma sarvam_mla sarvam_moe seed_oss smollm3 solar_open
stablelm starcoder2 vaultgemma youtu zamba2 zaya
""".split())

NOT_IN_ZOO = {
    "gemma3": "multimodal wrapper: its text model gemma3_text is in the zoo",
    "gemma3n": "multimodal wrapper: its text model gemma3n_text is in the zoo",
    "gemma4": "multimodal wrapper: its text model gemma4_text is in the zoo",
    "gemma4_unified": "multimodal wrapper: its text model gemma4_unified_text is in the zoo",
    "qwen3_5": "multimodal wrapper: its text model qwen3_5_text is in the zoo",
    "qwen3_5_moe": "multimodal wrapper: its text model qwen3_5_moe_text is in the zoo",
    "qwen4_exp": "multimodal wrapper: its text model qwen4_exp_text is in the zoo",
    "dots3_note": "multimodal wrapper of dots3_note_text",
    "llama4": "multimodal wrapper: its text model llama4_text is in the zoo",
    "mllama": "vision-language model whose causal LM needs cross-attention states from the vision tower",
    "emu3": "builds its VQ image tokenizer with the text model (a default config of several GB)",
    "roformer": "an encoder (RoFormerForCausalLM is its decoder head for seq2seq), no causal KV cache",
    "blt": "byte latent transformer: local encoder/decoder and patcher configs a tiny config does not reach in 5 min",
    "dots3_note_text": "its config keeps heads per layer (heterogeneity config); the generic shrink cannot set them",
    "nemotron_h": "no RoPE: its modeling file defines apply_rotary_pos_emb but its attention never calls it "
                  "(0 rotations in an eager forward)",
}
