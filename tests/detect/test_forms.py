"""rope_export.detect.forms: every form is verified against the real code that writes it.

The independent references are transformers' own rotary functions (one per way of writing RoPE
in the installed transformers), Meta's reference ``apply_rotary_emb`` when llama-models is
installed, and look-alikes that are not rotations. Each function must verify as exactly its form;
the replacement must then reproduce it on inputs the probe never saw, and export as one rotary
node per rotated tensor.
"""

from __future__ import annotations

import importlib

import numpy as np
import onnx
import pytest
import torch

from rope_export.detect.forms import FORMS, WRITTEN_FORMS, probe, replacement_call
from rope_export.exporting.core import custom_translation_table
from rope_export.op.contract import DOMAIN, OP_TYPE
from rope_export.op.tolerances import tolerance

pytest.importorskip("transformers")

OP_TOL = tolerance("op", "float32")

# (transformers model, function) -> the form it is written in
TRANSFORMERS_FUNCTIONS = {
    ("llama", "apply_rotary_pos_emb"): "rotate-half",
    ("phi3", "apply_rotary_pos_emb"): "rotate-half",  # partial inside the function
    ("gpt_neox", "apply_rotary_pos_emb"): "rotate-half",
    ("gemma3n", "apply_rotary_pos_emb"): "rotate-half-one",
    ("gpt_oss", "apply_rotary_pos_emb"): "rotate-half-half-angles",
    ("nanochat", "apply_rotary_pos_emb"): "rotate-half-negated",
    ("glm", "apply_rotary_pos_emb"): "interleaved-cat-angles",
    ("helium", "apply_rotary_pos_emb"): "interleaved-cat-angles",
    ("ernie4_5", "apply_rotary_pos_emb"): "interleaved-cat-angles",
    ("cohere", "apply_rotary_pos_emb"): "interleaved-repeat-angles",
    ("deepseek_v3", "apply_rotary_pos_emb_interleave"): "interleaved-to-half-order",
    ("gptj", "apply_rotary_pos_emb"): "interleaved-one",
    ("deepseek_v4", "apply_rotary_pos_emb"): "interleaved-one-trailing",
    ("llama4", "apply_rotary_emb"): "complex",
    ("deepseek_v2", "apply_rotary_emb"): "complex",
}


def transformers_function(model: str, name: str):
    return getattr(importlib.import_module(f"transformers.models.{model}.modeling_{model}"), name)


def verified_forms(function) -> list[str]:
    return [name for name, form in FORMS.items() if probe(form, function) is not None]


@pytest.mark.parametrize(("model", "name"), list(TRANSFORMERS_FUNCTIONS))
def test_each_transformers_function_verifies_as_its_form_only(model, name):
    assert verified_forms(transformers_function(model, name)) == [TRANSFORMERS_FUNCTIONS[model, name]]


def test_every_written_form_is_written_by_some_transformers_function():
    assert set(TRANSFORMERS_FUNCTIONS.values()) == {f.name for f in WRITTEN_FORMS}


# -- the replacement on inputs the probe never saw ---------------------------------------------

def _angles(form, batch, seq, half, generator):
    theta = torch.rand(batch, seq, half, generator=generator) * 300
    if form.angles == "complex":
        return (torch.polar(torch.full_like(theta, 1.1), theta),)
    full = {"cat": torch.cat((theta, theta), -1), "repeat": theta.repeat_interleave(2, -1), "half": theta}[form.angles]
    cos, sin = 1.1 * full.cos(), 1.1 * full.sin()
    return (sin, cos) if form.convention.angles == (2, 1) else (cos, sin)


