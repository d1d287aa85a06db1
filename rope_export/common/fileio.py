"""Atomic file writes: a reader never sees a half-written file, a failure leaves none behind.

Single files go through ``atomic_path`` (a temporary file beside the target, renamed onto it).
Groups of files that must appear together (an ONNX model and its external weights) are written
into a ``staging_dir`` beside the target and moved into place by ``commit_moves``, which holds
SIGINT/SIGTERM until every rename is done.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

# The atomic writers name their temporary files ".<name>.<8 random>.tmp" and, for ONNX external
# data, ".<name>.data.<8 random>.tmp": the longest is the name plus these bytes.
_TEMP_NAME_EXTRA = len(".") + len(".data.") + 8 + len(".tmp")


def read_range(fileno: int, offset: int, view: memoryview) -> int:
    """Fill ``view`` with the file's bytes from ``offset`` (``preadv``, the file position untouched); returns the
    bytes read, fewer than ``len(view)`` only where the file ends first (the caller names the error)."""
    done = 0
    while done < len(view):
        n = os.preadv(fileno, [view[done:]], offset + done)
        if not n:
            break
        done += n
    return done


@contextlib.contextmanager
def parent_folders_made(path: str | os.PathLike) -> Iterator[list[Path]]:
    """The folders missing above ``path`` are created for the block (as ``mkdir -p``), and removed again, deepest
    first and only while empty, if the block fails (an export that fails leaves no folder it made). A path
    ``mkdir`` cannot make (a file where a folder should be) is left to ``check_writable`` to name."""
    missing = []
    parent = Path(path).parent
    try:
        while str(parent) not in ("", ".") and not parent.exists() and not parent.is_symlink():
            missing.append(parent)
            parent = parent.parent
    except OSError:  # a name too long for the file system: check_writable says so
        missing = []
    made = []
    for folder in reversed(missing):
        try:
            folder.mkdir()
        except OSError:
            break
        made.append(folder)
    try:
        yield made
    except BaseException:
        for folder in reversed(made):
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise


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
    tmp_path = None
    try:
        with signals_deferred():  # a signal held here is raised inside the try: the file is removed
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent)
            tmp_path = Path(tmp)
        os.close(fd)
        _usual_mode(tmp_path)
        yield tmp_path
        os.replace(tmp_path, path)
    finally:
        if tmp_path is not None:
            with signals_deferred(), contextlib.suppress(FileNotFoundError):
                tmp_path.unlink()


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


@contextlib.contextmanager
def staging_dir(path: str | os.PathLike) -> Iterator[Path]:
    """A new hidden folder ``.<name>.XXXXXXXX.tmp`` beside ``path`` (same file system, so moving out of it is a
    rename).

    Write the files that belong together in it, then ``commit_moves`` them into place. The folder
    and whatever is still in it are removed when the block ends, also on error or interrupt. While the
    block runs the process holds a lock on the folder (``flock``, released by the kernel however the
    process ends), so ``remove_abandoned`` tells the folder of a killed process from a live one's.
    """
    parent = check_writable(path)
    stage = lock = None
    try:
        with signals_deferred():  # a signal held here is raised inside the try: the folder is removed
            stage, lock = _locked_folder(parent, f".{Path(path).name}.")
        yield stage
    finally:
        with signals_deferred():  # a signal during the cleanup would cut it short
            if stage is not None:
                shutil.rmtree(stage, ignore_errors=True)
            if lock is not None:
                os.close(lock)


def _locked_folder(parent: Path, prefix: str) -> tuple[Path, int | None]:
    """A new folder and an open descriptor of it holding its ``flock`` (None where the file system has no flock).
    ``remove_abandoned`` may take a folder between its creation and its lock: then another is made."""
    try:
        import fcntl  # POSIX
    except ImportError:  # no flock: nothing is ever taken as abandoned either
        return Path(tempfile.mkdtemp(prefix=prefix, suffix=".tmp", dir=parent)), None
    for _ in range(100):
        stage = Path(tempfile.mkdtemp(prefix=prefix, suffix=".tmp", dir=parent))
        try:
            fd = os.open(stage, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.path.samestat(os.fstat(fd), os.stat(stage)):
                return stage, fd
        except (BlockingIOError, FileNotFoundError):  # being removed as abandoned
            pass
        except OSError:  # no flock here
            os.close(fd)
            return stage, None
        os.close(fd)
    raise OSError(f"cannot write beside {parent}: every new staging folder there was removed at once; is another "
                  "process cleaning the folder?")


def remove_abandoned(path: str | os.PathLike) -> list[str]:
    """Remove the staging folders that earlier writes of ``path`` left behind when they were killed (SIGKILL, a
    power cut: an interrupt or an error removes its own); returns their names. A folder is abandoned when no
    process holds its lock (``staging_dir``)."""
    try:
        import fcntl  # POSIX
    except ImportError:
        return []
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    pattern = re.compile(re.escape(f".{path.name}.") + r"[A-Za-z0-9_]{8}\.tmp")
    try:
        candidates = [e.name for e in os.scandir(folder)
                      if pattern.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]
    except OSError:
        return []
    removed = []
    for name in candidates:
        try:
            fd = os.open(folder / name, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError:  # gone meanwhile
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a live write's (or no flock here: then nothing can be told, nothing is removed)
            os.close(fd)
            continue
        try:
            shutil.rmtree(folder / name, ignore_errors=True)
            removed.append(name)
        finally:
            os.close(fd)
    return removed


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
