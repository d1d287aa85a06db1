"""Section 3: the kernels' CPU twin against a memory copy of the same bytes.

The twin (``rope_export.kernels.cpu_twin.run``) walks the CUDA grid with one host thread, so it is held
against single-thread copies: ``numpy.copyto`` between two preallocated buffers (a libc memcpy)
moving the same total bytes (read x + the cos/sin rows used, write the output; q and k). The
output buffers are preallocated too, so neither side pays for allocation. A third runner calls
the twin with an empty block range: the cost of the Python/ctypes call alone, measured in the same
rounds, so the decode figures (a few hundred µs of work) can be read with the call overhead known.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict

from rope_export.bench.rope_alone import (
    RopeCase,
    cross_check_tolerance,
    full_width_tables,
    make_inputs,
    memcpy_of,
    torch_rotate_half,
)
from rope_export.bench.timing import interleaved, ratio

TWIN = "twin"
OVERHEAD = "twin_call_overhead"
COPY = "copy_1_thread"
LABELS = {
    TWIN: "CPU twin (kernel code, 1 host thread, vector path where aligned)",
    OVERHEAD: "CPU twin call with no grid blocks (Python + ctypes overhead only)",
    COPY: "copy of the same bytes (numpy.copyto = memcpy, 1 thread)",
}


def measure_case(case: RopeCase, rounds: int, say: Callable[[str], None]) -> dict:
    import torch

    from rope_export.kernels import cpu_twin

    say(f"CPU twin {case.phase} {case.dtype}: preparing")
    inputs = make_inputs(case)
    xq, xk = torch.from_numpy(inputs.x_q), torch.from_numpy(inputs.x_k)
    pos = torch.from_numpy(inputs.position_ids)
    cos, sin = torch.from_numpy(inputs.cos_cache), torch.from_numpy(inputs.sin_cache)
    oq, ok = torch.empty_like(xq), torch.empty_like(xk)
    _, plan_q = cpu_twin.run(xq, cos, sin, pos, out=oq)
    _, plan_k = cpu_twin.run(xk, cos, sin, pos, out=ok)
    cos_full, sin_full = full_width_tables(inputs)
    with torch.no_grad():
        expected = [torch_rotate_half(x, cos_full, sin_full, pos) for x in (xq, xk)]
    diff = max(float((o.float() - e.float()).abs().max()) for o, e in zip((oq, ok), expected, strict=True))
    tol = cross_check_tolerance(case.dtype)
    agrees = all(tol.allclose(o.float().numpy(), e.float().numpy()) for o, e in zip((oq, ok), expected, strict=True))
    nbytes = inputs.rope_bytes()
    runners = {
        TWIN: lambda: (cpu_twin.run(xq, cos, sin, pos, out=oq), cpu_twin.run(xk, cos, sin, pos, out=ok)),
        OVERHEAD: lambda: (cpu_twin.run(xq, cos, sin, pos, out=oq, blocks=(0, 0)),
                           cpu_twin.run(xk, cos, sin, pos, out=ok, blocks=(0, 0))),
        COPY: memcpy_of(nbytes, (inputs.x_q.size, inputs.x_k.size)),
    }
    say(f"CPU twin {case.phase} {case.dtype}: timing, {rounds} interleaved rounds")
    timings = interleaved(runners, rounds)
    copy, twin, overhead = (timings[k].median_s for k in (COPY, TWIN, OVERHEAD))
    variants = {}
    for vid, timing in timings.items():
        entry = {"label": LABELS[vid], **timing.to_dict()}
        if vid != OVERHEAD:
            entry["gb_per_s"] = nbytes / timing.median_s / 1e9
            entry["fraction_of_copy"] = ratio(copy, timing.median_s)
        variants[vid] = entry
    variants[TWIN]["fraction_of_copy_without_call_overhead"] = ratio(copy, twin - overhead) if twin > overhead else None
    variants[TWIN]["vector_path"] = bool(plan_q.vectorized and plan_k.vectorized)
    variants[TWIN]["max_abs_diff_vs_torch"] = diff
    variants[TWIN]["agrees"] = agrees
    return {"case": asdict(case), "shape": case.shape_text(), "bytes": nbytes, "variants": variants}


def run_section(cases: list[RopeCase], rounds: dict[str, int], say: Callable[[str], None]) -> dict:
    from rope_export.kernels import build as plugin_build

    say("building the plugin's CPU twin if needed (build/plugins)")
    plugin_build.ensure_built(quiet=True)
    return {
        "title": "CPU twin against a memory copy",
        "threads": "twin: 1 host thread (its host loop is serial); copy: numpy.copyto, 1 thread",
        "bytes_definition": "read x + the cos/sin rows used + write the output, q and k (as in the RoPE-alone section)",
        "ratios": "fraction_of_copy = median(copy) / median(twin) (1.0 = as fast as a memcpy of the same bytes)",
        "cases": [measure_case(case, rounds[case.phase], say) for case in cases],
    }
