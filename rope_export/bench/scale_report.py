"""The scale section as a rich table, Markdown and a PNG (time and peak RSS per step, ours beside plain;
the check's own steps; each step's peak on paper)."""

from __future__ import annotations

import os
import statistics

from rope_export.bench.scale_peers import BUILDER, FULL_TRACE, MOBIUS, PACKAGE
from rope_export.bench.scale_ratios import PEER_KEYS, ROWS, RSS_GOAL
from rope_export.common.bounds import format_bytes
from rope_export.common.plotting import pyplot_or_none, save_png

PLAIN, OURS, CHECK = "plain export", "export --hf", "check"


def _rows(size: dict) -> list[tuple[str, str, str, str, str]]:
    """(step, wall time, peak RSS, RSS over the weights, note) per measured step, in run order."""
    weights = size["weight_bytes"]
    rows = []
    for s in size["steps"]:
        if s["step"] == "warm-up":
            continue
        if "skipped" in s:
            rows.append((s["step"], "-", "-", "-", f"skipped: {s['skipped']}"))
            continue
        data = sum(f["bytes"] for f in s.get("files", []))
        note = s.get("note", "") or (f"wrote {format_bytes(data)}" if data else "")
        rss = format_bytes(s["peak_rss"])
        rows.append((s["step"], f"{s['seconds']:.1f} s", rss, f"{s['peak_rss'] / weights:.2f}x", note))
    return rows


def _title(size: dict) -> str:
    return (f"{size['size']}: {size['shape']}, {size['dtype']}, {size['parameters'] / 1e9:.2f} B parameters, "
            f"{format_bytes(size['weight_bytes'])} of weights")


def _ratio_line(size: dict) -> str:
    q = size["ratios"]
    return (f"export --hf against the plain export: peak RSS {q['export_peak_rss_over_plain']:.2f}x, wall time "
            f"{q['export_time_over_plain']:.2f}x; peak RSS over the weights: ours "
            f"{q['export_peak_rss_over_weights']:.2f}x, plain {q['plain_peak_rss_over_weights']:.2f}x "
            f"({q['repetitions']} run(s) each, medians)" + _peer_line(q))


def _peer_line(q: dict) -> str:
    """Each row against the graph builders, the full trace, and the write rate against cp, where measured."""
    text = ""
    for row, key in ROWS.items():
        parts = [f"{q[f'{key}_time_over_{peer}']:.2f}x {peer}'s time, peak RSS {q[f'{key}_peak_rss_over_{peer}']:.2f}x"
                 for peer in PEER_KEYS.values() if f"{key}_time_over_{peer}" in q]
        if parts:
            text += f"; {row} (same folder and dtype): " + ", ".join(parts)
    for peer in PEER_KEYS.values():
        if f"{peer}_peak_rss_over_weights" in q:
            text += f"; {peer}'s peak RSS {q[f'{peer}_peak_rss_over_weights']:.2f}x the weights"
    if "export_time_over_full_trace" in q:
        text += f"; export --hf (per-kind by default) {q['export_time_over_full_trace']:.2f}x the full trace's time"
    if "write_over_copy" in q:
        text += (f"; writing {q['write_mb_s']:.0f} MB/s against cp's {q['copy_mb_s']:.0f} MB/s on the same bytes "
                 f"({q['write_over_copy']:.2f}x)")
    return text


def _plan_line(size: dict) -> str:
    plan = size.get("memory_plan")
    if not plan:
        return ""
    return "peak RSS on paper (bytes of the plan checked before the run): " + ", ".join(
        f"{step} {format_bytes(n)}" for step, n in plan.items())


def _inner(size: dict) -> list[tuple[str, str, str, str]]:
    """(command, inner step, time, peak RSS) from the two exports' and the check's own step logs."""
    out = []
    for key, label in (("plain_steps", PLAIN), ("export_steps", OURS), ("full_steps", FULL_TRACE),
                       ("check_steps", CHECK)):
        for s in size.get(key, []):
            out.append((label, s["name"], f"{s['seconds']:.1f} s", format_bytes(s["peak_rss"])))
    return out


