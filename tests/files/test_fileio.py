"""Atomic writes: the target is either the old file or the complete new one; no temp file is left."""

from __future__ import annotations

import os
import stat

import pytest

from rope_export.common.fileio import atomic_path, atomic_write_bytes, atomic_write_text


def leftovers(folder, target_name: str) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name != target_name)


def test_write_text_creates_the_file(tmp_path):
    target = tmp_path / "model.json"
    atomic_write_text(target, "héllo\n")
    assert target.read_bytes() == "héllo\n".encode()
    assert leftovers(tmp_path, "model.json") == []


def test_write_bytes_replaces_an_existing_file(tmp_path):
    target = tmp_path / "model.onnx"
    target.write_bytes(b"old")
    atomic_write_bytes(target, b"new contents")
    assert target.read_bytes() == b"new contents"
    assert leftovers(tmp_path, "model.onnx") == []


def test_failure_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    target = tmp_path / "model.onnx"
    target.write_bytes(b"precious")
    with pytest.raises(RuntimeError, match="export failed"):
        with atomic_path(target) as tmp:
            assert tmp.parent == tmp_path and tmp != target
            tmp.write_bytes(b"half-writ")
            raise RuntimeError("export failed")
    assert target.read_bytes() == b"precious"
    assert leftovers(tmp_path, "model.onnx") == []


def test_failure_without_an_old_file_leaves_nothing(tmp_path):
    target = tmp_path / "fresh.onnx"
    with pytest.raises(TypeError):
        atomic_write_bytes(target, "not bytes")  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


def test_writer_that_never_writes_still_leaves_no_temp(tmp_path):
    target = tmp_path / "out.bin"
    target.write_bytes(b"keep")
    with pytest.raises(KeyboardInterrupt):
        with atomic_path(target):
            raise KeyboardInterrupt
    assert target.read_bytes() == b"keep"
    assert leftovers(tmp_path, "out.bin") == []


def test_temp_file_lies_beside_the_target_until_success(tmp_path):
    target = tmp_path / "a.txt"
    with atomic_path(target) as tmp:
        tmp.write_text("x")
        assert not target.exists()  # a reader never sees a half-written target
        assert tmp.exists() and tmp.parent == target.parent
    assert target.read_text() == "x" and not tmp.exists()


def test_written_file_gets_the_usual_mode(tmp_path):
    old = os.umask(0o022)
    try:
        target = tmp_path / "m.txt"
        atomic_write_text(target, "x")
    finally:
        os.umask(old)
    assert stat.S_IMODE(target.stat().st_mode) == 0o644  # not mkstemp's 0600


def test_missing_folder_is_named(tmp_path):
    target = tmp_path / "no" / "such" / "out.onnx"
    with pytest.raises(FileNotFoundError) as info:
        atomic_write_text(target, "x")
    assert str(target.parent) in str(info.value)
    assert "does not exist" in str(info.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write into read-only folders")
def test_read_only_folder_is_named(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(PermissionError, match="not writable"):
            atomic_write_text(folder / "x.txt", "x")
    finally:
        folder.chmod(0o700)


def test_relative_path_in_current_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    atomic_write_text("plain.txt", "ok")
    assert (tmp_path / "plain.txt").read_text() == "ok"
    assert leftovers(tmp_path, "plain.txt") == []
