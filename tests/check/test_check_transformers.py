"""check on ``export --hf`` files and their lowerings, against transformers rebuilt from the file's metadata."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from check_files import FAMILIES, RUNNERS_FOR, TAMPERING, TARGETS, copy, hf_file, hf_model  # noqa: E402

from rope_export import cli  # noqa: E402
from rope_export.check import check  # noqa: E402

# make test: every family's export, every lowering of Llama, one lowering of each other family;
# the rest of the 5 x 5 matrix runs under `make test-slow`.
QUICK = {(f, None) for f in FAMILIES} | {("llama", t) for t in TARGETS} | {
    ("qwen2", "trt-plugin"), ("phi3", "ort"), ("gptj", "decomposed"), ("qwen2_vl", "onnx")}
MATRIX = [pytest.param(f, t, marks=() if (f, t) in QUICK else pytest.mark.slow)
          for f in FAMILIES for t in (None, *TARGETS)]


@pytest.mark.parametrize(("family", "target"), MATRIX)
def test_export_and_every_lowering_match_transformers(family, target):
    report = check(hf_file(family, target), RUNNERS_FOR[target])
    assert report.passed, report.failure_message()
    assert report.against == "transformers" and report.independent
    compared = [r for r in report.runners if r.status == "pass"]
    assert [r.runner for r in compared] == list(RUNNERS_FOR[target])
    for r in compared:
        assert {"prefill", "decode", "decode-end-of-positions"} <= set(r.cases)
        outputs = {s.output for stats in r.cases.values() for s in stats}
        assert outputs == {"logits", "present.0.key", "present.0.value"}  # logits and every present key/value
        assert r.max_abs is not None and r.max_abs < 1e-4
        if target != "decomposed":  # a node to run alone, over every position the config allows
            limit = hf_model(family).config.get_text_config(decoder=True)
            limit = getattr(limit, "max_position_embeddings", None) or limit.n_positions
            assert r.sweep.status == "pass" and r.sweep.positions == limit, r.sweep
    if family == "qwen2_vl":
        assert "mrope-3d-positions" in report.cases


@pytest.mark.parametrize("tampering", TAMPERING)
def test_tampered_export_fails_against_transformers(tampering, tmp_path, capsys):
    path = tmp_path / "tampered.onnx"
    import onnx

    onnx.save_model(TAMPERING[tampering](hf_file("llama")), path)
    assert cli.main(["check", str(path), "--runners", "onnx-reference,onnxruntime-cpu"]) == 1
    err = capsys.readouterr().err
    assert "runner onnx-reference disagrees with transformers on" in err
    assert "runner onnxruntime-cpu disagrees with transformers on" in err
    assert "/logits" in err


def test_missing_transformers_config_is_one_line_exit_2(tmp_path, capsys):
    import onnx

    path = tmp_path / "llama.onnx"
    onnx.save_model(hf_file("llama"), path)
    assert cli.main(["check", str(path), "--hf", str(tmp_path / "no-such-config")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no such file or folder" in err and "Traceback" not in err
    assert cli.main(["check", str(path), "--weights", str(tmp_path / "no-weights")]) == 2
    assert "pass --weights DIR" in capsys.readouterr().err


def test_config_given_with_hf_checks_a_file_without_metadata(tmp_path):
    model = hf_model("qwen2")
    stripped = copy(hf_file("qwen2"))
    del stripped.metadata_props[:]
    (tmp_path / "config.json").write_text(json.dumps(json.loads(model.config.to_json_string())))
    report = check(stripped, ("onnxruntime-cpu",), hf_config=tmp_path, seed=0)
    assert report.passed and report.against == "transformers", report.failure_message()
    other_seed = check(stripped, ("onnxruntime-cpu",), hf_config=tmp_path, seed=1)
    assert not other_seed.passed  # other random weights: the comparison is real


@pytest.mark.slow
def test_one_attention_layer_export_matches_the_layer_in_transformers():
    from rope_export import hf

    result = hf.export_hf(hf_model("llama"), layer=0)
    report = check(result.model, ("onnx-reference", "onnxruntime-cpu"))
    assert report.passed and report.against == "transformers", report.failure_message()
    assert {s.output for stats in report.runners[0].cases.values() for s in stats} == {
        "output", "present_key", "present_value"}


def test_longrope_whole_model_on_both_sides_of_its_switch():
    """Phi-3's LongRoPE (original context 32 of 128): the whole model on one decode step just below the switch
    and one just past it, by a position offset, both against transformers."""
    report = check(hf_file("phi3"), ("onnxruntime-cpu",), sweep=False)
    assert {"decode-original-context-end", "decode-past-original-context"} <= set(report.cases)
    assert report.passed, report.failure_message()
    (runner,) = report.compared
    assert {"decode-original-context-end", "decode-past-original-context"} <= set(runner.cases)
