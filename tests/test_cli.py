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
