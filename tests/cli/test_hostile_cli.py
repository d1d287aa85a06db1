"""Every CLI command with broken files and paths: one line on stderr, exit 2, nothing written (issue 16).

Also the error handler itself: an unexpected exception is one line plus where the traceback is
(``--debug``), exit 1; onnx_ir's logged traceback no longer precedes lower's own error.
"""

from __future__ import annotations

import os
import stat

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from rope_export import cli
from rope_export.op.contract import DOMAIN, RotaryAttrs
from rope_export.op.onnx_op import make_rotary_node
from rope_export.presets import export as preset_export


@pytest.fixture()
def files(tmp_path):
    """Broken inputs: missing, a folder, random bytes, a TOML that is not a preset, a valid model."""
    (tmp_path / "folder").mkdir()
    (tmp_path / "random.onnx").write_bytes(np.random.default_rng(0).bytes(4096))
    (tmp_path / "notes.txt").write_text("not a folder\n")
    (tmp_path / "broken.toml").write_text("name = [\n")
    x = helper.make_tensor_value_info("x", TensorProto.INT32, [1, 2, 3, 8])  # X of a type the op refuses
    pos = helper.make_tensor_value_info("pos", TensorProto.INT64, [1, 3])
    cache = numpy_helper.from_array(np.ones((4, 4), np.float32), "cos")
    node = make_rotary_node("x", "cos", "cos", "pos", "y", RotaryAttrs())
    y = helper.make_tensor_value_info("y", TensorProto.INT32, [1, 2, 3, 8])
    graph = helper.make_graph([node], "g", [x, pos], [y], initializer=[cache])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)])
    onnx.save(model, tmp_path / "int_x.onnx")
    model.graph.input[0].type.tensor_type.elem_type = TensorProto.FLOAT
    model.graph.output[0].type.tensor_type.elem_type = TensorProto.FLOAT
    onnx.save(model, tmp_path / "valid.onnx")
    return tmp_path


def _run(capsys, argv: list[str], code: int = 2) -> str:
    assert cli.main(argv) == code, capsys.readouterr()
    captured = capsys.readouterr()
    err = captured.err
    assert err.count("\n") == 1, err  # exactly one line
    assert "Traceback" not in err and "Traceback" not in captured.out
    return err.strip()


BROKEN = [
    # (argv with {d} for the folder, words the one line must contain)
    (["presets", "{d}/missing.toml"], ["unknown preset"]),
    (["presets", "{d}/broken.toml"], ["not valid TOML"]),
    (["export", "--preset", "{d}/broken.toml", "-o", "{d}/m.onnx"], ["not valid TOML"]),
    (["export", "-o", "{d}/folder"], ["it is a folder", "give a file name"]),
    (["export", "-o", "{d}/" + "a" * 300 + ".onnx"], ["the file name is 305 bytes", "at most"]),
    (["export", "-o", "{d}/" + "b" * 300 + "/m.onnx"], ["longer than the file system allows"]),
    # the folders export makes for its output are removed again when it fails
    (["export", "--preset", "{d}/broken.toml", "-o", "{d}/no/such/m.onnx"], ["not valid TOML"]),
    (["export", "-o", "{d}/notes.txt/m.onnx"], ["is a file, not a folder"]),
    (["lower", "{d}/missing.onnx", "-t", "onnx", "-o", "{d}/o.onnx"], ["missing.onnx"]),
    (["lower", "{d}/random.onnx", "-t", "onnx", "-o", "{d}/o.onnx"], ["not a readable ONNX file"]),
    (["lower", "{d}/int_x.onnx", "-t", "onnx", "-o", "{d}/o.onnx"], ["int32", "float32, float16 or bfloat16"]),
    (["lower", "{d}/valid.onnx", "-t", "ort", "-o", "{d}/folder"], ["it is a folder"]),
    (["fuse", "{d}/valid.onnx", "-o", "{d}/" + "c" * 300 + ".onnx"], ["the file name is 305 bytes"]),
    (["fuse", "{d}/random.onnx", "-o", "{d}/o.onnx"], ["not a readable ONNX file"]),
    (["fuse", "{d}/missing.onnx", "-o", "{d}/o.onnx"], ["missing.onnx"]),
    (["check", "{d}/missing.onnx"], ["missing.onnx"]),
    (["check", "{d}/folder"], ["folder"]),
    (["build", "{d}/missing.onnx", "-o", "{d}/e.engine"], []),
    (["build-plugin", "--build-dir", "{d}/notes.txt"], ["notes.txt"]),
    (["demo", "--out", "{d}/notes.txt"], ["notes.txt"]),
]


