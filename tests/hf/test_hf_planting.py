"""rope_export.hf.planting: what the planted weights do in a forward, measured, not assumed."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from rope_export import hf  # noqa: E402
from rope_export.hf.planting import measure_statistics, plant_trained_statistics  # noqa: E402

CONFIG = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, pad_token_id=None, bos_token_id=None,
              eos_token_id=None)


def _llama(seed=0):
    return hf.build_hf_model(transformers.LlamaConfig(**CONFIG), seed=seed)


def test_planted_model_has_massive_activations_sinks_and_large_logits():
    model = _llama()
    ids = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(1))
    before = measure_statistics(model, ids)
    planted = plant_trained_statistics(model, massive=800.0, sink_logit=30.0)
    ids[0, ::5] = torch.tensor(planted.sink_tokens[:1])  # a sink every five tokens
    after = measure_statistics(model, ids, planted.sink_tokens)
    assert before.max_activation < 20 and before.max_logit < 5  # random weights: nothing of the kind
    assert 600 < after.max_activation < 1200 and after.massive_ratio > 500  # hundreds of times the median
    assert 20 < after.max_logit < 60  # about the sink logit asked for (the other logits add their spread)
    assert after.sink_attention > 0.3  # the sinks draw a large share of every other token's attention
    assert after.max_activation ** 2 > torch.finfo(torch.float16).max  # its square overflows float16
    assert "massive activations 800" in planted.describe()


def test_planting_is_deterministic_per_seed_and_changes_with_it():
    first, second, other = _llama(), _llama(), _llama()
    a, b = plant_trained_statistics(first, seed=3), plant_trained_statistics(second, seed=3)
    c = plant_trained_statistics(other, seed=4)
    assert a == b and a != c
    for (name, p), q in zip(first.named_parameters(), second.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert not torch.equal(first.model.embed_tokens.weight, other.model.embed_tokens.weight)


def test_a_model_without_llama_family_projections_is_refused_with_a_reason():
    config = transformers.GPTNeoXConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, max_position_embeddings=64)
    with pytest.raises(ValueError, match="q_proj/k_proj/v_proj"):
        plant_trained_statistics(hf.build_hf_model(config, seed=0))
