"""The benchmark's results as goals, rich tables, Markdown, JSON and a PNG of the ratios."""

from __future__ import annotations

import json
import os
from pathlib import Path

from rope_export.common.fileio import atomic_write_text
from rope_export.common.plotting import pyplot_or_none, save_png

SPEEDUP_GOAL = 4.0  # fused-and-lowered RoPE against its decomposed form, prefill, onnxruntime CPU
COPY_GOAL = 1 / 1.15  # "within 15% of a memory copy": time <= 1.15 x the copy's, fraction >= 0.87


def _fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value}{suffix}"
    return f"{value:{spec}}{suffix}"


def _case_label(case: dict) -> str:
    c = case["case"]
    return f"{c['phase']} {c['dtype']}" + (", cos/sin computed" if c.get("source") == "computed" else "")


def _tick(case: dict) -> str:
    c = case["case"]
    return "\n".join([c["phase"], c["dtype"]] + (["computed"] if c.get("source") == "computed" else []))


def _section(results: dict, name: str) -> dict | None:
    s = results.get("sections", {}).get(name)
    return s if s and s.get("status", "measured") == "measured" else None


def goals(results: dict) -> list[dict]:
    """The issue's goals, each with what was measured; reported, never asserted."""
    out = []
    rope = _section(results, "rope_alone")
    for case in (rope or {}).get("cases", []):
        if case["case"]["phase"] != "prefill":
            continue
        v = case["variants"]
        where = f"{_case_label(case)} ({case['shape']})"
        s = v["onnx"]["speedup_vs_decomposed"]
        out.append({"goal": f"onnx-lowered RoPE >= {SPEEDUP_GOAL:g}x faster than the plain decomposed export",
                    "where": where, "measured": s, "unit": "x", "met": s is not None and s >= SPEEDUP_GOAL,
                    "also": {k: v[k]["speedup_vs_decomposed"] for k in ("onnx_trusted", "ort")}})
        f = v["onnx"]["fraction_of_copy"]
        out.append({"goal": "onnx-lowered RoPE within 15% of a copy of the same bytes (fraction >= 0.87)",
                    "where": where, "measured": f, "unit": "of copy", "met": f is not None and f >= COPY_GOAL,
                    "also": {k: v[k]["fraction_of_copy"] for k in ("onnx_trusted", "ort")}})
    twin = _section(results, "twin")
    for case in (twin or {}).get("cases", []):
        if case["case"]["phase"] != "prefill":
            continue
        f = case["variants"]["twin"]["fraction_of_copy"]
        out.append({"goal": "CPU twin within 15% of a copy of the same bytes (fraction >= 0.87, both 1 thread)",
                    "where": f"prefill {case['case']['dtype']} ({case['shape']})", "measured": f, "unit": "of copy",
                    "met": f is not None and f >= COPY_GOAL})
    kernels = _section(results, "kernels")
    if kernels:
        s = kernels["summary"]
        out.append({"goal": "zero register spills / local memory in every kernel", "where": ", ".join(kernels["archs"]),
                    "measured": s["with_spills_or_stack"], "unit": "kernels with spills",
                    "met": s["with_spills_or_stack"] == 0})
        out.append({"goal": "128-bit global loads and stores in every vector-path kernel",
                    "where": f"{', '.join(kernels['archs'])}, evidence: {kernels['vector_evidence'].upper()}",
                    "measured": f"{s['vector_kernels_with_128bit_loads_and_stores']}/{s['vector_kernels']}",
                    "unit": "kernels",
                    "met": s["vector_kernels_with_128bit_loads_and_stores"] == s["vector_kernels"] > 0})
    if "sizes" in results.get("sections", {}).get("scale", {}):
        from rope_export.bench.scale import goals as scale_goals

        out += scale_goals(results["sections"]["scale"])
    return out


# -- tables (rich) -----------------------------------------------------------------------------

