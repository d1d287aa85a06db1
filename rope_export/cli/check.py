"""The ``rope-export check`` command: exit 0 when every runner agrees, 1 naming what disagrees, 2 on bad input.

The output ends with one verdict line (``PASS: 3 runners agree with transformers (2 skipped: ...)`` or ``FAIL: ...``)
after the tables; the time and peak RSS per step are printed with ``--verbose`` and written to check.md."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rope_export.check.names import RUNNERS
from rope_export.cli.options import add_model_source_arguments, whole_number


def _gigabytes(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GB") from None
    if not 0 <= value < 2**20:
        raise argparse.ArgumentTypeError(f"{text} GB is out of range")
    return value


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "check", help="compare an ONNX file with its reference (PyTorch, transformers, another file) on every runner",
        description="The reference is chosen from the file: a preset export is compared with its PyTorch block, an "
        "`export --hf` file with transformers, any other file with onnx-reference as the golden; or named with "
        "--reference / --hf. Every stored cos/sin cache row is compared with the RoPE configuration and each rotary "
        "node is run alone over every position. Exit 0: all agree; 1: a runner disagrees; 2: bad input.")
    parser.add_argument("model", help="the .onnx file (weights may be external, beside it), or the folder `export --hf "
                                      "VLM_DIR -o OUT_DIR/` wrote (each component, then the whole pipeline)")
    parser.add_argument("--runners", default=",".join(RUNNERS),
                        help=f"comma-separated, from {', '.join(RUNNERS)} (default: all; unavailable ones are skipped)")
    parser.add_argument("--reference", metavar="OTHER.onnx",
                        help="compare with another ONNX file run by onnxruntime (same input names), e.g. the plain "
                             "export a fused or lowered file came from")
    parser.add_argument("--module", metavar="SPEC",
                        help="compare with the PyTorch module a file of `export --module` came from, run on every "
                             "case: the same PACKAGE.MODULE:FACTORY or path/to/file.py:FACTORY as the export")
    add_model_source_arguments(parser, "compare with the transformers model of this config (folder or .json); "
                                       "default: the config recorded in the file")
    parser.add_argument("--inputs", action="append", metavar="FEEDS",
                        help="your own inputs: feeds.npz (one case), or a data-loader script loader.py[:load_data] "
                             "yielding feed dicts; repeatable")
    sizes = parser.add_argument_group("sizes of the generated inputs (dynamic dims; static ones are kept)")
    sizes.add_argument("--batch", type=whole_number, help="batch (default 2)")
    sizes.add_argument("--seq", type=whole_number, help="new tokens per case (default 16)")
    sizes.add_argument("--past", type=whole_number, help="past length of the decode cases (default 8)")
    sizes.add_argument("--long-seq", type=whole_number, help="tokens of the long-sequence case (default 128)")
    parser.add_argument("--no-sweep", action="store_true",
                        help="skip running each rotary node alone over every position (the stored caches are still "
                             "compared row by row)")
    parser.add_argument("--memory-limit", type=_gigabytes, metavar="GB",
                        help="refuse plans that would allocate more, and run onnxruntime CPU in pieces when one "
                             "session would take more (default: the memory available when check starts)")
    parser.add_argument("--max-in-memory", type=_gigabytes, metavar="GB",
                        help="weights above this stay on disk: onnx-reference and cpu-twin, which need the whole "
                             "ModelProto, are skipped for the whole model (default 1)")
    parser.add_argument("--piece-limit", type=_gigabytes, metavar="GB",
                        help="run onnxruntime CPU in consecutive pieces, one session of at most this at a time, when "
                             "one session would take more (default: only when one session exceeds --memory-limit, "
                             "then pieces of at most 4 GB)")
    parser.add_argument("--reference-precision", choices=("auto", "fp32", "fp64", "none"), default="auto",
                        help="a transformers causal LM is run layer by layer (one layer's weights in memory) in this "
                             "precision and in the file's dtype, and each runner's error is held to PyTorch's own "
                             "error in the file's dtype, per output and per decoder layer; auto: fp32 for fp16/bf16 "
                             "files, none for others (none: one run in the file's dtype, sqrt(layers) tolerance)")
    parser.add_argument("--report", metavar="DIR",
                        help="write check.json, check.md, error_vs_position.png and (per-layer errors) "
                             "error_vs_layer.png here")
    parser.add_argument("--summary-json", metavar="PATH",
                        help="write the time and peak RSS of each step (reference, each runner, each piece) as JSON")
    parser.add_argument("--plugin", metavar="LIB", help="TensorRT plugin library for the tensorrt runner")
    parser.set_defaults(func=_run)


def _run(args) -> int:
    from rope_export.check.core import check
    from rope_export.check.report import print_report, verdict_line, write_reports
    from rope_export.common.steps import cli_steps
    from rope_export.common.tables import console as make_console

    console = make_console()
    runners = tuple(r.strip() for r in args.runners.split(",") if r.strip())
    if Path(args.model).is_dir():  # a vision-language export: its components, then the pipeline
        return _run_folder(args, runners, console)
    module = _load_module(args.module) if args.module else {}
    verbose = getattr(args, "verbose", False)  # the time per step: with --verbose, else in check.md only
    with cli_steps(console, "check: time and peak RSS per step", args.summary_json, table=verbose) as progress:
        report = check(args.model, runners, reference=args.reference, hf_config=args.hf, weights=args.weights,
                       seed=args.seed, random_weights=bool(args.random_weights), inputs=args.inputs, batch=args.batch,
                       seq=args.seq, past=args.past,
                       long_seq=args.long_seq, sweep=not args.no_sweep, plugin_library=args.plugin,
                       memory_limit_gb=args.memory_limit, max_in_memory_gb=args.max_in_memory,
                       piece_limit_gb=args.piece_limit, precision=args.reference_precision, progress=progress,
                       **module)
        if report.weights:  # which weights the transformers reference was built with
            progress.facts["weights"] = report.weights
    print_report(report, console)
    if args.report:
        for path in write_reports(report, args.report, progress):
            console.print(f"wrote {path}")
    if not report.passed:  # what failed, on stderr (the report and its verdict are stdout's)
        for line in report.failure_message().splitlines():
            print(f"rope-export check: {line}", file=sys.stderr, flush=True)
    console.print(verdict_line(report), markup=False, highlight=False, soft_wrap=True)  # the last line, always
    return 0 if report.passed else 1


def _load_module(spec: str) -> dict:
    """check's module/args/kwargs from an export factory; a factory that fails is bad input (exit 2)."""
    from rope_export.blocks.export import ModuleExportError, load_factory
    from rope_export.check.model_file import CheckError

    try:
        parts = load_factory(spec)
    except ModuleExportError as exc:
        raise CheckError(str(exc)) from None
    return {"module": parts["module"], "args": parts["args"], "kwargs": parts.get("kwargs")}


