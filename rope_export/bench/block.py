"""Section 2: a whole attention block on onnxruntime CPU, our export against a plain export.

Ours: ``rope_export.presets.export.export`` (one rope_export::RotaryEmbedding per rotated tensor) lowered
to ``onnx`` (default, positions guarded in the graph), to ``onnx`` with trusted positions, and to
``ort``. Baseline: ``export.decomposed_export``, a plain ``torch.onnx.export`` of the same block
(same seed, same weights) with RoPE written as torch ops. Same inputs, same threads, interleaved
rounds; node counts of every file; and RoPE's share of the block's time, read from onnxruntime's
own profile (the nodes the lowering produced, over all nodes; first run dropped) for the ``onnx``
lowering and for our ``decomposed`` lowering of the same file. At real sizes the projections and
attention dominate: the share is what tells how much a faster RoPE can buy there.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from rope_export.bench.rope_alone import ort_session
from rope_export.bench.timing import interleaved, ratio

CACHE_LEN = 4096  # cos/sin rows of every block file; every position used stays below it
BASELINE = "plain"
LABELS = {
    "plain": "plain torch.onnx.export, decomposed RoPE (export.decomposed_export)",
    "onnx": "ours, lowered to onnx (default: positions guarded)",
    "onnx_trusted": "ours, lowered to onnx, trusted positions",
    "ort": "ours, lowered to ort",
}
PROFILED = {"onnx": "onnx (RotaryEmbedding-23 + position guard)", "decomposed": "decomposed (our lowering)"}


@dataclass(frozen=True)
class BlockCase:
    preset: str
    phase: str  # "prefill" | "decode"
    batch: int
    seq: int
    past: int = 0
    dtype: str = "fp32"

    @property
    def decode(self) -> bool:
        return self.phase == "decode"

    def shape_text(self) -> str:
        return f"B={self.batch} S={self.seq}" + (f" past={self.past}" if self.decode else "")


def block_feeds(case: BlockCase, preset, seed: int = 0) -> dict[str, np.ndarray]:
    a = preset.attention
    rng = np.random.default_rng(seed)
    dt = {"fp32": np.float32, "fp16": np.float16}[case.dtype]
    positions = np.arange(case.past, case.past + case.seq, dtype=np.int64)
    feeds = {
        "hidden_states": rng.standard_normal((case.batch, case.seq, a.hidden_size)).astype(dt),
        "position_ids": np.ascontiguousarray(np.broadcast_to(positions, (case.batch, case.seq))),
    }
    if case.decode:
        kv = (case.batch, a.num_kv_heads, case.past, a.head_dim)
        feeds["past_key"] = rng.standard_normal(kv).astype(dt)
        feeds["past_value"] = rng.standard_normal(kv).astype(dt)
    return feeds


def rope_node_names(custom, lowered) -> set[str]:
    """Nodes of ``lowered`` that stand for RoPE: the rotary nodes (the lowering keeps their names)
    and every node the lowering added (names absent from the custom-op file)."""
    from rope_export.op.nodes import is_ours

    before = {n.name for n in custom.graph.node}
    rotary = {n.name for n in custom.graph.node if is_ours(n)}
    return rotary | {n.name for n in lowered.graph.node if n.name not in before}


def profile_share(model, rope_names: set[str], feeds: dict, threads: int, runs: int) -> dict:
    """RoPE's share of the node time in onnxruntime's profile: median over runs, first run dropped."""
    with tempfile.TemporaryDirectory(prefix="rope-bench-profile-") as tmp:
        session = ort_session(model, threads, profile=os.path.join(tmp, "ort_profile"))
        for _ in range(runs + 1):
            session.run(None, feeds)
        with open(session.end_profiling(), encoding="utf-8") as f:
            events = json.load(f)
    runs_ev = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")
    per_run = [[0.0, 0.0] for _ in runs_ev]  # [rope us, all nodes us]
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        name = e["name"][: -len("_kernel_time")]
        for i, (start, end) in enumerate(runs_ev):
            if start <= e["ts"] <= end:
                per_run[i][1] += e["dur"]
                if name in rope_names:
                    per_run[i][0] += e["dur"]
                break
    kept = [r for r in per_run[1:] if r[1] > 0]  # the first run pays one-off costs
    if not kept:
        return {"rope_share": None, "rope_ms": None, "node_ms": None}
    return {
        "rope_share": statistics.median(r[0] / r[1] for r in kept),
        "rope_ms": statistics.median(r[0] for r in kept) / 1e3,
        "node_ms": statistics.median(r[1] for r in kept) / 1e3,
        "runs": len(kept),
    }


def _exports(preset, case: BlockCase, say):
    from rope_export.presets.export import decomposed_export, export

    say(f"block {preset.name} {case.phase}: exporting with the rotary op and as a plain export")
    custom = export(preset, dtype=case.dtype, decode=case.decode, cache_len=CACHE_LEN).model
    plain = decomposed_export(preset, case.dtype, case.decode, cache_len=CACHE_LEN)
    return custom, plain


def measure_case(case: BlockCase, threads: int, rounds: int, profile_runs: int, say: Callable[[str], None],
                 cache: dict) -> dict:
    from rope_export.exporting.core import summarize
    from rope_export.op.tolerances import tolerance
    from rope_export.passes import lower
    from rope_export.presets import load_preset

    preset = load_preset(case.preset)
    if case.past + case.seq > CACHE_LEN:
        raise ValueError(f"block case {case}: positions reach {case.past + case.seq}, past the {CACHE_LEN}-row cache")
    key = (case.preset, case.decode, case.dtype)
    if key not in cache:
        cache.clear()  # keep at most one preset's files (an 8B layer is 170 MB per file)
        cache[key] = _exports(preset, case, say)
    custom, plain = cache[key]
    say(f"block {preset.name} {case.phase}: lowering")
    models = {
        "plain": plain,
        "onnx": lower(custom, "onnx"),
        "onnx_trusted": lower(custom, "onnx", guard_positions=False),
        "ort": lower(custom, "ort"),
    }
    feeds = block_feeds(case, preset)
    say(f"block {preset.name} {case.phase} ({case.shape_text()}): onnxruntime sessions and a cross-check")
    sessions = {vid: ort_session(m, threads) for vid, m in models.items()}
    outputs = {vid: s.run(None, feeds) for vid, s in sessions.items()}
    tol = tolerance("block", {"fp32": "float32", "fp16": "float16"}[case.dtype])
    say(f"block {preset.name} {case.phase}: timing {len(sessions)} files, {rounds} interleaved rounds")
    timings = interleaved({vid: (lambda s=s: s.run(None, feeds)) for vid, s in sessions.items()}, rounds,
                          target_s=0.02)
    base = timings[BASELINE].median_s
    variants = {}
    for vid, timing in timings.items():
        summary = summarize(models[vid])
        diff = max(float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))
                   for a, b in zip(outputs[vid], outputs[BASELINE], strict=True))
        variants[vid] = {
            "label": LABELS[vid],
            "nodes": summary["nodes"],
            "nodes_without_constants": summary["nodes"] - summary["ops"].get("Constant", 0),
            **timing.to_dict(),
            "speedup_vs_plain": ratio(base, timing.median_s),
            "max_abs_diff_vs_plain": diff,
            "agrees": all(tol.allclose(a, b) for a, b in zip(outputs[vid], outputs[BASELINE], strict=True)),
        }
    del sessions
    say(f"block {preset.name} {case.phase}: RoPE's share of the block (onnxruntime profile)")
    shares = {}
    for target, label in PROFILED.items():
        lowered = models[target] if target in models else lower(custom, target)
        shares[target] = {"label": label, **profile_share(lowered, rope_node_names(custom, lowered), feeds, threads,
                                                          profile_runs)}
    a = preset.attention
    return {
        "case": asdict(case),
        "shape": case.shape_text(),
        "layer": f"hidden {a.hidden_size}, heads {a.num_heads}/{a.num_kv_heads}, head_dim {a.head_dim}",
        "custom_op_file_nodes": summarize(custom)["nodes"],
        "baseline": BASELINE,
        "variants": variants,
        "rope_share": shares,
    }


def run_section(cases: list[BlockCase], threads: int, rounds: dict[str, int], profile_runs: int,
                say: Callable[[str], None]) -> dict:
    cache: dict = {}
    results = [measure_case(c, threads, rounds[c.phase], profile_runs, say, cache) for c in cases]
    cache.clear()
    return {
        "title": "Whole attention block, onnxruntime CPU",
        "runtime": f"onnxruntime CPUExecutionProvider, intra-op threads {threads}",
        "cache_len": CACHE_LEN,
        "ratios": "speedup_vs_plain = median(plain export) / median(file); rope_share = time of the nodes that "
                  "stand for RoPE / time of all nodes, onnxruntime profile (same threads)",
        "no_target": "reported, not held to a goal: at real sizes RoPE is a small share of the block",
        "cases": results,
    }