def _variants_table(title: str, cases: list[dict], extra_columns: tuple[str, ...], extra_cells):
    """One row per runner, grouped by case: median, spread, then the section's own ratio columns."""
    from rich.table import Table

    t = Table(title=title)
    for col in ("case", "runner", "median ms", "spread", *extra_columns):
        t.add_column(col, justify="left" if col in ("case", "runner") else "right")
    for c in cases:
        case = f"{_case_label(c)}\n{c['shape']}"
        for v in c["variants"].values():
            mark = "" if v.get("agrees", True) else " [red](disagrees!)[/red]"
            t.add_row(case, v["label"] + mark, _fmt(v["median_ms"], ".3f"), _fmt(v["spread"], ".0%"),
                      *extra_cells(v))
            case = ""
        t.add_section()
    return t


def print_report(results: dict, console) -> None:
    from rich.table import Table

    m = results["machine"]
    console.print(f"[bold]machine[/bold]: {m['cpu']}, {m['logical_cpus']} logical CPUs, {m['memory_gib']} GiB, "
                  f"caches {m['cpu_caches']}, load average {m['load_average_1_5_15min']} at start, "
                  f"{m.get('load_average_end')} at the end; torch {m['torch']}, "
                  f"onnxruntime {m['onnxruntime']}; mode {results['mode']}", highlight=False)
    for print_one in _PRINTERS:
        print_one(results["sections"], console)
    t = Table(title="Goals (reported, not asserted)")
    for col in ("goal", "where", "measured", "met"):
        t.add_column(col)
    for g in results["goals"]:
        measured = _goal_measured(g)
        t.add_row(g["goal"], g["where"], measured,
                  "[green]yes[/green]" if g["met"] else "[red]no[/red]")
    console.print(t)


def _print_rope(sections: dict, console) -> None:
    rope = sections.get("rope_alone")
    if rope and rope.get("status", "measured") == "measured":
        console.print(_variants_table(
            f"1. {rope['title']} ({rope['runtime']})", rope["cases"],
            ("speedup vs plain decomposed", "of copy", "GB/s"),
            lambda v: (_fmt(v["speedup_vs_decomposed"], ".2f", "x"), _fmt(v["fraction_of_copy"], ".2f"),
                       _fmt(v["gb_per_s"], ".1f"))))
    elif rope:
        console.print(f"1. RoPE alone: {rope['status']}: {rope.get('reason')}")


def _print_block(sections: dict, console) -> None:
    from rich.table import Table

    block = sections.get("block")
    if block and block.get("status", "measured") == "measured":
        t = Table(title=f"2. {block['title']} ({block['runtime']})")
        for col in ("block", "file", "nodes", "median ms", "spread", "speedup vs plain"):
            t.add_column(col, justify="left" if col in ("block", "file") else "right")
        for c in block["cases"]:
            label = f"{c['case']['preset']} {c['case']['phase']}\n{c['shape']}"
            for v in c["variants"].values():
                mark = "" if v.get("agrees", True) else " [red](disagrees!)[/red]"
                t.add_row(label, v["label"] + mark, str(v["nodes"]), _fmt(v["median_ms"], ".3f"),
                          _fmt(v["spread"], ".0%"), _fmt(v["speedup_vs_plain"], ".2f", "x"))
                label = ""
            shares = "; ".join(f"{s['label']}: {_fmt(s['rope_share'], '.1%')}" for s in c["rope_share"].values())
            t.add_row("", f"RoPE's share of the block's node time: {shares}", "", "", "", "")
            t.add_section()
        console.print(t)
    elif block:
        console.print(f"2. Whole block: {block['status']}: {block.get('reason')}")


def _print_twin(sections: dict, console) -> None:
    twin = sections.get("twin")
    if twin and twin.get("status", "measured") == "measured":
        console.print(_variants_table(
            f"3. {twin['title']} ({twin['threads']})", twin["cases"], ("of copy", "GB/s"),
            lambda v: (_fmt(v.get("fraction_of_copy"), ".2f"), _fmt(v.get("gb_per_s"), ".1f"))))
    elif twin:
        console.print(f"3. CPU twin: {twin['status']}: {twin.get('reason')}")


