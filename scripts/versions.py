"""The test environment's lock, and the drift lane that tells how the newest releases differ from it.

    python3 scripts/versions.py lock            # make lock: re-resolve from the newest releases
    python3 scripts/versions.py drift JUNIT_XML # make test-latest: what changed and what broke

``lock`` resolves with pip itself, in a throwaway virtualenv: torch first (the CPU build on this
machine's disk, ``TORCH_SPEC``), then the package with its ``dev``, ``serve`` and ``trt-lean``
extras and the build backend, with no constraint but the machine's own; ``pip freeze`` of that
virtualenv is the lock, plus pip's ``--report`` of what ``make test`` installs into folders of its
own (TensorRT 10's lean runtime, nvidia-pytriton's server). It then prints what changed against the
previous lock. ``make demo`` and ``make test`` install with ``--constraint requirements/lock.txt``,
so a fresh clone installs exactly these versions.

``drift`` runs in the drift lane's virtualenv (newest releases, no lock) after the test suite: it
prints every package whose version differs from the lock, and the tests that failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements" / "lock.txt"
TORCH_SPEC = os.environ.get("TORCH_SPEC", "torch==2.13.0")
# What make test installs into folders of their own (pip --target), each with pip's options for it.
FOLDER_INSTALLS = (
    (os.environ.get("TRT_LEAN10_SPEC", "tensorrt-lean-cu12==10.16.0.72"), ()),  # TensorRT 10's lean runtime
    (os.environ.get("PYTRITON_SPEC", "nvidia-pytriton==0.7.0"), ("--no-deps",)),  # tritonserver; pins numpy<2
)
# The project itself and what pip brings with every virtualenv: not pinned.
UNPINNED = {"rope-export", "pip"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: Path) -> dict[str, str]:
    """name -> version of a ``name==version`` file (comments and blank lines skipped)."""
    pins = {}
    if not path.is_file():
        return pins
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[canonical(name)] = version.strip()
    return pins


def changes(old: dict[str, str], new: dict[str, str]) -> list[tuple[str, str, str]]:
    """(package, old version or '-', new version or '-') for every package that differs."""
    return [(name, old.get(name, "-"), new.get(name, "-"))
            for name in sorted(old.keys() | new.keys()) if old.get(name) != new.get(name)]


def table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=False)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(tuple("-" * w for w in widths)), *map(line, rows)])


def _pip(python: Path, *args: str) -> str:
    return subprocess.run([str(python), "-m", "pip", *args], check=True, text=True, stdout=subprocess.PIPE).stdout


def resolve_newest(workdir: Path) -> dict[str, str]:
    """Install the newest releases into a fresh virtualenv and read back what pip chose."""
    venv = workdir / "venv"
    print(f"resolving the newest releases in {venv} (a few minutes) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    _pip(python, "install", "--quiet", TORCH_SPEC, "setuptools")
    _pip(python, "install", "--quiet", "--no-build-isolation", "-e", f"{ROOT}[dev,serve,diffusers,trt-lean]")
    pins = {}
    for line in _pip(python, "freeze", "--all", "--exclude-editable").splitlines():
        if "==" in line:
            name, version = line.split("==", 1)
            pins[canonical(name)] = version
    for n, (spec, options) in enumerate(FOLDER_INSTALLS):
        report = workdir / f"folder{n}.json"
        _pip(python, "install", "--quiet", "--dry-run", "--ignore-installed", *options, "--report", str(report), spec)
        for item in json.loads(report.read_text())["install"]:
            pins[canonical(item["metadata"]["name"])] = item["metadata"]["version"]
    return {k: v for k, v in pins.items() if k not in UNPINNED}


def write_lock(pins: dict[str, str], path: Path = LOCK) -> None:
    python = ".".join(map(str, sys.version_info[:2]))
    header = [
        "# The test environment's lock: every package `make demo` and `make test` install, at these versions",
        "# (pip --constraint). Regenerate with `make lock` (scripts/versions.py): it resolves the newest",
        "# releases with pip in a throwaway virtualenv and prints what changed. Run `make test` before",
        "# committing a new lock.",
        f"# Resolved {datetime.date.today().isoformat()} on CPython {python}, {sys.platform}; "
        f"torch from {TORCH_SPEC} (the CPU build on this machine's disk).",
    ]
    body = [f"{name}=={version}" for name, version in sorted(pins.items())]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(header + body) + "\n")
    os.replace(tmp, path)


def cmd_lock(_args) -> int:
    old = read_pins(LOCK)
    with tempfile.TemporaryDirectory(prefix="rope-export-lock-") as workdir:
        new = resolve_newest(Path(workdir))
    write_lock(new)
    moved = changes(old, new)
    print(f"{LOCK.relative_to(ROOT)}: {len(new)} packages; {len(moved)} changed")
    if moved:
        print(table(moved, ("package", "was", "now")))
    return 0


def installed() -> dict[str, str]:
    return {canonical(d.metadata["Name"]): d.version for d in metadata.distributions()
            if canonical(d.metadata["Name"]) not in UNPINNED}


def failures(junit: Path) -> list[tuple[str, str]]:
    """(test id, first line of the failure) of every failed or erroring test in a JUnit XML file."""
    if not junit.is_file():
        return [("(no test report)", f"{junit} was not written: pytest did not run to the end")]
    out = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        for problem in (*case.findall("failure"), *case.findall("error")):
            message = (problem.get("message") or problem.text or "").strip().splitlines()
            where = f"{case.get('classname', '')}::{case.get('name', '')}"
            out.append((where, (message[0] if message else problem.tag)[:110]))
    return out


def cmd_drift(args) -> int:
    lock = read_pins(LOCK)
    moved = [(name, was, now) for name, was, now in changes(lock, installed())
             if now != "-"]
    print(f"\nThe newest releases against {LOCK.relative_to(ROOT)}: {len(moved)} packages differ")
    if moved:
        print(table(moved, ("package", "lock", "newest")))
    broken = failures(Path(args.junit))
    verdict = "" if broken else " (the suite passes on the newest releases)"
    print(f"\nWhat broke: {len(broken)} failed test(s){verdict}")
    if broken:
        print(table(broken, ("test", "first line")))
    return 1 if broken else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("lock", help="re-resolve requirements/lock.txt from the newest releases").set_defaults(run=cmd_lock)
    drift = sub.add_parser("drift", help="the installed versions against the lock, and the failed tests")
    drift.add_argument("junit", help="pytest's --junitxml report of the drift lane's run")
    drift.set_defaults(run=cmd_drift)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
