"""What counting rotations (rope_export.detect.count_rotations) costs next to a plain eager forward.

    .venv/bin/python scripts/count_cost.py [--repeat 7]

Two modules built offline from transformers configs with random weights: a tiny 2-layer Llama
(hidden 32) and one Llama-3.2-1B-shaped decoder layer (hidden 2048, 32 query / 8 key-value heads,
head_dim 64, MLP 8192; sequence 128). Medians of interleaved repetitions, one thread; the ratio is
measured side by side in the same run.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
import warnings


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args(argv)
    import torch
    import transformers as tf

    from rope_export.detect import count_rotations

    warnings.simplefilter("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    shapes = {
        "tiny 2-layer Llama": (dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2), 6),
        "Llama-3.2-1B-shaped layer": (dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=1,
                                           num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0), 128),
    }
    print("| module | seq | forward (ms) | counted forward (ms) | ratio | rotations |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (config, seq) in shapes.items():
        model = tf.AutoModelForCausalLM.from_config(
            tf.LlamaConfig(vocab_size=128, max_position_embeddings=4096, **config), attn_implementation="eager").eval()
        kwargs = dict(input_ids=torch.randint(0, 128, (1, seq)), position_ids=torch.arange(seq)[None], use_cache=False)

        def plain(model=model, kwargs=kwargs):
            with torch.no_grad():
                model(**kwargs)

        def counted(model=model, kwargs=kwargs):
            return count_rotations(model, (), kwargs)

        plain()
        census = counted()
        times: dict[str, list[float]] = {"plain": [], "counted": []}
        for _ in range(args.repeat):
            for key, run in (("plain", plain), ("counted", counted)):
                start = time.perf_counter()
                run()
                times[key].append(time.perf_counter() - start)
        p, c = statistics.median(times["plain"]), statistics.median(times["counted"])
        print(f"| {name} | {seq} | {p * 1e3:.1f} | {c * 1e3:.1f} | {c / p:.2f} | {census.total} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
