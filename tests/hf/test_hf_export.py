"""rope_export.hf: transformers models exported with one rotary node per rotated tensor.

Every family is a tiny random-weight model built offline from its config (2 layers, hidden 32).
The exported file is compared with transformers itself (the unhooked model and its own
DynamicCache) for a prefill and a few decode steps; the file is run lowered to ai.onnx
RotaryEmbedding-23 on onnxruntime when rope_export.passes is there, and always also as exported
(custom node) on onnx.reference with our OpRun.
"""

from __future__ import annotations

import argparse
import functools
import json
import re

import numpy as np
import onnx
import pytest
import torch
from onnx.reference import ReferenceEvaluator

transformers = pytest.importorskip("transformers")

from transformers.cache_utils import DynamicCache  # noqa: E402

from rope_export import cli, hf  # noqa: E402
from rope_export.cli.export import wants_hf_export  # noqa: E402
from rope_export.cli.export_hf import run_hf_export  # noqa: E402
from rope_export.exporting import core as export_core  # noqa: E402
from rope_export.op.contract import DOMAIN, OP_TYPE  # noqa: E402
from rope_export.op.onnx_op import RotaryEmbedding  # noqa: E402
from rope_export.op.rope_types import build_caches  # noqa: E402
from rope_export.op.tolerances import tolerance  # noqa: E402

TOL = tolerance("block", "float32")
LAYERS = 2
COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
              max_position_embeddings=128, pad_token_id=None, bos_token_id=None, eos_token_id=None)


def _rope(rope_type="default", **extra):
    return {"rope_type": rope_type, "rope_theta": 10000.0, **extra}


# One config per family whose rotation differs. GPT-J keeps n_positions <= 32: onnx.reference's
# GatherElements (np.choose) cannot index more than 63 rows.
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON, num_key_value_heads=2,
                                              rope_parameters=_rope("llama3", factor=8.0, low_freq_factor=1.0,
                                                                    high_freq_factor=4.0,
                                                                    original_max_position_embeddings=16)),
    "mistral": lambda: transformers.MistralConfig(**COMMON, num_key_value_heads=2, sliding_window=None),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, num_key_value_heads=2),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, num_key_value_heads=2, head_dim=8),
    "gemma": lambda: transformers.GemmaConfig(**COMMON, num_key_value_heads=1, head_dim=8),
    "phi": lambda: transformers.PhiConfig(**COMMON, num_key_value_heads=4,
                                          rope_parameters=_rope(partial_rotary_factor=0.5)),
    "phi3": lambda: transformers.Phi3Config(**COMMON, num_key_value_heads=2, original_max_position_embeddings=32,
                                            rope_parameters=_rope("longrope", partial_rotary_factor=0.5,
                                                                  short_factor=[1.0, 1.5], long_factor=[2.0, 4.0],
                                                                  original_max_position_embeddings=32)),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(**COMMON, rope_parameters=_rope(partial_rotary_factor=0.25)),
    "gptj": lambda: transformers.GPTJConfig(vocab_size=64, n_embd=32, n_layer=LAYERS, n_head=4, n_positions=32,
                                            rotary_dim=4, bos_token_id=None, eos_token_id=None),
    # Llama 4 (text): Meta-style complex RoPE inside transformers; layer 1 is a NoPE layer (no rotation).
    "llama4": lambda: transformers.Llama4TextConfig(**COMMON, intermediate_size_mlp=64, num_key_value_heads=2,
                                                    head_dim=8, num_local_experts=2, no_rope_layers=[1, 0]),
    "qwen2_vl": lambda: transformers.Qwen2VLConfig(
        text_config=dict(**COMMON, num_key_value_heads=2, rope_parameters=_rope(mrope_section=[1, 1, 2])),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=1, patch_size=2,
                           spatial_merge_size=1, temporal_patch_size=1),
    ),
}
PREFILL = {"phi3": 30}


def one_layer(config):
    """The same config with one decoder layer: for the tests that are not about every layer."""
    text = config.get_text_config(decoder=True)
    text.num_hidden_layers = 1
    if hasattr(text, "layer_types") and text.layer_types:
        text.layer_types = text.layer_types[:1]
    return config  # Phi-3: prefill below original_max_position_embeddings=32, decode crosses it (longrope)


