"""What `rope-export --help` and `rope-export COMMAND --help` import: values, not timings (the timings
are `rope-export bench --sections cli`). Each case runs in a fresh interpreter, since this one has torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rope_export import cli

HEAVY = ("torch", "transformers", "onnxruntime", "onnxscript", "polygraphy", "matplotlib")
PROBE = """
import json, sys
from rope_export import cli
try:
    cli.main({argv!r})
except SystemExit:
    pass
print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)))
"""


def heavy_imports(argv: list[str]) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", PROBE.format(argv=argv, heavy=HEAVY + ("onnx", "onnx_ir"))],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_top_level_help_imports_no_library():
    assert heavy_imports(["--help"]) == []


@pytest.mark.parametrize("command", ["lower", "fuse", "check", "build", "presets", "build-plugin", "package", "bench",
                                     "demo", "export"])
def test_a_command_help_imports_no_heavy_library(command):
    # onnx and onnx_ir may come with a command's parser; torch, transformers, onnxruntime, onnxscript not
    assert not set(heavy_imports([command, "--help"])) & set(HEAVY)


@pytest.fixture(scope="module")
def tiny_onnx(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny.onnx"
    assert cli.main(["export", "--preset", "tiny", "-o", str(path)]) == 0
    return path


@pytest.mark.parametrize("target", ["onnx", "ort", "trt-plugin", "decomposed"])
def test_lower_runs_without_torch(tiny_onnx, tmp_path, target):
    # the lowered nodes are validated against the contract in NumPy: importing torch was most of lower's time
    heavy = heavy_imports(["lower", str(tiny_onnx), "--target", target, "-o", str(tmp_path / "out.onnx")])
    assert (tmp_path / "out.onnx").is_file()
    assert "torch" not in heavy and "transformers" not in heavy


def test_top_level_help_lists_every_command_and_the_users_path(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    for name in cli.COMMANDS:
        assert f"    {name}" in out, name
    assert "--hf" in out and "--module" in out


def test_every_command_is_built_by_its_modules():
    # the whole parser (every module imported) has exactly the listed commands, each with a real parser
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command")
    assert set(subparsers.choices) == set(cli.COMMANDS)
    for name, sub in subparsers.choices.items():
        assert sub.get_default("func") is not cli._not_available, name
        lone = cli.build_parser(name, every=False)  # what a run of that command builds
        lone_sub = next(a for a in lone._actions if a.dest == "command").choices[name]
        assert lone_sub.format_help() == sub.format_help(), name  # every option, --hf and --module included
        assert lone_sub.get_default("func") is not cli._not_available, name


def test_command_in_skips_options():
    assert cli.command_in(["--debug", "lower", "x.onnx", "-t", "onnx"]) == "lower"
    assert cli.command_in(["--help"]) is None


def test_lowering_targets_and_their_help_list_the_same_names():
    from rope_export.passes.lowering import TARGETS
    from rope_export.passes.targets import TARGET_HELP

    assert list(TARGETS) == list(TARGET_HELP)


def test_the_benchmark_times_every_commands_help_and_lower_fuse_against_their_targets(tmp_path):
    from rope_export.bench import cli_startup

    cases = {name: target for name, _argv, target in cli_startup._cases(tmp_path, tuple(cli.COMMANDS))}
    assert cases["rope-export --help"] == cli_startup.HELP_TARGET_S == 0.5
    for command in cli.COMMANDS:
        assert cases[f"rope-export {command} --help"] == 0.5, command
    lowered = [name for name in cases if name.startswith("rope-export lower -t")]
    assert len(lowered) == 4 and all(cases[n] == cli_startup.RUN_TARGET_S == 1.5 for n in lowered)
    section = {"status": "measured", "rounds": 1, "rows": [
        {"command": "rope-export --help", "median_s": 0.1, "min_s": 0.1, "target_s": 0.5, "met": True}]}
    assert "| `rope-export --help` | 0.10 | 0.10 | 0.5 | yes |" in cli_startup.markdown(section)


def test_library_future_warnings_show_only_with_verbose(monkeypatch):
    import warnings

    def warn(args):
        warnings.warn("a keyword transformers deprecates", FutureWarning, stacklevel=1)
        return 0

    parser = cli.build_parser

    def patched(*args, **kwargs):
        p = parser(*args, **kwargs)
        next(a for a in p._actions if a.dest == "command").choices["presets"].set_defaults(func=warn)
        return p

    monkeypatch.setattr(cli, "build_parser", patched)
    for argv, shown in ((["presets"], False), (["--verbose", "presets"], True), (["presets", "--verbose"], True)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert cli.main(argv) == 0
        assert any(issubclass(w.category, FutureWarning) for w in caught) == shown, argv


@pytest.mark.parametrize("command", ["build", "build-plugin"])
def test_build_help_is_written_for_users_not_as_a_docstring(command, capsys, monkeypatch):
    monkeypatch.setattr(cli, "COMMAND_MODULES", ["rope_export.cli.build_plugin", "rope_export.cli.build"])
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    out = capsys.readouterr().out
    assert "``" not in out and "rope_export." not in out
    assert "trt-plugin" in out or "librope_export_trt_plugin.so" in out  # what it is for, in user terms
