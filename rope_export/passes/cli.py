"""``rope-export lower`` and ``rope-export fuse``: the graph passes on ONNX files."""

from __future__ import annotations

import sys


def register(subparsers) -> None:
    from rope_export.passes.lowering import TARGET_HELP, TARGETS

    lower = subparsers.add_parser(
        "lower",
        help="lower rope_export::RotaryEmbedding nodes to a runtime's form",
        description="Replace every rope_export::RotaryEmbedding node of IN by the target's form and write OUT. "
        + " ".join(f"{name}: {TARGET_HELP[name]}." for name in TARGETS),
    )
    lower.add_argument("input", metavar="IN.onnx")
    lower.add_argument("--target", "-t", required=True, choices=list(TARGETS), help="the runtime's form")
    lower.add_argument("--output", "-o", required=True, metavar="OUT.onnx")
    lower.add_argument(
        "--trust-positions",
        action="store_true",
        help="targets onnx/ort: feed position_ids to the op directly instead of gathering guarded per-token "
        "caches (faster; positions outside [0, max_pos), or a sequence longer than the cache, then make "
        "onnxruntime CPU fail instead of passing the token through)",
    )
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
    fuse.set_defaults(func=_run_fuse)


def _check(model, console) -> None:
    import onnx

    from rope_export.passes._model import check_model

    try:
        check_model(model, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        console.print(f"[yellow]warning:[/yellow] onnx.checker: {str(exc).splitlines()[0]}")


def _run_lower(args) -> int:
    from rich.console import Console

    from rope_export.passes import LoweringLog, load_model, lower, save_model

    console = Console(stderr=False)
    log = LoweringLog()
    model = lower(load_model(args.input), args.target, guard_positions=not args.trust_positions, log=log)
    _check(model, console)
    save_model(model, args.output)
    console.print(f"lowered {len(log.lowered)} RotaryEmbedding node(s) to {args.target}: {args.output}")
    for note in log.notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    return 0


def _run_fuse(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from rope_export.passes import FusionReport, fuse, load_model, save_model

    console = Console()
    report = FusionReport()
    model = fuse(load_model(args.input), report=report, adopt_standard=args.adopt_standard)
    _check(model, console)
    save_model(model, args.output)
    table = Table(title=f"rope-export fuse: {args.input}")
    for column in ("site", "status", "form", "detail"):
        table.add_column(column)
    for row in report.rows():
        style = {"fused": "green", "left alone": "yellow"}.get(row.status, "")
        table.add_row(row.site, f"[{style}]{row.status}[/{style}]" if style else row.status, row.form, row.detail)
    if report.records:
        console.print(table)
    else:
        console.print("no decomposed RoPE found")
    console.print(f"fused {report.num_fused} site(s): {args.output}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    from rope_export.cli import main

    sys.exit(main())
