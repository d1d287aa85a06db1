"""``check`` of a file with float64 caches: a refusal in one line where the rotary op cannot take them, a verdict where
plain ops compute with them (issue 40: both ended in ``internal error: KeyError: no tolerance for ... float64``)."""

from __future__ import annotations

import json

import numpy as np
import onnx
from check_files import copy, preset_file
from onnx import helper, numpy_helper

from rope_export import cli
from rope_export.passes import lower

CACHES = ("rotary.cos_cache", "rotary.sin_cache")


def float64_caches(model: onnx.ModelProto, cast_back: bool) -> onnx.ModelProto:
    """The cos/sin tables stored as float64; ``cast_back``: the rows a Gather reads of them are cast to float32 (a
    valid file of plain ops), else the tables are fed to the rotary node as they are (a file that breaks the op's
    contract)."""
    model = copy(model)
    for tensor in model.graph.initializer:
        if tensor.name in CACHES:
            tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float64), tensor.name))
    if cast_back:
        nodes = []
        for node in model.graph.node:
            nodes.append(node)
            if node.op_type == "Gather" and node.input[0] in CACHES:
                rows = node.output[0]
                node.output[0] = rows + ".f64"
                nodes.append(helper.make_node("Cast", [rows + ".f64"], [rows], to=onnx.TensorProto.FLOAT))
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        del model.graph.value_info[:]  # the Gathers' outputs are float64 now
    return model


def test_float64_caches_of_the_rotary_node_are_refused_in_one_line(tmp_path, capsys):
    path = tmp_path / "model.onnx"
    onnx.save_model(float64_caches(preset_file(), cast_back=False), path)
    code = cli.main(["check", str(path)])
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert err.count("\n") == 1 and err.startswith("rope-export check: error: "), err
    assert "the caches must have X's dtype (float32) or float32, got float64" in err
    assert "store X as float32, float16 or bfloat16 and the caches as float32" in err


def test_float64_tables_read_by_plain_ops_get_a_verdict(tmp_path, capsys):
    """A file lowered to plain ops whose cos/sin tables are float64 (cast to float32 where read): the tables are
    compared row by row with the preset's RoPE configuration, and the runners with PyTorch."""
    path, report = tmp_path / "model.onnx", tmp_path / "report"
    onnx.save_model(float64_caches(lower(preset_file(), "decomposed"), cast_back=True), path)
    code = cli.main(["check", str(path), "--runners", "onnxruntime-cpu", "--report", str(report)])
    err = capsys.readouterr().err
    assert code == 0, err[-2000:]
    verdict = json.loads((report / "check.json").read_text())
    assert verdict["passed"] and [r["status"] for r in verdict["runners"]] == ["pass"]
    tables = verdict["cache_tables"]
    assert sorted(t["name"] for t in tables) == list(CACHES), tables
    assert all(t["passed"] and t["against"] == "the RoPE configuration" for t in tables), tables