FOLDER_OPTIONS = ("reference", "hf", "module", "inputs", "batch", "seq", "past", "long_seq", "memory_limit",
                  "max_in_memory", "piece_limit")


def _run_folder(args, runners, console) -> int:
    """``rope-export check OUT_DIR/``: exit 0 when every component and the pipeline pass, 1 otherwise."""
    from rope_export.check.model_file import CheckError
    from rope_export.check.report import write_reports
    from rope_export.check.vlm_folder import check_folder, folder_verdict_line, print_folder_report
    from rope_export.common.steps import cli_steps

    given = [name for name in FOLDER_OPTIONS if getattr(args, name, None) not in (None, False)]
    if given:
        raise CheckError(f"--{given[0].replace('_', '-')} is for one file; check a component file of the folder "
                         "with it")
    verbose = getattr(args, "verbose", False)  # the time per step: with --verbose only
    with cli_steps(console, "check: time and peak RSS per step", args.summary_json, table=verbose) as progress:
        report = check_folder(args.model, runners, weights=args.weights, seed=args.seed,
                              random_weights=args.random_weights, sweep=not args.no_sweep, plugin_library=args.plugin,
                              progress=progress)
    print_folder_report(report, console)
    if args.report:
        for name, component in report.components.items():
            for path in write_reports(component, Path(args.report) / name):
                console.print(f"wrote {path}")
    if not report.passed:  # what failed, on stderr (the report and its verdict are stdout's)
        print(f"rope-export check: {report.failure_message()}", file=sys.stderr, flush=True)
    console.print(folder_verdict_line(report), markup=False, highlight=False, soft_wrap=True)  # the last line
    return 0 if report.passed else 1
