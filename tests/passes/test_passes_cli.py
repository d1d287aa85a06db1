"""``rope-export lower`` and ``rope-export fuse`` through the project's CLI entry point."""

from __future__ import annotations

import onnx
import pytest
from passes_util import rotary_case, run_ort
from test_passes_fuse_rules import Rope, torchscript

from rope_export import cli
from rope_export.op.contract import DOMAIN
from rope_export.op.tolerances import tolerance


@pytest.fixture
def main(monkeypatch):
    if "rope_export.cli.passes" not in cli.COMMAND_MODULES:
        monkeypatch.setattr(cli, "COMMAND_MODULES", [*cli.COMMAND_MODULES, "rope_export.cli.passes"])
    return cli.main


@pytest.mark.parametrize("target", ["trt-plugin", "onnx", "ort", "decomposed"])
def test_lower_writes_the_lowered_file(main, tmp_path, capsys, target):
    model, feeds, expected = rotary_case(x_dtype="float16", cache_dtype="float32", rd=8, angles=True)
    src, out = tmp_path / "in.onnx", tmp_path / "out.onnx"
    onnx.save(model, src)
    assert main(["lower", str(src), "--target", target, "-o", str(out)]) == 0
    assert f"lowered 1 RotaryEmbedding node(s) to {target}" in capsys.readouterr().out
    lowered = onnx.load(out)
    assert DOMAIN not in {n.domain for n in lowered.graph.node}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.onnx", "out.onnx"]  # no temporary left
    if target != "trt-plugin":
        assert tolerance("op", "float16").allclose(run_ort(lowered, feeds)[0], expected)


def test_lower_trust_positions_feeds_position_ids(main, tmp_path):
    model, _, _ = rotary_case(angles=True)
    onnx.save(model, tmp_path / "in.onnx")
    argv = ["lower", str(tmp_path / "in.onnx"), "-t", "onnx", "--trust-positions", "-o", str(tmp_path / "o.onnx")]
    assert main(argv) == 0
    (rope,) = [n for n in onnx.load(tmp_path / "o.onnx").graph.node if n.op_type == "RotaryEmbedding"]
    assert rope.input[3] == "pos"


def test_lower_errors_name_the_problem(main, tmp_path, capsys):
    assert main(["lower", str(tmp_path / "missing.onnx"), "-t", "onnx", "-o", str(tmp_path / "o.onnx")]) == 2
    assert "no such ONNX file" in capsys.readouterr().err
    (tmp_path / "junk.onnx").write_bytes(b"not a model")
    assert main(["lower", str(tmp_path / "junk.onnx"), "-t", "onnx", "-o", str(tmp_path / "o.onnx")]) == 2
    assert "not a readable ONNX file" in capsys.readouterr().err
    model, _, _ = rotary_case(layout="bhsd", rd=8, static_dims=False, angles=True)
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_param = "h"
    onnx.save(model, tmp_path / "in.onnx")
    assert main(["lower", str(tmp_path / "in.onnx"), "-t", "ort", "-o", str(tmp_path / "o.onnx")]) == 2
    err = capsys.readouterr().err
    assert "rope-export lower: error:" in err and "--target onnx or --target decomposed" in err
    assert not (tmp_path / "o.onnx").exists()
    with pytest.raises(SystemExit) as exc:
        main(["lower", str(tmp_path / "in.onnx"), "-t", "tensorrt", "-o", str(tmp_path / "o.onnx")])
    assert exc.value.code == 2


def test_fuse_prints_the_table_and_writes_the_file(main, tmp_path, capsys):
    onnx.save(torchscript(Rope("table")), tmp_path / "in.onnx")
    onnx.save(torchscript(Rope("computed-not-duplicated")), tmp_path / "odd.onnx")
    assert main(["fuse", str(tmp_path / "in.onnx"), "-o", str(tmp_path / "out.onnx")]) == 0
    out = capsys.readouterr().out
    assert "fused" in out and "table + position_ids" in out
    assert "1 rotation(s) found (cos/sin feeding multiply-add pairs), 1 fused:" in out
    assert sum(n.domain == DOMAIN for n in onnx.load(tmp_path / "out.onnx").graph.node) == 1


def test_fuse_that_fuses_nothing_of_what_it_found_warns_and_fails(main, tmp_path, capsys):
    """A rotation look-alike (sin of twice cos's angles) is multiply-add arithmetic on cos/sin: counted as
    found, left alone with the reason, and "0 of 1" is a warning and exit status 1, not a quiet success."""
    onnx.save(torchscript(Rope("computed-not-duplicated")), tmp_path / "odd.onnx")
    assert main(["fuse", str(tmp_path / "odd.onnx"), "-o", str(tmp_path / "odd_out.onnx")]) == 1
    captured = capsys.readouterr()
    assert "left alone" in captured.out and "1 rotation(s) found (cos/sin feeding multiply-add pairs), 0 fused, " \
        "1 left decomposed" in captured.out
    assert "warning: 1 rotation(s) stayed decomposed" in captured.err and (tmp_path / "odd_out.onnx").is_file()
    assert "the table says why each site was left alone" in captured.err


def test_fuse_says_when_no_rule_matched_what_it_found(main, tmp_path, capsys):
    """rope-export's own decomposed lowering passes out-of-range positions through (a Where around the
    rotation), a spelling no fusion rule reads back: the evidence counts its 2 rotations, no site row
    explains them, so the message must not point at a table that has no row for them."""
    assert main(["export", "--preset", "tiny", "-o", str(tmp_path / "tiny.onnx")]) == 0
    assert main(["lower", str(tmp_path / "tiny.onnx"), "-t", "decomposed", "-o", str(tmp_path / "dec.onnx")]) == 0
    capsys.readouterr()
    assert main(["fuse", str(tmp_path / "dec.onnx"), "-o", str(tmp_path / "out.onnx")]) == 1
    captured = capsys.readouterr()
    assert "2 rotation(s) found (cos/sin feeding multiply-add pairs), 0 fused, 2 left decomposed" in captured.out
    assert "no fusion rule matched them" in captured.err and "table" not in captured.err
