"""Per-token decode time against past length in onnxruntime-genai: Concat cache vs KV buffers updated in place.

    python -m rope_export.bench.genai_decode [--pasts 128 512 1024 2048] [--tokens 32] [--reps 3]

One random-weight Llama-shaped model (``--hidden``, ``--layers``; head 64, GQA 2:1) is packaged twice
with ``package_genai``: the default file (each step's present = Concat(past, new): the whole past
is copied every token) and ``kv_buffer=True`` (TensorScatter into a preallocated buffer, Attention
reads the filled part). For each past length a prompt of that many tokens is prefilled, then
``--tokens`` tokens are decoded greedily; the median time of one ``generate_next_token`` is the
figure. Both forms run side by side in one process, alternating, so the ratio is what to read
(the machines here are shared). Prints the shapes, the machine and the ratios.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path


def _model(hidden: int, layers: int, context: int):
    from transformers import LlamaConfig

    from rope_export.hf import build_hf_model

    heads = hidden // 64
    config = LlamaConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=64,
                         max_position_embeddings=context, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return build_hf_model(config, seed=0)


def _per_token(og, model, past: int, tokens: int) -> float:
    """Median seconds of one decode step after a prompt of ``past`` tokens."""
    import numpy as np

    params = og.GeneratorParams(model)
    params.set_search_options(max_length=past + tokens, min_length=past + tokens, do_sample=False)
    generator = og.Generator(model, params)
    ids = (np.arange(past, dtype=np.int32) % 1000 + 3)[None]
    generator.append_tokens(ids)  # the prefill and the first token
    times = []
    while not generator.is_done():
        start = time.perf_counter()
        generator.generate_next_token()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rope_export.bench.genai_decode",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--pasts", type=int, nargs="+", default=[128, 512, 1024, 2048])
    parser.add_argument("--tokens", type=int, default=32, help="decode steps timed per run")
    parser.add_argument("--reps", type=int, default=3, help="runs per past length and form (median of medians)")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args(argv)
    import onnxruntime_genai as og

    from rope_export.serve.genai import package_genai

    context = max(args.pasts) + args.tokens + 1
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = _model(args.hidden, args.layers, context)
        model.save_pretrained(root / "hf")
        folders = {}
        for name, buffer in (("concat", False), ("buffer", True)):
            print(f"packaging the {name} form ...", flush=True)
            folders[name] = package_genai(root / name, hf=root / "hf", weights=root / "hf", kv_buffer=buffer).folder
        models = {name: og.Model(str(folder)) for name, folder in folders.items()}
        heads = args.hidden // 64
        print(f"\nLlama-shaped, hidden {args.hidden}, {args.layers} layers, {heads} heads / {max(1, heads // 2)} kv "
              f"heads x 64, fp32, batch 1; onnxruntime-genai {og.__version__} CPU; {platform.processor() or 'cpu'}, "
              f"{os.cpu_count()} cores; median of {args.tokens} decode steps, median over {args.reps} runs")
        print(f"{'past':>6} {'concat ms/token':>16} {'buffer ms/token':>16} {'concat/buffer':>14}")
        for past in args.pasts:
            runs = {"concat": [], "buffer": []}
            for _ in range(args.reps):
                for name in ("concat", "buffer"):  # alternating: both see the same machine load
                    runs[name].append(_per_token(og, models[name], past, args.tokens))
            concat, buffer = (statistics.median(runs[name]) for name in ("concat", "buffer"))
            print(f"{past:>6} {concat * 1e3:>16.3f} {buffer * 1e3:>16.3f} {concat / buffer:>14.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
