"""``rope-export lower`` / ``fuse`` refuse what they cannot make right (rope_export.passes.validation).

Planted defects in real exported files: float64 caches, caches one column too wide, cache rows
that are not cos/sin of an angle (the rows past 100, which only long prompts reach). Each is
refused with exit 2, one line naming the node, the problem and the fix, and no file written. The
same files unchanged (and a YaRN file, whose caches carry a magnitude factor other than 1) lower
to every target. A lowered node whose form is wrong is refused by the run-once check.
"""

from __future__ import annotations

import functools
import re

import numpy as np
import onnx
import pytest
from exported import exported_model
from onnx import numpy_helper

from rope_export import cli
from rope_export.op.contract import DOMAIN
from rope_export.passes import PassError, lower, validation
from rope_export.passes._model import to_ir

TARGETS = ["trt-plugin", "onnx", "ort", "decomposed"]
COS, SIN = "rotary.cos_cache", "rotary.sin_cache"


@pytest.fixture
def main(monkeypatch):
    if "rope_export.cli.passes" not in cli.COMMAND_MODULES:
        monkeypatch.setattr(cli, "COMMAND_MODULES", [*cli.COMMAND_MODULES, "rope_export.cli.passes"])
    return cli.main


@functools.cache
def _tiny(rows: int = 128) -> onnx.ModelProto:
    from rope_export.presets import load_preset
    from rope_export.presets.export import export

    return export(load_preset("tiny").scaled_down(), dtype="fp32", decode=True, cache_len=rows).model


def _caches(model: onnx.ModelProto) -> tuple[np.ndarray, np.ndarray]:
    tensors = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.name in (COS, SIN)}
    return tensors[COS], tensors[SIN]


def _with_caches(cos: np.ndarray, sin: np.ndarray) -> onnx.ModelProto:
    model = onnx.ModelProto()
    model.CopyFrom(_tiny())
    for tensor in model.graph.initializer:
        if tensor.name in (COS, SIN):
            tensor.CopyFrom(numpy_helper.from_array(cos if tensor.name == COS else sin, tensor.name))
    return model


def _planted(defect: str) -> onnx.ModelProto:
    cos, sin = _caches(_tiny())
    if defect == "float64":
        return _with_caches(cos.astype(np.float64), sin.astype(np.float64))
    if defect == "too wide":
        return _with_caches(np.concatenate([cos, cos[:, :1]], 1), np.concatenate([sin, sin[:, :1]], 1))
    if defect == "sin shorter":
        return _with_caches(cos, sin[:100])
    if defect == "rows changed":  # what a bad edit or a mis-sliced cache leaves: past row 100, not cos/sin
        cos, sin = cos.copy(), sin.copy()
        cos[100:], sin[100:] = 0.5, 0.25
        return _with_caches(cos, sin)
    raise ValueError(defect)


EXPECTED = {
    "float64": ["cos_cache 'rotary.cos_cache' is double", "store both caches as float32"],
    "too wide": ["the caches have 9 columns", "rd/2 = 8", "store caches of 8 columns"],
    "sin shorter": ["cos_cache is [128, 8] but sin_cache is [100, 8]", "give both caches one shape"],
    "rows changed": ["row(s) 100, 101, 102, 103, 104 and 23 more", "not cos/sin of an angle", "re-export"],
}


@pytest.mark.parametrize("defect", list(EXPECTED))
@pytest.mark.parametrize("target", TARGETS)
def test_lower_refuses_planted_cache_defects(main, tmp_path, capsys, defect, target):
    onnx.save(_planted(defect), tmp_path / "in.onnx")
    out = tmp_path / "out.onnx"
    assert main(["lower", str(tmp_path / "in.onnx"), "-t", target, "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("rope-export lower: error: node node_rotary_embedding: ")
    for text in EXPECTED[defect]:
        assert text in err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["in.onnx"]


@pytest.mark.parametrize("defect", ["float64", "too wide", "sin shorter"])
def test_the_python_lower_checks_stored_types_and_widths_without_validate(defect):
    """No target can express these; only the cos² + sin² check and the run wait for validate=True."""
    with pytest.raises(PassError, match=re.escape(EXPECTED[defect][0])):
        lower(_planted(defect), "onnx")


def test_changed_rows_in_external_data_are_found(main, tmp_path, capsys):
    """Real models keep every initializer in external data; the caches are read from there, alone."""
    onnx.save(_planted("rows changed"), tmp_path / "in.onnx", save_as_external_data=True, location="in.data",
              size_threshold=0)
    assert main(["lower", str(tmp_path / "in.onnx"), "-t", "onnx", "-o", str(tmp_path / "out.onnx")]) == 2
    assert "row(s) 100, 101" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.data", "in.onnx"]


def test_fuse_refuses_a_fused_node_with_changed_rows(main, tmp_path, capsys):
    """fuse keeps rope_export nodes already there; their caches are checked like the ones it makes."""
    onnx.save(_planted("rows changed"), tmp_path / "in.onnx")
    assert main(["fuse", str(tmp_path / "in.onnx"), "-o", str(tmp_path / "out.onnx")]) == 2
    assert "row(s) 100, 101" in capsys.readouterr().err
    assert not (tmp_path / "out.onnx").exists()


@pytest.mark.parametrize("target", TARGETS)
def test_lower_accepts_the_correct_file_and_runs_it_once(main, tmp_path, capsys, target):
    onnx.save(_tiny(), tmp_path / "in.onnx")
    assert main(["lower", str(tmp_path / "in.onnx"), "-t", target, "-o", str(tmp_path / "out.onnx")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    runtime = "onnx.reference" if target == "trt-plugin" else "onnxruntime (CPU)"
    assert f"ran 2 {target} node(s) once on a small input on {runtime}" in out
    assert DOMAIN not in {n.domain for n in onnx.load(tmp_path / "out.onnx").graph.node}


@pytest.mark.parametrize("target", TARGETS)
def test_a_magnitude_factor_is_not_a_defect(target):
    """YaRN folds its attention factor into the caches: cos² + sin² is one constant, not 1."""
    model = exported_model("qwen2.5-7b-yarn", "fp16", decode=False)
    cos, sin = (numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer
                if t.name in (COS, SIN))
    assert abs(float(np.median(cos**2 + sin**2)) - 1) > 0.05  # the premise: a factor other than 1
    lower(model, target, validate=True)


def _lowered_then_broken(target: str, attribute: str, value: int):
    """The tiny file lowered, then one attribute of each lowered node changed: a wrong lowering."""
    ir_model, _ = to_ir(_tiny())
    nodes = [n for n in ir_model.graph if n.domain == DOMAIN]
    runs = validation.plan(ir_model, nodes, out_of_range=True)
    lowered, _ = to_ir(lower(_tiny(), target))
    for node in lowered.graph:
        if node.op_type.endswith("RotaryEmbedding"):
            node.attributes[attribute] = onnx_attr(attribute, value)
    return lowered, runs


def onnx_attr(name: str, value: int):
    import onnx_ir as ir

    return ir.AttrInt64(name, value)


@pytest.mark.parametrize(("target", "runtime"), [("onnx", "onnxruntime"), ("trt-plugin", "reference")])
def test_the_run_once_check_catches_a_wrong_lowered_node(target, runtime):
    lowered, runs = _lowered_then_broken(target, "interleaved", 1)
    with pytest.raises(PassError, match=r"node node_rotary_embedding: run once on .* differs from the op contract"):
        validation.run(lowered, runs, runtime, target)
    intact, _ = to_ir(lower(_tiny(), target))
    validation.run(intact, runs, runtime, target)  # the same check passes the lowering as made
