"""Atomic file writes: a reader never sees a half-written file, a failure leaves none behind."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


def check_writable(path: str | os.PathLike) -> Path:
    """The folder ``path`` would be written in; raise naming the problem if it cannot be.

    Called before slow work (an export) as well as by every atomic write."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise FileNotFoundError(f"cannot write {path}: the folder {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK):
        raise PermissionError(f"cannot write {path}: the folder {parent} is not writable")
    if path.exists() and not os.access(path, os.W_OK):
        raise PermissionError(f"cannot write {path}: permission denied; choose a writable path")
    return parent


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is renamed onto ``path``.

    The caller writes the file (or, for ONNX with external data, the file and its data file
    next to it) at the yielded path. On any exception the temporary file is removed.
    """
    path = Path(path)
    parent = check_writable(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent)
    os.close(fd)
    tmp_path = Path(tmp)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp_path, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual mode
    try:
        yield tmp_path
        os.replace(tmp_path, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))
