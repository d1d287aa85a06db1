"""``rope-export demo``: the main job on the built-in default preset.

Runs the default block in PyTorch (prefill, then decode steps with the KV cache) and prints its
RoPE configuration and output statistics; checks that decoding token by token reproduces the
prefill output, which exercises positions, the cache and the rotary op end to end.
"""

from __future__ import annotations

import time

import torch

from rope_export.presets import DEFAULT_PRESET, load_preset
from rope_export.tolerances import tolerance


def register(subparsers) -> None:
    parser = subparsers.add_parser("demo", help="run the main job on the built-in default preset")
    parser.add_argument("--preset", default=DEFAULT_PRESET, help=f"preset name or .toml (default {DEFAULT_PRESET})")
    parser.add_argument("--seq", type=int, default=32, help="prefill length (default 32)")
    parser.set_defaults(func=run)


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    preset = load_preset(args.preset)
    rope, att = preset.rope, preset.attention
    console.print(f"[bold]preset[/bold] {preset.name} ({preset.family}; {preset.source})")
    console.print(
        f"attention: hidden {att.hidden_size}, heads {att.num_heads}/{att.num_kv_heads} (q/kv), head_dim {att.head_dim}"
    )
    console.print(f"rope: {rope.to_dict()}")
    if args.seq < 2 or args.seq > rope.max_position_embeddings:
        raise ValueError(f"--seq must be in 2..{rope.max_position_embeddings}, got {args.seq}")

    block = preset.build_block(seed=0, cache_len=min(rope.max_position_embeddings, 4096))
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, args.seq, att.hidden_size, generator=generator)
    positions = torch.arange(args.seq).expand(2, -1)
    with torch.no_grad():
        block(hidden, positions)  # warm-up: the first call pays one-off dispatch costs
        start = time.perf_counter()
        prefill, _, _ = block(hidden, positions)
        prefill_ms = (time.perf_counter() - start) * 1e3
        # Prefill all but the last 4 tokens, then decode those one at a time with the KV cache.
        split = args.seq - 4
        _, key, value = block(hidden[:, :split], positions[:, :split])
        decoded = []
        for step in range(split, args.seq):
            out, key, value = block(hidden[:, step : step + 1], positions[:, step : step + 1], key, value)
            decoded.append(out)
    decoded = torch.cat(decoded, dim=1)
    error = (decoded - prefill[:, split:]).abs().max().item()
    ok = tolerance("block", "float32").allclose(decoded, prefill[:, split:])

    table = Table(title=f"{preset.name}: PyTorch block, batch 2, seq {args.seq}")
    for column in ("check", "value"):
        table.add_column(column)
    table.add_row("output mean / std", f"{prefill.mean().item():+.4f} / {prefill.std().item():.4f}")
    table.add_row("output max |x|", f"{prefill.abs().max().item():.4f}")
    table.add_row("prefill latency", f"{prefill_ms:.2f} ms")
    table.add_row("decode (KV cache) vs prefill, max abs error", f"{error:.2e}  {'PASS' if ok else 'FAIL'}")
    console.print(table)
    return 0 if ok else 1
