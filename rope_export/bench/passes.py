"""Micro-benchmark: a fused-and-lowered RoPE against the decomposed RoPE it replaced.

    python -m rope_export.bench.passes [--reps N] [--threads 2]

The decomposed form is transformers' ``x * cos + rotate_half(x) * sin`` on one [B, H, S, D]
tensor, exported with torch.onnx (TorchScript), with cos/sin either computed from positions and
``inv_freq`` (what transformers exports today) or read from a table by ``position_ids``.
``rope_export.passes.fuse`` turns it into one rope_export::RotaryEmbedding, which is then lowered
to each onnxruntime-runnable target. Every variant runs on onnxruntime CPU with the same thread
count, in interleaved rounds (the machines are shared and noisy); the table shows the median time
of each and its ratio to the decomposed original (< 1: the lowered op is faster).
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import statistics
import time
import warnings

import numpy as np

SHAPES = {"prefill": (1, 32, 2048, 128), "decode": (16, 32, 1, 128)}  # B, H, S, D
MAX_POS = 4096


def decomposed_model(source: str, dtype: str, head_dim: int):
    """The transformers-style decomposed RoPE of one tensor, exported by torch.onnx."""
    import onnx
    import torch

    torch_dtype = {"float32": torch.float32, "float16": torch.float16}[dtype]

    class Rope(torch.nn.Module):
        def __init__(self):
            super().__init__()
            inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
            self.register_buffer("inv_freq", inv_freq, persistent=False)
            freqs = torch.arange(MAX_POS).float()[:, None] * inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)
            self.register_buffer("cos_cached", emb.cos(), persistent=False)
            self.register_buffer("sin_cached", emb.sin(), persistent=False)

        def forward(self, x, position_ids):
            if source == "table":
                cos, sin = self.cos_cached[position_ids], self.sin_cached[position_ids]
            else:
                freqs = position_ids[..., None].float() * self.inv_freq
                emb = torch.cat((freqs, freqs), dim=-1)
                cos, sin = emb.cos(), emb.sin()
            cos, sin = cos.to(x.dtype).unsqueeze(1), sin.to(x.dtype).unsqueeze(1)
            half = x.shape[-1] // 2
            rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
            return x * cos + rotated * sin

    x = torch.zeros(1, 2, 3, head_dim, dtype=torch_dtype)
    pos = torch.zeros(1, 3, dtype=torch.int64)
    buffer = io.BytesIO()
    axes = {"x": {0: "batch", 1: "heads", 2: "seq"}, "position_ids": {0: "batch", 1: "seq"}}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Rope().to(torch_dtype), (x, pos), buffer, dynamo=False, opset_version=17,
                          input_names=["x", "position_ids"], output_names=["y"], dynamic_axes=axes)
    return onnx.load_from_string(buffer.getvalue())


def variants(source: str, dtype: str, head_dim: int) -> dict:
    from rope_export.passes import fuse, lower

    original = decomposed_model(source, dtype, head_dim)
    fused = fuse(original)
    out = {"decomposed (original)": original}
    out["fused -> onnx"] = lower(fused, "onnx")
    out["fused -> onnx, trusted positions"] = lower(fused, "onnx", guard_positions=False)
    out["fused -> ort"] = lower(fused, "ort")
    out["fused -> decomposed"] = lower(fused, "decomposed")
    return out


def measure(models: dict, feeds: dict, threads: int, reps: int) -> dict[str, float]:
    """Median seconds per run of each model, measured in interleaved rounds; outputs cross-checked."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    sessions = {name: ort.InferenceSession(m.SerializeToString(), options, providers=["CPUExecutionProvider"])
                for name, m in models.items()}
    reference = None
    for name, session in sessions.items():  # warm-up, and every variant computes the same
        out = session.run(None, feeds)[0].astype(np.float32)
        if reference is None:
            reference = out
        elif not np.allclose(out, reference, atol=2e-2, rtol=2e-2):
            raise RuntimeError(f"{name} disagrees with the original by {np.abs(out - reference).max():.3g}")
    times: dict[str, list[float]] = {name: [] for name in sessions}
    for _ in range(reps):
        for name, session in sessions.items():
            start = time.perf_counter()
            session.run(None, feeds)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    import onnxruntime as ort

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=0, help="repetitions per variant (default 15 prefill, 200 decode)")
    parser.add_argument("--threads", type=int, default=2, help="onnxruntime intra-op threads (default 2)")
    parser.add_argument("--dtypes", default="float32,float16")
    parser.add_argument("--sources", default="computed,table")
    args = parser.parse_args(argv)

    print(f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} CPUs; "
          f"onnxruntime {ort.__version__} CPU, {args.threads} threads")
    print("ratio = median time / median time of the decomposed original (lower is better)\n")
    header = f"{'phase':<8} {'B,H,S,D':<16} {'dtype':<8} {'cos/sin':<9} {'variant':<34} {'median ms':>10} {'ratio':>7}"
    print(header)
    print("-" * len(header))
    rng = np.random.default_rng(0)
    for phase, (b, h, s, d) in SHAPES.items():
        reps = args.reps or (15 if phase == "prefill" else 200)
        for dtype in args.dtypes.split(","):
            np_dtype = {"float32": np.float32, "float16": np.float16}[dtype]
            x = rng.standard_normal((b, h, s, d)).astype(np_dtype)
            start = 100 if phase == "prefill" else 3000
            pos = (np.arange(s)[None, :] + start + np.arange(b)[:, None]).astype(np.int64)
            for source in args.sources.split(","):
                models = variants(source, dtype, d)
                medians = measure(models, {"x": x, "position_ids": pos}, args.threads, reps)
                base = medians["decomposed (original)"]
                for name, value in medians.items():
                    print(f"{phase:<8} {f'{b},{h},{s},{d}':<16} {dtype:<8} {source:<9} {name:<34} "
                          f"{value * 1e3:>10.3f} {value / base:>7.2f}")
                print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
