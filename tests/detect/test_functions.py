"""rope_export.detect.functions: the rotary functions a module's code calls, found, verified, hooked.

The code searched is real: transformers' modeling files, Meta's reference code (tests/rope_blocks),
and the user-style module below, whose rotation is a function of another name, read through a
module attribute, next to a decoy that must never be called.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from rope_export.detect import count_rotations
from rope_export.detect.functions import (
    find_rotary_functions,
    recorded_calls,
    rotary_functions_hooked,
)
from rope_export.exporting.core import custom_translation_table
from rope_export.op.contract import DOMAIN, OP_TYPE
from rope_export.op.tolerances import tolerance

THIS_MODULE = sys.modules[__name__]
TOL = tolerance("op", "float32")
DECOY_CALLS = []


# -- a user's block: the rotation under another name, reached two ways ---------------------------

def spin_pairs(x, c, s):
    """Rotate-half on the whole head, one tensor per call (a name no registry knows)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def decoy(x, c, s):
    """Three tensors in, never called by the block: probing must not call it either."""
    DECOY_CALLS.append(1)
    return x


class UserBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(16, 32), nn.Linear(16, 32)

    def forward(self, x, pos):
        b, s, _ = x.shape
        q, k = self.q(x).view(b, s, 4, 8).transpose(1, 2), self.k(x).view(b, s, 4, 8).transpose(1, 2)
        angles = pos[..., None].float() / (100.0 ** (torch.arange(4) / 4))
        c, s_ = angles.cos()[:, None], angles.sin()[:, None]
        q = THIS_MODULE.spin_pairs(q, c, s_)  # read through a module attribute
        k = spin_pairs(k, c, s_)
        return q.transpose(1, 2).flatten(2) @ k.transpose(1, 2).flatten(2).transpose(1, 2)


def example():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(2, 5, 16, generator=generator), (torch.arange(5) + 3).expand(2, 5).contiguous()


def test_a_function_of_any_name_is_found_verified_and_hooked_where_it_is_read():
    block, args, original = UserBlock().eval(), example(), spin_pairs
    DECOY_CALLS.clear()
    with recorded_calls() as called, torch.no_grad():
        want = block(*args)
    found = find_rotary_functions(block, called=called)
    assert [(f.function, f.form.name) for f in found] == [(spin_pairs, "rotate-half (x, cos, sin; half angles)")]
    assert {site.qualified for site in found[0].sites} == {f"{__name__}.spin_pairs"}
    assert DECOY_CALLS == []  # never ran in the forward, so never probed
    with rotary_functions_hooked(found) as hooked, torch.no_grad():
        assert THIS_MODULE.spin_pairs.__wrapped_original__ is original
        got = block(*args)
    assert hooked.rotations == 2 and TOL.allclose(got, want)
    assert THIS_MODULE.spin_pairs is original


def test_the_hooked_export_has_one_node_per_rotation_the_census_counts():
    block, args = UserBlock().eval(), example()
    census = count_rotations(block, args)
    with rotary_functions_hooked(block) as hooked, torch.no_grad():
        program = torch.onnx.export(block, args, dynamo=True, opset_version=23,
                                    custom_translation_table=custom_translation_table())
    nodes = [n for n in program.model_proto.graph.node if n.domain == DOMAIN and n.op_type == OP_TYPE]
    assert len(nodes) == len(census.plain) == hooked.rotations == 2


def test_the_originals_are_back_after_an_error():
    block = UserBlock().eval()
    original = THIS_MODULE.spin_pairs
    with pytest.raises(RuntimeError, match="boom"), rotary_functions_hooked(block):
        assert THIS_MODULE.spin_pairs is not original
        raise RuntimeError("boom")
    assert THIS_MODULE.spin_pairs is original


def test_functions_held_by_instances_and_namespaces_are_found():
    from rope_blocks import block
    from rope_blocks import example as block_example

    for name, form in (("meta", "complex"), ("glm", "interleaved-cat-angles"),
                       ("nanochat_flipped", "rotate-half-negated")):
        module, args = block(name), block_example()
        with recorded_calls() as called, torch.no_grad():
            want = module(*args)
        found = find_rotary_functions(module, called=called)
        assert [f.form.name for f in found] == [form], name
        with rotary_functions_hooked(found) as hooked, torch.no_grad():
            got = module(*args)
        assert hooked.rotations == 2
        assert all(TOL.allclose(g, w) for g, w in zip(got, want, strict=True)), name


def test_inline_rotations_and_look_alikes_give_no_function():
    from rope_blocks import block
    from rope_blocks import example as block_example

    for name in ("mla", "rotate_half_table", "swiglu", "mismatched_angles", "sinusoidal_added"):
        module = block(name)
        with recorded_calls() as called, torch.no_grad():
            module(*block_example())
        assert find_rotary_functions(module, called=called) == [], name


def test_transformers_model_of_an_unregistered_type_is_found_by_code():
    transformers = pytest.importorskip("transformers")
    from rope_export.hf import build_hf_model

    config = transformers.OlmoConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = build_hf_model(config)
    with recorded_calls() as called, torch.no_grad():
        model(input_ids=torch.zeros(1, 3, dtype=torch.long))
    found = find_rotary_functions(model, called=called)
    assert [(f.qualified, f.form.name) for f in found] == [
        ("transformers.models.olmo.modeling_olmo.apply_rotary_pos_emb", "rotate-half")]
