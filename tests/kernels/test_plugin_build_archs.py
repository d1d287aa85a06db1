"""--cuda-archs all|auto|LIST: a machine without a GPU compiles no CUDA kernel unless asked, one with GPUs
compiles for those; every architecture stays the default of `make plugin` (CI)."""

from __future__ import annotations

import os
import stat

import pytest

from rope_export import cli
from rope_export.kernels import build as plugin_build
from rope_export.kernels.libraries import CUDA_ARCHS


def _fake_smi(tmp_path, monkeypatch, output: str | None) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if output is not None:
        smi = bin_dir / "nvidia-smi"
        smi.write_text(f"#!/bin/sh\nprintf '{output}'\n")
        smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}/usr/bin:/bin" if output is not None else str(bin_dir))


def test_auto_is_the_gpus_nvidia_smi_reports(tmp_path, monkeypatch):
    _fake_smi(tmp_path, monkeypatch, "9.0\\n8.6\\n9.0\\n")
    assert plugin_build.gpu_archs() == [86, 90]
    assert plugin_build.resolve_archs("auto") == "86;90"


def test_auto_without_a_gpu_is_no_cuda_build(tmp_path, monkeypatch):
    _fake_smi(tmp_path, monkeypatch, None)
    assert plugin_build.gpu_archs() == []
    assert plugin_build.resolve_archs("auto") is None


def test_all_and_lists():
    assert plugin_build.resolve_archs("all") == ";".join(str(a) for a in CUDA_ARCHS)
    assert plugin_build.resolve_archs("80,90") == "80;90"
    with pytest.raises(cli.CLIError, match="all, or auto"):
        plugin_build.resolve_archs("sm_90")


def test_build_plugin_auto_without_a_gpu_configures_no_cuda_and_says_so(tmp_path, monkeypatch, capsys):
    seen = {}

    def fake_build(opts, quiet=False):
        seen["opts"] = opts
        return "rope-export plugins in X:\n"

    monkeypatch.setattr(plugin_build, "build_plugins", fake_build)
    monkeypatch.setattr(plugin_build, "gpu_archs", lambda: [])
    monkeypatch.setattr(cli, "COMMAND_MODULES", ["rope_export.cli.build_plugin"])
    assert cli.main(["build-plugin", "--build-dir", str(tmp_path), "--cuda-archs", "auto"]) == 0
    assert seen["opts"].cuda is False
    assert plugin_build.NO_GPU_NOTE in capsys.readouterr().out
    assert cli.main(["build-plugin", "--build-dir", str(tmp_path)]) == 0  # the default: every architecture
    assert seen["opts"].cuda is True and seen["opts"].cuda_archs == plugin_build.DEFAULT_CUDA_ARCHS
