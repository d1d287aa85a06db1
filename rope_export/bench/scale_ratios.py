"""The scale benchmark's ratios and goals: each row (``export --hf``, ``package genai --hf``, the full trace)
against the plain export, each graph builder (onnxruntime-genai's, mobius) and the faster of them, and the
weights; medians over the repetitions of one run."""

from __future__ import annotations

import statistics

from rope_export.bench.scale_peers import BUILDER, COPY, FULL_TRACE, MOBIUS, PACKAGE, write_rate
from rope_export.common.bounds import format_bytes

RSS_GOAL = 1.05  # peak RSS of export --hf (and package genai --hf) over the weight bytes (issue 36)
TIME_GOAL = 1.2  # wall time of export --hf over the plain export's


def _median(steps: list[dict], name: str, key: str) -> float | None:
    values = [s[key] for s in steps if s.get("step") == name and key in s]
    return statistics.median(values) if values else None


ROWS = {"export --hf": "export", PACKAGE: "package", FULL_TRACE: "full_trace"}  # row -> its ratios' key
PEER_KEYS = {BUILDER: "builder", MOBIUS: "mobius"}


def ratios(result: dict) -> dict:
    """Each row's wall time and peak RSS over the plain export's, each graph builder's and the faster builder's,
    and over the weights (medians of the repetitions of one run)."""
    steps, weights = result["steps"], result["weight_bytes"]
    ours_rss, plain_rss = _median(steps, "export --hf", "peak_rss"), _median(steps, "plain export", "peak_rss")
    ours_s, plain_s = _median(steps, "export --hf", "seconds"), _median(steps, "plain export", "seconds")
    out = {
        "export_peak_rss_over_weights": ours_rss / weights,
        "plain_peak_rss_over_weights": plain_rss / weights,
        "export_peak_rss_over_plain": ours_rss / plain_rss,
        "export_time_over_plain": ours_s / plain_s,
        "repetitions": sum(1 for s in steps if s.get("step") == "export --hf"),
    }
    peers = {key: (_median(steps, peer, "seconds"), _median(steps, peer, "peak_rss"))
             for peer, key in PEER_KEYS.items() if _median(steps, peer, "seconds")}
    for key, (_, rss) in peers.items():
        out[f"{key}_peak_rss_over_weights"] = rss / weights
    if peers:
        out["fastest_peer"] = min(peers, key=lambda key: peers[key][0])
    for row, key in ROWS.items():
        seconds, rss = _median(steps, row, "seconds"), _median(steps, row, "peak_rss")
        if not seconds:
            continue
        out[f"{key}_peak_rss_over_weights"] = rss / weights
        for peer, (peer_s, peer_rss) in peers.items():
            out.update({f"{key}_time_over_{peer}": seconds / peer_s, f"{key}_peak_rss_over_{peer}": rss / peer_rss})
        if peers:
            out[f"{key}_time_over_fastest_peer"] = seconds / peers[out["fastest_peer"]][0]
    if "full_trace_time_over_builder" in out or _median(steps, FULL_TRACE, "seconds"):
        out["export_time_over_full_trace"] = ours_s / _median(steps, FULL_TRACE, "seconds")
    copy = next((s for s in steps if s.get("step") == COPY and s.get("seconds")), None)
    written = next((f["bytes"] for s in steps if s.get("step") == "export --hf" for f in s.get("files", [])
                    if f["path"].endswith(".data")), None)
    write = write_rate(result.get("export_steps", []), written) if written else None
    if copy and write:
        out.update(write_mb_s=write / 1e6, copy_mb_s=written / copy["seconds"] / 1e6,
                   write_over_copy=write * copy["seconds"] / written)
    return out


def _goal(goal: str, where: str, measured: float, unit: str, bound: float) -> dict:
    return {"goal": goal, "where": where, "measured": measured, "unit": unit, "met": measured <= bound}


def goals(section: dict) -> list[dict]:
    out = []
    for r in section.get("sizes", []):
        if r.get("status") != "measured":
            continue
        weights = format_bytes(r["weight_bytes"])
        q, where = r["ratios"], f"{r['size']} ({r['shape']}, {r['dtype']}, {weights} of weights)"
        out += [
            _goal("peak RSS of export --hf <= the plain torch.onnx.export's", where, q["export_peak_rss_over_plain"],
                  "x plain", 1.0),
            _goal(f"wall time of export --hf <= {TIME_GOAL}x the plain torch.onnx.export's", where,
                  q["export_time_over_plain"], "x plain", TIME_GOAL),
        ]
        for row, key in ROWS.items():  # issues 26 and 36: as fast as the faster graph builder, in memory the weights
            if f"{key}_peak_rss_over_weights" not in q or row == FULL_TRACE:
                continue
            out.append(_goal(f"peak RSS of {row} <= {RSS_GOAL}x the weight bytes", where,
                             q[f"{key}_peak_rss_over_weights"], "x weights", RSS_GOAL))
            if f"{key}_time_over_fastest_peer" in q:
                out.append(_goal(f"wall time of {row} <= the faster graph builder's ({q['fastest_peer']})", where,
                                 q[f"{key}_time_over_fastest_peer"], f"x {q['fastest_peer']}", 1.0))
            if f"{key}_peak_rss_over_mobius" in q:  # a small model: its fixed overhead against mobius's
                out.append(_goal(f"peak RSS of {row} <= mobius's", where, q[f"{key}_peak_rss_over_mobius"],
                                 "x mobius", 1.0))
    return out
