"""Bad input to check ends in one clear line and exit 2: broken files, bad metadata, bad feeds, huge sizes."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from check_files import copy, preset_file

from rope_export import cli


def run(args, capsys) -> str:
    code = cli.main(["check", *map(str, args)])
    captured = capsys.readouterr()
    err = captured.err
    assert code == 2, (code, err[-2000:], captured.out[-2000:])
    assert err.count("\n") == 1 and err.startswith("rope-export check: error: ") and "Traceback" not in err, err
    return err


@pytest.fixture(scope="module")
def model_bytes() -> bytes:
    return preset_file(cache_len=64).SerializeToString()


def save(tmp_path, model, name="model.onnx"):
    path = tmp_path / name
    onnx.save_model(model, path)
    return path


def with_metadata(key, value):
    model = copy(preset_file(cache_len=64))
    for prop in model.metadata_props:
        if prop.key == f"rope_export.{key}":
            prop.value = value
    return model


@pytest.mark.parametrize(("content", "message"), [
    (lambda b: b"", "is empty"),
    (lambda b: b"hello, I am not a model\n", "not a readable ONNX model"),
    (lambda b: b[: len(b) // 2], "not a readable ONNX model"),
    (lambda b: np.random.default_rng(0).bytes(4096), "not"),
])
def test_files_that_are_not_onnx(content, message, model_bytes, tmp_path, capsys):
    path = tmp_path / "model.onnx"
    path.write_bytes(content(model_bytes))
    assert message in run([path], capsys)


def test_missing_and_truncated_external_data(tmp_path, capsys):
    path = tmp_path / "model.onnx"
    onnx.save_model(copy(preset_file(cache_len=64)), path, save_as_external_data=True, location="model.onnx.data",
                    size_threshold=1024)  # (saving with external data rewrites the proto: a copy)
    data = tmp_path / "model.onnx.data"
    data.write_bytes(data.read_bytes()[:100])
    assert "is shorter than the model says" in run([path], capsys)
    data.unlink()
    assert "external data file 'model.onnx.data', which is not beside the model" in run([path], capsys)
    assert "no such file" in run([tmp_path / "nothing.onnx"], capsys)


@pytest.mark.parametrize("dtype", [onnx.TensorProto.INT32, onnx.TensorProto.FLOAT])
def test_position_ids_that_are_not_int64(dtype, tmp_path, capsys):
    model = copy(preset_file(cache_len=64))
    model.graph.input[1].type.tensor_type.elem_type = dtype
    err = run([save(tmp_path, model)], capsys)
    assert "input 'position_ids' is" in err and "takes int64 position ids" in err


@pytest.mark.parametrize(("key", "value", "message"), [
    ("dtype", "fp64", "rope_export.dtype is 'fp64', not one of fp32, fp16, bf16"),
    ("seed", "abc", "rope_export.seed is 'abc', not an integer"),
    ("seed", str(2**80), "outside"),
    ("cache_len", "1000000000", "would allocate about"),
    ("preset", "{not json", "is not valid JSON"),
])
def test_bad_metadata(key, value, message, tmp_path, capsys):
    assert message in run([save(tmp_path, with_metadata(key, value))], capsys)


def test_a_preset_that_would_allocate_tens_of_gb(tmp_path, capsys):
    model = copy(preset_file(cache_len=64))
    prop = next(p for p in model.metadata_props if p.key == "rope_export.preset")
    preset = json.loads(prop.value)
    preset["attention"].update(num_heads=1_000_000, num_kv_heads=1_000_000, hidden_size=1_000_000)
    prop.value = json.dumps(preset)
    err = run([save(tmp_path, model)], capsys)
    assert "the preset block of the metadata" in err and "would allocate about" in err and "GB" in err


def test_a_graph_output_missing(tmp_path, capsys):
    model = copy(preset_file(cache_len=64))
    del model.graph.output[2]
    err = run([save(tmp_path, model)], capsys)
    assert "has no graph output 'present_value', which the preset block produces" in err


def test_sizes_that_would_allocate_tens_of_gb(tmp_path, capsys):
    path = save(tmp_path, preset_file(cache_len=64))
    err = run([path, "--batch", 10_000_000], capsys)  # inputs alone: 41 GB
    assert "case prefill (batch 10000000, 16 new tokens, past 0) with the model's activations would allocate" in err
    assert "--memory-limit" in err


def test_feeds_of_the_wrong_shape_or_dtype(tmp_path, capsys):
    path = save(tmp_path, preset_file(cache_len=64))
    good = {"hidden_states": np.zeros((1, 3, 64), np.float32), "position_ids": np.zeros((1, 3), np.int64),
            "past_key": np.zeros((1, 2, 2, 16), np.float32), "past_value": np.zeros((1, 2, 2, 16), np.float32)}
    np.savez(tmp_path / "feeds.npz", **{**good, "position_ids": good["position_ids"].astype(np.int32)})
    assert "input 'position_ids' is int32 [1, 3]; the file declares int64" in run(
        [path, "--inputs", tmp_path / "feeds.npz"], capsys)
    np.savez(tmp_path / "feeds.npz", **{**good, "past_value": np.zeros((2, 2, 2, 16), np.float32)})
    assert "input 'past_value' has shape [2, 2, 2, 16] (dim 0 is 'batch', 1 in another input)" in run(
        [path, "--inputs", tmp_path / "feeds.npz"], capsys)
    np.savez(tmp_path / "feeds.npz", **{**good, "past_key": np.zeros((1, 4, 2, 16), np.float32)})
    assert "input 'past_key' has shape [1, 4, 2, 16] (dim 1 must be 2)" in run(
        [path, "--inputs", tmp_path / "feeds.npz"], capsys)
    np.savez(tmp_path / "feeds.npz", **good)
    assert cli.main(["check", str(path), "--inputs", str(tmp_path / "feeds.npz"), "--runners", "cpu-twin"]) == 0
    np.savez(tmp_path / "feeds.npz", hidden_states=good["hidden_states"])
    assert "missing input(s) ['past_key', 'past_value', 'position_ids']" in run(
        [path, "--inputs", tmp_path / "feeds.npz"], capsys)
    (tmp_path / "not.npz").write_text("no")
    assert "not a NumPy .npz" in run([path, "--inputs", tmp_path / "not.npz"], capsys)


def test_unknown_runner_and_conflicting_references(tmp_path, capsys):
    path = save(tmp_path, preset_file(cache_len=64))
    assert "unknown runner 'gpu'" in run([path, "--runners", "gpu"], capsys)
    assert "not both" in run([path, "--reference", path, "--hf", tmp_path], capsys)
