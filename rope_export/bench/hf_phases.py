"""Where a default ``export --hf`` of a tiny 2-layer model spends its time, phase by phase.

    python -m rope_export.bench.hf_phases [--reps 5] [--model-type llama]

Each repetition builds the tiny model and runs ``export_hf`` with default flags; its progress
messages mark the phases: cache geometry, the eager rotation count (with the call recording that
detection uses), detection (finding and probing the rotary functions), the export itself, the count
comparison and the checker. Prints the median seconds of each phase and its share of the whole
export (detection's share is the figure issue 13 bounds at 10%).
"""

from __future__ import annotations

import argparse
import statistics
import time

PHASES = (  # (progress message prefix that starts the phase, phase name)
    ("counting the rotations", "eager rotation count + call recording"),
    ("finding the rotary functions", "detection (find + probe)"),
    ("exporting", "torch.export + ONNX translation"),
    ("comparing the eager rotations", "count vs file"),
    ("checking the file", "onnx.checker"),
)


def tiny_config(model_type: str):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


def one_run(model_type: str) -> dict[str, float]:
    from rope_export.hf import build_hf_model, export_hf

    model = build_hf_model(tiny_config(model_type))
    marks: list[tuple[str, float]] = []
    start = time.perf_counter()
    export_hf(model, progress=lambda message: marks.append((message, time.perf_counter())))
    end = time.perf_counter()
    times = {"total": end - start, "before the count (cache geometry)": marks[0][1] - start}
    for n, (prefix, name) in enumerate(PHASES):
        begin = next(t for message, t in marks if message.startswith(prefix))
        following = [t for message, t in marks if any(message.startswith(p) for p, _ in PHASES[n + 1:])]
        times[name] = (min(following) if following else end) - begin
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--model-type", default="llama")
    args = parser.parse_args(argv)
    one_run(args.model_type)  # warm-up: imports, first trace
    runs = [one_run(args.model_type) for _ in range(args.reps)]
    total = statistics.median(r["total"] for r in runs)
    print(f"export --hf of a tiny 2-layer {args.model_type}: median of {args.reps} runs (after one warm-up)")
    for name in runs[0]:
        value = statistics.median(r[name] for r in runs)
        print(f"  {name:<40} {value:7.3f} s  {value / total:6.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
