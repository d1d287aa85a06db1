"""Which transformers releases rope-export was tested on, and what to say about any other.

rope-export reads transformers' internals (attention classes, caches, rotary functions), which
change with its weekly releases. ``TESTED`` is the range the test suite passed on: the oldest is
the lower bound in pyproject.toml (``make test-oldest``, requirements/oldest.txt), the newest is
the one in the lock (requirements/lock.txt); a test holds the three equal. Outside it an export may
still work, but nobody has seen it do so, and the user is told.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata

from rope_export.hf.errors import HFExportError

TESTED = ("5.21.0", "5.24.0")  # (oldest, newest) transformers release the suite passed on


def _release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string ("5.25.0.dev0" -> (5, 25, 0))."""
    parts = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(p) for p in parts.group(0).split(".")) if parts else ()


def installed_version() -> str:
    """The installed distribution's version (transformers' module object is replaced lazily; its metadata is not)."""
    return metadata.version("transformers")


def is_tested(version: str) -> bool:
    oldest, newest = (_release(v) for v in TESTED)
    return oldest <= _release(version)[:3] <= newest


def untested_note(version: str | None = None) -> str | None:
    """One line when the installed (or given) transformers is outside the tested range, else None."""
    if version is None:
        version = installed_version()
    if is_tested(version) and not re.search(r"(dev|rc|a|b)\d*$", version):
        return None
    return (f"transformers {version} is untested: rope-export was tested on {TESTED[0]} to {TESTED[1]} "
            f"(pip install 'transformers>={TESTED[0]},<={TESTED[1]}' for a tested one)")


@contextmanager
def said_when_untested(warn=None) -> Iterator[None]:
    """Around an export: one warning line first when transformers is untested, and the same words in the error
    if the export then fails (a failure on an untested release is most likely the release's doing)."""
    note = untested_note()
    if note is None:
        yield
        return
    (warn or (lambda line: print(f"warning: {line}", file=sys.stderr)))(note)
    try:
        yield
    except HFExportError as exc:
        raise HFExportError(f"{exc} ({note})") from exc
    except Exception as exc:  # noqa: BLE001 - any failure on an untested release says so
        text = " ".join(str(exc).split())[:300]
        raise HFExportError(f"{type(exc).__name__}: {text} ({note})") from exc
