"""torch.onnx's console output: silent unless --verbose, its phases passed on as progress steps.

The dynamo exporter prints "[torch.onnx] Obtain model graph...", "Run decompositions...",
"Translate the graph into ONNX...", "Optimize the ONNX graph..." to stdout, and logs and warns a
lot. ``quiet_exporter(verbose, progress)`` captures all of it and turns each phase line into a
call ``progress(step)``, so the tracing, decomposing, translating and optimizing of a large model
are timed steps of their own. ``describe_failure(exc)`` turns an error raised inside torch.onnx (a
page of text with ANSI colours) into one line: the stage, the op, the likely fix.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
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


# symbolic_shapes warns ("Unable to find user code ...") through a handler of its own on a failed trace
QUIET_LOGGERS = ("torch.onnx", "torch.export", "torch._dynamo", "torch.fx", "torch.fx.experimental.symbolic_shapes",
                 "onnxscript")


@contextlib.contextmanager
def quiet_exporter(verbose: bool, progress: Callable[[str], None] | None = None) -> Iterator[None]:
    """torch.onnx prints its own step lines and warnings; keep them for --verbose only.

    With ``progress``, its phases (tracing, decomposing, translating, optimizing) become steps."""
    if verbose:
        yield
        return
    sink = _PhaseLines(progress)
    loggers = [logging.getLogger(name) for name in QUIET_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        # a failed trace also prints its graphs to stderr: the error itself says what failed
        with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


# -- failures ------------------------------------------------------------------------------------

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# torch.onnx's own numbering of its steps ("This is step 3/3 of exporting the model to ONNX")
STEPS = {"1": "tracing (torch.export)", "2": "decomposing", "3": "translating to ONNX"}
TORCH_MODULES = ("torch.onnx", "torch.export", "torch._export", "torch._dynamo", "onnxscript")
MAX_LINE = 180  # the CLI adds "rope-export export: error: " and "(--debug: more)"
# export_module traces complex tables as real pairs itself; what still fails is a plain torch.onnx.export
# of complex code or a complex input
COMPLEX_HINT = "pass view_as_real of complex inputs, or trace under complex_as_pairs"
DATA_HINT = "use torch.where/torch.cond, not if on tensors"


def strip_ansi(text: str) -> str:
    return ANSI.sub("", text)


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def describe_failure(exc: BaseException) -> str | None:
    """One line for an error raised inside torch.onnx / torch.export: the stage, the op that failed,
    and the likely fix; None for any other error.

    torch.onnx's own message is a page (with ANSI colours) whose useful parts are the step number,
    the op without an ONNX form and the failure message; the rest stays behind --debug."""
    chain = _chain(exc)
    if not any(type(e).__module__.startswith(TORCH_MODULES) for e in chain):
        return None
    text = " ".join(strip_ansi("\n".join(str(e) for e in chain)).split())
    step = re.search(r"This is step (\d)/3", text)
    if step:
        stage = STEPS.get(step.group(1), "exporting")
    elif any(type(e).__module__.startswith(("torch._dynamo", "torch.export", "torch._export")) for e in chain):
        stage = STEPS["1"]
    else:
        stage = "exporting"
    op = re.search(r"OpOverload\(op='([\w.]+)', overload='(\w+)'\)", text)
    target = re.search(r"target=torch\.ops\.([\w.]+)\]\(args = \((%[\w.]+), \[(%[\w.]+)\]", text)
    complex_input = "complex" in text.lower()
    indexed = target is not None and target.group(1).startswith("aten.index")
    what = f"complex {_name(target.group(2))}[{_name(target.group(3))}]" if indexed else "a complex tensor"
    data_dependent = "data-dependent" in text
    if op:
        cause = f"{op.group(1)}.{op.group(2)}" + (f" on {what}" if complex_input else "") + " has no ONNX form"
    elif complex_input:
        cause = f"{what} has no ONNX form"
    else:
        cause = _summary_cause(text) or _first_cause(chain[-1])
    if complex_input:
        hint = COMPLEX_HINT
    elif data_dependent:
        hint = DATA_HINT
    elif op:
        hint = "rewrite that call with ops torch.onnx translates"
    else:
        hint = ""
    line = f"torch.onnx failed {stage}: {cause}" + (f"; {hint}" if hint else "")
    return line if len(line) <= MAX_LINE else line[: MAX_LINE - 1] + "…"


def _name(value: str) -> str:
    """A lifted graph input's name as the module spells it: %b_freqs_cis -> freqs_cis."""
    name = value.lstrip("%")
    return re.sub(r"^(b|p|c)_", "", name)


def _summary_cause(text: str) -> str | None:
    """The first sentence of the first exception in torch.onnx's "## Exception summary"."""
    found = re.search(r"## Exception summary <class '(?:[\w.]*\.)?(\w+)'>: (.+?)(?: ⬆️| \(Refer to|$)", text)
    if not found:
        return None
    message = re.split(r"(?<=[.)])\s", found.group(2), maxsplit=1)[0]
    return message if len(message) <= 90 else message[:89] + "…"


def _first_cause(exc: BaseException) -> str:
    lines = [line.strip() for line in strip_ansi(str(exc)).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0][:120]}" if lines else type(exc).__name__


# -- a program captured with torch.export's defaults --------------------------------------------------

def is_capture_failure(exc: BaseException) -> bool:
    """Whether torch.onnx failed in its first step, torch.export's capture of the module."""
    return type(exc).__name__ == "TorchExportError"


def export_captured(module, args: tuple, kwargs: dict | None, dynamic_shapes, **options):
    """``torch.onnx.export`` of the program ``torch.export.export`` captures with its own defaults.

    torch.onnx captures with ``backed_size_oblivious`` on (so that dims of size 0 and 1 stay dynamic), under
    which torch.export cannot prove some equalities that its defaults prove from the example's sizes
    (LTX-Video's caption axis after ``view(batch, -1, width)``: ``s41`` against ``s74//s21``). The file's axes
    are then renamed as ``dynamic_shapes`` names them, as torch.onnx does for a module."""
    import torch

    program = torch.export.export(module, args, kwargs=kwargs or None, dynamic_shapes=dynamic_shapes, strict=False)
    onnx_program = torch.onnx.export(program, dynamo=True, **options)
    onnx_program.rename_axes(_axis_names(onnx_program.model.graph.inputs, dynamic_shapes))
    return onnx_program


def _specs(shapes) -> list:
    """The per-input specifications ({axis: Dim} or None) of a dynamic_shapes structure, in input order."""
    if shapes is None or (isinstance(shapes, dict) and all(isinstance(k, int) for k in shapes)):
        return [shapes]
    values = shapes.values() if isinstance(shapes, dict) else shapes
    return [spec for value in values for spec in _specs(value)]


def _axis_names(inputs, dynamic_shapes) -> dict[str, str]:
    """torch.export's symbol of each named axis -> its name (a multiple ``2*Dim("h")`` names its root)."""
    import sympy

    specs = _specs(dynamic_shapes)
    names: dict[str, str] = {}
    if len(specs) != len(inputs):
        return names
    for value, spec in zip(inputs, specs, strict=True):
        for axis, dim in (spec or {}).items():
            symbol = getattr(value.shape[axis], "value", None) if value.shape is not None else None
            root = getattr(dim, "root", dim)
            name = getattr(root, "__name__", None)
            if not isinstance(symbol, str) or not isinstance(name, str):
                continue
            free = sympy.sympify(symbol).free_symbols
            if len(free) == 1:
                names.setdefault(str(next(iter(free))), name)
    return names
