"""Section 5: static report of the CUDA kernels (no GPU needed).

``plugins/rotary/rotary_cuda.cu`` is compiled once into a temporary folder with the build's own
nvcc flags (``plugins/cmake/nvcc_ptxas_check.cmake``) plus ``--keep``, which leaves:

* ptxas's ``-v`` report: registers, stack frame, spill stores/loads, shared memory, per kernel
  and architecture;
* the PTX of each architecture: global loads/stores counted by width, so a vector-path kernel
  can be seen to use 128-bit accesses (``ld.global.nc.v4.u32``, ``st.global.v4.u32``, ...);
* the object, disassembled with ``cuobjdump -sass`` where cuobjdump exists: ``LDG.E.128`` /
  ``STG.E.128`` counted in the SASS itself. Without cuobjdump the SASS column says so; PTX-level
  vector accesses almost always become 128-bit SASS accesses, but only the SASS proves it.

Each kernel is ``rope::rotary_kernel<rope::Kernel<T, C, INTERLEAVED, VECTOR>>``: storage dtype T,
cache dtype C, pair layout, and the vector path (16-byte accesses) or the scalar one (one element
per access, taken when sizes or alignment forbid vectors; it has no 128-bit accesses by design).
Without nvcc the section is skipped with the reason.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from rope_export.kernels.libraries import CUDA_ARCHS, source_root

DEFAULT_ARCHS = (80, 90)  # --quick and --smoke: two architectures keep the compile under a minute
CUDA_BIN_DIRS = ("/usr/local/cuda/bin",)
NVCC_FLAGS = ["-std=c++17", "-O3", "-Xcompiler=-fPIC,-fvisibility=hidden", "-Xptxas=-v", "--display-error-number"]

_TYPES = {"f": "float32", "6__half": "float16", "13__nv_bfloat16": "bfloat16"}
_KERNEL = re.compile(r"KernelI(?P<t>f|6__half|13__nv_bfloat16)(?P<c>f|6__half|13__nv_bfloat16|S\d*_)"
                     r"Lb(?P<i>[01])ELb(?P<v>[01])E")


def find_tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for d in CUDA_BIN_DIRS:
        candidate = Path(d) / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def kernel_variant(mangled: str) -> dict:
    """(x dtype, cache dtype, interleaved, vector path) from a mangled kernel name; {} if unknown."""
    m = _KERNEL.search(mangled)
    if not m:
        return {}
    x = _TYPES[m["t"]]
    cache = x if m["c"].startswith("S") else _TYPES[m["c"]]  # S2_ etc.: a substitution of T
    return {"x_dtype": x, "cache_dtype": cache, "interleaved": m["i"] == "1", "vector": m["v"] == "1"}


def parse_ptxas(log: str) -> list[dict]:
    """One entry per (kernel, arch) of an ``nvcc -Xptxas -v`` log."""
    out: list[dict] = []
    current: dict | None = None
    for line in log.replace("\r", "").splitlines():
        m = re.search(r"Compiling entry function '([^']+)' for '(sm_\w+)'", line)
        if m:
            current = {"kernel": m[1], "arch": m[2], "stack_bytes": 0, "spill_store_bytes": 0, "spill_load_bytes": 0}
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            current.update(stack_bytes=int(m[1]), spill_store_bytes=int(m[2]), spill_load_bytes=int(m[3]))
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m:
            smem = re.search(r"(\d+) bytes smem", line)
            cmem = re.search(r"(\d+) bytes cmem\[0\]", line)
            current.update(registers=int(m[1]), shared_bytes=int(smem[1]) if smem else 0,
                           cmem0_bytes=int(cmem[1]) if cmem else None)
            out.append(current)
            current = None
    return out


def _count_widths(ops: list[str], bits_of) -> dict[str, int]:
    counts: dict[str, int] = {}
    for op in ops:
        bits = bits_of(op)
        counts[str(bits)] = counts.get(str(bits), 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0))


def _ptx_bits(op: str) -> int | str:
    """Bits of one PTX global access, e.g. ld.global.nc.v4.u32 -> 128, st.global.wb.u16 -> 16."""
    parts = op.split(".")
    lanes = 1
    for p in parts:
        if p in ("v2", "v4", "v8"):
            lanes = int(p[1:])
    m = re.search(r"[usfb](\d+)$", parts[-1])
    return lanes * int(m[1]) if m else "?"


def parse_ptx(ptx: str) -> dict[str, dict]:
    """Per ``.entry``: global loads and stores counted by width in bits."""
    out: dict[str, dict] = {}
    entries = list(re.finditer(r"\.entry\s+(\S+?)\s*\(", ptx))
    for k, m in enumerate(entries):
        body = ptx[m.end(): entries[k + 1].start() if k + 1 < len(entries) else len(ptx)]
        loads = re.findall(r"\bld\.global(?:\.[a-z0-9]+)+", body)
        stores = re.findall(r"\bst\.global(?:\.[a-z0-9]+)+", body)
        out[m[1]] = {"loads_by_bits": _count_widths(loads, _ptx_bits),
                     "stores_by_bits": _count_widths(stores, _ptx_bits)}
    return out


def _sass_bits(op: str) -> int:
    """Bits of one SASS global access: LDG.E.128.CONSTANT -> 128, STG.E.U16 -> 16, LDG.E -> 32."""
    for part in op.split(".")[1:]:
        if part in ("64", "128", "256"):
            return int(part)
        m = re.fullmatch(r"[US](8|16)", part)
        if m:
            return int(m[1])
    return 32


def parse_sass(sass: str) -> dict[tuple[str, str], dict]:
    """``cuobjdump -sass`` output -> {(kernel, arch): global loads/stores by width in bits}."""
    out: dict[tuple[str, str], dict] = {}
    arch = None
    kernel = None
    ops: dict[str, list[str]] = {"LDG": [], "STG": []}

    def flush():
        if kernel is not None:
            out[(kernel, arch or "?")] = {
                "loads_by_bits": _count_widths(ops["LDG"], _sass_bits),
                "stores_by_bits": _count_widths(ops["STG"], _sass_bits),
            }

    for line in sass.splitlines():
        m = re.search(r"\barch = (sm_\w+)", line) or re.search(r"code for (sm_\w+)", line)
        if m:
            arch = m[1]
            continue
        m = re.search(r"Function : (\S+)", line)
        if m:
            flush()
            kernel, ops = m[1], {"LDG": [], "STG": []}
            continue
        m = re.search(r"\b(LDG|STG)(\.[A-Z0-9_]+)*", line)
        if m and kernel is not None:
            ops[m[1]].append(m[0])
    flush()
    return out


def _has_128(counts: dict) -> bool:
    return any(k.isdigit() and int(k) >= 128 for k in counts)


def compile_kernels(workdir: Path, archs=DEFAULT_ARCHS, nvcc: str | None = None) -> tuple[str, Path]:
    """nvcc with the build's flags and --keep; returns (ptxas log, object path)."""
    nvcc = nvcc or find_tool("nvcc")
    src = source_root() / "plugins" / "rotary" / "rotary_cuda.cu"
    obj = workdir / "rotary_cuda.o"
    gencode = []
    for a in archs:
        gencode += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    cmd = [nvcc, *NVCC_FLAGS, "--keep", "--keep-dir", str(workdir), *gencode, "-c", str(src), "-o", str(obj)]
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise RuntimeError(f"nvcc failed (exit {proc.returncode}): {(proc.stdout + proc.stderr).strip()[-2000:]}")
    return proc.stdout + proc.stderr, obj


