"""The ``rope-export`` command line.

Each subcommand has one module in this package (as polygraphy keeps its tools in ``tools/``), with a
``register(subparsers)`` function that adds its parser and sets ``func``; this file only lists those
modules, so adding a command is a module here and an entry in ``COMMANDS``. Only the module of the
command being run is imported, and it imports its libraries when it runs (torch, transformers and
onnxruntime take seconds to import): ``rope-export --help`` lists the commands from ``COMMANDS`` alone.

It also owns what every command shares at its edge: an error is one line on stderr, never a
traceback (exit 2 for bad input, 1 for an internal error, with ``--debug`` for the traceback; a
failure inside torch.onnx is summarised as its stage, op and likely fix, also exit 1), and
SIGINT/SIGTERM stop the command like an exception, so the atomic writers' cleanup runs and no
temporary file is left (exit 128 + the signal number).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import signal
import sys
import warnings
from collections.abc import Iterator

from rope_export.common.errors import CLIError  # re-exported: the commands raise it

# Every command, in the order of a user's path: the line `rope-export --help` shows for it (the one place it is
# written: the registered parsers get it from here) and the module of this package that builds its parser and runs
# it. Every command is registered this way and no other (tests/test_package_structure.py holds it): the module's
# register(subparsers) adds the parser and sets func; the packages below hold the work, never argparse.
COMMANDS: dict[str, tuple[str, str]] = {
    "export": ("export to ONNX with one rotary node per rotated tensor: a transformers model folder (--hf), "
               "your own nn.Module (--module) or a preset's attention block", "rope_export.cli.export"),
    "lower": ("rewrite the rotary nodes for a runtime: trt-plugin, onnx, ort or decomposed", "rope_export.cli.passes"),
    "check": ("compare an ONNX file with its reference (PyTorch, transformers, another file) on every runner",
              "rope_export.cli.check"),
    "package": ("write what a serving stack loads as it is (an onnxruntime-genai folder, a Triton model "
                "repository)", "rope_export.cli.package"),
    "build": ("build a TensorRT engine from a trt-plugin ONNX file, with the rotary plugin loaded",
              "rope_export.cli.build"),
    "build-plugin": ("build the rotary kernels, their CPU twin and the TensorRT plugin libraries",
                     "rope_export.cli.build_plugin"),
    "fuse": ("replace decomposed RoPE in any ONNX file by rotary nodes", "rope_export.cli.passes"),
    "presets": ("list the model presets, or show one", "rope_export.cli.presets"),
    "demo": ("export, lower, build, check: the whole product on one preset and a tiny transformers Llama",
             "rope_export.cli.demo"),
    "bench": ("benchmark RoPE alone, whole blocks, the CPU twin, the GPU path, the kernels' build and this "
              "command line's start-up", "rope_export.cli.bench"),
}
# The modules, in registration order (tests narrow it to the commands they use).
COMMAND_MODULES = list(dict.fromkeys(module for _, module in COMMANDS.values()))
DEBUG_ENV = "ROPE_EXPORT_DEBUG"
# Libraries that log exceptions with their tracebacks (onnx_ir's shape inference does, before our
# own error says what is wrong); quiet unless --debug.
NOISY_LOGGERS = ("onnx_ir", "onnxscript")


class Interrupted(BaseException):
    """SIGINT or SIGTERM, raised where the main thread is, like KeyboardInterrupt.

    A BaseException, so no ``except Exception`` in the package turns it into another error, and
    every ``finally`` (the atomic writers' temp-file cleanup) runs on the way out."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum
        self.name = signal.Signals(signum).name


def user_errors() -> tuple[type[BaseException], ...]:
    """Every error class that means bad input (a file, a path, an option, a preset): one line, exit 2.

    The package's own errors are ValueError subclasses (RotaryContractError, PresetError,
    RopeConfigError, AttentionConfigError, bounds.FieldError/AllocationError, ExportError,
    PassError, CheckError, PluginFieldError, ...) or CLIError; file problems are OSError
    (missing, a folder, a name too long, no permission, a full disk); a file that is not ONNX
    fails in protobuf or onnx's checker; a request too big for the memory is MemoryError."""
    import onnx
    from google.protobuf.message import DecodeError

    return (
        CLIError,
        ValueError,
        OSError,
        MemoryError,
        DecodeError,
        onnx.checker.ValidationError,
        onnx.shape_inference.InferenceError,
    )


def command_in(argv: list[str]) -> str | None:
    """The command named on the line: the first word that is not an option (the top level has only options
    without values)."""
    return next((word for word in argv if not word.startswith("-")), None)


def _not_available(args) -> int:
    raise CLIError(f"the command {args.command} is not available here")


def build_parser(command: str | None = None, *, every: bool = True) -> argparse.ArgumentParser:
    """The parser; with ``every=False`` only ``command``'s modules are imported and the other commands are
    names in the listing (what `rope-export --help` and a run need)."""
    parser = argparse.ArgumentParser(
        prog="rope-export",
        description="Export RoPE attention blocks to ONNX with one rotary op, lower it for a runtime, check it "
        "against PyTorch and package it for serving. The usual path: rope-export export --hf MODEL_DIR -o model.onnx; "
        "rope-export lower model.onnx -t onnx -o model-onnx.onnx; rope-export check model-onnx.onnx. "
        "`rope-export COMMAND --help` says more.",
    )
    debug_help = f"show the full traceback of an error (also: {DEBUG_ENV}=1) and the libraries' own logged errors"
    verbose_help = "also show the libraries' FutureWarnings (deprecation notices meant for rope-export's maintainers)"
    parser.add_argument("--debug", action="store_true", help=debug_help)
    parser.add_argument("--verbose", action="store_true", help=verbose_help)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    wanted = COMMAND_MODULES if every else [m for m in COMMAND_MODULES if m == COMMANDS.get(command, ("", ""))[1]]
    for name in wanted:
        importlib.import_module(name).register(subparsers)
    for name, (summary, _module) in COMMANDS.items():
        if name not in subparsers.choices:
            subparsers.add_parser(name, help=summary, add_help=False).set_defaults(func=_not_available)
    listing = {action.dest: action for action in subparsers._choices_actions}
    for name, (summary, _module) in COMMANDS.items():  # the one place each line is written
        if name in listing:
            listing[name].help = summary
        else:  # a parser added without help= is not listed by argparse until it has a line
            subparsers._choices_actions.append(subparsers._ChoicesPseudoAction(name, (), summary))
    order = list(COMMANDS)  # the user's path first, whatever order the modules registered in
    subparsers._choices_actions.sort(key=lambda a: order.index(a.dest) if a.dest in order else len(order))
    for sub in subparsers.choices.values():  # `rope-export export --debug ...` works too
        sub.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)
        if "--verbose" not in sub._option_string_actions:  # export's own --verbose shows torch.onnx's messages too
            sub.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS, help=verbose_help)
    return parser


