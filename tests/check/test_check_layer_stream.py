"""The layer-streamed transformers run (``check.layer_stream``) equals an ordinary transformers run.

A three-layer Llama with fp16 weights (random, or saved by save_pretrained): the float32 stream is
compared with the whole model cast to float32, the float16 stream with the whole fp16 model, bit for
bit, on logits, presents and the hidden state after every layer, with and without a past.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from rope_export.check.layer_stream import stream_causal_lm  # noqa: E402
from rope_export.check.layer_weights import CheckpointWeights, RandomWeights, skeleton  # noqa: E402
from rope_export.check.model_file import CheckError  # noqa: E402
from rope_export.hf.cache_io import returned_cache, with_cache  # noqa: E402
from rope_export.hf.checkpoints import build_causal_lm  # noqa: E402

LAYERS = 3
OPTIONS = dict(attn_implementation="eager")
AUTO = transformers.AutoModelForCausalLM


def config(tied: bool):
    return transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=None, bos_token_id=None, eos_token_id=None,
        tie_word_embeddings=tied)


def feeds() -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for batch, seq, past in ((2, 5, 0), (1, 4, 3)):
        f = {"input_ids": rng.integers(0, 64, (batch, seq)),
             "position_ids": np.arange(past, past + seq)[None].repeat(batch, 0).astype(np.int64)}
        for i in range(LAYERS):
            for kv in ("key", "value"):
                f[f"past_key_values.{i}.{kv}"] = rng.standard_normal((batch, 2, past, 8)).astype(np.float16)
        out.append(f)
    return out


def plain_run(model, feed, dtype):
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache()
    for i in range(LAYERS):
        key = torch.from_numpy(feed[f"past_key_values.{i}.key"]).to(dtype)
        value = torch.from_numpy(feed[f"past_key_values.{i}.value"]).to(dtype)
        if key.shape[2]:
            cache.update(key, value, i)
    with torch.no_grad():
        return with_cache(model, cache, input_ids=torch.from_numpy(feed["input_ids"]),
                          position_ids=torch.from_numpy(feed["position_ids"]), output_hidden_states=True)


def assert_same_as_plain(streamed, model, cases):
    same = np.testing.assert_array_equal

    for c, feed in enumerate(cases):
        out = plain_run(model, feed, streamed.dtype)
        same(streamed.outputs[c]["logits"], out.logits.numpy())
        layers = returned_cache(out).layers
        for i in range(LAYERS):
            same(streamed.outputs[c][f"present.{i}.key"], layers[i].keys.numpy())
            same(streamed.outputs[c][f"present.{i}.value"], layers[i].values.numpy())
            # hidden_states[i + 1] is after layer i, except the last, which transformers gives after the final norm
            if i < LAYERS - 1:
                same(streamed.layer_states[c][i], out.hidden_states[i + 1].numpy())
        assert len(streamed.layer_states[c]) == LAYERS


@pytest.mark.parametrize("tied", [False, True])
def test_random_weights_are_redrawn_layer_by_layer_exactly(tied):
    whole, _ = build_causal_lm(AUTO, config(tied), torch.float16, seed=3, options=OPTIONS)
    expected = dict(whole.named_parameters(remove_duplicate=False))
    source = RandomWeights(AUTO, config(tied), torch.float16, 3, OPTIONS)
    got = dict(source.outside())
    for i in reversed(range(LAYERS)):  # any order: each layer's draws are replayed from its own RNG state
        got.update(source.layer(i))
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize("tied", [False, True])
def test_streamed_fp32_and_fp16_equal_whole_model_runs(tied):
    cases = feeds()
    source = RandomWeights(AUTO, config(tied), torch.float16, 3, OPTIONS)
    in32, in16 = stream_causal_lm(AUTO, config(tied), source, [torch.float32, torch.float16], cases,
                                  list(range(LAYERS)), OPTIONS)
    half, _ = build_causal_lm(AUTO, config(tied), torch.float16, seed=3, options=OPTIONS)
    assert_same_as_plain(in16, half, cases)
    assert_same_as_plain(in32, half.float(), cases)  # the same fp16 weights, computed in float32
    assert in32.outputs[0]["logits"].dtype == np.float32 and in16.outputs[0]["logits"].dtype == np.float16
    # and float32 is not float16: the reference would be pointless otherwise
    assert not np.array_equal(in32.outputs[0]["logits"], in16.outputs[0]["logits"].astype(np.float32))


@pytest.mark.parametrize("tied", [False, True])
def test_streamed_from_a_safetensors_checkpoint(tmp_path, tied):
    model, _ = build_causal_lm(AUTO, config(tied), torch.float16, seed=5, options=OPTIONS)
    model.save_pretrained(tmp_path)  # a tied LM head is not saved: the stream ties it as the model does
    cases = feeds()
    source = CheckpointWeights(tmp_path, skeleton(AUTO, config(tied), torch.float16, OPTIONS))
    in32, in16 = stream_causal_lm(AUTO, config(tied), source, [torch.float32, torch.float16], cases,
                                  list(range(LAYERS)), OPTIONS)
    assert_same_as_plain(in16, model, cases)
    assert_same_as_plain(in32, model.float(), cases)


def test_checkpoint_of_another_model_is_refused(tmp_path):
    other = transformers.LlamaConfig(**{**config(False).to_dict(), "num_hidden_layers": 2})
    AUTO.from_config(other).save_pretrained(tmp_path)
    with pytest.raises(CheckError, match="does not name the model's tensors one to one"):
        CheckpointWeights(tmp_path, skeleton(AUTO, config(False), torch.float16, OPTIONS))