def _print_gpu(sections: dict, console) -> None:
    from rich.table import Table

    gpu = sections.get("gpu")
    if gpu and gpu.get("status") == "measured":
        from rope_export.bench import gpu as gpu_section

        peak = _fmt(gpu["peak_bandwidth_gb_per_s"], ".0f")
        t = Table(title=f"4. {gpu['title']} on {gpu['device']} (peak {peak} GB/s)")
        for col in gpu_section.COLUMNS:
            t.add_column(col)
        for row in gpu_section.rows(gpu):
            t.add_row(*row)
        console.print(t)
    elif gpu:
        console.print(f"[yellow]4. GPU section skipped[/yellow]: {gpu.get('reason')}", highlight=False)


def _print_kernels(sections: dict, console) -> None:
    from rich.table import Table

    kernels = sections.get("kernels")
    if kernels and kernels.get("status") == "measured":
        archs = kernels["archs"]
        t = Table(title=f"5. {kernels['title']}: {kernels['nvcc']}; per arch: {' / '.join(archs)}")
        evidence = kernels["vector_evidence"].upper()
        for col in ("x / cache", "pairs", "path", "registers", "spill+stack B", "smem B",
                    f"global ld, bits: n ({evidence})", "global st, bits: n", "128-bit ld+st"):
            t.add_column(col)
        flag = f"{kernels['vector_evidence']}_128bit_loads_and_stores"
        for variant, rows in _kernel_groups(kernels["kernels"]).items():
            x, cache, interleaved, vector = variant
            by_arch = {r["arch"]: r for r in rows}
            per = [by_arch.get(a) for a in archs]

            def join(fn, per=per):
                values = [fn(r) if r else "-" for r in per]
                return values[0] if len(set(values)) == 1 else " / ".join(values)

            ok = all(r[flag] for r in rows)
            t.add_row(f"{_short(x)} / {_short(cache)}", "interleaved" if interleaved else "rotate-half",
                      "vector" if vector else "scalar", join(lambda r: str(r["registers"])),
                      join(lambda r: str(r["spill_store_bytes"] + r["spill_load_bytes"] + r["stack_bytes"])),
                      join(lambda r: str(r["shared_bytes"])),
                      join(lambda r: _counts(_access(r)["loads_by_bits"])),
                      join(lambda r: _counts(_access(r)["stores_by_bits"])),
                      "yes" if ok else ("no (scalar by design)" if not vector else "[red]NO[/red]"))
        console.print(t)
        console.print(f"   SASS: {kernels['sass']}", highlight=False)
    elif kernels:
        console.print(f"[yellow]5. kernel report skipped[/yellow]: {kernels.get('reason')}", highlight=False)


def _print_scale(sections: dict, console) -> None:
    scale = sections.get("scale")
    if scale and "sizes" in scale:
        from rope_export.bench.scale_report import print_section

        print_section(scale, console)
    elif scale:
        console.print(f"[yellow]6. scale section {scale.get('status')}[/yellow]: {scale.get('reason')}",
                      highlight=False)


def _print_cli(sections: dict, console) -> None:
    cli = sections.get("cli")
    if cli and cli.get("status") == "measured":
        from rope_export.bench.cli_startup import print_section as print_cli

        print_cli(cli, console)
    elif cli:
        console.print(f"[yellow]7. cli section {cli.get('status')}[/yellow]: {cli.get('reason')}", highlight=False)


# the sections in report order, each printed by its own function
_PRINTERS = (_print_rope, _print_block, _print_twin, _print_gpu, _print_kernels, _print_scale, _print_cli)


def _goal_measured(goal: dict) -> str:
    """'2.94 x (onnx_trusted 3.32, ort 2.99)': the goal's figure, then the other lowerings' beside it."""
    m = goal["measured"]
    text = f"{m if isinstance(m, str) else _fmt(m, '.2f')} {goal['unit']}"
    also = goal.get("also")
    if also:
        text += " (" + ", ".join(f"{k} {_fmt(v, '.2f')}" for k, v in also.items()) + ")"
    return text


def _short(dtype: str | None) -> str:
    return {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}.get(dtype or "", str(dtype))


