"""rope_export.hf.stamping (and exporting.stamping, hf.layer_proof): the default ``export_hf``, per-kind,
against the full trace.

For every exporting type of the quick zoo (``test_hf_zoo.FAST``) either the per-kind trace ran and
its file has the full trace's rotary nodes and computes the same logits and presents on
onnxruntime (prefill and a decode step: ``hf_zoo.compare_with_transformers`` on both files, and
the two files' outputs side by side), or the full trace ran and the result names why. OLMo (one
kind), Gemma 3 (two kinds) and CodeGen (the fallback) run in ``make test``; the sweep is slow.
A layer that reads a per-layer value structure cannot see (a global table) is caught by the
numeric comparison of each stamped layer with transformers' own.
"""

from __future__ import annotations

import inspect
import json

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

import hf_zoo  # noqa: E402
from test_hf_zoo import FAST, RESULTS  # noqa: E402

from rope_export import hf  # noqa: E402

EXPORTING = [t for t in FAST if RESULTS.get(t, {}).get("status") == "pass"]
# in make test: a dense type with no entry of ours and one that falls back (its layers are no ModuleList named
# "layers"); Gemma 3 (sliding and full layers, 1 + norm weight left unfolded while tracing) is slow: 2 minutes
# on two busy cores
QUICK = {"olmo": "per-kind", "codegen": "full"}


LAYERS = 4  # the zoo's tiny configs have 2 layers: stamping needs 3 or more


def build(model_type: str, layers: int = LAYERS):
    """The zoo's tiny model of the type with ``layers`` decoder layers (its per-layer lists repeated to
    match); 3 where 4 does not build (Gemma 4's per-layer geometry wants its full layers alike)."""
    import torch
    from hf_zoo_configs import tiny_config

    from rope_export.hf.families import text_config

    config = tiny_config(model_type)
    text = text_config(config)
    before = text.num_hidden_layers
    for key, value in list(vars(text).items()):  # per-layer lists (layer_types, mlp_layer_types, no_rope_layers...)
        if isinstance(value, list) and len(value) == before:
            setattr(text, key, (value * layers)[:layers])
    text.num_hidden_layers = layers
    try:
        model = hf.build_hf_model(config, seed=0)
    except Exception as exc:  # noqa: BLE001
        if layers > 3:
            return build(model_type, 3)
        pytest.skip(f"the tiny {model_type} config does not build with {LAYERS} or 3 layers: {type(exc).__name__}")
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # as hf_zoo.build: no zero routers, whose top-k ties either side may break
        for parameter in model.parameters():
            if parameter.numel() > 1 and parameter.is_floating_point() and not parameter.any():
                parameter.copy_(0.5 * torch.randn(parameter.shape, generator=generator))
            elif parameter.is_floating_point():  # every layer's weights its own (norms are all ones at init),
                parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))  # so a mix-up shows
    return model


def _weights(result: hf.HFExportResult) -> list[tuple[int, ...]]:
    return sorted(tuple(t.dims) for t in result.model.graph.initializer if np.prod(t.dims) * 4 > 4096)


def _outputs(result: hf.HFExportResult) -> list[np.ndarray]:
    run = hf_zoo.runner(result.model)
    rank = result.family.position_rank
    rng = np.random.default_rng(3)
    ids = rng.integers(0, hf_zoo.VOCAB, (hf_zoo.BATCH, 3))
    past = [rng.standard_normal(shape).astype(np.float32) for io in result.layout.layers
            for shape in io.shapes(hf_zoo.BATCH, 4)]
    return run([ids, hf_zoo.positions(rank, 4, 3).numpy(), *past])


@pytest.mark.parametrize("model_type", [pytest.param(t, marks=[] if t in QUICK else [pytest.mark.slow])
                                        for t in EXPORTING])