def _call_args(form, layout, head_dim, rotary_dim, generator):
    """Positional arguments of a call of this form: [B=3, heads, S=5, D] tensors (6 and 3 heads)."""
    shapes = [(3, h, 5, head_dim) if layout == "bhsd" else (3, 5, h, head_dim) for h in (6, 3)]
    tensors = [torch.randn(s, generator=generator) for s in shapes[: form.tensors_per_call]]
    args = [None] * form.convention.arity
    for position, tensor in zip(form.convention.tensors, tensors, strict=False):
        args[position] = tensor
    for position, angle in zip(sorted(form.convention.angles), _angles(form, 3, 5, rotary_dim // 2, generator),
                               strict=True):
        args[position] = angle
    return args


@pytest.mark.parametrize(("model", "name"), list(TRANSFORMERS_FUNCTIONS))
def test_replacement_reproduces_the_function_on_new_shapes(model, name):
    original = transformers_function(model, name)
    result = probe(FORMS[TRANSFORMERS_FUNCTIONS[model, name]], original)
    form, generator = result.form, torch.Generator().manual_seed(7)
    layout = result.fixed_layout or "bhsd"
    for head_dim, rotary_dim in ((16, 16), (24, 16)):
        args = _call_args(form, layout, head_dim, rotary_dim, generator)
        try:
            want = original(*args)
        except RuntimeError:
            assert head_dim != rotary_dim, "the whole-head call must work"
            continue  # this function leaves partial rotation to its caller
        got = replacement_call(form, args, {}, layout)
        want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape and OP_TOL.allclose(g, w), f"{model}.{name} D={head_dim} rd={rotary_dim}"


class _Calls(torch.nn.Module):
    """Calls a rotary function's replacement on its inputs: what the hook puts in a model's forward."""

    def __init__(self, form, layout):
        super().__init__()
        self.form, self.layout = form, layout

    def forward(self, *args):
        return replacement_call(self.form, list(args), {}, self.layout)


@pytest.mark.parametrize("form_name", ["rotate-half", "interleaved-to-half-order", "interleaved-one-trailing",
                                       "complex", "rotate-half-negated"])
def test_replacement_exports_one_node_per_tensor_and_matches(form_name):
    model, name = next(k for k, v in TRANSFORMERS_FUNCTIONS.items() if v == form_name)
    original = transformers_function(model, name)
    result = probe(FORMS[form_name], original)
    layout = result.fixed_layout or "bhsd"
    args = _call_args(result.form, layout, 16, 16 if form_name != "interleaved-one-trailing" else 8,
                      torch.Generator().manual_seed(3))
    if result.form.angles == "complex":  # torch.onnx exports no complex tensors: hand it view_as_real
        args[2] = torch.view_as_real(args[2])
    with torch.no_grad():
        program = torch.onnx.export(_Calls(result.form, layout), tuple(args), dynamo=True, opset_version=23,
                                    custom_translation_table=custom_translation_table())
    onnx_model = program.model_proto
    nodes = [n for n in onnx_model.graph.node if n.domain == DOMAIN and n.op_type == OP_TYPE]
    assert len(nodes) == result.form.tensors_per_call
    from onnx.reference import ReferenceEvaluator

    from rope_export.op.onnx_op import RotaryEmbedding

    names = [i.name for i in onnx_model.graph.input]
    got = ReferenceEvaluator(onnx_model, new_ops=[RotaryEmbedding]).run(
        None, dict(zip(names, [a.numpy() for a in args], strict=True)))
    if result.form.angles == "complex":
        args[2] = torch.view_as_complex(args[2])
    want = original(*args)
    want = want if isinstance(want, tuple) else (want,)
    for g, w in zip(got, want, strict=True):
        assert OP_TOL.allclose(g, w.numpy()), f"{form_name}: {np.abs(g - w.numpy()).max():.3g}"
    onnx.checker.check_model(onnx_model, full_check=True)


# -- look-alikes are not rotations -------------------------------------------------------------

def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def no_rotation(q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + q * sin, k * cos + k * sin


def cos_sin_swapped(q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * sin + _rotate_half(q) * cos, k * sin + _rotate_half(k) * cos


def scaled_rotation(q, k, cos, sin, unsqueeze_dim=1):  # xPos-like: not plain RoPE
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    scale = torch.linspace(0.5, 1.5, q.shape[-1])
    return (q * cos + _rotate_half(q) * sin) * scale, (k * cos + _rotate_half(k) * sin) * scale


def q_only(q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_half(q) * sin, k


def gated_mlp(x, gate, up):  # three tensors, like (x, cos, sin): SwiGLU-ish
    return torch.nn.functional.silu(x * gate) * up


@pytest.mark.parametrize("function", [no_rotation, cos_sin_swapped, scaled_rotation, q_only, gated_mlp])
def test_look_alikes_verify_as_no_form(function):
    assert verified_forms(function) == []


def test_meta_reference_apply_rotary_emb_verifies_as_complex():
    from rope_blocks import meta_reference  # Meta's llama_models/llama3/model.py, from the installed file

    assert verified_forms(meta_reference().apply_rotary_emb) == ["complex"]


@pytest.mark.parametrize("unsqueeze_dim,shape", [(0, (6, 16)), (1, (1, 6, 16))], ids=["pixtral-[S,D]", "[1,S,D]"])
def test_tables_shared_by_the_batch_give_the_callers_rotation(unsqueeze_dim, shape):
    """Pixtral calls apply_rotary_pos_emb(..., unsqueeze_dim=0) with cos [S, D]; transformers' LMs may pass
    cos [1, S, D] at batch 2: the replacement equals transformers' own function on both."""
    from transformers.models.pixtral.modeling_pixtral import apply_rotary_pos_emb


    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 4, 6, 16, generator=g), torch.randn(2, 2, 6, 16, generator=g)
    theta = torch.rand(6, 8, generator=g) * 6
    cos, sin = torch.cat((theta, theta), -1).cos().reshape(shape), torch.cat((theta, theta), -1).sin().reshape(shape)
    got = replacement_call(FORMS["rotate-half"], [q, k, cos, sin], {"unsqueeze_dim": unsqueeze_dim}, None)
    want = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    for g_, w in zip(got, want, strict=True):
        torch.testing.assert_close(g_, w, rtol=1e-5, atol=1e-5)
