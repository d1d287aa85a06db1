"""ONNX export: one custom node per rotated tensor, dynamic shapes, metadata, CLI."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
import torch
from exported import CACHE_LEN, exported_model, feeds, test_block
from onnx.reference import ReferenceEvaluator

from rope_export import cli
from rope_export.exporting.core import DTYPES, ExportError, count_rotary_nodes, summarize
from rope_export.op.contract import DOMAIN, OP_TYPE
from rope_export.op.onnx_op import RotaryEmbedding
from rope_export.op.tolerances import tolerance
from rope_export.presets import load_preset, preset_names
from rope_export.presets.export import decomposed_export, example_inputs, export, read_metadata

ONNX_TYPES = {"fp32": onnx.TensorProto.FLOAT, "fp16": onnx.TensorProto.FLOAT16, "bf16": onnx.TensorProto.BFLOAT16}


def run_reference(model, inputs):
    return ReferenceEvaluator(model, new_ops=[RotaryEmbedding]).run(None, feeds(inputs))


def call_shapes(preset_name):
    """(batch, seq, past, first position): prefill with no past, decode far from 0, a middle case."""
    rope = load_preset(preset_name).rope
    far = CACHE_LEN - 4
    if rope.seq_len_dependent:  # no cache to stay inside; go past the scheme's switch point
        far = rope.original_max_positions + 100
    return [(1, 7, 0, 0), (3, 1, 5, far), (2, 4, 3, 20)]


def assert_block_close(got, want, dtype, what):
    tol = tolerance("block", DTYPES[dtype])
    for name, g, w in zip(("output", "present_key", "present_value"), got, want, strict=True):
        g = np.asarray(g, dtype=np.float32)
        w = w.float().numpy()
        assert g.shape == w.shape, f"{what}: {name} shape {g.shape} != {w.shape}"
        assert tol.allclose(g, w), f"{what}: {name} max error {np.abs(g - w).max():.3g}"


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("preset_name", preset_names())
def test_every_preset_exports_and_matches_pytorch(preset_name, dtype):
    model = exported_model(preset_name, dtype)
    onnx.checker.check_model(model, full_check=True)
    assert count_rotary_nodes(model) == 2  # q and k
    ops = [n.op_type for n in model.graph.node]
    assert "Neg" not in ops, "a rotate-half remnant survived the export"
    trig = sorted(op for op in ops if op in ("Sin", "Cos"))
    # Static schemes read cos/sin from initializers; seq-len-dependent ones compute them once.
    assert trig == ([] if not load_preset(preset_name).rope.seq_len_dependent else ["Cos", "Sin"])
    for value in list(model.graph.input[:1]) + list(model.graph.input[2:]) + list(model.graph.output):
        assert value.type.tensor_type.elem_type == ONNX_TYPES[dtype], f"{value.name} is not {dtype}"

    block = test_block(preset_name, dtype)
    for batch, seq, past, start in call_shapes(preset_name):
        inputs = example_inputs(load_preset(preset_name).scaled_down(), DTYPES[dtype], True, batch, seq, past, seed=7)
        inputs = (inputs[0], inputs[1] - past + start, *inputs[2:])
        with torch.no_grad():
            want = block(*inputs)
        assert_block_close(run_reference(model, inputs), want, dtype, f"{preset_name} {dtype} B{batch} S{seq} P{past}")


def test_caches_are_initializers_sized_to_the_cache_not_the_example():
    model = exported_model("gpt-neox-20b")  # partial rotary: rd/2 = 12
    caches = {i.name: list(i.dims) for i in model.graph.initializer if "cache" in i.name}
    assert sorted(caches.values()) == [[CACHE_LEN, 12], [CACHE_LEN, 12]]
    assert all(i.data_type == onnx.TensorProto.FLOAT for i in model.graph.initializer if "cache" in i.name)
    default = export("tiny").model  # cache_len defaults to the preset's max_position_embeddings
    rows = {tuple(i.dims) for i in default.graph.initializer if "cache" in i.name}
    assert rows == {(load_preset("tiny").rope.max_position_embeddings, 8)}


def test_half_precision_file_keeps_float32_caches():
    model = exported_model("llama-3.1-8b", "fp16")
    node = next(n for n in model.graph.node if n.domain == DOMAIN and n.op_type == OP_TYPE)
    cache = next(i for i in model.graph.initializer if i.name == node.input[1])
    assert cache.data_type == onnx.TensorProto.FLOAT


def test_metadata_rebuilds_the_block():
    model = exported_model("phi-2", "fp16")
    meta = read_metadata(model)
    assert meta["preset"] == load_preset("phi-2").scaled_down()
    assert (meta["dtype"], meta["cache_len"], meta["decode"], meta["seed"]) == ("fp16", CACHE_LEN, True, 0)
    rebuilt = meta["preset"].build_block(DTYPES[meta["dtype"]], seed=meta["seed"], cache_len=meta["cache_len"])
    inputs = example_inputs(meta["preset"], torch.float16, True, 2, 3, 4, seed=3)
    with torch.no_grad():
        want = rebuilt(*inputs)
    assert_block_close(run_reference(model, inputs), want, "fp16", "rebuilt from metadata")


def test_prefill_only_file_has_two_inputs_and_runs_other_lengths():
    model = exported_model("tiny", "fp32", decode=False)
    assert [i.name for i in model.graph.input] == ["hidden_states", "position_ids"]
    summary = summarize(model)
    assert summary["inputs"]["hidden_states"] == ["batch", "seq", 64]
    block = test_block("tiny")
    for batch, seq in ((1, 1), (4, 33)):
        inputs = example_inputs(load_preset("tiny").scaled_down(), torch.float32, False, batch, seq, seed=5)
        with torch.no_grad():
            want = block(*inputs)
        assert_block_close(run_reference(model, inputs), want, "fp32", f"B{batch} S{seq}")


def test_custom_op_export_is_smaller_than_a_decomposed_one():
    preset = load_preset("tiny")
    ours = exported_model("tiny", "fp32", decode=False)
    plain = decomposed_export(preset.scaled_down(), cache_len=CACHE_LEN)
    plain_ops = [n.op_type for n in plain.graph.node]
    assert count_rotary_nodes(plain) == 0 and "Neg" in plain_ops
    assert len(ours.graph.node) < len(plain.graph.node)


def test_a_model_past_the_threshold_streams_its_weights_to_an_external_file(tmp_path, monkeypatch):
    from rope_export.common.steps import StepLog
    from rope_export.files import onnx_files

    in_memory = exported_model("tiny")  # the same export, kept in memory
    monkeypatch.setattr(onnx_files, "EXTERNAL_DATA_THRESHOLD", 1000)  # pretend the weights are past 2 GB
    path = tmp_path / "big.onnx"
    steps = StepLog()
    result = export(load_preset("tiny").scaled_down(), path, decode=True, cache_len=CACHE_LEN, progress=steps)
    steps.finish()
    assert sorted(os.listdir(tmp_path)) == ["big.onnx", "big.onnx.data"]
    names = [s.name for s in steps.steps]
    for phase in ("tracing", "translating", "optimizing", "writing", "checking"):
        assert any(phase in name for name in names), f"no {phase} step in {names}"
    stored = result.model.graph.initializer  # the file as written: weights by reference
    assert {i.name for i in stored if i.data_location == onnx.TensorProto.EXTERNAL} == \
        {i.name for i in in_memory.graph.initializer if len(i.raw_data) > onnx_files.INLINE_LIMIT}
    onnx.checker.check_model(str(path), full_check=True)
    original = {i.name: onnx.numpy_helper.to_array(i) for i in in_memory.graph.initializer}
    reloaded = {i.name: onnx.numpy_helper.to_array(i) for i in onnx.load_model(path).graph.initializer}
    assert original.keys() == reloaded.keys()
    for name, array in original.items():
        np.testing.assert_array_equal(reloaded[name], array, err_msg=name)


def test_the_graph_is_edited_without_its_weights():
    from rope_export.exporting.core import finish_export, graph_proto
    from rope_export.files import onnx_files
    from rope_export.presets.export import export_program

    preset = load_preset("llama-3.1-8b").scaled_down()
    block = preset.build_block(torch.float16, cache_len=CACHE_LEN)
    program = export_program(block, example_inputs(preset, torch.float16, False))
    weights = sum(v.const_value.nbytes for v in program.model.graph.initializers.values())
    proto = graph_proto(program)
    assert all(len(i.raw_data) <= onnx_files.INLINE_LIMIT for i in proto.graph.initializer)  # no weight copied in
    assert proto.ByteSize() < weights / 2
    rebuilt = finish_export(proto, program)
    assert rebuilt == program.model_proto  # every tensor back, nothing else changed


def test_export_rejects_bad_requests(tmp_path):
    with pytest.raises(ExportError, match="opset 17"):
        export("tiny", dtype="fp32", opset=17)
    with pytest.raises(ExportError, match="unknown dtype 'fp8'"):
        export("tiny", dtype="fp8")
    with pytest.raises(ExportError, match="does not exist"):
        export("tiny", tmp_path / "missing" / "x.onnx")
    with pytest.raises(ValueError, match="unknown preset 'nope'.*tiny"):
        export("nope")
    assert list(tmp_path.iterdir()) == []


def test_cli_writes_file_and_prints_summary(tmp_path, capsys):
    path = tmp_path / "tiny.onnx"
    assert cli.main(["export", "--preset", "tiny", "--decode", "--cache-len", "32", "-o", str(path)]) == 0
    out = capsys.readouterr().out
    assert "rope_export::RotaryEmbedding nodes" in out and "'past'" in out and "'batch'" in out
    model = onnx.load_model(path)
    assert count_rotary_nodes(model) == 2 and read_metadata(model)["cache_len"] == 32
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.onnx"]  # no temporary left behind


def test_cli_makes_the_folders_of_its_output(tmp_path):
    path = tmp_path / "new" / "dir" / "tiny.onnx"
    assert cli.main(["export", "--preset", "tiny", "-o", str(path)]) == 0
    assert count_rotary_nodes(onnx.load_model(path)) == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--preset", "nope"], "unknown preset 'nope'"),
        (["--opset", "17"], "opset 17 is outside"),
        (["-o", "/dev/null/x.onnx"], "is a file, not a folder"),
    ],
)
def test_cli_errors_are_one_clear_line(argv, message, tmp_path, capsys):
    argv = ["export", "-o", str(tmp_path / "x.onnx"), *argv]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_checks_the_output_folder_before_building_a_transformers_model(tmp_path, capsys, monkeypatch):
    pytest.importorskip("transformers")
    from rope_export import hf

    def never(*args, **kwargs):
        raise AssertionError("the model was built before the output folder was checked")

    monkeypatch.setattr(hf, "build_hf_model", never)
    (tmp_path / "config.json").write_text('{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}')
    assert cli.main(["export", "--hf", str(tmp_path), "-o", str(tmp_path / "config.json" / "x.onnx")]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


def test_cli_rejects_bad_dtype(capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        cli.main(["export", "--dtype", "fp8", "-o", str(tmp_path / "x.onnx")])
    assert exc.value.code == 2 and "invalid choice: 'fp8'" in capsys.readouterr().err


def test_dynamic_ntk_frequencies_follow_the_runtime_length():
    import dataclasses

    tiny = load_preset("tiny").scaled_down()
    rope = dataclasses.replace(tiny.rope, rope_type="dynamic", factor=2.0, max_position_embeddings=16)
    preset = dataclasses.replace(tiny, name="tiny-dynamic", rope=rope)
    model = export(preset, decode=False).model
    block = preset.build_block()
    outputs = {}
    for seq in (8, 40):  # below and above max_position_embeddings: the base changes in-graph
        inputs = example_inputs(preset, torch.float32, False, 2, seq, seed=1)
        with torch.no_grad():
            want = block(*inputs)
        got = run_reference(model, inputs)
        assert_block_close(got, want, "fp32", f"dynamic S{seq}")
        outputs[seq] = got[1]
    # The first 8 keys differ between the two runs only because the frequencies were rescaled.
    assert not np.allclose(outputs[8], outputs[40][:, :, :8], atol=1e-4)
