"""rope_export.bench.scale_peers and the scale benchmark's ratios against them: the builder's and
cp's figures become the ratios the table prints; the model folder is one the builder accepts and
that export --hf reads with the same weights."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from rope_export.bench import scale, scale_peers
from rope_export.bench.scale_report import _ratio_line


def _result() -> dict:
    steps = [
        {"step": "plain export", "seconds": 100.0, "peak_rss": 6e9},
        {"step": "export --hf", "seconds": 80.0, "peak_rss": 5e9,
         "files": [{"path": "w/model.onnx", "bytes": 10**6}, {"path": "w/model.onnx.data", "bytes": 4 * 10**9}]},
        {"step": scale_peers.COPY, "seconds": 10.0, "peak_rss": 1e6},
        {"step": scale_peers.BUILDER, "seconds": 40.0, "peak_rss": 5.5e9},
    ]
    export_steps = [{"name": "tracing the model with torch.export", "seconds": 30.0},
                    {"name": "writing w/model.onnx and its weights (4 GB) to model.onnx.data", "seconds": 20.0}]
    return {"steps": steps, "weight_bytes": 4 * 10**9, "export_steps": export_steps}


def test_ratios_against_the_builder_and_the_file_copy():
    q = scale.ratios(_result())
    assert q["export_time_over_builder"] == pytest.approx(2.0)
    assert q["export_peak_rss_over_builder"] == pytest.approx(5 / 5.5)
    assert q["builder_peak_rss_over_weights"] == pytest.approx(1.375)
    assert q["write_mb_s"] == pytest.approx(200.0) and q["copy_mb_s"] == pytest.approx(400.0)
    assert q["write_over_copy"] == pytest.approx(0.5)
    line = _ratio_line({"ratios": q})
    assert "export --hf (same folder and dtype): 2.00x builder's time, peak RSS 0.91x" in line
    assert "writing 200 MB/s against cp's 400 MB/s on the same bytes (0.50x)" in line
    goals = scale.goals({"sizes": [{**_result(), "status": "measured", "ratios": q, "size": "1b", "shape": "s",
                                    "dtype": "fp32"}]})
    builder_goals = {g["goal"]: g["met"] for g in goals if "builder" in g["goal"] or "weight bytes" in g["goal"]}
    assert builder_goals == {"wall time of export --hf <= the faster graph builder's (builder)": False,
                             "peak RSS of export --hf <= 1.05x the weight bytes": False}


def test_every_row_is_held_to_the_faster_graph_builder_and_the_weights():
    result = _result()
    result["steps"] += [{"step": scale_peers.MOBIUS, "seconds": 20.0, "peak_rss": 1e9},
                        {"step": scale_peers.PACKAGE, "seconds": 30.0, "peak_rss": 2e9},
                        {"step": scale_peers.FULL_TRACE, "seconds": 160.0, "peak_rss": 6e9}]
    q = scale.ratios(result)
    assert q["fastest_peer"] == "mobius"
    assert q["export_time_over_mobius"] == pytest.approx(4.0) and q["export_time_over_fastest_peer"] == 4.0
    assert q["package_time_over_builder"] == pytest.approx(0.75) and q["package_time_over_fastest_peer"] == 1.5
    assert q["package_peak_rss_over_mobius"] == pytest.approx(2.0)
    assert q["mobius_peak_rss_over_weights"] == pytest.approx(0.25)
    assert q["export_time_over_full_trace"] == pytest.approx(0.5)
    line = _ratio_line({"ratios": q})
    assert "package genai --hf (same folder and dtype): 0.75x builder's time, peak RSS 0.36x, 1.50x mobius's" in line
    goals = scale.goals({"sizes": [{**result, "status": "measured", "ratios": q, "size": "1b", "shape": "s",
                                    "dtype": "fp32"}]})
    package = {g["goal"]: (round(g["measured"], 3), g["met"]) for g in goals if "package" in g["goal"]}
    assert package == {"peak RSS of package genai --hf <= 1.05x the weight bytes": (0.5, True),
                       "wall time of package genai --hf <= the faster graph builder's (mobius)": (1.5, False),
                       "peak RSS of package genai --hf <= mobius's": (2.0, False)}
    assert not any("--trace full" in g["goal"] for g in goals)  # the full trace is a row, not held to a goal


def test_without_the_builder_or_a_data_file_no_ratio_is_made_up():
    result = _result()
    result["steps"] = [s for s in result["steps"] if s["step"] in ("plain export", "export --hf")]
    q = scale.ratios(result)
    assert "export_time_over_builder" not in q and "write_over_copy" not in q and "fastest_peer" not in q
    assert "builder" not in _ratio_line({"ratios": q})


@pytest.mark.slow
@pytest.mark.skipif(bool(scale_peers.builder_missing()), reason=scale_peers.builder_missing() or "installed")
def test_the_model_folder_feeds_the_builder_and_export_the_same_weights(tmp_path):
    from rope_export.hf import build_hf_model

    config = {**scale.SIZES["1b"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 300,
              "bos_token_id": 1, "eos_token_id": 2}
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(config))
    folder = scale_peers.write_model_folder(tmp_path / "cfg", tmp_path / "model", dtype="fp32")
    random = build_hf_model(tmp_path / "cfg", dtype="fp32", seed=0, random_weights=True)
    loaded = build_hf_model(folder, dtype="fp32")  # what export --hf FOLDER builds
    for (name, a), b in zip(random.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    out = tmp_path / "built"
    run = subprocess.run(scale_peers.builder_command(folder, out, "fp32"), capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert (out / "model.onnx").is_file() and (out / "genai_config.json").is_file()
    assert json.loads((out / "genai_config.json").read_text())["model"]["vocab_size"] == 300
