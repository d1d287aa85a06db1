"""``rope-export demo`` (what ``make demo`` runs): the whole product on the built-in default.

Exports the default preset with one rotary node per rotated tensor, lowers it to every target,
builds the plugin's CPU twin, validates every artefact against PyTorch on RoPE stress inputs
(``rope_export.check``), and prints one table: target, runtime, max error, pass/fail, latency.
With TensorRT and a GPU present the engine joins the table; otherwise its row says why not.
"""

from __future__ import annotations

import time
from pathlib import Path

from rope_export.check import check
from rope_export.export import export, save_model
from rope_export.presets import DEFAULT_PRESET

DEFAULT_OUT = "out/demo"
CACHE_LEN = 256  # keeps the demo fast; `rope-export export` defaults to the preset's max position

# (artefact, runners that validate it). The custom-op file is also run through the plugin's
# CPU twin: the kernel code compared inside a whole block.
PLAN = [
    ("custom-op", ("onnx-reference", "cpu-twin")),
    ("trt-plugin", ("cpu-twin", "tensorrt")),
    ("onnx", ("onnxruntime-cpu", "onnx-reference", "onnxruntime-cuda")),
    ("ort", ("onnxruntime-cpu", "onnxruntime-cuda")),
    ("decomposed", ("onnxruntime-cpu", "onnxruntime-cuda")),
]


def register(subparsers) -> None:
    parser = subparsers.add_parser("demo", help="export, lower, build, validate: the whole product on one preset")
    parser.add_argument("--preset", default=DEFAULT_PRESET, help=f"preset name or .toml (default {DEFAULT_PRESET})")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "fp16", "bf16"))
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"folder for the artefacts (default {DEFAULT_OUT})")
    parser.set_defaults(func=run)


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from rope_export import plugin_build
    from rope_export.passes import lower

    console = Console()
    started = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with console.status("starting") as status:
        def step(message: str) -> None:
            status.update(message)
            console.log(message)

        step("building the plugin's CPU twin (build/plugins)")
        plugin_build.ensure_built(quiet=True)
        step(f"exporting {args.preset} ({args.dtype}) with the rotary custom op")
        exported = export(args.preset, out / "model.onnx", dtype=args.dtype, decode=True, cache_len=CACHE_LEN)
        artefacts = {"custom-op": exported.model}
        for target, _ in PLAN[1:]:
            step(f"lowering to {target}")
            try:
                artefacts[target] = lower(exported.model, target)
                save_model(artefacts[target], out / f"model.{target}.onnx")
            except ValueError as exc:  # a target that cannot express this file says which can
                rows.append((target, "-", "", "skipped", "", str(exc)))
        for target, runners in PLAN:
            if target not in artefacts:
                continue
            step(f"validating {target} against PyTorch")
            report = check(artefacts[target], runners)
            for r in report.runners:
                rows.append((
                    target,
                    r.runner,
                    "" if r.max_abs is None else f"{r.max_abs:.2e}",
                    r.status,
                    "" if r.latency_ms is None else f"{r.latency_ms:.2f} ms",
                    r.reason,
                ))
    table = Table(title=f"rope-export demo: {exported.preset.name} ({args.dtype}), every artefact against PyTorch")
    for column in ("target", "runtime", "max abs error", "result", "median latency"):
        table.add_column(column)
    notes = []
    for target, runtime, error, status, latency, reason in rows:
        style = {"pass": "green", "FAIL": "bold red", "skipped": "yellow"}[status]
        table.add_row(target, runtime, error, f"[{style}]{status}[/{style}]", latency)
        if reason:
            notes.append(f"  {target} / {runtime}: {reason}")
    console.print(table)
    for note in notes:
        console.print(note, markup=False, highlight=False, soft_wrap=True)
    failed = [f"{t}/{r}" for t, r, _, status, _, _ in rows if status == "FAIL"]
    console.print(f"artefacts in {out}/ ; {time.perf_counter() - started:.0f} s")
    if failed:
        console.print(f"[bold red]FAIL[/bold red]: {', '.join(failed)} disagree with PyTorch "
                      f"(run `rope-export check {out}/model.<target>.onnx --report DIR` for details)")
        return 1
    return 0
