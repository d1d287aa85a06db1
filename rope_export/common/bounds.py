"""Bounds on the numbers a user hands in: field checks (type, range, finiteness) and memory.

One place for both, so a preset, a transformers config or a command-line option is refused with
the same kind of message, before any work: ``check_int``/``check_number``/``check_bool`` name the
field and what it must be (``num_heads = true`` is not 1 head, ``factor = inf`` is not a factor),
and ``check_allocation`` says what would be allocated and refuses what this process cannot hold
(``--cache-len 1000000000`` is 238 GiB of float64 angles and caches for the tiny preset): the memory
available, and the process's own limits (``memory_limits``: ``ulimit -v``, a cgroup's limit).
``allocation_failure`` names the size of an allocation that failed anyway (torch's allocator).
"""

from __future__ import annotations

import math
import numbers
import os
import re
import resource
from collections.abc import Mapping

INT32_MAX = 2**31 - 1
MAX_HEAD_DIM = 2**24  # the kernels' bound (plugins/core: units per token fit int32)
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.manual_seed accepts


class FieldError(ValueError):
    """A field value of the wrong type, outside its range, or not finite."""


class AllocationError(ValueError):
    """A request that would allocate more memory than this machine has."""


def _kind(value) -> str:
    return type(value).__name__


def _show(value) -> str:
    """repr, cut to one readable line (a hostile value may be a 400-digit int)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...{text[-8:]} ({len(text)} characters)"


def check_int(field: str, value, low: int | None = 1, high: int | None = INT32_MAX, fail=None) -> int:
    """``value`` as an int in [low, high]; a bool, a float or a string is refused, not converted."""
    fail = fail or _raise
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        fail(field, f"must be {'a positive' if low == 1 else 'an'} integer, got {_show(value)} ({_kind(value)})")
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        if low == 1:
            at_most = f" (at most {_bound(high)})" if high is not None else ""
            fail(field, f"must be a positive integer{at_most}, got {_show(value)}")
        fail(field, f"must be an integer in [{_bound(low)}, {_bound(high)}], got {_show(value)}")
    return value


def check_number(field: str, value, low: float | None = None, high: float | None = None, *,
                 low_open: bool = False, high_open: bool = False, fail=None) -> float:
    """``value`` as a finite float in the range; inf, nan, bools and strings are refused."""
    fail = fail or _raise
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        fail(field, f"must be a number, got {_show(value)} ({_kind(value)})")
    try:
        number = float(value)
    except OverflowError:  # an int past float's range
        number = math.inf
    if not math.isfinite(number):
        fail(field, f"must be a finite number, got {_show(value)}")
    too_low = low is not None and (number <= low if low_open else number < low)
    too_high = high is not None and (number >= high if high_open else number > high)
    if too_low or too_high:
        if high is None:
            fail(field, f"must be a finite number {'>' if low_open else '>='} {_bound(low)}, got {_show(value)}")
        left = "(" if low_open else "["
        right = ")" if high_open else "]"
        fail(field, f"must be in {left}{_bound(low)}, {_bound(high)}{right}, got {_show(value)}")
    return number


def check_bool(field: str, value, fail=None) -> bool:
    fail = fail or _raise
    if not isinstance(value, bool):
        fail(field, f"must be true or false, got {_show(value)} ({_kind(value)})")
    return value


def check_seed(seed) -> int:
    """A seed torch.manual_seed accepts (``--seed 2**80`` overflowed inside torch)."""
    def fail(_field, problem):
        raise FieldError(f"seed {problem.replace('must be', 'must be, for torch,', 1)}; pass another --seed")

    low, high = SEED_RANGE
    return check_int("seed", seed, low, high, fail=fail)


def _bound(value) -> str:
    if value is None:
        return "inf"
    if isinstance(value, int) and abs(value) >= 2**20:
        exponent = round(math.log2(abs(value) + 1))
        if 2**exponent - abs(value) in (0, 1):  # 2**31 - 1 reads better as such
            sign = "-" if value < 0 else ""
            return f"{sign}2**{exponent}" + (" - 1" if abs(value) == 2**exponent - 1 else "")
    return f"{value:g}" if isinstance(value, float) and not value.is_integer() else str(int(value))


def _raise(field: str, problem: str):
    raise FieldError(f"field '{field}': {problem}")


# -- memory --------------------------------------------------------------------------------------

def memory_limits() -> list[tuple[int, str]]:
    """(bytes this process may still allocate, what says so) for every limit that applies here.

    Available, not installed: on a shared machine the installed figure lets a request through that the kernel
    then kills halfway. And the process's own limits, which the machine's figure does not show: the address-space
    and data-segment limits (``ulimit -v``, ``ulimit -d``: RLIMIT_AS, RLIMIT_DATA) less what it maps already,
    and its cgroup's memory limit less its cgroup's usage (a container's, a batch job's)."""
    limits = []
    available = _meminfo_available()
    if available is not None:
        limits.append((available, "of memory available"))
    status = _proc_status()
    for name, key, what in (("RLIMIT_AS", "VmSize", "address-space limit (ulimit -v)"),
                            ("RLIMIT_DATA", "VmData", "data-segment limit (ulimit -d)")):
        soft = resource.getrlimit(getattr(resource, name))[0] if hasattr(resource, name) else resource.RLIM_INFINITY
        if soft != resource.RLIM_INFINITY and key in status:
            limits.append((max(0, soft - status[key]), f"this process may still map under its {what} of "
                                                       f"{format_bytes(soft)}"))
    cgroup = _cgroup_headroom()
    if cgroup is not None:
        limits.append(cgroup)
    return limits


def available_memory() -> int | None:
    """Bytes this process may still allocate (the tightest of ``memory_limits``), or None if unknown."""
    limits = memory_limits()
    return min(limits)[0] if limits else None


def _meminfo_available() -> int | None:
    """Linux MemAvailable; else free pages; None if unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return None


