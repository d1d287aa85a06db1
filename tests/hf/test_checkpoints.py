"""Building transformers models with the weights once: random (meta construction) and from safetensors.

References: transformers' own ``from_config`` (same parameters, buffers, tying and initialization
statistics) and ``from_pretrained`` (same weights, same logits), and the ``safetensors`` library's
own reader for the bytes of the checkpoint.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from rope_export.hf import checkpoint_files  # noqa: E402
from rope_export.hf.checkpoints import CheckpointError, build_causal_lm  # noqa: E402

AUTO = transformers.AutoModelForCausalLM
COMMON = dict(vocab_size=96, max_position_embeddings=64)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                              num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                              rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                                               "factor": 8.0, "low_freq_factor": 1.0,
                                                               "high_freq_factor": 4.0,
                                                               "original_max_position_embeddings": 32}, **COMMON),
    "qwen2": lambda: transformers.Qwen2Config(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                              num_attention_heads=4, num_key_value_heads=2, **COMMON),
    "phi3": lambda: transformers.Phi3Config(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                            num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
                                            eos_token_id=2, **COMMON),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                                   num_attention_heads=4, rotary_pct=0.25, **COMMON),
    "gptj": lambda: transformers.GPTJConfig(n_layer=2, n_embd=32, n_head=4, rotary_dim=4, n_positions=64,
                                            vocab_size=96),
    "gemma": lambda: transformers.GemmaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, **COMMON),
}
IDS = torch.tensor([[3, 17, 42, 5, 90, 1]])


def logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_random_build_matches_from_config_but_for_the_random_values(family):
    config = CONFIGS[family]()
    ours, report = build_causal_lm(AUTO, config, torch.float16, seed=3)
    torch.manual_seed(3)
    ref = AUTO.from_config(config, attn_implementation="eager", dtype=torch.float16)
    assert report.loader == "random"
    ours_params, ref_params = dict(ours.named_parameters()), dict(ref.named_parameters())
    assert {k: (v.shape, v.dtype) for k, v in ours_params.items()} == \
        {k: (v.shape, v.dtype) for k, v in ref_params.items()}
    ours_all = dict(ours.named_parameters(remove_duplicate=False))
    ref_all = dict(ref.named_parameters(remove_duplicate=False))
    assert set(ours_all) == set(ref_all)  # the same names tied to the same tensors
    for buffers in (dict(ours.named_buffers()), dict(ref.named_buffers())):
        assert set(buffers) == set(dict(ref.named_buffers()))
    for name, buffer in ref.named_buffers():
        assert torch.equal(dict(ours.named_buffers())[name], buffer), f"buffer {name} differs"
    for name, param in ref_params.items():
        mine = ours_params[name].float()
        assert torch.isfinite(mine).all(), name
        want = param.float()
        if want.std() == 0:  # norm weights (ones), biases (zeros)
            assert torch.equal(mine, want), name
        else:  # transformers' normal(0, initializer_range): same distribution, other draws
            assert abs(mine.std().item() - want.std().item()) < 0.25 * want.std().item(), name
    assert torch.isfinite(logits(ours)).all()


def test_random_build_is_seeded():
    config = CONFIGS["llama"]()
    a, _ = build_causal_lm(AUTO, config, torch.float32, seed=1)
    b, _ = build_causal_lm(AUTO, config, torch.float32, seed=1)
    c, _ = build_causal_lm(AUTO, config, torch.float32, seed=2)
    assert torch.equal(logits(a), logits(b)) and not torch.equal(logits(a), logits(c))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A bf16 Llama checkpoint in several shards, as save_pretrained writes it."""
    folder = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(0)
    model = AUTO.from_config(CONFIGS["llama"](), attn_implementation="eager", dtype=torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="20KB")
    assert len(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]) > 1
    return folder


def stored(folder) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


class Dtypes(TorchDispatchMode):
    """Records the dtype and size of every tensor an aten op produces."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.made.append((str(func), t.dtype, t.numel()))
        return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sharded_checkpoint_loads_in_the_export_dtype_without_float32(checkpoint, monkeypatch, dtype):
    monkeypatch.setattr(checkpoint_files, "CHUNK_BYTES", 256)  # several chunks per tensor
    config = transformers.AutoConfig.from_pretrained(checkpoint)
    with Dtypes() as seen:
        model, report = build_causal_lm(AUTO, config, dtype, weights=checkpoint)
    float32_made = [m for m in seen.made if m[1] == torch.float32 and m[2] > 64]  # > the rotary inv_freq
    assert float32_made == [], f"a float32 copy was made while loading: {float32_made[:3]}"
    assert report.loader == "safetensors" and len(report.files) > 1
    want = stored(checkpoint)
    assert report.tensors == len(want)
    assert report.converted == ({"bf16->fp16": len(want)} if dtype == torch.float16 else {})
    params = dict(model.named_parameters(remove_duplicate=False))
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as in the config
    for name, tensor in want.items():
        assert params[name].dtype == dtype, name
        assert torch.equal(params[name], tensor.to(dtype)), name  # bf16 -> fp16 is exact for these values
    ref = AUTO.from_pretrained(checkpoint, attn_implementation="eager", dtype=dtype)
    assert torch.equal(logits(model), logits(ref))


def test_float32_checkpoint_is_converted_in_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_files, "CHUNK_BYTES", 1000)
    torch.manual_seed(0)
    AUTO.from_config(CONFIGS["qwen2"](), attn_implementation="eager").save_pretrained(tmp_path)
    model, report = build_causal_lm(AUTO, transformers.AutoConfig.from_pretrained(tmp_path), torch.float16,
                                    weights=tmp_path)
    want = stored(tmp_path)
    assert report.converted == {"fp32->fp16": len(want)}
    for name, tensor in want.items():
        assert torch.equal(dict(model.named_parameters())[name], tensor.to(torch.float16)), name


def test_a_checkpoint_that_does_not_match_goes_to_transformers(tmp_path):
    torch.manual_seed(0)
    AUTO.from_config(CONFIGS["llama"](), attn_implementation="eager").save_pretrained(tmp_path)
    from safetensors.torch import save_file

    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)  # an old checkpoint's extra key
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model, report = build_causal_lm(AUTO, transformers.AutoConfig.from_pretrained(tmp_path), torch.float32,
                                    weights=tmp_path)
    assert report.loader == "transformers" and "rotary_emb.inv_freq" in report.reason
    assert torch.equal(model.model.norm.weight, tensors["model.norm.weight"])


def test_broken_checkpoints_are_named(tmp_path):
    config = CONFIGS["llama"]()
    with pytest.raises(CheckpointError, match="not a folder"):
        build_causal_lm(AUTO, config, torch.float16, weights=tmp_path / "missing")
    with pytest.raises(CheckpointError, match="has none of model.safetensors.index.json, model.safetensors, pytorch"):
        build_causal_lm(AUTO, config, torch.float16, weights=tmp_path)
    torch.manual_seed(0)
    AUTO.from_config(config, attn_implementation="eager").save_pretrained(tmp_path)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        build_causal_lm(AUTO, config, torch.float16, weights=tmp_path)
