"""``rope-export presets``: list the model presets, or show one (``rope_export.presets``)."""

from __future__ import annotations

from rope_export.presets import load_preset, preset_names


def register(subparsers) -> None:
    parser = subparsers.add_parser("presets", help="list the model presets, or show one")
    parser.add_argument("name", nargs="?", help="a preset name or .toml path to show in full")
    parser.set_defaults(func=run)


def run(args) -> int:
    from rope_export.common.tables import console as make_console
    from rope_export.common.tables import print_table
    from rope_export.common.tables import table as make_table

    console = make_console()
    if args.name:
        preset = load_preset(args.name)
        console.print_json(data=preset.to_dict())
        return 0
    table = make_table("rope-export presets", ("name", "family", "heads (q/kv)", "head dim", "rotary dim",
                                                "rope type", "layout", "max pos"), keep=("name",))
    for name in preset_names():
        p = load_preset(name)
        table.add_row(
            p.name,
            p.family,
            f"{p.attention.num_heads}/{p.attention.num_kv_heads}",
            str(p.attention.head_dim),
            str(p.rope.rotary_embedding_dim),
            p.rope.rope_type,
            "interleaved" if p.rope.interleaved else "rotate-half",
            str(p.rope.max_position_embeddings),
        )
    print_table(console, table)
    return 0