def test_per_kind_equals_the_full_trace_or_names_the_fallback(model_type):
    model = build(model_type)
    stamped = hf.export_hf(model)  # the default
    print(f"{model_type}: {stamped.trace}")  # the sweep's record (pytest -rP) of which path each type takes
    assert stamped.trace.startswith(QUICK.get(model_type, ""))
    if stamped.trace.startswith("full (per-kind not used: "):
        assert len(stamped.trace) > len("full (per-kind not used: )")
        return
    full = hf.export_hf(model, trace="full")
    assert full.trace == "full"
    assert stamped.trace.startswith("per-kind: "), stamped.trace
    assert stamped.custom_nodes == full.custom_nodes == stamped.rotations
    assert stamped.rotations == full.rotations  # the leading layers' census, extended by kind, counts them all
    assert [i.name for i in stamped.model.graph.input] == [i.name for i in full.model.graph.input]
    assert [o.name for o in stamped.model.graph.output] == [o.name for o in full.model.graph.output]
    # the same weights (the two-layer trace keeps equal small constants apart, so those may be more)
    assert _weights(stamped) == _weights(full)
    hf_zoo.compare_with_transformers(model, stamped)
    for a, b in zip(_outputs(full), _outputs(stamped), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


def test_the_cli_says_which_trace_ran(tmp_path, capsys):
    from hf_zoo_configs import tiny_config

    from rope_export.cli import main

    config = tiny_config("olmo")
    config.num_hidden_layers = LAYERS
    (tmp_path / "cfg").mkdir()
    config.save_pretrained(tmp_path / "cfg")
    summary = tmp_path / "summary.json"
    assert main(["export", "--hf", str(tmp_path / "cfg"), "-o", str(tmp_path / "m.onnx"),
                 "--summary-json", str(summary)]) == 0
    trace = json.loads(summary.read_text())["trace"]
    assert trace.startswith("per-kind: 2 of 4 decoder layers traced and counted (1 kind(s)), 2 stamped")
    assert "each stamped layer equal to the model's own (the first of each kind in 2 cases, the others in 1)" in trace
    assert f"trace: {trace}" in capsys.readouterr().out


class _Attention:  # made a subclass of the model's own attention class in the test below
    def forward(self, *args, **kwargs):
        out, weights = super().forward(*args, **kwargs)
        return out * (1.0 + 0.1 * self.layer_idx), weights  # a value per layer: a copy of layer 1 would be wrong


@pytest.mark.slow  # the planted per-layer value below is make test's case of a difference only numbers see
def test_a_forward_that_computes_with_its_layer_index_is_traced_in_full():
    model = build("olmo")
    attention = type(model.model.layers[0].self_attn)
    scaled = type("ScaledByLayerAttention", (_Attention, attention), {"forward": _Attention.forward})
    for layer in model.model.layers:
        layer.self_attn.__class__ = scaled
    result = hf.export_hf(model)
    assert result.trace.startswith("full (per-kind not used: ScaledByLayerAttention.forward reads its layer index"), \
        result.trace
    hf_zoo.compare_with_transformers(model, result)  # the full trace keeps each layer's own factor


def test_the_layer_index_handed_to_the_cache_update_is_no_reason_to_trace_in_full():
    from rope_export.exporting.stamping import layer_index_use

    attention = type(build("olmo").model.layers[0].self_attn)
    assert ".update(key_states, value_states, self.layer_idx" in inspect.getsource(attention.forward)  # handed on
    assert layer_index_use(attention) is None


def test_layers_whose_buffers_differ_are_traced_in_full():
    import torch

    model = build("olmo")
    for i, layer in enumerate(model.model.layers):  # a per-layer constant that is no parameter, read in forward
        layer.mlp.register_buffer("scale", torch.tensor(1.0 + 0.1 * i))
        layer.mlp.forward = (lambda mlp, forward: lambda x: forward(x) * mlp.scale)(layer.mlp, layer.mlp.forward)
    result = hf.export_hf(model)
    assert result.trace == ("full (per-kind not used: layer 1's buffer mlp.scale differs from layer 0's "
                            "(a constant per layer, which a stamped copy would not have))"), result.trace
    hf_zoo.compare_with_transformers(model, result)  # the full trace keeps each layer's own scale


def test_layers_whose_settings_or_tensor_attributes_differ_are_different_kinds_or_traced_in_full():
    import torch

    from rope_export.exporting.stamping import NotStampable
    from rope_export.hf.stamping import layer_kinds

    model = build("olmo")
    layout = hf.cache_layout(model)
    for i, layer in enumerate(model.model.layers):
        layer.mlp.windows = [8, 16] if i == 1 else [8, 8]  # a list setting: layer 1 is a kind of its own
    assert layer_kinds(model, layout) == [0, 1, 0, 0]
    for i, layer in enumerate(model.model.layers):
        layer.mlp.windows = [8, 8]
        layer.mlp.offset = torch.tensor([float(i)])  # a tensor attribute, no buffer: traced as a constant
    with pytest.raises(NotStampable, match="layer 1's buffer mlp.offset differs from layer 0's"):
        layer_kinds(model, layout)


_LAYER_SCALE: dict[int, float] = {}  # a global table a module reads: no parameter, buffer, attribute or layer index


class _TableMLP:  # made a subclass of the model's own MLP class in the test below
    def forward(self, x):
        return super().forward(x) * _LAYER_SCALE[id(self)]


def _table_model(scales: list[float]):
    """The 4-layer OLMo whose layer i's MLP scales its output by ``scales[i]``, read from a global table."""
    model = build("olmo")
    mlp = type(model.model.layers[0].mlp)
    table_mlp = type("TableMLP", (_TableMLP, mlp), {"forward": _TableMLP.forward})
    for layer, scale in zip(model.model.layers, scales, strict=True):
        layer.mlp.__class__ = table_mlp
        _LAYER_SCALE[id(layer.mlp)] = scale
    return model


@pytest.mark.parametrize("planted", [3, pytest.param(2, marks=pytest.mark.slow)])
def test_a_per_layer_value_structure_cannot_see_is_caught_by_the_layer_comparison(planted):
    """One layer's MLP scales its output by another entry of a global table than the others: the layers group into
    one kind and the stamped graph is well formed (torch.export bakes layer 1's entry into the template, and every
    copy reads it), so only comparing each stamped layer with transformers' own finds it. Layer 2 is the first
    stamped layer (run on onnxruntime), layer 3 a later one (layer 1's module run with its weights, in torch)."""
    from rope_export.hf.stamping import layer_kinds

    model = _table_model([1.0 if i != planted else 1.25 for i in range(LAYERS)])
    assert layer_kinds(model, hf.cache_layout(model)) == [0, 0, 0, 0]  # structure sees one kind
    result = hf.export_hf(model)
    assert result.trace.startswith(f"full (per-kind not used: stamped layer {planted}'s hidden state differs from "
                                   f"the model's layer {planted} by "), result.trace


def test_a_global_table_with_one_value_for_every_layer_is_stamped():
    model = _table_model([1.5] * LAYERS)
    result = hf.export_hf(model)
    assert result.trace.startswith("per-kind: "), result.trace
    hf_zoo.compare_with_transformers(model, result)


def _masked_outputs(result: hf.HFExportResult, kv_buffer: bool) -> list[np.ndarray]:
    """The file on a batch whose first row starts with two padding tokens (past 4, 3 new tokens; with a KV buffer
    each past in a buffer two longer than past+seq)."""
    run = hf_zoo.runner(result.model)
    rng = np.random.default_rng(5)
    ids = rng.integers(0, hf_zoo.VOCAB, (hf_zoo.BATCH, 3))
    mask = np.ones((hf_zoo.BATCH, 7), dtype=np.int64)
    mask[0, :2] = 0
    past = [rng.standard_normal(shape).astype(np.float32) for io in result.layout.layers for shape in io.shapes(
        hf_zoo.BATCH, 4)]
    if kv_buffer:
        past = [np.concatenate([p, np.zeros((*p.shape[:2], 5, p.shape[3]), np.float32)], axis=2) for p in past]
    return run([ids, hf_zoo.positions(result.family.position_rank, 4, 3).numpy(), mask, *past])


@pytest.mark.parametrize("kv_buffer", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_files_with_an_attention_mask_or_a_kv_buffer_are_stamped_and_equal_the_full_trace(kv_buffer):
    """What package genai --hf exports: an attention_mask input (and with --kv-buffer, buffers updated in place)."""
    model = build("olmo")
    stamped = hf.export_hf(model, attention_mask=True, kv_buffer=kv_buffer)
    assert stamped.trace.startswith("per-kind: 2 of 4 decoder layers"), stamped.trace
    full = hf.export_hf(model, attention_mask=True, kv_buffer=kv_buffer, trace="full")
    assert [i.name for i in stamped.model.graph.input] == [i.name for i in full.model.graph.input]
    for a, b in zip(_masked_outputs(full, kv_buffer), _masked_outputs(stamped, kv_buffer), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
