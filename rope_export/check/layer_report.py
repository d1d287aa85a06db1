"""The per-layer part of the check report: lines for Markdown and the console, and ``error_vs_layer.png``.

One series per runner (its max abs error after each decoder layer against the higher-precision
reference, in each layer's case closest to its bound) and PyTorch's in the file's dtype in the same
cases, on a log axis, with the envelope (``tolerances.against_pytorch``) shaded; a runner that
leaves it is marked at its first layer.
"""

from __future__ import annotations

import os

from rope_export.check.layer_errors import LayerErrors
from rope_export.common.plotting import pyplot_or_none, save_png


def summary_line(layers: LayerErrors) -> str:
    if layers.first_outside is None:
        return (f"within PyTorch's envelope after every one of {len(layers.errors)} decoder layers (worst "
                f"{layers.worst_ratio:.2f} of the bound)")
    i = layers.first_outside
    return (f"leaves PyTorch's envelope first after decoder layer {i} (error {layers.errors[i]:.3g}, PyTorch's "
            f"{layers.pytorch[i]:.3g}, bound {layers.bounds[i]:.3g}; cases {', '.join(layers.cases_outside)})")


def layer_lines(report, markdown: bool = True) -> list[str]:
    """The per-layer section: a verdict per runner, then (Markdown) a table of error by layer."""
    from rope_export.check.layer_faults import fault_lines

    series = [r for r in report.runners if r.layers is not None]
    faults = [r.fault for r in report.runners if getattr(r, "fault", None) is not None]
    if not series and not faults:
        return []
    lines = []
    if markdown:
        lines += ["", "## Error after each decoder layer (max abs over the hidden state, against the "
                  "higher-precision reference)", ""]
    for r in series:
        lines.append(f"{'- ' if markdown else ''}{r.runner} per layer: {summary_line(r.layers)}")
    for fault in faults:
        lines += fault_lines(fault, markdown)
    if markdown:
        lines += ["", "Each layer's case closest to its bound: the runner's error, PyTorch's in the same case, their "
                  "ratio and the bound.", "",
                  "| layer | runner | case | runner error | PyTorch " + report.dtype + " | ratio | bound |",
                  "|---|---|---|---|---|---|---|"]
        for r in series:
            for i, (err, pt, bound) in enumerate(zip(r.layers.errors, r.layers.pytorch, r.layers.bounds, strict=True)):
                ratio = f"{err / pt:.2f}" if pt > 0 else ""
                lines.append(f"| {i} | {r.runner} | {r.layers.worst_cases[i]} | {err:.3g} | {pt:.3g} | {ratio} | "
                             f"{bound:.3g} |")
    return lines


def plot_error_vs_layer(report, path: str | os.PathLike) -> bool:
    """A PNG of error after each layer per runner and for PyTorch; False without matplotlib or per-layer errors."""
    series = [r for r in report.runners if r.layers is not None]
    plt = pyplot_or_none()
    if plt is None or not series or not report.pytorch_layers:
        return False
    layers = range(len(report.pytorch_layers))
    fig, ax = plt.subplots(figsize=(9, 4.2), dpi=110)
    bound = series[0].layers.bounds  # each layer's case closest to its bound (LayerErrors), PyTorch's in that case
    pytorch = series[0].layers.pytorch
    values = [v for v in [*pytorch, *bound, *(e for r in series for e in r.layers.errors)] if v > 0]
    floor = min(values, default=1e-12) / 3  # log axis: the y range follows the data; exact zeros at its floor
    ax.fill_between(layers, floor, bound, color="tab:green", alpha=0.12, label="PyTorch's envelope (the bound)")
    ax.plot(layers, bound, color="tab:green", linewidth=1)
    ax.plot(layers, [max(e, floor) for e in pytorch], "k--", linewidth=1.5,
            label=f"PyTorch in {report.dtype} (same case)")
    styles = ["o-", "s-", "^-", "D-", "v-"]
    for k, r in enumerate(series):
        ax.plot(layers, [max(e, floor) for e in r.layers.errors], styles[k % len(styles)], linewidth=1.2,
                markersize=5, alpha=0.85, label=r.runner)
        first = r.layers.first_outside
        if first is not None:
            ax.axvline(first, color="tab:red", linewidth=1, linestyle=":")
            ax.annotate(f"{r.runner} leaves the envelope at layer {first}", (first, r.layers.errors[first]),
                        fontsize=7, color="tab:red", xytext=(5, 5), textcoords="offset points")
    ax.set_yscale("log")
    ax.set_ylim(floor, max(values, default=1.0) * 3)
    ax.set_xticks(list(layers) if len(layers) <= 40 else list(layers)[::4])
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("max |hidden state - reference|", fontsize=8)
    ax.set_title(f"{report.model}: error after each decoder layer ({report.dtype}, against the higher-precision "
                 "reference)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    save_png(fig, path)
    return True
