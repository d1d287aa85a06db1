"""count_rotations against real RoPE code: transformers models (rotate-half, interleaved, partial,
complex, MLA, NoPE layers), torchtune, Meta's reference, lucidrains' einops code, the hand-written
forms of the block zoo, and look-alikes that are not rotations."""

from __future__ import annotations

import pytest
import rope_blocks as rb
import torch

from rope_export.detect import RotationCensus, WitnessError, count_rotations


@pytest.mark.parametrize("name", list(rb.FORMS))
def test_every_form_of_the_zoo_counts_one_rotation_per_tensor(name):
    census = count_rotations(rb.block(name), rb.example())
    assert census.total == 2 and not census.scaled, census.as_text()
    assert all(s.module_path.startswith("rope") for s in census.sites), census.as_text()
    assert all(s.layer is None for s in census.sites)
    shapes = sorted(s.shape[-1] for s in census.sites)
    assert shapes == [rb.D, rb.D], census.as_text()  # joined back to whole heads (partial: with the pass part)


@pytest.mark.parametrize("name", list(rb.LOOK_ALIKES))
def test_look_alikes(name):
    form = rb.LOOK_ALIKES[name]
    census = count_rotations(rb.block(name), rb.example())
    assert census.total == form.rotations and len(census.scaled) == form.scaled, census.as_text()
    assert len(census.plain) == form.rotations - form.scaled


def test_xpos_rotations_are_flagged_by_name():
    census = count_rotations(rb.block("xpos"), rb.example())
    assert [s.scaled for s in census.sites] == [True, True]
    assert "xPos-style scaled rotation" in census.as_text()


def _hf(config, **kwargs):
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(6).expand(2, 6) + torch.tensor([[0], [3]])
    return count_rotations(model, (), dict(input_ids=ids, position_ids=pos, use_cache=False, **kwargs))


SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)


def _configs():
    tf = pytest.importorskip("transformers")
    return {
        "llama": (tf.LlamaConfig(**SMALL), "real", {0: 2, 1: 2}),
        "gptj": (tf.GPTJConfig(n_layer=2, n_embd=32, n_head=2, rotary_dim=8, n_positions=64, vocab_size=64),
                 "real", {0: 2, 1: 2}),
        "phi": (tf.PhiConfig(**{**SMALL, "num_key_value_heads": 4}, partial_rotary_factor=0.5), "real", {0: 2, 1: 2}),
        "deepseek_v3": (tf.DeepseekV3Config(**{**SMALL, "num_key_value_heads": 4}, kv_lora_rank=16, q_lora_rank=16,
                                            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4,
                                            num_experts_per_tok=2, first_k_dense_replace=2,
                                            moe_intermediate_size=16), "real", {0: 2, 1: 2}),
        # no_rope_layers: 1 = RoPE, 0 = NoPE; layer 1 has no rotation
        "llama4_text": (tf.Llama4TextConfig(**SMALL, head_dim=8, num_local_experts=2, interleave_moe_layer_step=2,
                                            no_rope_layers=[1, 0], intermediate_size_mlp=64), "complex", {0: 2}),
        "smollm3": (tf.SmolLM3Config(**SMALL, no_rope_layers=[0, 1]), "real", {1: 2}),
    }


@pytest.mark.parametrize("family", ["llama", "gptj", "phi", "deepseek_v3", "llama4_text", "smollm3"])
def test_transformers_models_per_layer(family):
    config, form, per_layer = _configs()[family]
    census = _hf(config)
    assert census.by_layer() == per_layer, census.as_text()
    assert {s.form for s in census.sites} == {form}
    assert all(".self_attn" in s.module_path or ".attn" in s.module_path for s in census.sites), census.as_text()


def test_cos_sin_handed_in_as_inputs_are_recognised_as_a_pair():
    """An attention layer called alone gets (cos, sin) from outside: leaves paired numerically."""
    tf = pytest.importorskip("transformers")
    model = tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(**SMALL), attn_implementation="eager").eval()
    hidden = torch.randn(2, 6, 32)
    cos, sin = model.model.rotary_emb(hidden, torch.arange(6).expand(2, 6))
    attention = model.model.layers[0].self_attn
    census = count_rotations(attention, (), dict(hidden_states=hidden, position_embeddings=(cos, sin),
                                                 attention_mask=None))
    assert census.total == 2
    # the same layer with (cos, sin) that are not a pair: no rotation
    census = count_rotations(attention, (), dict(hidden_states=hidden, position_embeddings=(cos, cos * 0.5),
                                                 attention_mask=None))
    assert census.total == 0


def test_pairs_copied_into_slices_of_one_tensor_count_once():
    class SliceCopy(torch.nn.Module):
        def forward(self, x, pos):
            a = rb.angles(pos)[:, :, None, :]
            cos, sin = a.cos(), a.sin()
            x1, x2 = x[..., 0::2], x[..., 1::2]
            out = torch.empty_like(x)
            out[..., 0::2] = x1 * cos - x2 * sin
            out[..., 1::2] = x1 * sin + x2 * cos
            return out

    x = torch.randn(2, 5, 4, rb.D)
    census = count_rotations(SliceCopy(), (x, torch.arange(5).expand(2, 5)))
    assert census.total == 1 and census.sites[0].shape == (2, 5, 4, rb.D)


def test_a_rope_module_shared_by_layers_is_attributed_to_each_calling_layer():
    class Layer(torch.nn.Module):
        def __init__(self, rope):
            super().__init__()
            self.rope = rope

        def forward(self, x, pos):
            return self.rope(x, input_pos=pos)

    rope = rb.torchtune_rope_class()(rb.D, max_seq_len=rb.MAX_POS)
    model = torch.nn.Sequential()
    model.layers = torch.nn.ModuleList([Layer(rope), Layer(rope)])
    model.forward = lambda x, pos: model.layers[1](model.layers[0](x, pos), pos)
    census = count_rotations(model, (torch.randn(2, 5, 4, rb.D), torch.arange(5).expand(2, 5)))
    assert [(s.module_path, s.layer) for s in census.sites] == [("layers.0.rope", 0), ("layers.1.rope", 1)]


def test_rope_exports_own_op_and_its_decomposed_mode_count_the_same():
    from rope_export.presets import load_preset
    from rope_export.presets.export import example_inputs

    preset = load_preset("phi-2").scaled_down()
    block = preset.build_block(cache_len=64)
    inputs = example_inputs(preset, torch.float32, False)
    own = count_rotations(block, inputs)
    for module in block.modules():
        if hasattr(module, "mode"):
            module.mode = "decomposed"
    decomposed = count_rotations(block, inputs)
    assert own.total == decomposed.total == 2
    assert {s.form for s in own.sites} == {"rope_export op"} and {s.form for s in decomposed.sites} == {"real"}


def test_the_module_is_left_as_it_was():
    block = rb.block("torchtune")
    x, pos = rb.example()
    before = block(x, pos)[0]
    count_rotations(block, (x, pos))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in block.modules())
    torch.testing.assert_close(block(x, pos)[0], before, rtol=0, atol=0)


def test_a_failing_forward_is_named():
    with pytest.raises(WitnessError, match="RuntimeError: .*mat1 and mat2"):
        count_rotations(rb.block("torchtune"), (torch.randn(2, 5, 7), torch.arange(5).expand(2, 5)))


def test_census_summaries():
    census = count_rotations(rb.block("rotate_half_table"), rb.example())
    assert isinstance(census, RotationCensus)
    assert census.by_module() == {"rope": 2} and census.by_layer() == {None: 2}
    assert "2 rotation(s)" in census.as_text()
