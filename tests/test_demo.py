"""The demo (what `make demo` runs) and the deployment script, end to end on this machine."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import onnx

from rope_export import cli
from rope_export.export import count_rotary_nodes

ROOT = Path(__file__).resolve().parents[1]


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
    assert "5/5 check" in result.stdout and "done: artefacts" in result.stdout
    if "skipped: TensorRT" in result.stdout:
        assert not (tmp_path / "deploy" / "model.engine").exists()
    reports = sorted(p.name for p in (tmp_path / "deploy" / "report").iterdir())
    assert reports == sorted(["model", "model.trt-plugin", "model.onnx", "model.ort", "model.decomposed"])
    assert (tmp_path / "deploy" / "report" / "model.ort" / "check.json").is_file()


def test_deployment_script_stops_at_the_first_broken_step(tmp_path):
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "deploy.sh"), "--preset", "no-such-preset", "--out", str(tmp_path / "d")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 1
    assert 'step "export" failed' in result.stderr and "unknown preset 'no-such-preset'" in result.stderr
    assert "2/5" not in result.stdout