def _access(kernel: dict) -> dict:
    return kernel["sass"] or kernel["ptx"] or {"loads_by_bits": {}, "stores_by_bits": {}}


def _kernel_groups(kernels: list[dict]) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = {}
    for k in kernels:
        key = (k.get("x_dtype"), k.get("cache_dtype"), k.get("interleaved"), k.get("vector"))
        groups.setdefault(key, []).append(k)
    return groups


def _counts(by_bits: dict) -> str:
    return ", ".join(f"{bits}: {n}" for bits, n in by_bits.items())


# -- Markdown ----------------------------------------------------------------------------------

def report_markdown(results: dict) -> str:
    m = results["machine"]
    lines = [
        f"# rope-export bench ({results['mode']})",
        "",
        f"Machine: {m['cpu']}, {m['logical_cpus']} logical CPUs, {m['memory_gib']} GiB, caches {m['cpu_caches']}; "
        f"load average (1/5/15 min) {m['load_average_1_5_15min']} at start, {m.get('load_average_end')} at the end "
        f"(2.0 = both cores busy); {m['os']}; Python {m['python']}, torch {m['torch']}, "
        f"onnxruntime {m['onnxruntime']}, numpy {m['numpy']}. {m['date']}. Run took {results['elapsed_s']:.0f} s.",
        "",
        "Every figure is a median over interleaved rounds; every ratio is between two runners measured in the "
        "same rounds. `spread` is the interquartile range over the median.",
        "",
    ]
    for markdown_one in _MARKDOWN:
        lines += markdown_one(results["sections"])
    lines += ["## Goals (reported, not asserted)", "", "| goal | where | measured | met |", "|---|---|---|---|"]
    for g in results["goals"]:
        lines.append(f"| {g['goal']} | {g['where']} | {_goal_measured(g)} | {'yes' if g['met'] else 'no'} |")
    return "\n".join(lines) + "\n"