def nvcc_version(nvcc: str) -> str:
    proc = subprocess.run([nvcc, "--version"], capture_output=True, text=True)
    m = re.search(r"release ([\d.]+), (V[\d.]+)", proc.stdout)
    return f"{m[1]} ({m[2]})" if m else proc.stdout.strip().splitlines()[-1]


def archs_for(mode: str) -> tuple[int, ...]:
    """The full run reports every architecture the plugin is built for; the short modes two of them."""
    return CUDA_ARCHS if mode == "full" else DEFAULT_ARCHS


def static_report(archs=DEFAULT_ARCHS) -> dict:
    """The kernel table, or {'status': 'skipped', 'reason': ...} without nvcc."""
    nvcc = find_tool("nvcc")
    if nvcc is None:
        return {"status": "skipped", "reason": "nvcc not found (PATH, /usr/local/cuda/bin): the kernels cannot be "
                                               "compiled here, so there is no ptxas report to read"}
    cuobjdump = find_tool("cuobjdump")
    with tempfile.TemporaryDirectory(prefix="rope-bench-nvcc-") as tmp:
        work = Path(tmp)
        log, obj = compile_kernels(work, archs, nvcc)
        ptx = {f"sm_{a}": parse_ptx((work / f"rotary_cuda.compute_{a}.ptx").read_text())
               for a in archs if (work / f"rotary_cuda.compute_{a}.ptx").is_file()}
        sass = None
        sass_reason = None
        if cuobjdump is None:
            sass_reason = "cuobjdump not found (PATH, /usr/local/cuda/bin): SASS not inspected; PTX widths shown"
        else:
            proc = subprocess.run([cuobjdump, "-sass", str(obj)], capture_output=True, text=True)
            if proc.returncode:
                sass_reason = f"cuobjdump -sass failed: {proc.stderr.strip()[:300]}"
            else:
                sass = parse_sass(proc.stdout)
    kernels = []
    for entry in parse_ptxas(log):
        row = {**entry, **kernel_variant(entry["kernel"])}
        p = ptx.get(entry["arch"], {}).get(entry["kernel"])
        row["ptx"] = p
        row["ptx_128bit_loads_and_stores"] = bool(p and _has_128(p["loads_by_bits"]) and _has_128(p["stores_by_bits"]))
        s = sass.get((entry["kernel"], entry["arch"])) if sass is not None else None
        row["sass"] = s
        row["sass_128bit_loads_and_stores"] = (
            bool(_has_128(s["loads_by_bits"]) and _has_128(s["stores_by_bits"])) if s is not None else None
        )
        row["spills"] = entry["spill_store_bytes"] + entry["spill_load_bytes"] + entry["stack_bytes"] > 0
        kernels.append(row)
    vector = [k for k in kernels if k.get("vector")]
    evidence = "sass" if sass is not None else "ptx"
    flag = f"{evidence}_128bit_loads_and_stores"
    return {
        "status": "measured",
        "title": "CUDA kernels, static report",
        "nvcc": f"{nvcc} {nvcc_version(nvcc)}",
        "flags": " ".join(NVCC_FLAGS),
        "archs": [f"sm_{a}" for a in archs],
        "sass": "inspected with cuobjdump -sass" if sass is not None else f"skipped: {sass_reason}",
        "vector_evidence": evidence,
        "kernels": kernels,
        "summary": {
            "kernels": len(kernels),
            "with_spills_or_stack": sum(k["spills"] for k in kernels),
            "max_registers": max((k["registers"] for k in kernels), default=None),
            "max_shared_bytes": max((k["shared_bytes"] for k in kernels), default=None),
            "vector_kernels": len(vector),
            "vector_kernels_with_128bit_loads_and_stores": sum(bool(k[flag]) for k in vector),
            "scalar_kernels_with_128bit_accesses": sum(bool(k[flag]) for k in kernels if not k.get("vector")),
        },
    }