@functools.cache
def tiny_model(family: str, dtype: str = "fp32"):
    return hf.build_hf_model(CONFIGS[family](), dtype=dtype, seed=0)


@functools.cache
def exported(family: str) -> hf.HFExportResult:
    return hf.export_hf(tiny_model(family))


def runner(model: onnx.ModelProto):
    """Run the file lowered to ai.onnx (onnxruntime) if rope_export.passes has lower(), else as exported."""
    try:
        from rope_export.passes import lower
    except ImportError:
        return reference_runner(model)
    import onnxruntime as ort

    session = ort.InferenceSession(lower(model, "onnx").SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    return lambda inputs: session.run(None, dict(zip(names, inputs, strict=True)))


def reference_runner(model: onnx.ModelProto):
    evaluator = ReferenceEvaluator(model, new_ops=[RotaryEmbedding])
    names = [i.name for i in model.graph.input]
    return lambda inputs: evaluator.run(None, dict(zip(names, inputs, strict=True)))


def positions(family: str, batch: int, start: int, length: int) -> torch.Tensor:
    """[B, S], or for Qwen2-VL (3, B, S) with three *different* rows (temporal, height, width)."""
    p = torch.arange(start, start + length).expand(batch, length)
    if hf.HF_FAMILIES[family].position_rank == 3:
        p = torch.stack((p, p // 2, p % 3 + p // 3))
    return p.contiguous()


def empty_past(model: onnx.ModelProto, batch: int) -> list[np.ndarray]:
    dims = model.graph.input[2].type.tensor_type.shape.dim
    return [np.zeros((batch, dims[1].dim_value, 0, dims[3].dim_value), np.float32) for _ in model.graph.input[2:]]


def assert_close(got, want, what):
    got, want = np.asarray(got, np.float32), want.float().numpy()
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert TOL.allclose(got, want), f"{what}: max error {np.abs(got - want).max():.3g}"


def generate_and_compare(family: str, onnx_model: onnx.ModelProto, run, steps: int = 3, batch: int = 2):
    """Prefill then ``steps`` greedy decode steps; the file and transformers must agree at each one."""
    model = tiny_model(family)
    generator = torch.Generator().manual_seed(1)
    prefill = PREFILL.get(family, 6)
    ids = torch.randint(0, 64, (batch, prefill), generator=generator)
    cache, past, start = DynamicCache(), empty_past(onnx_model, batch), 0
    for step in range(steps + 1):
        pos = positions(family, batch, start, ids.shape[1])
        with torch.no_grad():
            want = hf.with_cache(model, cache, input_ids=ids, position_ids=pos).logits
        out = run([ids.numpy(), pos.numpy(), *past])
        assert_close(out[0], want, f"{family} step {step} logits")
        past = out[1:]
        start += ids.shape[1]
        ids = want[:, -1:].argmax(-1)
    for i, layer in enumerate(cache.layers):
        assert_close(past[2 * i], layer.keys, f"{family} layer {i} keys")
        assert_close(past[2 * i + 1], layer.values, f"{family} layer {i} values")


# -- every family ----------------------------------------------------------------------------

def rotated_layers(family: str) -> int:
    return 1 if family == "llama4" else LAYERS  # Llama 4's layer 1 is NoPE


@pytest.mark.parametrize("family", list(CONFIGS))
def test_family_exports_one_node_per_rotated_tensor_and_matches_transformers(family):
    result = exported(family)
    model = result.model
    onnx.checker.check_model(model, full_check=True)
    rotary = [n for n in model.graph.node if n.domain == DOMAIN and n.op_type == OP_TYPE]
    assert len(rotary) == 2 * rotated_layers(family), f"{family}: {len(rotary)} rotary nodes, want q and k per layer"
    assert result.notes == []
    ops = [n.op_type for n in model.graph.node]
    assert "Neg" not in ops, "a rotate-half / rotate_every_two remnant survived the export"
    want_interleaved = int(family in ("gptj", "llama4"))
    assert {a.i for n in rotary for a in n.attribute if a.name == "interleaved"} == {want_interleaved}
    names = [i.name for i in model.graph.input]
    assert names[:3] == ["input_ids", "position_ids", "past_key_values.0.key"]
    assert [o.name for o in model.graph.output][:2] == ["logits", "present.0.key"]
    summary = export_core.summarize(model)
    assert summary["inputs"]["input_ids"] == ["batch", "seq"]
    assert summary["inputs"]["past_key_values.1.value"][::2] == ["batch", "past"]
    assert summary["outputs"]["present.0.key"][::2] == ["batch", "past+seq"]
    generate_and_compare(family, model, runner(model))


@pytest.mark.parametrize("family", ["llama", "gptj", "qwen2_vl", "phi3"])
def test_file_as_exported_runs_on_onnx_reference(family):
    """The custom-node file itself (no lowering), through rope_export's onnx.reference kernel."""
    model = exported(family).model
    generate_and_compare(family, model, reference_runner(model), steps=1)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_metadata_rope_parameters_rebuild_transformers_cos_sin(family):
    model = tiny_model(family)
    meta = hf.read_hf_metadata(exported(family).model)
    assert meta["kind"] == "hf-causal-lm" and meta["hf_family"] == family and meta["decode"]
    assert meta["hf_config"]["model_type"] == model.config.model_type
    rope = meta["rope"]
    cos_cache, sin_cache = build_caches(rope, 32)
    pos = torch.arange(20).expand(2, 20)
    half = rope.rotary_embedding_dim // 2
    with torch.no_grad():  # what the decoder hands its attention layers
        embeddings = hf.position_embeddings(model, torch.zeros(1, dtype=torch.float32), pos)
    if embeddings is None:  # GPT-J before transformers 5.24: its attention gathered sin|cos itself
        pytest.skip(f"{family}: no rotary module in transformers {transformers.__version__}")
    if family == "gptj":  # GPT-J: sin and cos [B, S, rd/2] from its sin|cos table, pairs interleaved
        assert rope.interleaved and rope.rotary_dim == 4
        sin, cos = embeddings
    elif family == "llama4":  # complex freqs_cis [B, S, D/2]
        assert rope.interleaved
        cos, sin = embeddings.real, embeddings.imag
    else:
        assert not rope.interleaved
        cos, sin = embeddings
        assert cos.shape[-1] == 2 * half  # transformers' cat(freqs, freqs)
        cos, sin = cos[..., :half], sin[..., :half]
    op_tol = tolerance("op", "float32")
    assert op_tol.allclose(cos, cos_cache[pos]) and op_tol.allclose(sin, sin_cache[pos]), family
    expected_rd = {"phi": 4, "phi3": 4, "gpt_neox": 2, "gptj": 4}.get(family, 8)
    assert rope.rotary_embedding_dim == expected_rd
    assert meta["rope_extra"] == ({"mrope_section": [1, 1, 2]} if family == "qwen2_vl" else {})
    assert meta["position_ids_rank"] == ("3" if family == "qwen2_vl" else "2")
    props = {p.key for p in exported(family).model.metadata_props}
    for key in ("version", "dtype", "seed", "cache_len", "decode", "out_of_range_positions", "rope"):
        assert export_core.METADATA_PREFIX + key in props  # the preset files' keys, where they fit


def test_rope_types_map_from_rope_parameters():
    llama = hf.rope_config_from_hf(CONFIGS["llama"]())[0]
    assert (llama.rope_type, llama.factor, llama.original_max_position_embeddings) == ("llama3", 8.0, 16)
    phi3 = hf.rope_config_from_hf(CONFIGS["phi3"]())[0]
    assert phi3.rope_type == "longrope" and phi3.seq_len_dependent and phi3.long_factor == (2.0, 4.0)
    neox = hf.rope_config_from_hf(CONFIGS["gpt_neox"]())[0]
    assert neox.partial_rotary_factor == 0.25 and neox.rotary_embedding_dim == 2


# -- a single attention layer ----------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "gptj"])
def test_attention_layer_export_matches_the_layer_inside_transformers(family):
    model = tiny_model(family)
    result = hf.export_hf(model, layer=1)
    assert result.kind == "hf-attention" and result.custom_nodes == 2
    assert [i.name for i in result.model.graph.input] == list(export_core.INPUT_NAMES)
    assert hf.read_hf_metadata(result.model)["layer"] == 1
    attention = hf.attention_layers(model)[1]
    seen = {}

    def grab_input(module, args, kwargs):
        seen["hidden"] = (args[0] if args else kwargs["hidden_states"]).clone()

    def grab_output(module, args, kwargs, output):
        seen["output"] = output[0].clone()

    cache = DynamicCache()
    with torch.no_grad():
        hf.with_cache(model, cache, input_ids=torch.randint(0, 64, (2, 5)), position_ids=positions(family, 2, 0, 5))
        past_key, past_value = cache.layers[1].keys.clone(), cache.layers[1].values.clone()
        hooks = [attention.register_forward_pre_hook(grab_input, with_kwargs=True),
                 attention.register_forward_hook(grab_output, with_kwargs=True)]
        try:
            pos = positions(family, 2, 5, 3)
            hf.with_cache(model, cache, input_ids=torch.randint(0, 64, (2, 3)), position_ids=pos)
        finally:
            for h in hooks:
                h.remove()
    run = runner(result.model)
    out, key, value = run([seen["hidden"].numpy(), pos.numpy(), past_key.numpy(), past_value.numpy()])
    assert_close(out, seen["output"], "layer output")
    assert_close(key, cache.layers[1].keys, "present_key")
    assert_close(value, cache.layers[1].values, "present_value")


# -- the hook is contained and reversible ----------------------------------------------------

def _snapshot(model):
    return [(m, dict(vars(m)), dict(m._buffers), {k: v.clone() for k, v in m._buffers.items() if v is not None})
            for m in model.modules()]


def _assert_unchanged(model, snapshot):
    for module, attrs, buffers, values in snapshot:
        assert vars(module).keys() == attrs.keys(), f"{type(module).__name__}: attributes added or removed"
        assert all(vars(module)[k] is v for k, v in attrs.items()), f"{type(module).__name__}: attribute rebound"
        assert all(module._buffers[k] is v for k, v in buffers.items())
        assert all(torch.equal(module._buffers[k], v) for k, v in values.items())


def _logits(model, family="llama"):
    ids = torch.arange(12).remainder(64).view(2, 6)
    with torch.no_grad():
        return model(input_ids=ids, position_ids=positions(family, 2, 0, 6)).logits


@pytest.mark.parametrize("family", ["llama", "gptj", "phi3"])
def test_hook_routes_through_the_op_and_restores_the_function(family):
    import sys

    model = tiny_model(family)
    module = sys.modules[type(model).__module__]  # the family's modeling file
    original = module.apply_rotary_pos_emb
    before = _logits(model, family)
    with hf.rotary_hooked(model) as state:
        assert module.apply_rotary_pos_emb is not original
        assert state.target == f"{module.__name__}.apply_rotary_pos_emb"
        assert state.probe_error < 1e-5
        hooked = _logits(model, family)
        assert state.rotations == 2 * LAYERS  # q and k of every layer went through the op
    assert module.apply_rotary_pos_emb is original
    assert TOL.allclose(hooked, before)
    assert torch.equal(_logits(model, family), before)
    with pytest.raises(RuntimeError, match="boom"), hf.rotary_hooked(model):
        raise RuntimeError("boom")
    assert module.apply_rotary_pos_emb is original


def test_failed_export_leaves_the_model_as_it_was():
    """A real export that fails after tracing (inside the hook): everything is restored."""
    import transformers.models.phi3.modeling_phi3 as phi3_module

    # longrope: transformers' rotary module sets attributes on itself in forward
    model = hf.build_hf_model(one_layer(CONFIGS["phi3"]()), seed=3)
    original = phi3_module.apply_rotary_pos_emb
    _logits(model, "phi3")  # let transformers make its own lazy attributes first
    before, snapshot = _logits(model, "phi3"), _snapshot(model)
    with pytest.raises(hf.HFExportError, match="fixed seq of 1"):
        hf.export_hf(model, example=(2, 1, 3))  # torch.export fixes seq=1: refused after the trace
    assert phi3_module.apply_rotary_pos_emb is original
    _assert_unchanged(model, snapshot)
    assert torch.equal(_logits(model, "phi3"), before)


def test_successful_export_leaves_the_model_as_it_was():
    model = tiny_model("phi3")
    _logits(model, "phi3")
    before, snapshot = _logits(model, "phi3"), _snapshot(model)
    hf.export_hf(model, layer=0)
    _assert_unchanged(model, snapshot)
    assert torch.equal(_logits(model, "phi3"), before)


# -- families rope-export does not know ------------------------------------------------------

ONE_LAYER = {**COMMON, "num_hidden_layers": 1}


def _olmo():
    return hf.build_hf_model(transformers.OlmoConfig(**ONE_LAYER, num_key_value_heads=2), seed=0)


def test_a_type_rope_export_has_no_entry_for_exports_by_default_through_its_own_function():
    import transformers.models.olmo.modeling_olmo as olmo_module

    model = _olmo()
    assert model.config.model_type not in hf.MODEL_TYPES
    result = hf.export_hf(model)
    assert result.custom_nodes == result.rotations == 2 and result.notes == []
    assert result.hook.startswith("transformers.models.olmo.modeling_olmo.apply_rotary_pos_emb -> ")
    assert olmo_module.apply_rotary_pos_emb.__module__ == olmo_module.__name__  # restored
    props = {p.key: p.value for p in result.model.metadata_props}
    assert props["rope_export.rotations_eager"] == props["rope_export.rotary_nodes"] == "2"
    assert json.loads(props["rope_export.rope"])["head_dim"] == 8  # rope_parameters read the common way
    check_against_transformers(model, result.model)


def test_overrides_plain_and_fuse_say_what_they_did():
    model = _olmo()
    with pytest.warns(UserWarning, match="2 of 2 rotation"):
        plain = hf.export_hf(model, fallback="plain", opset=18)  # opset 18: torch.onnx writes no RotaryEmbedding
    assert plain.custom_nodes == 0 and "plain export" in plain.hook
    assert any("stayed decomposed" in note for note in plain.notes)
    check_against_transformers(model, plain.model)
    standard = hf.export_hf(model, fallback="plain")  # opset 23: torch.onnx's own ai.onnx nodes, counted as such
    assert standard.custom_nodes == 0 and len(hf_exporting_standard_nodes(standard.model)) == 2
    assert standard.notes == []
    fused = hf.export_hf(model, fallback="fuse")  # no hook: the traced graph is fused
    assert fused.custom_nodes == 2 and fused.hook.startswith("none (no rotary function verified)")
    assert any("rope_export.passes.fuse made 2 rotary node(s)" in note for note in fused.notes)
    assert not hf_exporting_standard_nodes(fused.model)
    onnx.checker.check_model(fused.model, full_check=True)
    check_against_transformers(model, fused.model)


def hf_exporting_standard_nodes(model):
    return [n for n in model.graph.node if n.op_type == OP_TYPE and n.domain in ("", "ai.onnx")]


def test_a_rotation_left_decomposed_is_an_error_naming_its_layer():
    from rope_export.detect import DecomposedRotationError
    from rope_export.hf.counting import count_and_compare, eager_rotations

    model = _olmo()
    plain = hf.export_hf(model, fallback="plain", allow_decomposed=True, opset=18).model
    layout = hf.cache_layout(model)
    census = eager_rotations(hf.CausalLMWithCache(model, layout), hf.hf_example_inputs(model, layout=layout))
    with pytest.raises(DecomposedRotationError, match=r"2 of 2 rotation\(s\) stayed decomposed(.|\n)*layers\.0"):
        count_and_compare(census, plain, allow_decomposed=False, notes=[])


def test_forced_family_hooks_the_models_own_module_after_checking_it():
    import transformers.models.olmo.modeling_olmo as olmo_module

    model = _olmo()
    result = hf.export_hf(model, family="llama")
    assert result.custom_nodes == 2 and result.family.name == "olmo (as llama)"
    assert result.hook.startswith("transformers.models.olmo.modeling_olmo.apply_rotary_pos_emb")
    assert not hasattr(olmo_module.apply_rotary_pos_emb, "__wrapped_original__")
    check_against_transformers(model, result.model)
    # Cohere rotates interleaved pairs under Llama's signature: the numerical check refuses it.
    cohere = hf.build_hf_model(transformers.CohereConfig(**ONE_LAYER, num_key_value_heads=2))
    with pytest.raises(hf.HFExportError, match="does not reproduce .*modeling_cohere.apply_rotary_pos_emb"):
        hf.export_hf(cohere, family="llama")


def check_against_transformers(model, onnx_model):
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(5).expand(2, 5).contiguous()
    with torch.no_grad():
        want = model(input_ids=ids, position_ids=pos).logits
    out = reference_runner(onnx_model)([ids.numpy(), pos.numpy(), *empty_past(onnx_model, 2)])
    assert_close(out[0], want, "logits")


# -- half precision --------------------------------------------------------------------------

def test_fp16_file_has_fp16_io_and_matches_transformers_fp16():
    model = hf.build_hf_model(one_layer(CONFIGS["llama"]()), dtype="fp16", seed=0)
    result = hf.export_hf(model)
    assert result.custom_nodes == 2
    kinds = {v.name: v.type.tensor_type.elem_type for v in [*result.model.graph.input, *result.model.graph.output]}
    assert kinds["past_key_values.0.key"] == kinds["logits"] == onnx.TensorProto.FLOAT16
    assert hf.read_hf_metadata(result.model)["dtype"] == "fp16"
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(4))
    pos = torch.arange(6).expand(2, 6).contiguous()
    with torch.no_grad():
        want = model(input_ids=ids, position_ids=pos).logits
    past = [p.astype(np.float16) for p in empty_past(result.model, 2)]
    got = runner(result.model)([ids.numpy(), pos.numpy(), *past])[0]
    assert tolerance("block", "float16").allclose(got, want.float().numpy())


# -- offline loading and the CLI -------------------------------------------------------------

def export_parser() -> argparse.ArgumentParser:
    """The real command line (``export`` carries the --hf arguments)."""
    return cli.build_parser()


def test_cli_exports_a_local_config_with_local_weights(tmp_path, capsys):
    model = hf.build_hf_model(one_layer(CONFIGS["qwen2"]()), seed=11)
    model.save_pretrained(tmp_path / "weights")
    config_file = tmp_path / "my-config.json"
    config_file.write_text(model.config.to_json_string())
    out = tmp_path / "qwen2.onnx"
    args = export_parser().parse_args(
        ["export", "--hf", str(config_file), "--weights", str(tmp_path / "weights"), "-o", str(out)]
    )
    assert wants_hf_export(args) and run_hf_export(args) == 0
    printed = capsys.readouterr().out
    assert "rope_export::RotaryEmbedding nodes" in printed and "qwen2" in printed
    assert re.search(r"rotations in eager transformers\s*│\s*2\b", printed)  # both counts in the summary
    onnx_model = onnx.load_model(out)
    assert export_core.count_rotary_nodes(onnx_model) == 2
    meta = hf.read_hf_metadata(onnx_model)
    assert meta["hf_weights"] == str(tmp_path / "weights")
    check_against_transformers(model, onnx_model)  # the saved weights, not fresh random ones


def test_cli_rejects_options_that_do_not_fit():
    parser = export_parser()
    args = parser.parse_args(["export", "--hf", "x.json", "--cache-len", "64", "-o", "x.onnx"])
    with pytest.raises(hf.HFExportError, match="--cache-len does not apply to --hf"):
        run_hf_export(args)
    args = parser.parse_args(["export", "--weights", "w", "-o", "x.onnx"])
    assert wants_hf_export(args)
    with pytest.raises(hf.HFExportError, match="need --hf"):
        run_hf_export(args)
    assert not wants_hf_export(parser.parse_args(["export", "--preset", "tiny", "-o", "x.onnx"]))


def test_config_errors_are_clear(tmp_path):
    with pytest.raises(hf.HFExportError, match="no such file or folder"):
        hf.load_hf_config(tmp_path / "missing")
    with pytest.raises(hf.HFExportError, match="has no config.json"):
        hf.load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(CONFIGS["llama"]().to_json_string())
    assert hf.load_hf_config(tmp_path).model_type == "llama"
    with pytest.raises(hf.HFExportError, match="not a folder"):
        hf.build_hf_model(tmp_path, tmp_path / "nope")
    with pytest.raises(hf.HFExportError, match="fallback must be one of"):
        hf.export_hf(tiny_model("llama"), fallback="maybe")
    with pytest.raises(hf.HFExportError, match="unknown family 'bert'"):
        hf.family_of(tiny_model("llama"), "bert")