def _markdown_rope(s: dict) -> list[str]:
    lines: list[str] = []
    rope = s.get("rope_alone")
    if rope and rope.get("status", "measured") == "measured":
        lines += [f"## 1. {rope['title']}", "", f"{rope['runtime']}. Models: {rope['models']}. "
                  f"Bytes: {rope['bytes_definition']}.", "",
                  "| case | runner | median ms | spread | speedup vs plain decomposed | of copy | GB/s |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for c in rope["cases"]:
            for v in c["variants"].values():
                lines.append(f"| {_case_label(c)}, {c['shape']} | {v['label']} | "
                             f"{_fmt(v['median_ms'], '.3f')} | {_fmt(v['spread'], '.0%')} | "
                             f"{_fmt(v['speedup_vs_decomposed'], '.2f', 'x')} | {_fmt(v['fraction_of_copy'], '.2f')} | "
                             f"{_fmt(v['gb_per_s'], '.1f')} |")
        lines.append("")
    return lines


def _markdown_block(s: dict) -> list[str]:
    lines: list[str] = []
    block = s.get("block")
    if block and block.get("status", "measured") == "measured":
        lines += [f"## 2. {block['title']}", "", f"{block['runtime']}; caches of {block['cache_len']} rows. "
                  f"{block['ratios']}.", "",
                  "| block | file | nodes | median ms | spread | speedup vs plain |", "|---|---|---:|---:|---:|---:|"]
        for c in block["cases"]:
            for v in c["variants"].values():
                lines.append(f"| {c['case']['preset']} {c['case']['phase']}, {c['shape']} | {v['label']} | "
                             f"{v['nodes']} | {_fmt(v['median_ms'], '.3f')} | {_fmt(v['spread'], '.0%')} | "
                             f"{_fmt(v['speedup_vs_plain'], '.2f', 'x')} |")
        lines += ["", "RoPE's share of the block's node time (onnxruntime profile):", "",
                  "| block | lowering | RoPE ms | all nodes ms | share |", "|---|---|---:|---:|---:|"]
        for c in block["cases"]:
            for sh in c["rope_share"].values():
                lines.append(f"| {c['case']['preset']} {c['case']['phase']}, {c['shape']} | {sh['label']} | "
                             f"{_fmt(sh['rope_ms'], '.3f')} | {_fmt(sh['node_ms'], '.3f')} | "
                             f"{_fmt(sh['rope_share'], '.1%')} |")
        lines.append("")
    return lines


def _markdown_twin(s: dict) -> list[str]:
    lines: list[str] = []
    twin = s.get("twin")
    if twin and twin.get("status", "measured") == "measured":
        lines += [f"## 3. {twin['title']}", "", f"Threads: {twin['threads']}. {twin['ratios']}.", "",
                  "| case | runner | median ms | spread | of copy | GB/s |", "|---|---|---:|---:|---:|---:|"]
        for c in twin["cases"]:
            for v in c["variants"].values():
                lines.append(f"| {_case_label(c)}, {c['shape']} | {v['label']} | "
                             f"{_fmt(v['median_ms'], '.3f')} | {_fmt(v['spread'], '.0%')} | "
                             f"{_fmt(v.get('fraction_of_copy'), '.2f')} | {_fmt(v.get('gb_per_s'), '.1f')} |")
        lines.append("")
    return lines


def _markdown_gpu(s: dict) -> list[str]:
    lines: list[str] = []
    gpu = s.get("gpu")
    if gpu:
        from rope_export.bench import gpu as gpu_section

        lines += ["## 4. GPU", ""] + gpu_section.markdown(gpu)
    return lines


def _markdown_kernels(s: dict) -> list[str]:
    lines: list[str] = []
    kernels = s.get("kernels")
    if kernels:
        lines += ["## 5. CUDA kernels, static report", ""]
        if kernels.get("status") != "measured":
            lines += [f"Skipped: {kernels.get('reason')}", ""]
        else:
            flag = f"{kernels['vector_evidence']}_128bit_loads_and_stores"
            archs = kernels["archs"]
            lines += [f"{kernels['nvcc']}, flags `{kernels['flags']}`. SASS: {kernels['sass']}. Global access "
                      f"widths from the {kernels['vector_evidence'].upper()}; where two values are given they are "
                      f"{' / '.join(archs)}.", "",
                      f"| x / cache | pairs | path | registers {' / '.join(archs)} | spill + stack B | smem B | "
                      "global loads (bits: n) | global stores (bits: n) | 128-bit ld+st |",
                      "|---|---|---|---|---:|---:|---|---|---|"]
            for (x, cache, interleaved, vector), rows in _kernel_groups(kernels["kernels"]).items():
                by_arch = {r["arch"]: r for r in rows}
                regs = " / ".join(str(by_arch[a]["registers"]) if a in by_arch else "-" for a in archs)
                spills = max(r["spill_store_bytes"] + r["spill_load_bytes"] + r["stack_bytes"] for r in rows)
                loads = " / ".join(dict.fromkeys(_counts(_access(r)["loads_by_bits"]) for r in rows))
                stores = " / ".join(dict.fromkeys(_counts(_access(r)["stores_by_bits"]) for r in rows))
                ok = all(r[flag] for r in rows)
                lines.append(
                    f"| {_short(x)} / {_short(cache)} | {'interleaved' if interleaved else 'rotate-half'} | "
                    f"{'vector' if vector else 'scalar'} | {regs} | {spills} | "
                    f"{max(r['shared_bytes'] for r in rows)} | {loads} | {stores} | "
                    f"{'yes' if ok else ('no (scalar path)' if not vector else 'NO')} |")
            lines.append("")
    return lines


def _markdown_scale(s: dict) -> list[str]:
    lines: list[str] = []
    if "sizes" in s.get("scale", {}):
        from rope_export.bench.scale_report import markdown

        lines += markdown(s["scale"])
    return lines


def _markdown_cli(s: dict) -> list[str]:
    lines: list[str] = []
    if s.get("cli", {}).get("status") == "measured":
        from rope_export.bench.cli_startup import markdown as cli_markdown

        lines += cli_markdown(s["cli"])
    return lines


_MARKDOWN = (_markdown_rope, _markdown_block, _markdown_twin, _markdown_gpu, _markdown_kernels, _markdown_scale,
             _markdown_cli)


# -- plot --------------------------------------------------------------------------------------

def plot(results: dict, path: str | os.PathLike) -> bool:
    """A PNG of the ratios (speedups, fractions of a copy, block speedups); False without matplotlib."""
    plt = pyplot_or_none()
    if plt is None:
        return False
    s = results["sections"]
    rope = s.get("rope_alone") if s.get("rope_alone", {}).get("status", "measured") == "measured" else None
    twin = s.get("twin") if s.get("twin", {}).get("status", "measured") == "measured" else None
    block = s.get("block") if s.get("block", {}).get("status", "measured") == "measured" else None
    fig, axes = plt.subplots(1, 3, figsize=(18, 7), dpi=100)

    def bars(ax, groups: dict[str, dict[str, float]], title: str, goal: float | None, goal_label: str):
        names = list(dict.fromkeys(n for g in groups.values() for n in g))
        width = 0.8 / max(1, len(names))
        for i, name in enumerate(names):
            xs = [j + i * width for j in range(len(groups))]
            ys = [groups[g].get(name) or 0.0 for g in groups]
            ax.bar(xs, ys, width, label=name)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))])
        ax.set_xticklabels(list(groups), fontsize=8)
        if goal is not None:
            ax.axhline(goal, color="gray", linestyle="--", linewidth=1, label=goal_label)
        ax.set_title(title, fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)

    if rope:
        groups = {_tick(c): {
            v["label"].split(" (")[0]: v["speedup_vs_decomposed"] for k, v in c["variants"].items()
            if k not in ("copy", "memcpy", "decomposed_plain")} for c in rope["cases"]}
        bars(axes[0], groups, "RoPE alone, onnxruntime CPU: speedup vs plain decomposed export", SPEEDUP_GOAL,
             f"goal {SPEEDUP_GOAL:g}x")
        axes[0].set_yscale("log")
    groups = {}
    for c in (rope or {}).get("cases", []):
        key = _tick(c)
        groups[key] = {f"ort {k}": c["variants"][k]["fraction_of_copy"] for k in ("onnx", "onnx_trusted", "ort")}
    for c in (twin or {}).get("cases", []):
        key = _tick(c)
        groups.setdefault(key, {})["CPU twin (1 thread)"] = c["variants"]["twin"]["fraction_of_copy"]
    if groups:
        bars(axes[1], groups, "fraction of a copy of the same bytes (1.0 = copy speed)", COPY_GOAL, "goal: within 15%")
        axes[1].set_yscale("log")
    if block:
        groups = {f"{c['case']['preset']}\n{c['case']['phase']}\n{c['shape']}": {
            v["label"]: v["speedup_vs_plain"] for k, v in c["variants"].items() if k != "plain"}
            for c in block["cases"]}
        bars(axes[2], groups, "whole block, onnxruntime CPU: speedup vs plain export", 1.0, "plain export")
    fig.suptitle(f"rope-export bench ({results['mode']}): {results['machine']['cpu']}, "
                 f"{results['settings']['threads']} threads", fontsize=11)
    fig.tight_layout()
    save_png(fig, path)
    return True


def write_outputs(results: dict, out_dir: str | os.PathLike, plot_path: str | os.PathLike | None = None) -> list[Path]:
    """bench.json, bench.md and (with matplotlib) bench.png in ``out_dir``, each written atomically."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "bench.json", out / "bench.md"]
    atomic_write_text(written[0], json.dumps(results, indent=2) + "\n")
    atomic_write_text(written[1], report_markdown(results))
    png = Path(plot_path) if plot_path else out / "bench.png"
    if set(results["sections"]) - {"scale", "cli"} and plot(results, png):
        written.append(png)
    if "sizes" in results["sections"].get("scale", {}):
        from rope_export.bench.scale_report import plot as plot_scale

        if plot_scale(results["sections"]["scale"], out / "scale.png"):
            written.append(out / "scale.png")
    return written
