"""Half precision with trained-like statistics: check's per-layer worst ratios before and after the float32 steps.

    .venv/bin/python scripts/half_precision.py --out /tmp/half [--size tiny|1b] [--dtypes fp16 bf16]
        [--runners onnxruntime-cpu,onnx-reference,cpu-twin] [--max-in-memory GB] [--memory-limit GB]
        [--piece-limit GB] [--cases tests|small] [--when before after]

A Llama (the tests' tiny one: 2 layers, hidden 128; or Llama-3.2-1B-shaped: 16 layers, hidden 2048, vocab 128256)
with random weights, given trained-like statistics by ``rope_export.hf.planting`` and saved with save_pretrained,
is exported twice per dtype, after a few op-level figures (the softmax alone in half on each runner): **before**,
the exporter with its float32 steps switched off (torchlib's softmax translation, torch.onnx's fused norm: what
``export --hf`` wrote before them), and **after**, as it is. Each file is checked on every runner; per runner the
script prints its status, the worst ratio of its logits' error to the bound (``tolerances.against_pytorch``), the
worst ratio after each decoder layer, the first layer outside PyTorch's envelope and, where check looked into it,
which op and whose fault. ``results.json`` in ``--out`` has every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import time
import warnings
from pathlib import Path

SIZES = {
    "tiny": dict(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256),
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, tie_word_embeddings=True,
               rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                                    high_freq_factor=4.0, original_max_position_embeddings=8192)),
}
CASES = {"tests": dict(batch=1, seq=16, past=4, long_seq=32, sweep=False),  # the tests' (tests/planted.py)
         "small": dict(batch=1, seq=4, past=2, long_seq=8, sweep=False)}  # NumPy's float16 MatMul: 0.04 GMAC/s here
SINKS = {"tiny": 0.125, "1b": 0.25}  # share of token ids that are sinks: the small cases' 19 tokens hold some


def planted_folder(size: str, dtype: str, out: Path) -> Path:
    import torch
    import transformers

    from rope_export import hf
    from rope_export.hf.planting import plant_trained_statistics

    folder = out / f"planted-{size}-{dtype}"
    if (folder / "config.json").is_file():
        return folder
    config = transformers.LlamaConfig(**SIZES[size], pad_token_id=None, bos_token_id=None, eos_token_id=None)
    model = hf.build_hf_model(config, dtype="fp32" if size == "tiny" else dtype, seed=0)
    planted = plant_trained_statistics(model, seed=0, sink_fraction=SINKS[size])
    print(f"planted: {planted.describe()}", flush=True)
    model.to({"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]).save_pretrained(folder)
    return folder


@contextlib.contextmanager
def float32_steps(on: bool):
    """The exporter as it is (on), or with its float32 steps switched off (as it was before them)."""
    from rope_export.exporting import precision

    saved = precision.translations, precision.state_norm_precision
    if not on:
        precision.translations, precision.state_norm_precision = (lambda: {}), (lambda model: 0)
    try:
        yield
    finally:
        precision.translations, precision.state_norm_precision = saved


def export(folder: Path, dtype: str, path: Path, steps: bool) -> None:
    from rope_export import hf

    if path.is_file():
        return
    with float32_steps(steps):
        hf.export_hf(hf.build_hf_model(folder, dtype=dtype), path, weights=str(folder))


def summary(report) -> list[dict]:
    rows = []
    for r in report.runners:
        row = {"runner": r.runner, "status": r.status, "reason": r.reason if r.status == "skipped" else ""}
        logits = [s.max_abs / s.bound for stats in r.cases.values() for s in stats
                  if s.output == "logits" and s.bound]
        outputs = [s.max_abs / s.bound for stats in r.cases.values() for s in stats if s.bound]
        row["worst_logits_ratio"] = max(logits, default=None)
        row["worst_output_ratio"] = max(outputs, default=None)
        if r.layers is not None:
            row["layer_ratios"] = [e / b for e, b in zip(r.layers.errors, r.layers.bounds, strict=True)]
            row["first_layer_outside"] = r.layers.first_outside
        if r.fault is not None:
            row["op_by_op"] = r.fault.sentence()
        rows.append(row)
    return rows


def op_level() -> None:
    """The softmax alone in half: onnxruntime's CPU kernel and NumPy (onnx.reference) against PyTorch's float32
    softmax rounded once, on rows of 2048 logits (spread 3, a sink at 8); and a sum of 4096 terms of 1e-3 in
    bfloat16 as NumPy (ml_dtypes) accumulates it."""
    import ml_dtypes
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper

    shape = [2, 4, 64, 2048]
    node = helper.make_node("Softmax", ["x"], ["y"], axis=-1)
    graph = helper.make_graph([node], "softmax", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)])
    session = ort.InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
                                   .SerializeToString(), providers=["CPUExecutionProvider"])
    x = (np.random.default_rng(0).standard_normal(shape) * 3).astype(np.float16)
    x[..., 0] = 8
    exact = np.exp(x.astype(np.float64) - x.max(-1, keepdims=True))
    exact /= exact.sum(-1, keepdims=True)
    terms = np.exp(x - x.max(-1, keepdims=True))
    runs = {"PyTorch (float32 softmax, rounded to float16)": exact.astype(np.float32).astype(np.float16),
            "onnxruntime CPU, Softmax on float16": session.run(None, {"x": x})[0],
            "NumPy as onnx.reference, Softmax on float16": terms / terms.sum(-1, keepdims=True)}
    print("| softmax of float16 logits (rows of 2048) | max abs error against float64 |\n|---|---|")
    for name, y in runs.items():
        print(f"| {name} | {np.abs(y.astype(np.float64) - exact).max():.3g} |")
    terms = np.full((1, 4096), 1e-3)
    print(f"\nsum of 4096 x 1e-3: float64 {terms.sum():.4g}, NumPy float16 {terms.astype(np.float16).sum():.4g}, "
          f"NumPy bfloat16 (ml_dtypes) {float(terms.astype(ml_dtypes.bfloat16).sum()):.4g}\n", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--dtypes", nargs="+", default=["fp16", "bf16"], choices=["fp16", "bf16"])
    parser.add_argument("--runners", default="onnxruntime-cpu,onnx-reference,cpu-twin")
    parser.add_argument("--max-in-memory", type=float, default=None, help="GB of weights onnx.reference may load")
    parser.add_argument("--cases", choices=sorted(CASES), default="tests", help="check's case sizes")
    parser.add_argument("--memory-limit", type=float, default=None, help="check's --memory-limit GB")
    parser.add_argument("--piece-limit", type=float, default=None,
                        help="check's --piece-limit GB: onnxruntime, onnx.reference and the CPU twin in pieces of this")
    parser.add_argument("--when", nargs="+", default=["before", "after"], choices=["before", "after"],
                        help="which exports to check (one process each keeps each peak RSS its own)")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    from rope_export.check import check
    from rope_export.common.fileio import atomic_write_text

    args.out.mkdir(parents=True, exist_ok=True)
    op_level()
    saved = args.out / "results.json"
    results = json.loads(saved.read_text()) if saved.is_file() else {}
    for dtype in args.dtypes:
        folder = planted_folder(args.size, dtype, args.out)
        for when, steps in (("before", False), ("after", True)):
            if when not in args.when:
                continue
            path = args.out / f"{args.size}-{dtype}-{when}" / "model.onnx"
            path.parent.mkdir(exist_ok=True)
            started = time.perf_counter()
            export(folder, dtype, path, steps)
            print(f"{dtype} {when}: exported in {time.perf_counter() - started:.0f} s", flush=True)
            started = time.perf_counter()
            report = check(path, tuple(args.runners.split(",")), max_in_memory_gb=args.max_in_memory,
                           memory_limit_gb=args.memory_limit, piece_limit_gb=args.piece_limit, **CASES[args.cases],
                           progress=lambda message: print(f"  {message}", flush=True))
            rows = summary(report)
            results[f"{dtype} {when}"] = {"passed": report.passed, "runners": rows, "notes": report.notes,
                                          "check_seconds": time.perf_counter() - started}
            print(f"\n{dtype} {when}: {'PASS' if report.passed else 'FAIL'} ({time.perf_counter() - started:.0f} s)")
            for row in rows:
                layers = ", ".join(f"{v:.2f}" for v in row.get("layer_ratios", []))
                logits = row["worst_logits_ratio"]
                print(f"  {row['runner']}: {row['status']}"
                      + (f"; logits {logits:.2f} of the bound" if logits is not None else "")
                      + (f"; per layer [{layers}]" if layers else "") + (f"; {row['reason']}" if row['reason'] else "")
                      + (f"\n    {row['op_by_op']}" if row.get("op_by_op") else ""), flush=True)
            atomic_write_text(args.out / "results.json", json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
