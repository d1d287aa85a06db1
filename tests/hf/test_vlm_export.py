"""Vision-language models whole: ``export --hf VLM_DIR -o OUT_DIR/`` and ``check OUT_DIR/``.

Each type of the issue's list (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Mistral 3 with its Pixtral tower, Llama 4) is
built tiny from a config with random weights, exported to its three components, and:

* every component has one rotary node per rotation transformers performs in it (counted by data flow in an
  eager forward), and both towers rotate (the vision tower's 2-D rotation, the text tower's RoPE or mRoPE);
* ``check`` compares each component with the same transformers submodule on every runner here and runs the
  pipeline (image + prompt -> logits, then a decode step) against transformers' model: PASS;
* planted faults FAIL: an export whose mRoPE sections were swapped (temporal and width), and one whose vision
  grid was transposed (height and width positions exchanged): the component and the pipeline both fail.

Qwen2.5-VL runs through the command line in ``make test``; the other types and the faults are slow.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

transformers = pytest.importorskip("transformers")

import vlm_configs  # noqa: E402

from rope_export import cli  # noqa: E402
from rope_export.check.vlm_folder import check_folder, folder_verdict_line  # noqa: E402
from rope_export.hf.vlm import build_vlm, kinds  # noqa: E402
from rope_export.hf.vlm.exporting import MANIFEST, export_vlm  # noqa: E402

RUNNERS = ("onnxruntime-cpu", "onnx-reference", "cpu-twin")
TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "mistral3", "llama4")


def _model(model_type: str):
    """Random weights scaled to trained-like attention logits (``vlm_configs.trained_like``): positions matter."""
    return vlm_configs.trained_like(build_vlm(vlm_configs.tiny_config(model_type), seed=0))


def _export(model, model_type: str, tmp_path, **options):
    """``model`` saved with ``save_pretrained`` (check rebuilds transformers from the weights the files record),
    exported from that folder."""
    folder = vlm_configs.save_folder(model, tmp_path / "model")
    return export_vlm(build_vlm(folder), tmp_path / "out", image_size=vlm_configs.IMAGE_SIZES[model_type],
                      weights=str(folder), **options)


def _assert_whole(manifest: dict) -> None:
    components = manifest["components"]
    assert list(components) == ["vision", "embedding", "decoder"]
    for name, entry in components.items():
        assert entry["rotary_nodes"] == entry["rotations"], (name, entry)
    assert components["vision"]["rotations"] > 0 and components["decoder"]["rotations"] > 0
    assert components["embedding"]["rotations"] == 0


def test_qwen2_5_vl_exports_whole_and_checks_from_the_command_line(tmp_path, capsys):
    folder = vlm_configs.save_folder(_model("qwen2_5_vl"), tmp_path / "model")
    out = tmp_path / "out"
    assert cli.main(["export", "--hf", str(folder), "-o", str(out), "--image-size", "112x84"]) == 0
    printed = capsys.readouterr().out
    assert f"weights from {folder}" in printed and "112x84" in printed
    manifest = json.loads((out / MANIFEST).read_text())
    _assert_whole(manifest)
    # Qwen2.5-VL: 2 vision blocks (q and k each), 2 decoder layers; the prompt holds (112/28) x (84/28) tokens
    assert (manifest["components"]["vision"]["rotations"], manifest["components"]["decoder"]["rotations"]) == (4, 4)
    assert manifest["image"]["tokens"] == 12 and manifest["image"]["constants"] == {"image_grid_thw": [[1, 8, 6]]}
    assert "get_rope_index" in manifest["positions"]["decoder"]
    assert cli.main(["check", str(out), "--runners", ",".join(RUNNERS), "--report", str(tmp_path / "report")]) == 0
    printed = capsys.readouterr().out
    assert "vision PASS, embedding PASS, decoder PASS, pipeline PASS" in printed
    last = printed.strip().splitlines()[-1]  # one verdict line ends the output; the time per step: with --verbose
    assert last.startswith("PASS: vision: ") and "; decoder: " in last and "pipeline: logits match" in last, last
    assert sum(line.startswith(("PASS: ", "FAIL: ")) for line in printed.splitlines()) == 1
    assert "time and peak RSS per step" not in printed
    assert (tmp_path / "report" / "decoder" / "check.json").is_file()
    # one component alone: its reference (the transformers submodule) is read from the file's metadata
    assert cli.main(["check", str(out / "vision.onnx"), "--runners", "onnxruntime-cpu", "--no-sweep"]) == 0
    assert "PyTorch (VisionEncoder" in capsys.readouterr().out
    # a VLM asked for one file is refused, naming the fix
    assert cli.main(["export", "--hf", str(folder), "-o", str(tmp_path / "out2"), "--layer", "0"]) == 2
    assert "--layer does not apply to a vision-language model" in capsys.readouterr().err


def test_an_image_text_to_text_type_without_an_entry_is_refused_naming_the_covered_types(tmp_path, capsys):
    import vlm_zoo

    folder = tmp_path / "llava"
    vlm_zoo.build("llava").save_pretrained(folder)
    assert cli.main(["export", "--hf", str(folder), "-o", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert "llava: rope-export exports these vision-language types whole: " in error and "qwen2_5_vl" in error
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("model_type", [t for t in TYPES if t != "qwen2_5_vl"])
def test_each_type_exports_whole_and_checks_against_transformers(model_type, tmp_path):
    result = _export(_model(model_type), model_type, tmp_path)
    _assert_whole(result.manifest)
    report = check_folder(tmp_path / "out", RUNNERS)
    assert report.passed, report.failure_message()
    assert report.pipeline.tokens == report.pipeline.reference_tokens
    assert all(len(r.compared) >= 2 for r in report.components.values())


def _planted_mrope(model):
    """The text rotary module's sections with the temporal and width bands exchanged ([2, 1, 1] -> [1, 1, 2])."""
    rotary = next(m for m in model.modules() if type(m).__name__ == "Qwen2_5_VLRotaryEmbedding")
    rotary.mrope_section = list(reversed(rotary.mrope_section))
    return rotary


