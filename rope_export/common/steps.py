"""Progress that is also a measurement: each message starts a timed step with its peak memory.

Long commands (export, lower, fuse) take a ``progress`` callable of one string. A ``StepLog`` is
such a callable: every call ends the current step and starts a new one named by the message;
``detail(message)`` only refreshes what is shown (e.g. "tensor 37 of 146"). A sampler thread reads
the resident set size (RSS) every few milliseconds, so each step gets its own peak, and the
summary at the end lists time and peak RSS per step, plus the files written and their sizes.

The peak is sampled rather than read from the kernel's high-water mark, so that the process's own
``ru_maxrss`` (what a parent measuring us sees) is left alone; an allocation shorter than the
sampling period can be missed.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rope_export.common.bounds import format_bytes

SAMPLE_PERIOD_S = 0.02
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """The current resident set size; the peak so far where /proc is missing (not Linux)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


@dataclass
class Step:
    name: str
    seconds: float = 0.0
    peak_rss: int = 0


@dataclass
class StepLog:
    """A progress callable that times each step and samples its peak RSS; see the module doc."""

    show: Callable[[str], None] | None = None  # called with each step's message
    show_detail: Callable[[str], None] | None = None  # called with each detail
    steps: list[Step] = field(default_factory=list)
    files: list[tuple[str, int]] = field(default_factory=list)
    facts: dict = field(default_factory=dict)  # what the command used, for --summary-json (e.g. "weights")
    _start: float = 0.0
    _peak: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stop: threading.Event | None = None

    def __call__(self, message: str) -> None:
        self._close_step()
        if self._stop is None:
            self._start_sampler()
        with self._lock:
            self.steps.append(Step(message))
            self._start, self._peak = time.perf_counter(), rss_bytes()
        if self.show is not None:
            self.show(message)

    def detail(self, message: str) -> None:
        if self.show_detail is not None:
            self.show_detail(message)

    def add_files(self, files: Iterable[tuple[str | os.PathLike, int]]) -> None:
        self.files += [(str(path), int(size)) for path, size in files]

    def finish(self) -> list[Step]:
        """End the last step and the sampler; returns the steps."""
        self._close_step()
        if self._stop is not None:
            self._stop.set()
            self._stop = None
        return self.steps

    @property
    def peak_rss(self) -> int:
        return max((s.peak_rss for s in self.steps), default=0)

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.steps)

    def to_dict(self) -> dict:
        return {"steps": [asdict(s) for s in self.steps], "files": [{"path": p, "bytes": n} for p, n in self.files],
                "seconds": self.seconds, "peak_rss": self.peak_rss, **self.facts}

    def write_json(self, path: str | os.PathLike) -> None:
        from rope_export.common.fileio import atomic_write_text

        atomic_write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")

    def table(self, title: str = "summary"):
        """A rich Table: one row per step (time, peak RSS), then the files and their sizes."""
        from rich.table import Table

        table = Table(title=title)
        for column, justify in (("step", "left"), ("time", "right"), ("peak RSS", "right")):
            table.add_column(column, justify=justify)
        for step in self.steps:
            table.add_row(step.name, f"{step.seconds:.1f} s", format_bytes(step.peak_rss))
        total_rss = format_bytes(self.peak_rss)
        table.add_row("[bold]total[/bold]", f"[bold]{self.seconds:.1f} s[/bold]", f"[bold]{total_rss}[/bold]")
        for path, size in self.files:
            table.add_row(f"file {path}", "", format_bytes(size))
        return table

    # -- internals --------------------------------------------------------------------------

    def _close_step(self) -> None:
        with self._lock:
            if self.steps and self._start:
                step = self.steps[-1]
                step.seconds = time.perf_counter() - self._start
                step.peak_rss = max(self._peak, rss_bytes())
                self._start = 0.0

    def _start_sampler(self) -> None:
        stop = self._stop = threading.Event()

        def sample() -> None:
            while not stop.wait(SAMPLE_PERIOD_S):
                rss = rss_bytes()
                with self._lock:
                    self._peak = max(self._peak, rss)

        threading.Thread(target=sample, name="rope-export-rss", daemon=True).start()


def detail(progress: Callable[[str], None] | None, message: str) -> None:
    """Show ``message`` without starting a step (plain callables get nothing)."""
    show = getattr(progress, "detail", None)
    if show is not None:
        show(message)


def log_line(console, message: str) -> None:
    """One progress line on a rich console: the time and the message, nothing else (rich's own ``log`` adds the
    caller's source location, noise in a user's terminal that stretches log lines past 150 columns)."""
    from rich.text import Text

    line = Text(time.strftime("[%H:%M:%S] "), style="dim")
    line.append(message)
    console.print(line, highlight=False)


def console_log(console, status=None) -> StepLog:
    """A StepLog that logs each step on a rich console and shows details in its status line."""
    def show(message: str) -> None:
        if status is not None:
            status.update(message)
        log_line(console, message)

    def show_detail(message: str) -> None:
        if status is not None:
            status.update(message)

    return StepLog(show, show_detail)


def file_sizes(paths: Iterable[Path]) -> list[tuple[Path, int]]:
    """(path, bytes) of each file; a folder counts the files in it."""
    out = []
    for path in paths:
        if path.is_dir():
            out.append((path, sum(p.stat().st_size for p in path.rglob("*") if p.is_file())))
        elif path.exists():
            out.append((path, path.stat().st_size))
    return out


@contextlib.contextmanager
def cli_steps(console, title: str, summary_json: str | os.PathLike | None = None,
              table: bool = True) -> Iterator[StepLog]:
    """A StepLog on a rich console (status line + one log line per step); on success, the summary
    table is printed (``table``) and, with ``summary_json``, written as JSON."""
    if summary_json is not None:
        from rope_export.common.fileio import check_writable

        try:
            check_writable(summary_json)
        except OSError as exc:
            raise ValueError(f"--summary-json: {exc}") from None
    with console.status("starting") as status:
        log = console_log(console, status)
        try:
            yield log
        finally:
            log.finish()
    if table:
        console.print(log.table(title))
    if summary_json is not None:
        log.write_json(summary_json)
