"""The check report: what was compared with what, per runner and case, as JSON, Markdown, a PNG and a table.

The PNG plots the worst error per power-of-two bucket of positions, one series per runner, in units of
the limit that decided pass or fail (so the drawn line at 1 is the rule applied, position allowance
included, and a point's colour is its verdict): the whole model on the stress cases (top) and each
rotary node alone over every position (bottom), readable whether positions span 64 rows or 131072.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rope_export.check.cache_rows import SweepResult, TableCheck
from rope_export.check.compare import OutputStats, PositionErrors, bucket_label
from rope_export.check.layer_errors import LayerErrors
from rope_export.check.layer_faults import LayerFault, fault_dict
from rope_export.check.layer_report import layer_lines, plot_error_vs_layer, summary_line
from rope_export.common.bounds import format_bytes
from rope_export.common.fileio import atomic_write_text
from rope_export.common.plotting import pyplot_or_none, save_png
from rope_export.op.tolerances import AgainstPyTorch, Tolerance


@dataclass
class RunnerReport:
    runner: str
    status: str  # "pass", "FAIL", "skipped", "golden" (the runner the others are compared with) or "runner fault"
    # ("runner fault": it leaves PyTorch's envelope at an op it computes less precisely than the file states,
    # check.layer_faults; the file is not failed for it)
    reason: str = ""
    latency_ms: float | None = None
    cases: dict[str, list[OutputStats]] = field(default_factory=dict)
    position_error: PositionErrors = field(default_factory=PositionErrors)
    sweep: SweepResult | None = None
    layers: LayerErrors | None = None  # error after each decoder layer, beside PyTorch's (measured rule only)
    fault: LayerFault | None = None  # the op of the first layer outside PyTorch's envelope, and whose fault

    @property
    def max_abs(self) -> float | None:
        values = [s.max_abs for stats in self.cases.values() for s in stats]
        return max(values) if values else None

    def failures(self) -> list[str]:
        return [f"{case}/{s.output}" for case, stats in self.cases.items() for s in stats if not s.passed]


@dataclass
class CheckReport:
    model: str
    reference: str  # what the runners were compared with, in words
    against: str  # short: "PyTorch", "transformers", "onnxruntime on X.onnx", "onnx-reference"
    independent: bool  # False: the reference is one of the runners (compared with each other)
    dtype: str
    tolerance: Tolerance
    runners: list[RunnerReport]
    tables: list[TableCheck] = field(default_factory=list)
    inputs: str = ""
    cases: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    preset: str = ""
    sweep_tolerance: Tolerance | None = None  # the op tolerance the rotary nodes alone are held to
    weights: dict = field(default_factory=dict)  # a transformers reference's: {"source": "folder"|"random", ...}
    rule: AgainstPyTorch | None = None  # the measured rule, where a higher-precision reference decided
    pytorch_layers: list[float] | None = None  # PyTorch's own error after each layer, in the file's dtype
    precision: list[dict] = field(default_factory=list)  # ops the file states less precisely than PyTorch computes

    @property
    def rule_name(self) -> str:
        return "against PyTorch's own error" if self.rule is not None else "tolerance (sqrt(layers) for a model)"

    @property
    def compared(self) -> list[RunnerReport]:
        return [r for r in self.runners if r.status in ("pass", "FAIL")]

    @property
    def passed(self) -> bool:
        return bool(self.compared) and all(r.status == "pass" for r in self.compared) and all(
            t.passed for t in self.tables)

    def failure_message(self) -> str:
        lines = [t.message() for t in self.tables if not t.passed]
        for r in self.runners:
            if r.status != "FAIL":
                continue
            where = ", ".join(r.failures()[:4])
            if where or not r.sweep or r.sweep.status != "FAIL":
                lines.append(f"runner {r.runner} disagrees with {self.against} on {where or r.reason}")
            if r.layers is not None and r.layers.first_outside is not None:
                lines.append(f"runner {r.runner}: {summary_line(r.layers)}")
            if r.fault is not None:
                lines.append(f"runner {r.runner}: {r.fault.sentence()}")
            if r.sweep is not None and r.sweep.status == "FAIL":
                lines.append(f"runner {r.runner}, rotary node alone: {r.sweep.reason}")
        if not self.compared:
            lines.append("no runner could run this file as it states: " + "; ".join(
                f"{r.runner}: {r.reason}" for r in self.runners if r.status in ("skipped", "runner fault")))
        return "\n".join(lines)


def verdict_line(report: CheckReport) -> str:
    """The one line that ends ``check``'s output: PASS or FAIL, how many runners agree with what, what was skipped
    and why (the first clause of each reason), for a person and a script alike."""
    compared, skipped = report.compared, [r for r in report.runners if r.status == "skipped"]
    passing = [r for r in compared if r.status == "pass"]
    with_what = report.against + ("" if report.independent else " (compared with each other, not with PyTorch)")
    why = "; ".join(f"{r.runner}: {_first_clause(r.reason)}" for r in skipped)
    tail = f" ({len(skipped)} skipped: {why})" if skipped else ""
    if report.passed:
        runners = f"{len(passing)} runner{'s agree' if len(passing) != 1 else ' agrees'}"
        rows = f", every stored cos/sin row matches {_tables_against(report)}" if report.tables else ""
        return f"PASS: {runners} with {with_what}{rows}{tail}"
    problems = [f"{r.runner} disagrees with {with_what}" for r in compared if r.status == "FAIL"]
    bad_tables = [t for t in report.tables if not t.passed]
    if bad_tables:
        problems.append(f"{len(bad_tables)} stored cos/sin table{'s' if len(bad_tables) != 1 else ''} off "
                        f"{_tables_against(report)}")
    if not compared:
        problems.append("no runner could run this file")
    agree = f"; {len(passing)} of {len(compared)} runners agree" if compared else ""
    return f"FAIL: {', '.join(problems)}{agree}{tail}"


def _first_clause(reason: str) -> str:
    text = reason.split("; ")[0].split(" (")[0].strip().rstrip(".")
    return text if len(text) <= 80 else text[:77] + "..."


def _tables_against(report: CheckReport) -> str:
    sources = {t.against for t in report.tables}
    return sources.pop() if len(sources) == 1 else "the RoPE configuration or a fitted rotation table"


# -- JSON and Markdown -------------------------------------------------------------------------

def _sweep_dict(sweep: SweepResult | None) -> dict | None:
    if sweep is None:
        return None
    return {"status": sweep.status, "reason": sweep.reason, "max_abs_error": sweep.max_abs,
            "positions": sweep.positions, "out_of_range_positions": sweep.out_of_range,
            "error_by_position": sweep.position_error.buckets()}


def report_dict(report: CheckReport) -> dict:
    return {
        "model": report.model,
        "reference": report.reference,
        "compared_with_an_independent_reference": report.independent,
        "preset": report.preset or None,
        "weights": report.weights or None,
        "dtype": report.dtype,
        "tolerance": asdict(report.tolerance),
        "tolerance_rule": "|actual - reference| <= atol + rtol * |reference|, elementwise",
        "pass_rule": report.rule_name,
        "against_pytorch": None if report.rule is None else {**asdict(report.rule), "rule": report.rule.describe()},
        "pytorch_error_by_layer": report.pytorch_layers,
        "stated_below_pytorch": report.precision,
        "inputs": report.inputs,
        "cases": report.cases,
        "notes": report.notes,
        "passed": report.passed,
        "cache_tables": [asdict(t) for t in report.tables],
        "runners": [
            {
                "runner": r.runner,
                "status": r.status,
                "reason": r.reason,
                "latency_ms_median": r.latency_ms,
                "max_abs_error": r.max_abs,
                "cases": {case: [{**asdict(s), "ratio_to_pytorch": s.ratio} for s in stats]
                          for case, stats in r.cases.items()},
                "error_by_layer": None if r.layers is None else {**asdict(r.layers),
                                                                 "worst_ratio": r.layers.worst_ratio},
                "op_by_op": None if r.fault is None else fault_dict(r.fault),
                "error_by_position": r.position_error.buckets(),
                "rotary_sweep": _sweep_dict(r.sweep),
            }
            for r in report.runners
        ],
    }


def _cell(value, fmt="{:.3g}") -> str:
    return "" if value is None else fmt.format(value)


def report_markdown(report: CheckReport, steps=None) -> str:
    """check.md; ``steps``: the command's StepLog, whose time and peak RSS per step close the page."""
    comparison = ("against " + report.reference if report.independent else
                  f"**the runners compared with each other, not with PyTorch**: {report.reference}")
    rule = (f"pass rule: {report.rule.describe()}" if report.rule is not None else
            f"tolerance atol={report.tolerance.atol:g} (times an output's RMS where above 1), "
            f"rtol={report.tolerance.rtol:g}")
    lines = [
        f"# rope-export check: {report.model}",
        "",
        f"{report.dtype}, {comparison}; {rule}. Result: **{'PASS' if report.passed else 'FAIL'}**.",
        "",
        f"Inputs: {report.inputs}. Cases: {', '.join(report.cases)}.",
        "",
        "| runner | status | max abs error | worst case/output | rotary nodes alone | median latency | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report.runners:
        worst = max(((c, s) for c, stats in r.cases.items() for s in stats), key=lambda cs: cs[1].max_abs,
                    default=None)
        sweep = "" if r.sweep is None else f"{r.sweep.status}" + (
            f", {r.sweep.positions} positions, max {_cell(r.sweep.max_abs)}" if r.sweep.positions else "")
        lines.append(f"| {r.runner} | {r.status} | {_cell(r.max_abs)} | "
                     f"{'' if worst is None else f'{worst[0]}/{worst[1].output}'} | {sweep} | "
                     f"{_cell(r.latency_ms, '{:.2f} ms')} | {r.reason} |")
    if report.rule is not None:
        lines += ["", "## Against PyTorch's own error (per case and output, max abs vs the higher-precision reference)",
                  "", "The logits and the output of the highest ratio, per case (every output: check.json).", "",
                  "| runner | case | output | runner error | PyTorch error | ratio | bound | result |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in report.compared:
            for case, stats in r.cases.items():
                worst = max(stats, key=lambda st: st.ratio or 0.0, default=None)
                for st in (st for st in stats if st.output == "logits" or st is worst):  # the rest: check.json
                    lines.append(f"| {r.runner} | {case} | {st.output} | {st.max_abs:.3g} | "
                                 f"{_cell(st.pytorch_max_abs)} | {_cell(st.ratio, '{:.2f}')} | {_cell(st.bound)} | "
                                 f"{'pass' if st.passed else '**FAIL**'} |")
    lines += layer_lines(report)
    if report.tables:
        lines += ["", "## Stored cos/sin caches, every row", ""]
        for t in report.tables:
            lines.append(f"- `{t.name}` ({t.role}, {t.rows} rows) against {t.against}: "
                         + ("pass" if t.passed else f"**FAIL**: {t.message()}") + f", max abs {t.max_abs:.3g}")
    for title, getter in (("whole model, stress cases", lambda r: r.position_error),
                          ("rotary nodes alone", lambda r: r.sweep.position_error if r.sweep else None)):
        rows = [(r.runner, getter(r).buckets()) for r in report.runners if getter(r) is not None and getter(r).worst]
        if rows:
            lines += ["", f"## Max abs error by position ({title})", ""]
            for runner, buckets in rows:
                lines.append(f"- **{runner}**: " + ", ".join(f"{b['label']}: {b['max_abs']:.2g}" for b in buckets))
    if report.notes:
        lines += ["", "## Notes", "", *(f"- {n}" for n in report.notes)]
    if steps is not None and steps.steps:
        lines += ["", "## Time and peak RSS per step", "", "| step | time | peak RSS |", "|---|---|---|",
                  *(f"| {st.name} | {st.seconds:.1f} s | {format_bytes(st.peak_rss)} |" for st in steps.steps),
                  f"| total | {steps.seconds:.1f} s | {format_bytes(steps.peak_rss)} |"]
    lines += ["", verdict_line(report)]
    return "\n".join(lines) + "\n"


# -- the plot ----------------------------------------------------------------------------------

FLOOR = 1e-7  # log axis: an exact 0 is drawn here, in units of the limit


@dataclass
class PlotSeries:
    runner: str
    label: str
    xs: list[int]
    ys: list[float]  # worst error per bucket over the limit applied to it (1 = the limit)
    passed: list[bool]  # by the same rule: ys <= 1


@dataclass
class PlotPanel:
    title: str
    limit_label: str
    buckets: list[int]
    series: list[PlotSeries]
    limit: float = 1.0


def error_plot_panels(report: CheckReport) -> list[PlotPanel]:
    """What the error plot draws, as data: per panel and runner, each position bucket's worst error in units of
    the limit that decided it (atol + rtol * |expected|, at the output's scale for the whole model, plus the
    position allowance for the rotary nodes alone), so a point under the line passed and one over it failed."""
    sweep_tol = report.sweep_tolerance or report.tolerance
    panels = [
        ("whole model on the stress cases", report.tolerance,
         (f"limit: {report.rule.factor:g} x PyTorch's own {report.dtype} error + {report.rule.floor:g}, per case"
          if report.rule is not None else
          f"limit: {report.tolerance.atol:g} x max(1, output RMS) + {report.tolerance.rtol:g} x |{report.against}|"),
         [(r, r.position_error, r.status) for r in report.runners]),
        ("each rotary node alone, every position", sweep_tol,
         f"limit: {sweep_tol.atol:g} + {sweep_tol.rtol:g} x |expected| + allowance for the position",
         [(r, r.sweep.position_error, r.sweep.status) for r in report.runners if r.sweep is not None]),
    ]
    panels = [(t, tol, label, [s for s in series if s[1].worst]) for t, tol, label, series in panels]
    out = []
    for title, tol, limit_label, series in [p for p in panels if p[3]] or panels[:1]:
        buckets = sorted({b for _, e, _ in series for b in e.worst})
        index = {b: i for i, b in enumerate(buckets)}
        drawn = []
        for r, errors, status in series:
            order = sorted(errors.worst)
            # recorded by the rule that decided; without it (an old report) the plain atol is all there is
            ratios = [errors.ratio[b] if b in errors.ratio else errors.worst[b] / tol.atol for b in order]
            drawn.append(PlotSeries(r.runner, f"{r.runner} ({status})", [index[b] for b in order],
                                    [max(v, FLOOR) for v in ratios], [v <= 1.0 for v in ratios]))
        out.append(PlotPanel(title, limit_label, buckets, drawn))
    return out


def plot_error_vs_position(report: CheckReport, path: str | os.PathLike) -> bool:
    """A PNG of each runner's worst error per position bucket over the limit applied to it; False when
    matplotlib is missing. Points are green at or under the limit (pass) and red over it (FAIL)."""
    plt = pyplot_or_none()
    if plt is None:
        return False
    panels = error_plot_panels(report)
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 3.6 * len(panels)), dpi=110, squeeze=False)
    styles = ["o-", "s--", "^-.", "D:", "v-"]  # runners that agree exactly stay visible on top of each other
    for ax, panel in zip(axes[:, 0], panels, strict=True):
        for k, s in enumerate(panel.series):
            line, = ax.plot(s.xs, s.ys, styles[k % len(styles)], linewidth=1.2, markersize=9 - 1.5 * k, alpha=0.85,
                            markerfacecolor="none", label=s.label)
            colours = ["tab:green" if ok else "tab:red" for ok in s.passed]
            ax.scatter(s.xs, s.ys, c=colours, s=(7 - k) ** 2, zorder=3)
        ax.axhline(panel.limit, color="black", linestyle="--", linewidth=1, label=panel.limit_label)
        ax.scatter([], [], c="tab:green", label="pass: at or under the limit")
        ax.scatter([], [], c="tab:red", label="FAIL: over the limit")
        ax.set_yscale("log")
        ax.set_xticks(range(len(panel.buckets)))
        ax.set_xticklabels([bucket_label(b) for b in panel.buckets], rotation=45, ha="right", fontsize=7)
        ax.set_xlabel("position (power-of-two buckets)")
        ax.set_ylabel("worst error / limit applied", fontsize=8)
        ax.set_title(f"{panel.title} ({report.dtype}); exact 0 drawn at {FLOOR:g}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.suptitle(f"{report.model}: error against position, in units of the limit", fontsize=10)
    fig.tight_layout()
    save_png(fig, path)
    return True


def write_reports(report: CheckReport, directory: str | os.PathLike, steps=None) -> list[Path]:
    """check.json, check.md (with ``steps``' time and peak RSS per step) and the plots, in ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = [directory / "check.json", directory / "check.md"]
    atomic_write_text(written[0], json.dumps({**report_dict(report), "verdict": verdict_line(report)}, indent=2)
                      + "\n")
    atomic_write_text(written[1], report_markdown(report, steps))
    if plot_error_vs_position(report, directory / "error_vs_position.png"):
        written.append(directory / "error_vs_position.png")
    if plot_error_vs_layer(report, directory / "error_vs_layer.png"):
        written.append(directory / "error_vs_layer.png")
    return written


def print_report(report: CheckReport, console) -> None:
    from rope_export.common.tables import print_table
    from rope_export.common.tables import table as make_table

    title = (f"{report.model} ({report.dtype}) against {report.against}" if report.independent else
             f"{report.model} ({report.dtype}): runners compared with {report.against}, not with PyTorch")
    columns = ["runner", "status", "max abs error", "rotary nodes alone", "median latency"]
    if report.rule is not None:
        columns.insert(3, "worst ratio to PyTorch")
    table = make_table(f"{title}, atol {report.tolerance.atol:g} rtol {report.tolerance.rtol:g}", columns,
                       keep=("runner",))
    styles = {"pass": "green", "FAIL": "bold red", "skipped": "yellow", "golden": "cyan", "runner fault": "magenta"}
    for r in report.runners:
        sweep = "" if r.sweep is None or r.sweep.status == "skipped" else (
            f"[{styles[r.sweep.status]}]{r.sweep.status}[/{styles[r.sweep.status]}]"
            + (f" ({r.sweep.positions} positions)" if r.sweep.positions else ""))
        cells = [r.runner, f"[{styles[r.status]}]{r.status}[/{styles[r.status]}]", _cell(r.max_abs), sweep,
                 _cell(r.latency_ms, "{:.2f} ms")]
        if report.rule is not None:
            ratios = [st.ratio for stats in r.cases.values() for st in stats if st.ratio is not None]
            cells.insert(3, _cell(max(ratios) if ratios else None, "{:.2f}"))
        table.add_row(*cells)
    print_table(console, table)
    for r in report.runners:  # notes below the table: skip reasons are sentences, not cells
        if r.reason:
            console.print(f"  {r.runner}: {r.reason}", markup=False, highlight=False, soft_wrap=True)
    for t in report.tables:
        if not t.passed:
            console.print(f"  {t.message()}", markup=False, highlight=False, soft_wrap=True)
    for line in layer_lines(report, markdown=False):
        console.print(f"  {line}", markup=False, highlight=False, soft_wrap=True)
    console.print(f"  reference: {report.reference}", markup=False, highlight=False, soft_wrap=True)
    console.print(f"  decided by: {report.rule_name}", markup=False, highlight=False, soft_wrap=True)
    for note in report.notes:
        console.print(f"  note: {note}", markup=False, highlight=False, soft_wrap=True)
