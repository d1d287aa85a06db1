"""``rope-export check``: prove that an exported or lowered file computes what PyTorch computes.

The PyTorch block is rebuilt from the file's metadata (preset, dtype, seed, cache length). Inputs
stress RoPE: a prefill, a long sequence, decode steps with a past and positions at the very end
of the cache, positions running past the end (the contract passes those tokens through), and
large-magnitude activations. Every runner is executed through polygraphy's
``Comparator.run`` and compared with PyTorch using ``rope_export.tolerances`` ("block" kind).
The report gives per-output error statistics and the error against position buckets; it is
written as JSON, Markdown and a PNG plot, atomically.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx
import torch

from rope_export import contract
from rope_export.export import DTYPES, INPUT_NAMES, example_inputs, read_metadata
from rope_export.fileio import atomic_write_text
from rope_export.plotting import pyplot_or_none, save_png
from rope_export.presets import Preset
from rope_export.runners import (
    CpuTwinRunner,
    OnnxReferenceRunner,
    TorchRunner,
    cuda_available_for_onnxruntime,
    is_rotary_node,
    onnxrt_runner,
    to_numpy,
)
from rope_export.tolerances import Tolerance, tolerance

RUNNERS = ("onnx-reference", "cpu-twin", "onnxruntime-cpu", "onnxruntime-cuda", "tensorrt")
POSITION_BUCKETS = 8


class CheckError(ValueError):
    """A check that cannot start (bad file, unknown runner); the message names the fix."""


@dataclass
class Case:
    name: str
    feeds: dict[str, np.ndarray]
    positions: np.ndarray  # [B, S] absolute positions of the new tokens


@dataclass
class OutputStats:
    output: str
    max_abs: float
    mean_abs: float
    max_rel: float
    mean_rel: float
    passed: bool


@dataclass
class RunnerReport:
    runner: str
    status: str  # "pass", "FAIL" or "skipped"
    reason: str = ""
    latency_ms: float | None = None
    cases: dict[str, list[OutputStats]] = field(default_factory=dict)
    position_error: list[tuple[int, float]] = field(default_factory=list)  # (position, max abs error)

    @property
    def max_abs(self) -> float | None:
        values = [s.max_abs for stats in self.cases.values() for s in stats]
        return max(values) if values else None

    def failures(self) -> list[str]:
        return [f"{case}/{s.output}" for case, stats in self.cases.items() for s in stats if not s.passed]


@dataclass
class CheckReport:
    model: str
    preset: str
    dtype: str
    tolerance: Tolerance
    runners: list[RunnerReport]

    @property
    def passed(self) -> bool:
        compared = [r for r in self.runners if r.status != "skipped"]
        return bool(compared) and all(r.status == "pass" for r in compared)

    def failure_message(self) -> str:
        lines = []
        for r in self.runners:
            if r.status == "FAIL":
                where = ", ".join(r.failures()[:4]) or r.reason
                lines.append(f"runner {r.runner} disagrees with PyTorch on {where}")
        if not any(r.status != "skipped" for r in self.runners):
            lines.append("no runner could run this file: " + "; ".join(f"{r.runner}: {r.reason}" for r in self.runners))
        return "\n".join(lines)


# -- inputs ------------------------------------------------------------------------------------

def stress_cases(preset: Preset, dtype: str, decode: bool, cache_len: int | None, seed: int = 1) -> list[Case]:
    """Inputs that stress RoPE, sized for a CPU: prefill, long, end of cache, large values."""
    torch_dtype = DTYPES[dtype]
    limit = cache_len or preset.rope.max_position_embeddings  # last valid position + 1
    long_seq = min(limit, 256)
    specs = [  # name, batch, seq, past, first position, scale of the activations
        ("prefill", 2, min(16, limit), 0, 0, 1.0),
        ("long-sequence", 1, long_seq, 0, 0, 1.0),
        ("large-magnitude", 2, min(16, limit), 0, 0, 4.0),
    ]
    past = min(8, limit - 1)
    if decode:
        specs += [
            ("decode-mid-cache", 3, 1, past, limit // 2, 1.0),
            ("decode-end-of-cache", 2, 1, past, limit - 1, 1.0),
        ]
    else:
        specs += [("prefill-end-of-cache", 2, min(4, limit), 0, limit - min(4, limit), 1.0)]
    if not preset.rope.seq_len_dependent:
        # Positions running off the end of the cache: the contract passes those tokens through.
        specs += [("past-end-of-cache", 2, 4, 0, limit - 2, 1.0)]
    cases = []
    for i, (name, batch, seq, past_len, first, scale) in enumerate(specs):
        inputs = example_inputs(preset, torch_dtype, decode, batch, seq, past_len, seed=seed + i)
        hidden = (inputs[0].float() * scale).to(torch_dtype)
        positions = torch.arange(first, first + seq).expand(batch, seq).contiguous()
        tensors = (hidden, positions, *inputs[2:])
        feeds = {n: to_numpy(t) for n, t in zip(INPUT_NAMES, tensors, strict=False)}
        cases.append(Case(name, feeds, positions.numpy()))
    return cases


# -- comparison --------------------------------------------------------------------------------

def compare_output(name: str, actual: np.ndarray, expected: np.ndarray, tol: Tolerance) -> OutputStats:
    """Error statistics; relative error is |a-b| / (|b| + atol) so near-zero values do not explode."""
    a = np.asarray(actual, dtype=np.float64)
    b = np.asarray(expected, dtype=np.float64)
    if a.shape != b.shape:
        return OutputStats(name, float("inf"), float("inf"), float("inf"), float("inf"), False)
    abs_err = np.abs(a - b)
    rel_err = abs_err / (np.abs(b) + tol.atol)
    finite = bool(np.isfinite(a).all() == np.isfinite(b).all())
    return OutputStats(
        name,
        float(abs_err.max(initial=0.0)),
        float(abs_err.mean()) if abs_err.size else 0.0,
        float(rel_err.max(initial=0.0)),
        float(rel_err.mean()) if rel_err.size else 0.0,
        finite and tol.allclose(a, b),
    )


def per_position_error(actual: np.ndarray, expected: np.ndarray, positions: np.ndarray) -> list[tuple[int, float]]:
    """(position, max abs error over the hidden channels) for each token of ``output`` [B, S, hidden]."""
    err = np.abs(np.asarray(actual, np.float64) - np.asarray(expected, np.float64)).max(axis=-1)
    return [(int(p), float(e)) for p, e in zip(positions.reshape(-1), err.reshape(-1), strict=True)]


def position_buckets(points: list[tuple[int, float]], buckets: int = POSITION_BUCKETS) -> list[dict]:
    """Max error per equal-width bucket of positions."""
    if not points:
        return []
    positions = np.array([p for p, _ in points])
    errors = np.array([e for _, e in points])
    edges = np.linspace(0, positions.max() + 1, buckets + 1)
    out = []
    for low, high in zip(edges[:-1], edges[1:], strict=True):
        inside = (positions >= low) & (positions < high)
        if inside.any():
            worst = float(errors[inside].max())
            out.append({"from": int(np.ceil(low)), "to": int(np.ceil(high)) - 1, "max_abs": worst})
    return out


# -- runners -----------------------------------------------------------------------------------

def has_custom_nodes(model: onnx.ModelProto) -> bool:
    return any(n.domain == contract.DOMAIN for n in model.graph.node)


def has_rotary_nodes(model: onnx.ModelProto) -> bool:
    """Nodes that carry the op contract: ours, or their trt-plugin form."""
    return any(is_rotary_node(n) for n in model.graph.node)


def _ort_model(model: onnx.ModelProto) -> tuple[onnx.ModelProto, str]:
    """onnxruntime cannot run our domain: lower a custom-op file to the standard op in memory."""
    if has_rotary_nodes(model) and not has_custom_nodes(model):
        raise _Skip("onnxruntime cannot run the TensorRT plugin node; use cpu-twin or tensorrt for this file")
    if not has_custom_nodes(model):
        return model, ""
    from rope_export.passes import lower

    return lower(model, "onnx"), " (custom op lowered in memory to the standard op)"


def build_runner(name: str, model: onnx.ModelProto, plugin_library: str | None = None, cases: list[Case] = ()):
    """(runner, note) or raise _Skip(reason)."""
    if name == "onnx-reference":
        if any(n.domain == "com.microsoft" for n in model.graph.node):
            raise _Skip("onnx.reference has no com.microsoft kernels; use onnxruntime-cpu for this file")
        return OnnxReferenceRunner(model), ""
    if name == "cpu-twin":
        if not has_rotary_nodes(model):
            raise _Skip("no rotary node for the twin to run (the file was lowered to another target)")
        from rope_export import plugin

        try:
            plugin.twin()
        except FileNotFoundError as exc:
            raise _Skip(str(exc)) from None
        return CpuTwinRunner(model), ""
    if name in ("onnxruntime-cpu", "onnxruntime-cuda"):
        if name == "onnxruntime-cuda" and not cuda_available_for_onnxruntime():
            raise _Skip("onnxruntime has no CUDA execution provider here (install rope-export[gpu] on a GPU machine)")
        provider = "CUDAExecutionProvider" if name == "onnxruntime-cuda" else "CPUExecutionProvider"
        try:
            ort_model, note = _ort_model(model)
        except (ValueError, NotImplementedError) as exc:
            raise _Skip(str(exc)) from None
        return onnxrt_runner(ort_model, name, providers=(provider,)), note
    if name == "tensorrt":
        from rope_export import trt

        reason = trt.tensorrt_unavailable_reason()
        if reason:
            raise _Skip(reason)
        return _tensorrt_runner(model, plugin_library, cases), " (engine built with the rotary plugin)"
    raise CheckError(f"unknown runner {name!r}; choose from {', '.join(RUNNERS)}")


class _Skip(Exception):
    pass


def _tensorrt_runner(model: onnx.ModelProto, plugin_library: str | None, cases: list[Case]):
    """Lower to the plugin form, build an engine whose profile covers the cases, wrap it."""
    import tempfile

    from polygraphy.backend.trt import TrtRunner

    from rope_export import trt
    from rope_export.passes import lower

    plugin = plugin_library or str(trt.default_plugin_library())
    lowered = lower(model, "trt-plugin") if has_custom_nodes(model) else model
    shapes = {}
    for name in cases[0].feeds:
        dims = np.array([case.feeds[name].shape for case in cases])
        low = tuple(int(d) for d in dims.min(axis=0))
        high = tuple(int(d) for d in dims.max(axis=0))
        shapes[name] = (low, high, high)
    with tempfile.TemporaryDirectory() as tmp:
        onnx.save_model(lowered, f"{tmp}/model.onnx")
        engine_path = trt.build_engine(f"{tmp}/model.onnx", f"{tmp}/model.engine", [plugin], shapes)
        engine = trt.load_engine(engine_path, [plugin])
    return TrtRunner(engine, name="tensorrt")


def _run_one(runner, cases: list[Case]) -> tuple[list[dict[str, np.ndarray]], float]:
    from polygraphy.comparator import Comparator
    from polygraphy.logger import G_LOGGER

    with G_LOGGER.verbosity(G_LOGGER.ERROR):
        results = Comparator.run([runner], data_loader=[case.feeds for case in cases], warm_up=1)
    (_, iterations), = results.items()
    outputs = [{k: np.asarray(v.numpy() if hasattr(v, "numpy") else v) for k, v in it.items()} for it in iterations]
    times = [it.runtime for it in iterations if it.runtime is not None]
    return outputs, (float(np.median(times)) * 1e3 if times else None)


def check(
    model: onnx.ModelProto | str | os.PathLike,
    runners: tuple[str, ...] = RUNNERS,
    *,
    reference_block: torch.nn.Module | None = None,
    plugin_library: str | None = None,
    progress=None,
) -> CheckReport:
    """Run every runner on the stress cases and compare with the PyTorch block."""
    say = progress or (lambda message: None)
    path = str(model) if not isinstance(model, onnx.ModelProto) else "<in memory>"
    if not isinstance(model, onnx.ModelProto):
        if not Path(model).is_file():
            raise CheckError(f"no such file: {model}")
        model = onnx.load_model(model)
    meta = read_metadata(model)
    preset, dtype = meta["preset"], meta["dtype"]
    for name in runners:
        if name not in RUNNERS:
            raise CheckError(f"unknown runner {name!r}; choose from {', '.join(RUNNERS)}")
    tol = tolerance("block", DTYPES[dtype])
    block = reference_block or preset.build_block(DTYPES[dtype], seed=meta["seed"], cache_len=meta["cache_len"])
    cases = stress_cases(preset, dtype, meta["decode"], meta["cache_len"])
    say(f"running PyTorch on {len(cases)} stress cases")
    expected, _ = _run_one(TorchRunner(block, model), cases)

    reports = []
    for name in runners:
        try:
            runner, note = build_runner(name, model, plugin_library, cases)
        except _Skip as skip:
            reports.append(RunnerReport(name, "skipped", str(skip)))
            continue
        say(f"running {name}{note}")
        try:
            actual, latency = _run_one(runner, cases)
        except Exception as exc:  # a runner that crashes is a failed comparison, reported by name
            reports.append(RunnerReport(name, "FAIL", f"{type(exc).__name__}: {exc}".splitlines()[0][:300]))
            continue
        report = RunnerReport(name, "pass", note.strip(" ()"), latency)
        for case, got, want in zip(cases, actual, expected, strict=True):
            report.cases[case.name] = [compare_output(o, got[o], want[o], tol) for o in want]
            if "output" in want and got["output"].shape == want["output"].shape:
                report.position_error += per_position_error(got["output"], want["output"], case.positions)
        if report.failures():
            report.status = "FAIL"
        reports.append(report)
    return CheckReport(path, preset.name, dtype, tol, reports)


# -- reports -----------------------------------------------------------------------------------

def report_dict(report: CheckReport) -> dict:
    return {
        "model": report.model,
        "preset": report.preset,
        "dtype": report.dtype,
        "tolerance": asdict(report.tolerance),
        "tolerance_rule": "|actual - pytorch| <= atol + rtol * |pytorch|, elementwise",
        "passed": report.passed,
        "runners": [
            {
                "runner": r.runner,
                "status": r.status,
                "reason": r.reason,
                "latency_ms_median": r.latency_ms,
                "max_abs_error": r.max_abs,
                "cases": {case: [asdict(s) for s in stats] for case, stats in r.cases.items()},
                "error_by_position": position_buckets(r.position_error),
            }
            for r in report.runners
        ],
    }


def report_markdown(report: CheckReport) -> str:
    lines = [
        f"# rope-export check: {report.model}",
        "",
        f"Preset `{report.preset}`, dtype {report.dtype}; tolerance atol={report.tolerance.atol:g}, "
        f"rtol={report.tolerance.rtol:g} against PyTorch. Result: **{'PASS' if report.passed else 'FAIL'}**.",
        "",
        "| runner | status | max abs error | worst case/output | median latency | note |",
        "|---|---|---|---|---|---|",
    ]
    for r in report.runners:
        worst = max(((c, s) for c, stats in r.cases.items() for s in stats), key=lambda cs: cs[1].max_abs,
                    default=None)
        lines.append(
            f"| {r.runner} | {r.status} | {'' if r.max_abs is None else f'{r.max_abs:.3g}'} | "
            f"{'' if worst is None else f'{worst[0]}/{worst[1].output}'} | "
            f"{'' if r.latency_ms is None else f'{r.latency_ms:.2f} ms'} | {r.reason} |"
        )
    lines += ["", "## Error against position (max abs error of `output`)", ""]
    for r in report.runners:
        buckets = position_buckets(r.position_error)
        if buckets:
            cells = ", ".join(f"{b['from']}-{b['to']}: {b['max_abs']:.2g}" for b in buckets)
            lines.append(f"- **{r.runner}**: {cells}")
    return "\n".join(lines) + "\n"


def plot_error_vs_position(report: CheckReport, path: str | os.PathLike) -> bool:
    """A PNG of max abs error against position per runner; False when matplotlib is missing."""
    plt = pyplot_or_none()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    for r in report.runners:
        if r.position_error:
            points = sorted(r.position_error)
            positions = np.array([p for p, _ in points])
            errors = np.maximum(np.array([e for _, e in points]), 1e-12)  # log axis: show exact zeros at the floor
            ax.scatter(positions, errors, s=10, alpha=0.6, label=f"{r.runner} ({r.status})")
    atol = report.tolerance.atol
    ax.axhline(atol, color="gray", linestyle="--", linewidth=1, label=f"atol {atol:g}")
    ax.set_yscale("log")
    ax.set_xlabel("position")
    ax.set_ylabel("max |runner - PyTorch| per token (exact 0 at 1e-12)")
    ax.set_title(f"{report.preset} ({report.dtype}): error against position")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    save_png(fig, path)
    return True


def write_reports(report: CheckReport, directory: str | os.PathLike) -> list[Path]:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = [directory / "check.json", directory / "check.md"]
    atomic_write_text(written[0], json.dumps(report_dict(report), indent=2) + "\n")
    atomic_write_text(written[1], report_markdown(report))
    if plot_error_vs_position(report, directory / "error_vs_position.png"):
        written.append(directory / "error_vs_position.png")
    return written


# -- CLI ---------------------------------------------------------------------------------------

def register(subparsers) -> None:
    parser = subparsers.add_parser("check", help="compare an exported or lowered file with PyTorch")
    parser.add_argument("model", help="an .onnx file written by `rope-export export` or `lower`")
    parser.add_argument("--runners", default=",".join(RUNNERS),
                        help=f"comma-separated, from {', '.join(RUNNERS)} (default: all; unavailable ones are skipped)")
    parser.add_argument("--report", metavar="DIR", help="write check.json, check.md and error_vs_position.png here")
    parser.add_argument("--plugin", metavar="LIB", help="TensorRT plugin library for the tensorrt runner")
    parser.set_defaults(func=_run)


def print_report(report: CheckReport, console) -> None:
    from rich.table import Table

    table = Table(title=f"{report.model}: {report.preset} ({report.dtype}) against PyTorch, "
                        f"atol {report.tolerance.atol:g} rtol {report.tolerance.rtol:g}")
    for column in ("runner", "status", "max abs error", "median latency"):
        table.add_column(column)
    for r in report.runners:
        style = {"pass": "green", "FAIL": "bold red", "skipped": "yellow"}[r.status]
        table.add_row(
            r.runner,
            f"[{style}]{r.status}[/{style}]",
            "" if r.max_abs is None else f"{r.max_abs:.3g}",
            "" if r.latency_ms is None else f"{r.latency_ms:.2f} ms",
        )
    console.print(table)
    for r in report.runners:  # notes below the table: skip reasons are sentences, not cells
        if r.reason:
            console.print(f"  {r.runner}: {r.reason}", markup=False, highlight=False, soft_wrap=True)


def _run(args) -> int:
    import sys

    from rich.console import Console

    console = Console()
    runners = tuple(r.strip() for r in args.runners.split(",") if r.strip())
    with console.status("checking") as status:
        report = check(args.model, runners, plugin_library=args.plugin, progress=status.update)
    print_report(report, console)
    if args.report:
        for path in write_reports(report, args.report):
            console.print(f"wrote {path}")
    if not report.passed:
        print(f"rope-export check: FAIL: {report.failure_message()}", file=sys.stderr)
        return 1
    return 0
