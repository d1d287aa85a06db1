"""``rope-export bench``: measured ratios on the CPU now, the GPU harness ready for when a GPU is lent.

Five sections, one module each; every figure is a median of interleaved rounds and every
comparison a ratio of two runners measured in the same rounds (``rope_export.bench.timing``):

1. ``rope_alone``: RoPE alone on onnxruntime CPU, the ``onnx`` and ``ort`` lowerings against the
   decomposed form and PyTorch eager, prefill and decode, fp32 and fp16, plus a copy of the same bytes;
2. ``block``: a whole attention block, our export lowered to ``onnx`` against a plain
   ``torch.onnx.export`` with decomposed RoPE (tiny preset and a Llama-3.1-8B layer), node counts,
   and RoPE's share of the block's time;
3. ``twin``: the kernels' CPU twin against a single-thread memory copy of the same bytes;
4. ``gpu``: TensorRT plugin / TensorRT RotaryEmbedding / onnxruntime CUDA / PyTorch eager with CUDA
   events; runs only with a GPU, otherwise reported as skipped with the reason (never zeros);
5. ``kernels``: ptxas registers/spills/shared memory and 128-bit global accesses of every kernel;
6. ``scale`` (only when asked for, ``--sections scale``): a real-size transformers model (1B-class,
   8B-class with ``--scale-sizes 8b``) exported, lowered, fused and checked, each step in its own process,
   wall time and peak RSS beside a plain ``torch.onnx.export`` (``rope_export.bench.scale``);
7. ``cli`` (only when asked for, ``--sections cli``): how long ``rope-export --help``, each command's
   ``--help`` and ``lower``/``fuse`` of a small file take, a fresh process each (``rope_export.bench.cli_startup``).

Writes ``bench.json``, ``bench.md`` and ``bench.png`` (atomically) into ``--out`` (default
``out/bench``). ``--quick`` fits in two minutes on 2 cores; ``--smoke`` uses toy shapes to check
the harness end to end (its numbers mean nothing).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rope_export.bench.block import BlockCase
from rope_export.bench.rope_alone import RopeCase

SECTIONS = ("rope", "block", "twin", "gpu", "kernels", "scale", "cli")
DEFAULT_SECTIONS = ("rope", "block", "twin", "gpu", "kernels")  # scale (minutes, GBs) and cli: only when asked for
SECTION_KEYS = {"rope": "rope_alone", "block": "block", "twin": "twin", "gpu": "gpu", "kernels": "kernels",
                "scale": "scale", "cli": "cli"}
DEFAULT_OUT = "out/bench"
SCHEMA = "rope-export-bench/1"
DESCRIPTION = (
    "Benchmark RoPE alone (onnxruntime CPU), whole attention blocks, the kernels' CPU twin, the GPU path "
    "(only with a GPU) and the kernels' build; medians of interleaved rounds, ratios measured side by side. "
    "Writes bench.json, bench.md and bench.png."
)

# B, S, Hq, Hk, D: a Llama-3-8B-like GQA layer (32 query heads, 8 kv heads, head_dim 128).
ROPE_SHAPES = {"prefill": (1, 2048, 32, 8, 128), "decode": (16, 1, 32, 8, 128)}
SMOKE_ROPE_SHAPES = {"prefill": (1, 64, 4, 2, 128), "decode": (2, 1, 4, 2, 128)}
DTYPES = ("float32", "float16")

BLOCK_CASES = {
    "full": [
        BlockCase("tiny", "prefill", 1, 512),
        BlockCase("tiny", "decode", 16, 1, past=512),
        BlockCase("llama-3.1-8b", "prefill", 1, 1024),
        BlockCase("llama-3.1-8b", "decode", 16, 1, past=1024),
    ],
    "quick": [BlockCase("tiny", "prefill", 1, 128), BlockCase("llama-3.1-8b", "prefill", 1, 128)],
    "smoke": [BlockCase("tiny", "prefill", 1, 16)],
}
ROUNDS = {  # (RoPE alone and twin by phase, block by phase, profiled runs)
    "full": ({"prefill": 31, "decode": 41}, {"prefill": 9, "decode": 21}, 5),
    "quick": ({"prefill": 7, "decode": 11}, {"prefill": 5, "decode": 7}, 3),
    "smoke": ({"prefill": 2, "decode": 2}, {"prefill": 2, "decode": 2}, 1),
}


@dataclass
class BenchConfig:
    mode: str = "quick"  # "full" | "quick" | "smoke"
    threads: int = 2
    sections: tuple[str, ...] = SECTIONS
    rope_cases: list[RopeCase] = field(default_factory=list)  # twin and GPU: the "table" ones
    block_cases: list[BlockCase] = field(default_factory=list)
    rounds: dict[str, int] = field(default_factory=dict)
    block_rounds: dict[str, int] = field(default_factory=dict)
    profile_runs: int = 3
    scale_sizes: tuple[str, ...] = ("1b",)
    scale_dir: str | None = None  # default: OUT/scale-work
    scale_reps: int = 1
    scale_keep: bool = False
    scale_check: bool = True
    scale_dtype: str = "fp16"
    scale_builder: bool = True  # the graph builders (onnxruntime-genai's, mobius) beside export --hf, when installed
    scale_full_trace: bool = False  # also export --hf --trace full
    scale_package: bool = True  # also package genai --hf
    scale_cold: bool = False  # drop the page cache before every step (root)
    commands: tuple[str, ...] = ()  # section cli: the command line's commands, each --help timed

    @classmethod
    def for_mode(cls, mode: str = "quick", threads: int = 2, rounds: int | None = None,
                 sections: tuple[str, ...] = DEFAULT_SECTIONS) -> BenchConfig:
        if mode not in ROUNDS:
            raise ValueError(f"unknown mode {mode!r}; use full, quick or smoke")
        unknown = sorted(set(sections) - set(SECTIONS))
        if unknown:
            raise ValueError(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
        if threads < 1:
            raise ValueError(f"--threads must be >= 1, got {threads}")
        if rounds is not None and rounds < 1:
            raise ValueError(f"--reps must be >= 1, got {rounds}")
        shapes = SMOKE_ROPE_SHAPES if mode == "smoke" else ROPE_SHAPES
        rope_cases = [RopeCase(phase, *shape, dtype=dtype) for phase, shape in shapes.items() for dtype in DTYPES]
        if mode == "full":  # also against the graph transformers exports today: cos/sin computed from inv_freq
            rope_cases += [RopeCase("prefill", *shapes["prefill"], dtype=dtype, source="computed") for dtype in DTYPES]
        rope_rounds, block_rounds, profile_runs = ROUNDS[mode]
        if rounds is not None:
            rope_rounds = dict.fromkeys(rope_rounds, rounds)
            block_rounds = dict.fromkeys(block_rounds, rounds)
        return cls(mode, threads, tuple(sections), rope_cases, list(BLOCK_CASES[mode]), dict(rope_rounds),
                   dict(block_rounds), profile_runs, scale_reps=rounds or 1)


def _guarded(name: str, fn: Callable[[], dict], say: Callable[[str], None]) -> dict:
    """Run one section; a failure is recorded (status "failed" and the reason) and the others still run."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - a broken section must not hide the others' figures
        say(f"{name}: FAILED: {type(exc).__name__}: {exc}")
        return {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"}


def run_bench(config: BenchConfig, progress: Callable[[str], None] | None = None) -> dict:
    """Run the configured sections; returns the JSON-ready results (``report.write_outputs`` saves them)."""
    from rope_export.bench import block, cli_startup, gpu, kernels, report, rope_alone, scale, twin
    from rope_export.bench.timing import machine_info

    say = progress or (lambda message: None)
    started = time.perf_counter()
    results: dict = {
        "schema": SCHEMA,
        "mode": config.mode,
        "machine": machine_info(),
        "settings": {
            "threads": config.threads,
            "sections": list(config.sections),
            "rope_cases": [asdict(c) for c in config.rope_cases],
            "block_cases": [asdict(c) for c in config.block_cases],
            "rounds": config.rounds,
            "block_rounds": config.block_rounds,
            "profile_runs": config.profile_runs,
        },
        "sections": {},
    }
    sections = results["sections"]
    table_cases = [c for c in config.rope_cases if c.source == "table"]
    plan = {
        "rope": lambda: rope_alone.run_section(config.rope_cases, config.threads, config.rounds, say),
        "block": lambda: block.run_section(config.block_cases, config.threads, config.block_rounds,
                                           config.profile_runs, say),
        "twin": lambda: twin.run_section(table_cases, config.rounds, say),
        "gpu": lambda: gpu.run_section(config.mode, say),  # its own cases (issue 17): prefill 4096, decode 64
        "kernels": lambda: kernels.static_report(kernels.archs_for(config.mode)),
        "scale": lambda: scale.run_section(config.scale_sizes, Path(config.scale_dir or "out/bench/scale-work"),
                                           dtype=config.scale_dtype, reps=config.scale_reps, keep=config.scale_keep,
                                           check=config.scale_check, builder=config.scale_builder,
                                           full_trace=config.scale_full_trace, package=config.scale_package,
                                           cold=config.scale_cold, say=say),
        "cli": lambda: cli_startup.run_section(config.mode, say, config.commands),
    }
    for name in SECTIONS:
        if name in config.sections:
            if name == "kernels":
                say("kernels: compiling plugins/rotary/rotary_cuda.cu with nvcc -Xptxas -v --keep")
            load = round(os.getloadavg()[0], 2)  # other people's jobs on the same cores skew a whole section
            sections[SECTION_KEYS[name]] = {**_guarded(name, plan[name], say), "load_average_1min_at_start": load}
    results["goals"] = report.goals(results)
    results["machine"]["load_average_end"] = [round(v, 2) for v in os.getloadavg()]
    results["elapsed_s"] = time.perf_counter() - started
    return results


# -- CLI ---------------------------------------------------------------------------------------
