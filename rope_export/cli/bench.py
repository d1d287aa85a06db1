"""``rope-export bench``: the benchmark sections of ``rope_export.bench``, their options and report."""

from __future__ import annotations

import argparse
from pathlib import Path

from rope_export.bench import DEFAULT_OUT, DEFAULT_SECTIONS, DESCRIPTION, SECTIONS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="fewer rounds and smaller blocks: under two minutes on 2 cores")
    size.add_argument("--smoke", action="store_true",
                      help="toy shapes and 2 rounds: checks the harness end to end in seconds (numbers mean nothing)")
    parser.add_argument("--threads", type=int, default=2,
                        help="onnxruntime intra-op and torch threads of the CPU runners (default 2; the twin uses 1)")
    parser.add_argument("--reps", type=int, default=None,
                        help="interleaved rounds of every comparison (default by mode)")
    parser.add_argument("--sections", default=",".join(DEFAULT_SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)} (default all but scale and cli)")
    scale = parser.add_argument_group("scale section (--sections scale)")
    scale.add_argument("--scale-sizes", default="1b",
                       help="comma-separated model sizes: 135m (SmolLM-135M shape: deep and narrow, 30 layers of "
                            "hidden 576), 1b (Llama-3.2-1B shape), 8b (Llama-3.1-8B shape, 16 GB of weights: run on a "
                            "quiet machine), 2gb (the smallest > 2 GB case) (default 1b)")
    scale.add_argument("--scale-dir", default=None,
                       help="folder for the model files (default OUT/scale-work; needs about 3x the weights free, "
                            "4x with the builder)")
    scale.add_argument("--scale-keep", action="store_true", help="keep the exported and lowered files")
    scale.add_argument("--scale-no-check", dest="scale_check", action="store_false",
                       help="leave out the last step, rope-export check of the exported file against transformers")
    scale.add_argument("--scale-dtype", default="fp16", choices=("fp32", "fp16", "bf16"),
                       help="weight dtype of every export in the section (default fp16)")
    scale.add_argument("--scale-full-trace", action="store_true",
                       help="also run export --hf --trace full (every layer traced) as a row, its file checked too")
    scale.add_argument("--scale-no-package", dest="scale_package", action="store_false",
                       help="leave out package genai --hf (a genai folder, as the builder writes one)")
    scale.add_argument("--scale-cold", action="store_true",
                       help="drop the page cache before every step (root; the whole machine's cache: a quiet machine "
                            "only), so each step reads its libraries and the checkpoint from disk, as a first command "
                            "after copying a model does")
    scale.add_argument("--scale-no-builder", dest="scale_builder", action="store_false",
                       help="leave out the graph builders, onnxruntime-genai's and mobius (each run by default when "
                            "installed, on a save_pretrained folder that every export then reads)")
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help=f"folder for bench.json, bench.md, bench.png (default {DEFAULT_OUT})")
    parser.add_argument("--plot", default=None, metavar="PNG",
                        help="write the ratio plot here instead of OUT/bench.png")
    parser.set_defaults(func=run)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench", help="benchmark RoPE alone, whole blocks, the CPU twin, the GPU path and the kernels' build",
        description=DESCRIPTION,
    )
    add_arguments(parser)


def run(args) -> int:
    from rich.console import Console

    from rope_export.bench import BenchConfig, run_bench
    from rope_export.bench.report import print_report, write_outputs
    from rope_export.cli import COMMANDS

    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    sections = tuple(s.strip() for s in args.sections.split(",") if s.strip())
    config = BenchConfig.for_mode(mode, args.threads, args.reps, sections)
    config.scale_sizes = tuple(s.strip() for s in args.scale_sizes.split(",") if s.strip())
    config.scale_dir = args.scale_dir or str(Path(args.out) / "scale-work")
    config.scale_keep, config.scale_check = args.scale_keep, args.scale_check
    config.scale_dtype, config.scale_builder = args.scale_dtype, args.scale_builder
    config.scale_full_trace, config.scale_package = args.scale_full_trace, args.scale_package
    config.scale_cold = args.scale_cold
    config.commands = tuple(COMMANDS)
    console = Console()
    if not console.is_terminal:  # a log or a pipe: wide enough for the tables, not rich's 80 columns
        console = Console(width=160)
    with console.status("starting") as status:
        def progress(message: str) -> None:
            status.update(message)
            console.log(message, highlight=False)

        results = run_bench(config, progress)
        progress("writing bench.json, bench.md and the plot")
        written = write_outputs(results, args.out, args.plot)
    print_report(results, console)
    console.print(f"written: {', '.join(str(p) for p in written)} ({results['elapsed_s']:.0f} s)", highlight=False)
    failed = [k for k, v in results["sections"].items() if v.get("status") == "failed"]
    if failed:
        console.print(f"[bold red]failed sections[/bold red]: {', '.join(failed)}")
        return 1
    return 0
