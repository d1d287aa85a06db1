"""Which RoPE sites each fuser finds, file by file: rope-export's ``fuse`` against onnxscript's
``ort_fusions`` and onnxruntime's transformers optimizer, on plain exports (no rope_export op).

A development benchmark (needs the ``dev`` extra: transformers, torchtune, llama-models,
rotary-embedding-torch); run from the repository root::

    .venv/bin/python scripts/compare_fusers.py [--out out/fusers.md]

Files: the block zoo of tests/rope_blocks.py (third-party RoPE code and hand-written spellings,
dynamo exporter at opset 18 and 23) and the tiny transformers attention layers of
tests/passes/hf_models.py (dynamo at opset 18 and 23, TorchScript at opset 17). For each file:
the rotations one eager forward performs (rope_export.detect.count_rotations), the
RotaryEmbedding-23 nodes torch.onnx's optimizer already wrote, and the rotary nodes each fuser
leaves in the file: ours (split into sites our rules fused and torch.onnx nodes adopted),
onnxscript's ``optimize_for_ort`` (its ``rotary_embedding`` count) and onnxruntime's
``optimize_model(model_type="bert")`` (com.microsoft RotaryEmbedding nodes). Not a timed test: the
fuse time is printed for information only.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import logging
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "passes")]


def _rotary(model) -> int:
    return sum(1 for n in model.graph.node if n.op_type == "RotaryEmbedding")


def ours(model) -> tuple[int, int, float]:
    """(sites our rules fused, torch.onnx nodes adopted, seconds)."""
    from rope_export.passes import FusionReport, fuse

    report = FusionReport()
    start = time.perf_counter()
    fuse(model, report=report, adopt_standard=True)
    seconds = time.perf_counter() - start
    adopted = sum(r.status == "fused" and r.form.startswith("ai.onnx") for r in report.rows())
    return report.num_fused - adopted, adopted, seconds


def onnxscript_fusions(model) -> int:
    import onnx_ir as ir
    from onnxscript.rewriter.ort_fusions import optimize_for_ort

    try:
        _, counts = optimize_for_ort(ir.from_proto(copy.deepcopy(model)))
    except Exception as exc:  # noqa: BLE001 - a fuser that fails on a file counts 0, with the reason
        print(f"    onnxscript failed: {type(exc).__name__}: {str(exc)[:100]}", file=sys.stderr)
        return 0
    return counts.get("rotary_embedding", 0)


def onnxruntime_optimizer(model) -> int:
    import onnx
    from onnxruntime.transformers.optimizer import optimize_model

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.onnx"
        onnx.save(model, path)
        try:
            optimized = optimize_model(str(path), model_type="bert", opt_level=0)
        except Exception as exc:  # noqa: BLE001
            print(f"    onnxruntime optimizer failed: {type(exc).__name__}: {str(exc)[:100]}", file=sys.stderr)
            return 0
    return sum(1 for n in optimized.model.graph.node if n.op_type == "RotaryEmbedding" and n.domain == "com.microsoft")


def files():
    """(name, exporter, opset, model, eager rotations)."""
    import hf_models
    import rope_blocks as rb
    import torch
    from transformers import AutoModelForCausalLM

    from rope_export.detect import count_rotations

    for name in list(rb.FORMS) + list(rb.UNFUSABLE) + list(rb.LOOK_ALIKES):
        census = count_rotations(rb.block(name), rb.example())
        for opset in (18, 23):
            yield name, "dynamo", opset, rb.plain_export(name, opset), len(census.plain)
    for family in hf_models.FAMILIES:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(hf_models.config(family), attn_implementation="eager").eval()
        census = count_rotations(hf_models.Attention(family, model), hf_models.example(seq=4))
        for exporter, opset in (("dynamo", 18), ("dynamo", 23), ("torchscript", 17)):
            model_proto = hf_models.exported(family, exporter, opset=opset if exporter == "dynamo" else None)
            yield f"transformers {family}", exporter, opset, model_proto, len(census.plain)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the table as Markdown here")
    args = parser.parse_args(argv)
    for name in ("torch", "torch.onnx", "torch.export", "onnxscript", "transformers", "onnxruntime"):
        logging.getLogger(name).setLevel(logging.ERROR)
    header = ("| file | exporter | opset | eager rotations | torch.onnx's own | ours: fused by our rules | "
              "ours: adopted | ours: total | onnxscript ort_fusions | onnxruntime optimizer | fuse s |")
    rows = [header, "|" + "---|" * 11]
    totals = [0] * 7
    for name, exporter, opset, model, rotations in files():
        print(f"  {name} ({exporter}, opset {opset})", file=sys.stderr, flush=True)
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            own = _rotary(model)
            fused, adopted, seconds = ours(model)
            theirs = onnxscript_fusions(model)
            ort_count = onnxruntime_optimizer(model)
        values = [rotations, own, fused, adopted, fused + adopted, theirs, ort_count]
        totals = [t + v for t, v in zip(totals, values, strict=True)]
        rows.append(f"| {name} | {exporter} | {opset} | " + " | ".join(map(str, values)) + f" | {seconds:.2f} |")
    rows.append("| **total** | | | " + " | ".join(f"**{t}**" for t in totals) + " | |")
    table = "\n".join(rows)
    print(table)
    if args.out:
        from rope_export.common.fileio import atomic_write_text

        args.out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.out, table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
