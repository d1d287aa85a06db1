"""rope_export.hf as a package: its public names and its one-line refusals
(the import structure: tests/test_package_structure.py)."""

from __future__ import annotations

import json

import pytest


def test_the_public_names_other_modules_use_stay_importable():
    from rope_export import hf

    for name in ("build_hf_model", "load_hf_config", "read_hf_metadata", "hf_io_names", "hf_example_inputs",
                 "export_hf", "rotary_hooked", "HF_FAMILIES", "MODEL_TYPES", "family_of",
                 "HFExportError", "rotate_half_qk", "FORMS"):
        assert hasattr(hf, name), name
    assert hf.hf_io_names(2) == (
        ["input_ids", "position_ids", "past_key_values.0.key", "past_key_values.0.value", "past_key_values.1.key",
         "past_key_values.1.value"], ["logits", "present.0.key", "present.0.value", "present.1.key", "present.1.value"])


def test_a_hidden_size_that_is_not_a_multiple_of_the_heads_is_one_clear_line(tmp_path):
    transformers = pytest.importorskip("transformers")
    from rope_export import cli, hf

    # a config class that checks this itself (Llama) refuses the file; its reason is the line
    llama = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_attention_heads=4, num_hidden_layers=1,
                                     intermediate_size=64, num_key_value_heads=2).to_dict()
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**llama, "hidden_size": 30}))
    with pytest.raises(hf.HFExportError, match=r"not a config transformers accepts: .*hidden size \(30\) is not a "
                                               r"multiple of the number of attention heads \(4\)\.$"):
        hf.load_hf_config(path)
    code = cli.main(["export", "--hf", str(path), "-o", str(tmp_path / "x.onnx")])
    assert code == 2 and not (tmp_path / "x.onnx").exists()
    # one that does not (GPT-J) is refused by rope-export before anything is built
    gptj = transformers.GPTJConfig(vocab_size=64, n_embd=30, n_head=4, n_layer=1, rotary_dim=4)
    with pytest.raises(hf.HFExportError, match=r"^gptj: hidden_size 30 is not a multiple of num_attention_heads 4"):
        hf.build_hf_model(gptj)


def test_an_operator_torch_onnx_cannot_translate_is_named():
    """transformers' default experts implementation (grouped_mm) emits an op torch.onnx has no translation for."""
    transformers = pytest.importorskip("transformers")
    from rope_export import hf

    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=64)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                          experts_implementation="grouped_mm").eval()
    with pytest.raises(hf.HFExportError, match=r"torch\.onnx cannot translate .*grouped_mm"):
        hf.export_hf(model)
    built = hf.build_hf_model(config)  # rope-export's own build: batched_mm, which exports
    assert built.config._experts_implementation == "batched_mm"
    assert hf.export_hf(built).custom_nodes == 2
