"""The demo (what `make demo` runs) and the deployment script, end to end on this machine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

from rope_export import cli
from rope_export.exporting.core import count_rotary_nodes

ROOT = Path(__file__).resolve().parents[2]


def test_demo_validates_every_target(tmp_path, capsys):
    assert cli.main(["demo", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for target in ("custom-op", "trt-plugin", "onnx", "ort", "decomposed"):
        assert target in out
    assert "FAIL" not in out and out.count("pass") >= 14  # 7 preset rows and 7 tiny Llama rows ran
    assert "tensorrt" in out  # its row is there, skipped with a reason, when TensorRT is absent
    lowered = [f"model.{t}.onnx" for t in ("trt-plugin", "onnx", "ort", "decomposed")]
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == sorted(["model.onnx", "llama", *lowered])
    assert count_rotary_nodes(onnx.load_model(tmp_path / "model.onnx")) == 2
    # the real-model path: export --hf of a tiny Llama config, its lowerings, checked against transformers
    assert "tiny Llama" in out and "against its reference" in out
    assert sorted(p.name for p in (tmp_path / "llama").iterdir()) == sorted(["config.json", "model.onnx", *lowered])
    assert count_rotary_nodes(onnx.load_model(tmp_path / "llama" / "model.onnx")) == 4  # q and k of 2 layers


def test_deployment_script_runs_to_the_end(tmp_path):
    env = dict(os.environ)
    bindir = Path(sys.executable).parent
    env["PATH"] = f"{bindir}{os.pathsep}{env['PATH']}"  # the venv's rope-export and python
    env["ROPE_EXPORT"] = shutil.which("rope-export", path=env["PATH"])
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "deploy.sh"), "--preset", "tiny", "--dtype", "fp16", "--cache-len", "128",
         "--out", str(tmp_path / "deploy")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "5/7 check every artefact against PyTorch" in result.stdout and "done: artefacts" in result.stdout
    if "skipped: TensorRT" in result.stdout:
        assert not (tmp_path / "deploy" / "model.engine").exists()
    reports = sorted(p.name for p in (tmp_path / "deploy" / "report").iterdir())
    assert reports == sorted(["model", "model.trt-plugin", "model.onnx", "model.ort", "model.decomposed"])
    assert (tmp_path / "deploy" / "report" / "model.ort" / "check.json").is_file()
    # the Triton repository serves the checked onnx lowering; genai is for whole causal LMs only
    assert (tmp_path / "deploy" / "triton" / "tiny" / "1" / "model.onnx").is_file()
    assert 'name: "tiny"' in (tmp_path / "deploy" / "triton" / "tiny" / "config.pbtxt").read_text()
    assert "skipped: onnxruntime-genai runs whole causal LMs" in result.stdout


def _deploy(args: list[str], timeout: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env["ROPE_EXPORT"] = shutil.which("rope-export", path=env["PATH"])
    return subprocess.run(["bash", str(ROOT / "scripts" / "deploy.sh"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow  # 5 checks against transformers in their own processes: minutes; the preset run keeps the script
def test_deployment_script_takes_a_transformers_model_folder(tmp_path):
    """--hf: a tiny random-weight Llama written by save_pretrained (offline), exported with its weights,
    every artefact checked against transformers, then the Triton repository."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from rope_export.cli.demo import TINY_LLAMA

    folder = tmp_path / "tiny-llama.v1"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**TINY_LLAMA)).save_pretrained(folder)
    out = tmp_path / "deploy"
    result = _deploy(["--hf", str(folder), "--out", str(out)], timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "5/7 check every artefact against transformers" in result.stdout
    for name in ("model", "model.trt-plugin", "model.onnx", "model.ort", "model.decomposed"):
        report = json.loads((out / "report" / name / "check.json").read_text())
        assert report["passed"] and report["reference"].startswith("transformers Llama")
        assert str(folder) in report["reference"]  # its weights, not random ones
    repo = out / "triton" / "tiny-llama_v1"  # the folder's name, in the characters Triton takes
    assert sorted(p.name for p in (repo / "1").iterdir()) == ["model.onnx", "model.onnx.data"]
    assert "validated against Triton's ModelConfig schema" in result.stdout or "not validated" in result.stdout
    config = json.loads((out / "genai" / "genai_config.json").read_text())
    assert config["model"]["decoder"]["num_hidden_layers"] == TINY_LLAMA["num_hidden_layers"]
    assert (out / "genai" / "model.onnx").is_file()


def test_deployment_script_refuses_preset_and_hf_together(tmp_path):
    result = _deploy(["--preset", "tiny", "--hf", str(tmp_path), "--out", str(tmp_path / "d")], timeout=60)
    assert result.returncode == 2 and result.stderr.strip() == "deploy.sh: give --preset or --hf, not both"
    assert not (tmp_path / "d").exists()


def test_deployment_script_stops_when_the_model_folder_is_not_a_model(tmp_path):
    (tmp_path / "empty").mkdir()
    result = _deploy(["--hf", str(tmp_path / "empty"), "--out", str(tmp_path / "d")], timeout=300)
    assert result.returncode == 1
    assert 'step "export" failed' in result.stderr and "2/7" not in result.stdout


def test_deployment_script_stops_at_the_first_broken_step(tmp_path):
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "deploy.sh"), "--preset", "no-such-preset", "--out", str(tmp_path / "d")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 1
    assert 'step "export" failed' in result.stderr and "unknown preset 'no-such-preset'" in result.stderr
    assert "2/7" not in result.stdout
