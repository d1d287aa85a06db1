"""``rope-export bench --sections cli``: how long the command line takes before it answers.

Every command is run as a user runs it, a fresh ``rope-export`` process each time (so imports count),
its wall time the median of interleaved rounds: ``--help``, each ``COMMAND --help``, and ``lower`` /
``fuse`` of the tiny preset's export (a few KB), beside ``python -c pass``, the interpreter's own
start. Targets (issue 27): help within 0.5 s, lower/fuse of a small file within 1.5 s; reported,
never asserted (the machine is shared).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HELP_TARGET_S = 0.5
RUN_TARGET_S = 1.5
ROUNDS = {"full": 5, "quick": 3, "smoke": 1}


def _cases(work: Path, commands: tuple[str, ...]) -> list[tuple[str, list[str], float | None]]:
    """What is timed: ``commands`` are the command line's own (``rope_export.cli.COMMANDS``, handed down by it)."""
    tiny, plain = str(work / "tiny.onnx"), str(work / "tiny-plain.onnx")
    cases: list[tuple[str, list[str], float | None]] = [
        ("python -c pass", [sys.executable, "-c", "pass"], None),
        ("rope-export --help", [*_rope_export(), "--help"], HELP_TARGET_S),
    ]
    cases += [(f"rope-export {c} --help", [*_rope_export(), c, "--help"], HELP_TARGET_S) for c in commands]
    for target in ("onnx", "ort", "trt-plugin", "decomposed"):
        cases.append((f"rope-export lower -t {target} (tiny)",
                      [*_rope_export(), "lower", tiny, "-t", target, "-o", str(work / f"out-{target}.onnx")],
                      RUN_TARGET_S))
    cases.append(("rope-export fuse (tiny, plain export)", [*_rope_export(), "fuse", plain, "-o",
                                                        str(work / "fused.onnx")], RUN_TARGET_S))
    return cases


def _rope_export() -> list[str]:
    return [sys.executable, "-m", "rope_export.cli"]


def run_section(mode: str, say: Callable[[str], None], commands: tuple[str, ...]) -> dict:
    rounds = ROUNDS.get(mode, 3)
    with tempfile.TemporaryDirectory(prefix="rope-export-bench-cli-") as tmp:
        work = Path(tmp)
        say("cli: exporting the tiny preset, and its plain export for fuse (not timed)")
        subprocess.run([*_rope_export(), "export", "--preset", "tiny", "-o", str(work / "tiny.onnx")], check=True,
                       capture_output=True, timeout=600)
        from rope_export.exporting.core import save_model
        from rope_export.presets import load_preset
        from rope_export.presets.export import decomposed_export

        # what users fuse: a plain torch.onnx export of the block (fuse does not read back rope-export's own
        # decomposed lowering, whose out-of-range pass-through is not a spelling it knows)
        save_model(decomposed_export(load_preset("tiny")), work / "tiny-plain.onnx")
        cases = _cases(work, commands)
        times: dict[str, list[float]] = {name: [] for name, _, _ in cases}
        for r in range(rounds):  # interleaved: a burst of load hits every command alike
            say(f"cli: round {r + 1} of {rounds}, {len(cases)} commands")
            for name, argv, _ in cases:
                started = time.perf_counter()
                proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
                times[name].append(time.perf_counter() - started)
                if proc.returncode != 0:
                    raise RuntimeError(f"{name} exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
    rows = []
    for name, _, target in cases:
        median = statistics.median(times[name])
        rows.append({"command": name, "median_s": median, "min_s": min(times[name]), "target_s": target,
                     "met": None if target is None else median <= target})
    return {"status": "measured", "rounds": rounds, "rows": rows}


def print_section(section: dict, console) -> None:
    from rich.table import Table

    t = Table(title=f"7. command line start-up ({section['rounds']} rounds, fresh process each)")
    for col in ("command", "median s", "min s", "target s", "met"):
        t.add_column(col)
    for row in section["rows"]:
        met = "" if row["met"] is None else ("[green]yes[/green]" if row["met"] else "[red]no[/red]")
        t.add_row(row["command"], f"{row['median_s']:.2f}", f"{row['min_s']:.2f}",
                  "" if row["target_s"] is None else f"{row['target_s']:g}", met)
    console.print(t)


def markdown(section: dict) -> list[str]:
    lines = ["## 7. Command line start-up", "",
             f"A fresh process per run, median of {section['rounds']} interleaved rounds.", "",
             "| command | median s | min s | target s | met |", "|---|---:|---:|---:|---|"]
    for row in section["rows"]:
        met = "" if row["met"] is None else ("yes" if row["met"] else "no")
        target = "" if row["target_s"] is None else f"{row['target_s']:g}"
        lines.append(f"| `{row['command']}` | {row['median_s']:.2f} | {row['min_s']:.2f} | {target} | {met} |")
    return lines + [""]