@contextlib.contextmanager
def signals_as_exceptions() -> Iterator[None]:
    """SIGINT and SIGTERM raise Interrupted in the main thread; a second signal while the first
    unwinds is ignored, so cleanup is not cut short (SIGKILL still ends a stuck process)."""
    caught: list[int] = []

    def handler(signum, _frame):
        if caught:
            return
        caught.append(signum)
        raise Interrupted(signum)

    previous = {}
    try:
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, handler)
    except ValueError:  # not the main thread (an embedding host): keep Python's defaults
        pass
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


@contextlib.contextmanager
def quiet_libraries(debug: bool, verbose: bool = False) -> Iterator[None]:
    """The libraries' logged errors only with --debug; their FutureWarnings (transformers', torch's: what to
    change in rope-export's own calls, not in the user's) only with --verbose or --debug."""
    loggers = [logging.getLogger(name) for name in NOISY_LOGGERS]
    levels = [lg.level for lg in loggers]
    if not debug:
        for lg in loggers:
            lg.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            if not (debug or verbose):
                warnings.filterwarnings("ignore", category=FutureWarning)
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def one_line(exc: BaseException) -> str:
    """The exception's message on one line (messages from onnx or torch can span many).

    An OSError from the standard library ("[Errno 17] File exists: 'out'") reads as the path and
    the problem; the package's own OSErrors carry a whole sentence and no errno."""
    if isinstance(exc, OSError) and exc.errno is not None and exc.strerror:
        where = f" {exc.filename}" if exc.filename else ""
        return f"cannot use{where}: {exc.strerror.lower()}"
    from rope_export.exporting.torch_onnx import strip_ansi

    text = " ".join(strip_ansi(str(exc)).split())  # torch colours its messages for a terminal
    return text or type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    debug = os.environ.get(DEBUG_ENV, "") not in ("", "0")
    prefix = "rope-export"
    # The handlers go in first: importing a command's modules (torch, onnx) takes seconds too.
    words = sys.argv[1:] if argv is None else argv
    with signals_as_exceptions(), quiet_libraries(debug or "--debug" in words, "--verbose" in words):
        try:
            args = build_parser(command_in(words), every=False).parse_args(words)
            debug = debug or args.debug
            prefix = f"rope-export {args.command}"
            return int(args.func(args) or 0)
        except SystemExit:  # --help, or argparse's own usage error: before user_errors() imports onnx
            raise
        except Interrupted as exc:
            if debug:
                raise
            print(f"{prefix}: interrupted by {exc.name}; files are written atomically, so an output is either "
                  "complete or absent (no temporary file is left)", file=sys.stderr)
            return 128 + exc.signum
        except user_errors() as exc:
            if debug:
                raise
            print(f"{prefix}: error: {one_line(exc)}", file=sys.stderr)
            return 2
        except Exception as exc:
            if debug:
                raise
            from rope_export.common.bounds import allocation_failure
            from rope_export.exporting.torch_onnx import describe_failure

            too_big = allocation_failure(exc)  # torch's allocator raises RuntimeError, not MemoryError
            if too_big is not None:
                print(f"{prefix}: error: {too_big}", file=sys.stderr)
                return 2

            summary = describe_failure(exc)  # torch.onnx's page of text, as one line with the likely fix
            if summary is not None:
                print(f"{prefix}: error: {summary} (--debug: more)", file=sys.stderr)
                return 1
            print(f"{prefix}: internal error: {type(exc).__name__}: {one_line(exc)} (a bug in rope-export or a "
                  f"library; run again with --debug or {DEBUG_ENV}=1 for the traceback)", file=sys.stderr)
            return 1
