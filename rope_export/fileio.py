"""Atomic file writes: a reader never sees a half-written file, a failure leaves none behind."""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

# The atomic writers name their temporary files ".<name>.<8 random>.tmp" and, for ONNX external
# data, ".<name>.data.<8 random>.tmp": the longest is the name plus these bytes.
_TEMP_NAME_EXTRA = len(".") + len(".data.") + 8 + len(".tmp")


def check_writable(path: str | os.PathLike) -> Path:
    """The folder ``path`` would be written in; raise an OSError naming the problem if it cannot be.

    Called before slow work (an export) as well as by every atomic write. It tries rather than
    asks: os.access says yes to root for any folder (and /proc, an immutable folder or a full
    disk say no only when written), so a temporary file is created and removed in the folder."""
    path = Path(path)
    try:
        return _check_writable(path)
    except OSError as exc:
        if exc.errno != errno.ENAMETOOLONG:
            raise
        raise OSError(f"cannot write {str(path)[:60]}...: a name in the path is longer than the file system "
                      "allows; use shorter folder and file names") from None


def _check_writable(path: Path) -> Path:
    parent = path.parent if str(path.parent) else Path(".")
    try:
        name_max = os.pathconf(parent if parent.is_dir() else ".", "PC_NAME_MAX")
    except (OSError, ValueError):  # pragma: no cover - platforms without pathconf
        name_max = 255
    size = len(os.fsencode(path.name))
    if size + _TEMP_NAME_EXTRA > name_max:
        raise OSError(  # one argument: str() is the message, without an "[Errno 36]" prefix
            f"cannot write {path.name[:40]}...: the file name is {size} bytes; this file system allows "
            f"{name_max}, and the temporary file beside it needs {_TEMP_NAME_EXTRA} more: use a name of at most "
            f"{name_max - _TEMP_NAME_EXTRA} bytes",
        )
    if path.is_dir():
        raise IsADirectoryError(f"cannot write {path}: it is a folder; give a file name, e.g. {path / 'model.onnx'}")
    if not parent.is_dir():
        if parent.exists():
            raise NotADirectoryError(f"cannot write {path}: {parent} is a file, not a folder")
        raise FileNotFoundError(f"cannot write {path}: the folder {parent} does not exist; create it first")
    if path.exists():
        if not path.is_file():
            raise PermissionError(f"cannot write {path}: it exists and is not a regular file; choose another path")
        if not os.access(path, os.W_OK):
            raise PermissionError(f"cannot write {path}: permission denied; choose a writable path")
        try:  # root passes os.access; an immutable file still refuses (opened without truncating)
            os.close(os.open(path, os.O_WRONLY))
        except OSError as exc:
            problem = (exc.strerror or str(exc)).lower()
            raise PermissionError(f"cannot write {path}: {problem}; choose a writable path") from None
    if not os.access(parent, os.W_OK):
        raise PermissionError(f"cannot write {path}: the folder {parent} is not writable")
    try:
        _probe(parent, path.name)
    except OSError as exc:
        problem = (exc.strerror or str(exc)).lower()
        raise PermissionError(f"cannot write {path}: the folder {parent} refuses new files ({problem}); choose another "
                              "folder") from None
    return parent


def _probe(folder: Path, name: str) -> None:
    """Create and remove a file in ``folder``. An unnamed one where the file system allows
    (O_TMPFILE): then a signal arriving meanwhile cannot leave a name behind."""
    flag = getattr(os, "O_TMPFILE", 0)
    if flag:
        try:
            os.close(os.open(folder, flag | os.O_WRONLY, 0o600))
            return
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
    probe = folder / f".{name}.{os.getpid()}.probe.tmp"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    finally:
        with contextlib.suppress(FileNotFoundError):
            probe.unlink()


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
