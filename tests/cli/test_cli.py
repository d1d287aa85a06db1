"""The command line: `rope-export presets`, `presets NAME`, `demo`, and its error handling."""

from __future__ import annotations

import json

import pytest

from rope_export.cli import main
from rope_export.presets import load_preset, preset_names


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    # rich sizes tables to the terminal (80 columns when captured); give it room so that whole
    # names are printed rather than cut with an ellipsis.
    monkeypatch.setenv("COLUMNS", "200")


def test_presets_lists_every_preset(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    assert "rope-export presets" in out
    names = preset_names()
    assert len(names) >= 10
    for name in names:
        preset = load_preset(name)
        row = next((line for line in out.splitlines() if f" {name} " in line), None)
        assert row is not None, f"{name} missing from the listing"
        assert preset.rope.rope_type in row
        assert f"{preset.attention.num_heads}/{preset.attention.num_kv_heads}" in row
        assert ("interleaved" if preset.rope.interleaved else "rotate-half") in row


def test_presets_shows_one_preset_as_json(capsys):
    assert main(["presets", "tiny"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data == load_preset("tiny").to_dict()
    assert data["attention"]["num_heads"] == 4 and data["rope"]["head_dim"] == 16


def test_presets_shows_a_toml_path(capsys, tmp_path):
    path = tmp_path / "custom.toml"
    path.write_text(
        'name = "custom"\n[attention]\nhidden_size = 32\nnum_heads = 2\nnum_kv_heads = 1\nhead_dim = 16\n'
        '[rope]\nrope_type = "linear"\nfactor = 2.0\n',
        encoding="utf-8",
    )
    assert main(["presets", str(path)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["name"] == "custom" and data["rope"]["rope_type"] == "linear" and data["rope"]["factor"] == 2.0


def test_unknown_preset_exits_2_with_a_clear_message(capsys):
    assert main(["presets", "no-such-model"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert err.startswith("rope-export presets: error:")
    assert "unknown preset 'no-such-model'" in err
    assert "tiny" in err and "llama-3.1-8b" in err
    assert "Traceback" not in err and len(err.splitlines()) == 1


def test_bad_preset_file_exits_2_naming_file_and_field(capsys, tmp_path):
    path = tmp_path / "broken.toml"
    text = 'name = "x"\n[attention]\nhidden_size = 32\nnum_heads = 2\nhead_dim = 16\n[rope]\n'
    path.write_text(text, encoding="utf-8")
    assert main(["presets", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "attention.num_kv_heads" in err


def test_demo_runs_on_the_default_preset(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the demo writes its artefacts under ./out/demo
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "tiny" in out  # the default preset
    assert "pass" in out and "FAIL" not in out
    assert (tmp_path / "out" / "demo" / "model.onnx").is_file()


def test_demo_with_an_unknown_preset_exits_2(capsys, tmp_path):
    assert main(["demo", "--preset", "no-such-model", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "rope-export demo: error:" in err and "unknown preset 'no-such-model'" in err


def test_unknown_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "presets" in out and "demo" in out


META_BLOCK = '''
import torch
from torch import nn


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis[:, :, None, :]
    return (torch.view_as_real(xq_ * freqs_cis).flatten(3).type_as(xq),
            torch.view_as_real(xk_ * freqs_cis).flatten(3).type_as(xk))


class Attention(nn.Module):
    def __init__(self, dim=32, heads=4, max_pos=64):
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.wq, self.wk = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        freqs = 1.0 / (10000.0 ** (torch.arange(0, self.hd, 2).float() / self.hd))
        angles = torch.outer(torch.arange(max_pos, dtype=torch.float32), freqs)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=False)

    def forward(self, x, pos):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.hd)
        k = self.wk(x).view(b, s, self.heads, self.hd)
        q, k = apply_rotary_emb(q, k, self.freqs_cis[pos])  # Meta's complex table, indexed by positions
        return (q * k).sum(-1)


def make():
    return Attention().eval(), (torch.randn(2, 5, 32), torch.arange(5).expand(2, -1).contiguous())
'''


def test_metas_complex_table_indexed_by_positions_exports_through_the_cli(capsys, tmp_path):
    """Meta's complex freqs_cis indexed by positions used to fail in torch.onnx's translation; export_module
    now traces the complex tensors as real pairs and fuses both rotations."""
    (tmp_path / "meta_block.py").write_text(META_BLOCK)
    out = tmp_path / "out.onnx"
    import onnx

    assert main(["export", "--module", f"{tmp_path / 'meta_block.py'}:make", "-o", str(out)]) == 0
    model = onnx.load(out)
    assert sum(n.op_type == "RotaryEmbedding" and n.domain == "rope_export" for n in model.graph.node) == 2


COMPLEX_INPUT_BLOCK = '''
import torch


class ComplexIn(torch.nn.Module):
    def forward(self, z, pos):
        turn = torch.polar(torch.ones_like(pos, dtype=torch.float32), pos.float())
        return torch.view_as_real(z * turn[..., None])


def make():
    return ComplexIn(), (torch.randn(2, 5, 8, dtype=torch.complex64), torch.arange(5).expand(2, 5))
'''


def test_a_failure_inside_torch_onnx_is_one_line_naming_the_stage_and_the_fix(capsys, tmp_path):
    """A complex input fails in torch.onnx's translation; the line used to be torch's page of text (hundreds
    of characters, ANSI colours) called an internal error."""
    (tmp_path / "complex_input.py").write_text(COMPLEX_INPUT_BLOCK)
    out = tmp_path / "out.onnx"
    assert main(["export", "--module", f"{tmp_path / 'complex_input.py'}:make", "-o", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "\x1b" not in err and len(err) < 220, err
    assert err.startswith("rope-export export: error: torch.onnx failed translating to ONNX: "), err
    assert "complex" in err and "view_as_real" in err
    assert "internal error" not in err and not out.exists()


BRANCHING_BLOCK = '''
import torch


class Branching(torch.nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # a Python branch on a tensor's value: torch.export cannot trace it
            return x * 2
        return x - 1


def make():
    return Branching(), (torch.randn(2, 3),)
'''


def test_a_tracing_failure_names_torch_export_and_the_usual_fix(capsys, tmp_path):
    (tmp_path / "branching.py").write_text(BRANCHING_BLOCK)
    assert main(["export", "--module", f"{tmp_path / 'branching.py'}:make", "-o", str(tmp_path / "o.onnx")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "\x1b" not in err and len(err) < 220, err
    assert err.startswith("rope-export export: error: torch.onnx failed tracing (torch.export): ")
    assert "data-dependent" in err and "torch.where/torch.cond" in err


def test_other_errors_keep_the_internal_error_line():
    from rope_export.exporting.torch_onnx import describe_failure

    assert describe_failure(RuntimeError("\x1b[96mnot from torch\x1b[0m")) is None