def _proc_status() -> dict[str, int]:
    """VmSize, VmData, ... of /proc/self/status in bytes (empty where there is none)."""
    values = {}
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if key.startswith("Vm") and len(parts) == 2 and parts[1] == "kB":
                    values[key] = int(parts[0]) * 1024
    except (OSError, ValueError):
        pass
    return values


def _cgroup_headroom() -> tuple[int, str] | None:
    """(limit - usage, what) of this process's memory cgroup (v2 memory.max, v1 memory.limit_in_bytes) where it has a
    limit; None without one."""
    try:
        with open("/proc/self/cgroup", encoding="ascii") as f:
            lines = [line.strip().split(":", 2) for line in f if line.count(":") >= 2]
    except OSError:
        return None
    for _, controllers, path in lines:
        if controllers == "":  # v2
            files = (f"/sys/fs/cgroup{path}/memory.max", f"/sys/fs/cgroup{path}/memory.current")
        elif "memory" in controllers.split(","):  # v1
            files = (f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes",
                     f"/sys/fs/cgroup/memory{path}/memory.usage_in_bytes")
        else:
            continue
        try:
            limit, usage = (open(name, encoding="ascii").read().strip() for name in files)  # noqa: SIM115
            limit_bytes, usage_bytes = int(limit), int(usage)
        except (OSError, ValueError):  # "max": no limit; or files this process cannot see
            continue
        if limit_bytes < 2**60:
            return max(0, limit_bytes - usage_bytes), f"left under its cgroup's memory limit of " \
                                                      f"{format_bytes(limit_bytes)}"
    return None


_TORCH_ALLOCATION = re.compile(r"can't allocate memory: you tried to allocate (\d+) bytes")


def allocation_failure(exc: BaseException) -> str | None:
    """One line for an allocation that failed where no MemoryError is raised (torch's CPU allocator raises a
    RuntimeError), naming the size and the process's limit; None for any other error. The exception's causes
    are read too (torch.onnx wraps what fails inside it)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        found = _TORCH_ALLOCATION.search(str(exc))
        if found:
            limits = memory_limits()
            room = f": the tightest limit now is the {format_bytes(min(limits)[0])} {min(limits)[1]}" if limits else ""
            return (f"could not allocate {format_bytes(int(found.group(1)))}{room}; use smaller sizes (heads, hidden "
                    "size, cache length, model) or run where more memory is free")
        exc = exc.__cause__ or exc.__context__
    return None


def format_bytes(n: float | None) -> str:
    """Bytes for people, in decimal units as disks and the reports count them: 2.47 GB, 31.5 MB, 812 kB, 96 B."""
    if n is None:
        return "-"
    for unit, size in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}" if unit == "GB" else f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def check_allocation(what: str, parts: Mapping[str, int], fix: str, limit: int | None = None) -> int:
    """Refuse, before allocating, ``what`` when its ``parts`` (name -> bytes) exceed the memory.

    ``limit`` defaults to the memory available now. Returns the total.
    """
    total = sum(parts.values())
    limits = memory_limits() if limit is None else [(limit, "of memory available")]
    if limits and total > min(limits)[0]:
        room, why = min(limits)
        detail = ", ".join(f"{name} {format_bytes(size)}" for name, size in parts.items() if size)
        raise AllocationError(f"{what} would allocate {format_bytes(total)} ({detail}), more than the "
                              f"{format_bytes(room)} {why}; {fix}")
    return total
