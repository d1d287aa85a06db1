"""Atomic file writes: a reader never sees a half-written file, a failure leaves none behind.

Single files go through ``atomic_path`` (a temporary file beside the target, renamed onto it).
Groups of files that must appear together (an ONNX model and its external weights) are written
into a ``staging_dir`` beside the target and moved into place by ``commit_moves``, which holds
SIGINT/SIGTERM until every rename is done.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path


def check_writable(path: str | os.PathLike) -> Path:
    """The folder ``path`` would be written in; raise naming the problem if it cannot be.

    Called before slow work (an export, a pass over a large model) as well as by every atomic
    write. Besides the permission bits it creates and removes a probe file, which also catches
    read-only mounts, ACLs and full quotas that ``os.access`` does not see."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise FileNotFoundError(f"cannot write {path}: the folder {parent} does not exist; create it first")
    if path.is_dir():
        raise IsADirectoryError(f"cannot write {path}: it is a folder; give a file name such as {path / 'model.onnx'}")
    if path.exists() and not os.access(path, os.W_OK):
        raise PermissionError(f"cannot write {path}: permission denied; choose a writable path")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".probe", dir=parent)
    except OSError as exc:
        raise PermissionError(f"cannot write {path}: the folder {parent} is not writable ({exc.strerror})") from None
    os.close(fd)
    os.unlink(probe)
    return parent


def _usual_mode(path: Path) -> None:
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual mode


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is renamed onto ``path``.

    The caller writes the file at the yielded path. On any exception (KeyboardInterrupt
    included) the temporary file is removed and an existing ``path`` is left as it was.
    """
    path = Path(path)
    parent = check_writable(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent)
    os.close(fd)
    tmp_path = Path(tmp)
    _usual_mode(tmp_path)
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


@contextlib.contextmanager
def staging_dir(path: str | os.PathLike) -> Iterator[Path]:
    """A new hidden folder beside ``path`` (same file system, so moving out of it is a rename).

    Write the files that belong together in it, then ``commit_moves`` them into place. The folder
    and whatever is still in it are removed when the block ends, also on error or interrupt.
    """
    parent = check_writable(path)
    stage = Path(tempfile.mkdtemp(prefix=f".{Path(path).name}.", suffix=".tmp", dir=parent))
    try:
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)


_DEFERRED = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM until the block ends; they take effect right after it.

    Python runs signal handlers in the main thread only, so the handlers are swapped for ones
    that just note the signal (blocking the signal would not do: another thread of the process,
    e.g. onnxruntime's or torch's, would receive it). Elsewhere than in the main thread this does
    nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    saved = {}
    for number in _DEFERRED:
        handler = signal.getsignal(number)
        if handler is not None:  # None: installed outside Python; leave it alone
            saved[number] = signal.signal(number, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        for number, handler in saved.items():
            signal.signal(number, handler)
        for number in received:
            signal.raise_signal(number)


def commit_moves(moves: Sequence[tuple[Path, Path]], trash: Path) -> None:
    """Rename each ``(source, target)`` in order, with SIGINT/SIGTERM held until all are done.

    A target of another kind (a folder where a file goes, or the reverse) is first moved into
    ``trash`` (a folder in the staging area, removed with it), since a rename cannot replace it.
    Order the moves so that what is referred to lands before what refers to it.
    """
    with signals_deferred():
        for source, target in moves:
            if target.exists() and not target.is_symlink() and (target.is_dir() or source.is_dir()):
                trash.mkdir(exist_ok=True)
                os.replace(target, trash / target.name)
            os.replace(source, target)