def _transposed_grid(kind):
    """The vision positions (row, column) exchanged before they reach transformers' rotary module."""

    def precomputed(model, grid):
        values = kind.precomputed(model, grid)
        return {**values, "position_ids": [[w, h] for h, w in values["position_ids"]]}

    return dataclasses.replace(kind, precomputed=precomputed)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["swapped mRoPE section", "transposed 2-D grid"])
def test_planted_faults_fail(fault, tmp_path, monkeypatch):
    folder = vlm_configs.save_folder(_model("qwen2_5_vl"), tmp_path / "model")
    model = build_vlm(folder)
    with monkeypatch.context() as planted:
        if fault == "swapped mRoPE section":
            rotary = _planted_mrope(model)
            assert rotary.mrope_section != model.config.get_text_config().rope_parameters["mrope_section"]
        else:
            planted.setitem(kinds.MODEL_TYPES, "qwen2_5_vl", _transposed_grid(kinds.MODEL_TYPES["qwen2_5_vl"]))
        export_vlm(model, tmp_path / "out", image_size=vlm_configs.IMAGE_SIZES["qwen2_5_vl"], weights=str(folder))
    report = check_folder(tmp_path / "out", ("onnxruntime-cpu",))
    failed = {name for name, r in report.components.items() if not r.passed}
    assert failed == ({"decoder"} if fault == "swapped mRoPE section" else {"vision"}), report.failure_message()
    assert report.pipeline.status == "FAIL" and max(report.pipeline.errors.values()) > 1e-2, report.pipeline
    verdict = folder_verdict_line(report)  # check's last line names what failed, and only that
    assert verdict.startswith(f"FAIL: {failed.pop()}: ") and "pipeline FAIL: logits differ" in verdict, verdict
    assert verdict.endswith("; 2 of 3 components pass"), verdict


@pytest.mark.slow
def test_every_lowering_of_every_component_computes_the_component(tmp_path):
    """trt-plugin (on the CPU twin), onnx, ort and decomposed: each component file lowered, then checked against the
    same transformers submodule (its reference is read from the lowered file's metadata)."""
    import onnx

    from rope_export.check.core import check
    from rope_export.passes import lower

    _export(_model("qwen2_5_vl"), "qwen2_5_vl", tmp_path)
    runners = {"trt-plugin": ("cpu-twin",), "onnx": ("onnxruntime-cpu", "onnx-reference"),
               "ort": ("onnxruntime-cpu",), "decomposed": ("onnxruntime-cpu",)}
    for name in ("vision", "decoder"):
        original = onnx.load(str(tmp_path / "out" / f"{name}.onnx"))
        for target, names in runners.items():
            path = tmp_path / f"{name}-{target}.onnx"
            onnx.save(lower(original, target), str(path))
            report = check(path, names, sweep=False)
            assert report.passed and [r.status for r in report.runners] == ["pass"] * len(names), \
                (name, target, report.failure_message())


@pytest.mark.slow
def test_a_vlm_whose_decoder_weights_change_fails_the_pipeline(tmp_path):
    """check rebuilds transformers from the recorded seed: other random weights must fail every component that has
    weights and the pipeline (the reference is not the file itself)."""
    export_vlm(build_vlm(vlm_configs.tiny_config("mistral3"), seed=0), tmp_path / "out",
               image_size=vlm_configs.IMAGE_SIZES["mistral3"], seed=0)
    report = check_folder(tmp_path / "out", ("onnxruntime-cpu",), seed=1)
    assert not report.components["vision"].passed and not report.components["decoder"].passed
    assert report.pipeline.status == "FAIL"
