"""torch.onnx's console output: silent unless --verbose, its phases passed on as progress steps.

The dynamo exporter prints "[torch.onnx] Obtain model graph...", "Run decompositions...",
"Translate the graph into ONNX...", "Optimize the ONNX graph..." to stdout, and logs and warns a
lot. ``quiet_exporter(verbose, progress)`` captures all of it and turns each phase line into a
call ``progress(step)``, so the tracing, decomposing, translating and optimizing of a large model
are timed steps of their own.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections.abc import Callable, Iterator

# torch.onnx's own step lines, shown as progress steps (the dynamo exporter prints them to stdout).
TORCH_ONNX_PHASES = {
    "Obtain model graph": "tracing the model with torch.export",
    "Run decompositions": "decomposing to core ATen ops",
    "Translate the graph into ONNX": "translating the graph to ONNX",
    "Optimize the ONNX graph": "optimizing the ONNX graph (onnxscript)",
}


class _PhaseLines(io.TextIOBase):
    """A stdout stand-in that passes torch.onnx's "[torch.onnx] <phase>..." lines on as progress steps."""

    def __init__(self, progress: Callable[[str], None] | None):
        self.progress, self.pending, self.last = progress, "", None

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        *lines, self.pending = (self.pending + text).split("\n")
        for line in lines:
            for phase, step in TORCH_ONNX_PHASES.items():
                if line.startswith("[torch.onnx]") and phase in line and line.rstrip().endswith("...") \
                        and step != self.last and self.progress is not None:
                    self.last = step
                    self.progress(step)
        return len(text)


@contextlib.contextmanager
def quiet_exporter(verbose: bool, progress: Callable[[str], None] | None = None) -> Iterator[None]:
    """torch.onnx prints its own step lines and warnings; keep them for --verbose only.

    With ``progress``, its phases (tracing, decomposing, translating, optimizing) become steps."""
    if verbose:
        yield
        return
    sink = _PhaseLines(progress)
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "torch.export", "torch._dynamo", "onnxscript")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(sink):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