def print_section(section: dict, console) -> None:
    from rich.table import Table

    for size in section["sizes"]:
        if size.get("status") != "measured":
            console.print(f"[yellow]6. scale {size['size']} {size.get('status')}[/yellow]: {size.get('reason')}",
                          highlight=False)
            continue
        t = Table(title=f"6. {section['title']}: {_title(size)}")
        for col in ("step", "wall time", "peak RSS", "RSS / weights", "note"):
            t.add_column(col, justify="left" if col in ("step", "note") else "right")
        for row in _rows(size):
            t.add_row(*row)
        console.print(t)
        console.print("   " + _ratio_line(size), highlight=False)
        console.print("   " + _plan_line(size), highlight=False)
        inner = Table(title=f"6. inside the exports and the check ({size['size']}): each command's own steps, RSS "
                            "sampled")
        for col in ("command", "step", "time", "peak RSS"):
            inner.add_column(col)
        for row in _inner(size):
            inner.add_row(*row)
        console.print(inner)


def markdown(section: dict) -> list[str]:
    lines = [f"## 6. Scale: {section['title']}", ""]
    for size in section["sizes"]:
        if size.get("status") != "measured":
            lines += [f"{size['size']}: {size.get('status')}: {size.get('reason')}", ""]
            continue
        lines += [f"### {_title(size)}", "", "| step | wall time | peak RSS | RSS / weights | note |",
                  "|---|---:|---:|---:|---|"]
        lines += [f"| {' | '.join(row)} |" for row in _rows(size)]
        lines += ["", _ratio_line(size), "", _plan_line(size), "", "| command | step | time | peak RSS |",
                  "|---|---|---:|---:|"]
        lines += [f"| {' | '.join(row)} |" for row in _inner(size)]
        lines.append("")
    return lines


def plot(section: dict, path: str | os.PathLike) -> bool:
    """Wall time and peak RSS per step, one row of panels per size; False without matplotlib or data."""
    plt = pyplot_or_none()
    sizes = [s for s in section["sizes"] if s.get("status") == "measured"]
    if plt is None or not sizes:
        return False
    fig, axes = plt.subplots(len(sizes), 2, figsize=(14, 4.5 * len(sizes)), dpi=100, squeeze=False)
    for row, size in zip(axes, sizes, strict=True):
        steps = [s for s in size["steps"] if "seconds" in s and s["step"] != "warm-up"]
        names = list(dict.fromkeys(s["step"] for s in steps))
        colors = ["tab:gray" if n == PLAIN else "tab:blue" if n in (OURS, PACKAGE) else "tab:orange" if n == CHECK
                  else "tab:purple" if n in (BUILDER, MOBIUS) else "tab:green" for n in names]
        seconds = [statistics.median(s["seconds"] for s in steps if s["step"] == n) for n in names]
        peaks = [statistics.median(s["peak_rss"] for s in steps if s["step"] == n) / 1e9 for n in names]
        row[0].bar(names, seconds, color=colors)
        row[0].set_ylabel("wall time (s, median of runs)")
        row[1].bar(names, peaks, color=colors)
        row[1].axhline(size["weight_bytes"] / 1e9, color="black", linestyle="--", linewidth=1, label="weight bytes")
        row[1].axhline(RSS_GOAL * size["weight_bytes"] / 1e9, color="red", linestyle=":", linewidth=1,
                       label=f"{RSS_GOAL}x weights")
        row[1].set_ylabel("peak RSS (GB)")
        row[1].legend(fontsize=8)
        for ax in row:
            ax.set_title(_title(size), fontsize=9)
            ax.tick_params(axis="x", labelrotation=30, labelsize=8)
            ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("rope-export scale benchmark: each step in its own process (gray: plain torch.onnx.export, blue: "
                 "rope-export, purple: the graph builders)",
                 fontsize=11)
    fig.tight_layout()
    save_png(fig, path)
    return True
