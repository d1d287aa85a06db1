"""``rope-export lower`` and ``rope-export fuse``: the graph passes on ONNX files."""

from __future__ import annotations

import sys


def register(subparsers) -> None:
    from rope_export.cli.options import add_output_arguments
    from rope_export.passes.targets import TARGET_HELP

    lower = subparsers.add_parser(
        "lower",
        help="lower rope_export::RotaryEmbedding nodes to a runtime's form",
        description="Replace every rope_export::RotaryEmbedding node of IN by the target's form and write OUT. "
        + " ".join(f"{name}: {help}." for name, help in TARGET_HELP.items()),
    )
    lower.add_argument("input", metavar="IN.onnx")
    lower.add_argument("--target", "-t", required=True, choices=list(TARGET_HELP), help="the runtime's form")
    lower.add_argument("--output", "-o", required=True, metavar="OUT.onnx")
    lower.add_argument(
        "--trust-positions",
        action="store_true",
        help="targets onnx/ort: feed position_ids to the op directly instead of gathering guarded per-token "
        "caches (faster; positions outside [0, max_pos), or a sequence longer than the cache, then make "
        "onnxruntime CPU fail instead of passing the token through)",
    )
    add_output_arguments(lower)
    lower.set_defaults(func=_run_lower)

    fuse = subparsers.add_parser(
        "fuse",
        help="replace decomposed RoPE in an ONNX file by rope_export::RotaryEmbedding nodes",
        description="Find decomposed RoPE (rotate-half or interleaved, full or partial, cos/sin from a cache "
        "or computed from positions) in IN, replace each by one rope_export::RotaryEmbedding node, write OUT "
        "and print what was fused and what was left alone (and why).",
    )
    fuse.add_argument("input", metavar="IN.onnx")
    fuse.add_argument("--output", "-o", required=True, metavar="OUT.onnx")
    fuse.add_argument(
        "--adopt-standard",
        action="store_true",
        help="also rename ai.onnx RotaryEmbedding-23 nodes (torch.onnx's dynamo exporter makes them at opset >= 23) "
        "to rope_export::RotaryEmbedding; same semantics, out-of-range positions then pass through",
    )
    add_output_arguments(fuse)
    fuse.set_defaults(func=_run_fuse)


def _check(path, console) -> None:
    """onnx.checker's full check on the written file (weights stay on disk); a failure is a warning."""
    import onnx

    from rope_export.passes._model import check_model

    try:
        check_model(path, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        console.print(f"[yellow]warning:[/yellow] onnx.checker: {str(exc).splitlines()[0]}")


def _run_pass(args, title: str, apply) -> tuple:
    """Load IN lazily, apply the pass, write OUT (weights streamed) and check it, as timed steps.

    ``apply(model, steps)`` returns the changed model. The output folder is checked first, so a
    missing or read-only folder is reported before any work."""
    from rich.console import Console

    from rope_export.common.fileio import check_writable
    from rope_export.common.steps import cli_steps
    from rope_export.files.onnx_files import output_files
    from rope_export.passes import PassError, load_ir, save_model

    try:
        check_writable(args.output)
    except OSError as exc:
        raise PassError(str(exc)) from None
    console = Console()
    with cli_steps(console, title, args.summary_json) as steps:
        steps(f"loading {args.input} (the graph; weights stay on disk)")
        model = apply(load_ir(args.input), steps)
        save_model(model, args.output, external=args.external_data, progress=steps)
        steps(f"checking {args.output} (onnx.checker, full check, on the file)")
        _check(args.output, console)
        steps.add_files(output_files(args.output))
    return console, model


def _run_lower(args) -> int:
    from rope_export.passes import LoweringLog, lower

    log = LoweringLog()

    def apply(model, steps):
        steps(f"lowering the RotaryEmbedding nodes to {args.target}, each run once against the op contract")
        return lower(model, args.target, guard_positions=not args.trust_positions, log=log, validate=True)

    console, _ = _run_pass(args, f"rope-export lower: {args.output}", apply)
    console.print(f"lowered {len(log.lowered)} RotaryEmbedding node(s) to {args.target}: {args.output}")
    for note in log.notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    return 0


def _run_fuse(args) -> int:
    from rich.table import Table

    from rope_export.passes import FusionReport, fuse

    report = FusionReport()

    def apply(model, steps):
        steps("finding and fusing decomposed RoPE, each fused node run once against the op contract")
        return fuse(model, report=report, adopt_standard=args.adopt_standard, validate=True)

    console, _ = _run_pass(args, f"rope-export fuse: {args.output}", apply)
    table = Table(title=f"rope-export fuse: {args.input}")
    for column in ("site", "status", "form", "detail"):
        table.add_column(column)
    for row in report.rows():
        style = {"fused": "green", "left alone": "yellow"}.get(row.status, "")
        table.add_row(row.site, f"[{style}]{row.status}[/{style}]" if style else row.status, row.form, row.detail)
    if report.records:
        console.print(table)
    elif not report.found:
        console.print("no decomposed RoPE found")
    console.print(f"{report.summary()}: {args.output}")
    if not report.complete:
        left = report.left if report.left else report.found - report.num_fused
        print(f"rope-export fuse: warning: {left} rotation(s) stayed decomposed in {args.output} (written all the "
              f"same); {report.why_left()}", file=sys.stderr)
        if report.num_fused == 0:
            return 1  # nothing of what was found was fused: not a silent success
    return 0
