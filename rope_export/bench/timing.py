"""Side-by-side timing: every variant of one comparison runs in the same interleaved rounds.

These machines are shared and noisy, so a figure is the median over rounds, and a comparison is a
ratio of two medians measured in the same rounds. Each round runs every variant once, starting
with a different one each round (no variant always runs first, after a cold spell or another
process's burst). A variant that takes well under ``target_s`` is repeated ``inner`` times inside
one sample (calibrated once), so a sample of a 40 µs call is not mostly timer noise.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

Clock = Callable[[Callable[[], object], int], float]  # (fn, inner) -> seconds for `inner` calls


def wall_clock(fn: Callable[[], object], inner: int) -> float:
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    return time.perf_counter() - start


@dataclass(frozen=True)
class Timing:
    """Seconds per call of one variant: one sample per round (each the mean of ``inner`` calls)."""

    samples: tuple[float, ...]
    inner: int

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples)

    @property
    def spread(self) -> float:
        """Interquartile range over the median: how noisy the rounds were (0.05 = 5%)."""
        if len(self.samples) < 4:
            return (max(self.samples) - min(self.samples)) / self.median_s if self.median_s > 0 else 0.0
        q1, _, q3 = statistics.quantiles(self.samples, n=4)
        return (q3 - q1) / self.median_s if self.median_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "median_ms": self.median_s * 1e3,
            "spread": self.spread,
            "rounds": len(self.samples),
            "calls_per_sample": self.inner,
        }


def calibrate(fn: Callable[[], object], target_s: float, clock: Clock = wall_clock, max_inner: int = 10_000) -> int:
    """Calls per sample so that one sample lasts about ``target_s`` (at least 1)."""
    once = clock(fn, 1)
    if once <= 0 or once >= target_s:
        return 1
    return max(1, min(max_inner, math.ceil(target_s / once)))


def interleaved(
    fns: Mapping[str, Callable[[], object]],
    rounds: int,
    *,
    target_s: float = 0.005,
    warmup: int = 1,
    clock: Clock = wall_clock,
) -> dict[str, Timing]:
    """Time every callable in ``rounds`` interleaved rounds; returns each one's Timing."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    inner = {name: calibrate(fns[name], target_s, clock) for name in names}
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            samples[name].append(clock(fns[name], inner[name]) / inner[name])
    return {name: Timing(tuple(samples[name]), inner[name]) for name in names}


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _cache_sizes() -> dict[str, str]:
    """L1d/L2/L3 sizes as the kernel reports them (sysfs), e.g. {'L2': '1024K'}."""
    sizes: dict[str, str] = {}
    root = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for entry in sorted(os.listdir(root)):
            if not entry.startswith("index"):
                continue
            with open(f"{root}/{entry}/level", encoding="utf-8") as f:
                level = f.read().strip()
            with open(f"{root}/{entry}/type", encoding="utf-8") as f:
                kind = f.read().strip()
            with open(f"{root}/{entry}/size", encoding="utf-8") as f:
                size = f.read().strip()
            if kind != "Instruction":
                sizes[f"L{level}{'d' if kind == 'Data' else ''}"] = size
    except OSError:
        pass
    return sizes


def machine_info() -> dict:
    """What the figures were measured on, and how busy the machine was when the run started."""
    import numpy
    import onnxruntime
    import torch

    try:
        load = [round(v, 2) for v in os.getloadavg()]
    except OSError:
        load = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "cpu_caches": _cache_sizes(),
        "memory_gib": _memory_gib(),
        "load_average_1_5_15min": load,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "onnxruntime": onnxruntime.__version__,
        "numpy": numpy.__version__,
    }