@pytest.mark.parametrize("argv, words", BROKEN, ids=[" ".join(a[:2]) + f"#{i}" for i, (a, _) in enumerate(BROKEN)])
def test_broken_files_and_paths_are_one_line_exit_2(files, capsys, argv, words):
    before = sorted(os.listdir(files))
    err = _run(capsys, [a.format(d=files) for a in argv])
    assert err.startswith(f"rope-export {argv[0]}: error: "), err
    for word in words:
        assert word in err, err
    assert sorted(os.listdir(files)) == before  # nothing written, no temporary file left


def test_lower_shows_no_onnx_ir_traceback_before_its_error(files, capsys):
    """onnx_ir's shape inference logs its exception with a traceback (on the root logger's
    last-resort handler) before lower's own message; the CLI quiets it unless --debug."""
    err = _run(capsys, ["lower", str(files / "int_x.onnx"), "-t", "onnx", "-o", str(files / "o.onnx")])
    assert "Shape inference failed" not in err


def _unwritable_folder(tmp_path):
    """A folder this process cannot create files in: chmod 555 for a user, /proc for root (root
    passes os.access and chmod; /proc refuses new files to everyone)."""
    if os.geteuid() == 0:
        return "/proc"
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(stat.S_IRUSR | stat.S_IXUSR)
    return str(folder)


def test_an_unwritable_output_is_found_before_the_export_and_names_the_output(tmp_path, capsys, monkeypatch):
    """Before the fix the error named the hidden temporary file and came after the whole export."""
    def must_not_run(*args, **kwargs):
        raise AssertionError("the export ran before the output was checked")

    monkeypatch.setattr(preset_export, "export_block", must_not_run)
    out = os.path.join(_unwritable_folder(tmp_path), "model.onnx")
    err = _run(capsys, ["export", "--preset", "tiny", "-o", out])
    assert f"cannot write {out}" in err and ".tmp" not in err


def test_an_existing_output_that_is_not_a_regular_file_is_refused(capsys, tmp_path):
    err = _run(capsys, ["export", "--preset", "tiny", "-o", os.devnull])
    assert "is not a regular file" in err


def _presets_raises(monkeypatch, error: BaseException) -> None:
    """`rope-export presets` raising ``error``: the handler is what is under test."""
    def fail(args):
        raise error

    parser = cli.build_parser

    def patched(*args, **kwargs):
        p = parser(*args, **kwargs)
        for action in p._subparsers._group_actions:
            action.choices["presets"].set_defaults(func=fail)
        return p

    monkeypatch.setattr(cli, "build_parser", patched)


def test_an_unexpected_exception_is_one_line_with_where_to_find_the_traceback(capsys, monkeypatch):
    _presets_raises(monkeypatch, RuntimeError("something inside\nspanning lines"))
    err = _run(capsys, ["presets"], code=1)
    assert err == ("rope-export presets: internal error: RuntimeError: something inside spanning lines (a bug in "
                   "rope-export or a library; run again with --debug or ROPE_EXPORT_DEBUG=1 for the traceback)")
    with pytest.raises(RuntimeError, match="something inside"):  # --debug: the traceback, anywhere on the line
        cli.main(["presets", "--debug"])
    with pytest.raises(RuntimeError):
        cli.main(["--debug", "presets"])
    monkeypatch.setenv(cli.DEBUG_ENV, "1")
    with pytest.raises(RuntimeError):
        cli.main(["presets"])


@pytest.mark.parametrize(
    "error",
    [
        ValueError("a value"), FileNotFoundError(2, "No such file or directory", "x.onnx"), MemoryError("big"),
        IsADirectoryError(21, "Is a directory", "out"), OSError(28, "No space left on device", "out.onnx"),
    ],
)
def test_the_handler_catches_every_bad_input_class_in_one_line(capsys, monkeypatch, error):
    _presets_raises(monkeypatch, error)
    err = _run(capsys, ["presets"])
    if isinstance(error, OSError) and error.filename:
        assert err == f"rope-export presets: error: cannot use {error.filename}: {error.strerror.lower()}"


def test_check_of_a_file_whose_metadata_asks_for_a_huge_block_is_one_line(files, capsys):
    """check rebuilds the block from the file's metadata: sizes there are bounded like a preset's."""
    import json

    from rope_export.presets import load_preset
    from rope_export.presets.export import preset_metadata

    model = onnx.load(files / "valid.onnx")
    metadata = preset_metadata(load_preset("tiny"), "fp32", 0, None, False)
    preset = json.loads(metadata["rope_export.preset"])
    preset["attention"].update(num_heads=10**8, num_kv_heads=10**8)
    metadata["rope_export.preset"] = json.dumps(preset)
    for key, value in metadata.items():
        model.metadata_props.add(key=key, value=value)
    onnx.save(model, files / "huge.onnx")
    err = _run(capsys, ["check", str(files / "huge.onnx")])
    assert "the preset block of the metadata" in err and "would allocate" in err and "100000000 heads" in err
