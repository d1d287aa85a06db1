"""``rope-export demo`` (what ``make demo`` runs): the whole product on the built-in default, and on a
tiny transformers Llama.

Exports the default preset with one rotary node per rotated tensor, lowers it to every target,
builds the plugin's CPU twin, and validates every artefact against PyTorch on RoPE stress inputs
(``rope_export.check``). Then the real-model path: a tiny Llama config (random weights) exported
with ``export --hf``, lowered to every target and checked against transformers. One table: model,
target, runtime, max error, pass/fail, latency. With TensorRT and a GPU present the engine joins
the table; otherwise its row says why not. Without transformers the Llama rows say so.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from rope_export.presets import DEFAULT_PRESET

DEFAULT_OUT = "out/demo"
CACHE_LEN = 256  # keeps the demo fast; `rope-export export` defaults to the preset's max position

# (artefact, runners that validate it). The custom-op file is also run through the plugin's
# CPU twin: the kernel code compared inside a whole block.
PLAN = [
    ("custom-op", ("onnx-reference", "cpu-twin")),
    ("trt-plugin", ("cpu-twin", "tensorrt")),
    ("onnx", ("onnxruntime-cpu", "onnx-reference", "onnxruntime-cuda")),
    ("ort", ("onnxruntime-cpu", "onnxruntime-cuda")),
    ("decomposed", ("onnxruntime-cpu", "onnxruntime-cuda")),
]

# A Llama-3-style config at toy size: llama3 RoPE scaling, grouped-query attention, 2 layers.
TINY_LLAMA = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 256, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2,  # genai stops on eos: a folder for it has one
}


def register(subparsers) -> None:
    parser = subparsers.add_parser("demo", help="export, lower, build, validate: the whole product on one preset and "
                                                "a tiny transformers Llama")
    parser.add_argument("--preset", default=DEFAULT_PRESET, help=f"preset name or .toml (default {DEFAULT_PRESET})")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "fp16", "bf16"))
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"folder for the artefacts (default {DEFAULT_OUT})")
    parser.add_argument("--no-transformers", action="store_true", help="leave out the tiny transformers Llama rows")
    parser.set_defaults(func=run)


def _validate(model_name: str, artefacts: dict, rows: list, step) -> None:
    from rope_export.check import check

    for target, runners in PLAN:
        if target not in artefacts:
            continue
        step(f"validating {model_name} {target}")
        report = check(artefacts[target], runners)
        for r in report.runners:
            rows.append((model_name, target, r.runner, "" if r.max_abs is None else f"{r.max_abs:.2e}", r.status,
                         "" if r.latency_ms is None else f"{r.latency_ms:.2f} ms", r.reason, report.against))


def _lower_all(model, out: Path, stem: str, model_name: str, rows: list, step) -> dict:
    from rope_export.exporting.core import save_model
    from rope_export.passes import lower

    artefacts = {"custom-op": model}
    for target, _ in PLAN[1:]:
        step(f"lowering {model_name} to {target}")
        try:
            artefacts[target] = lower(model, target)
            save_model(artefacts[target], out / f"{stem}.{target}.onnx")
        except ValueError as exc:  # a target that cannot express this file says which can
            rows.append((model_name, target, "-", "", "skipped", "", str(exc), ""))
    return artefacts


def _transformers_llama(out: Path, dtype: str, rows: list, step) -> None:
    try:
        from rope_export import hf
    except ImportError as exc:
        rows.append(("tiny Llama", "custom-op", "-", "", "skipped", "", f"transformers is missing ({exc})", ""))
        return
    folder = out / "llama"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA, indent=2) + "\n")
    step(f"exporting a tiny transformers Llama ({folder / 'config.json'}, random weights) with export --hf")
    model = hf.build_hf_model(folder, dtype=dtype, seed=0)
    exported = hf.export_hf(model, folder / "model.onnx").model
    artefacts = _lower_all(exported, folder, "model", "tiny Llama", rows, step)
    _validate("tiny Llama", artefacts, rows, step)


def run(args) -> int:
    from rope_export.common.steps import log_line
    from rope_export.common.tables import console as make_console
    from rope_export.common.tables import print_table
    from rope_export.common.tables import table as make_table
    from rope_export.kernels import build as plugin_build
    from rope_export.presets.export import export

    console = make_console()
    started = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[tuple] = []
    with console.status("starting") as status:
        def step(message: str) -> None:
            status.update(message)
            log_line(console, message)

        step("building the plugin's CPU twin (build/plugins)")
        plugin_build.ensure_built(quiet=True)
        step(f"exporting {args.preset} ({args.dtype}) with the rotary custom op")
        exported = export(args.preset, out / "model.onnx", dtype=args.dtype, decode=True, cache_len=CACHE_LEN)
        preset_name = exported.preset.name
        artefacts = _lower_all(exported.model, out, "model", preset_name, rows, step)
        _validate(preset_name, artefacts, rows, step)
        if not args.no_transformers:
            _transformers_llama(out, args.dtype, rows, step)
    table = make_table(f"rope-export demo ({args.dtype}): every artefact against its reference "
                       "(PyTorch for the preset, transformers for Llama)",
                       ("model", "target", "runtime", "max abs error", "result", "median latency"),
                       keep=("model", "target", "runtime"))
    notes = []
    for model_name, target, runtime, error, status, latency, reason, _ in rows:
        style = {"pass": "green", "FAIL": "bold red", "skipped": "yellow"}[status]
        table.add_row(model_name, target, runtime, error, f"[{style}]{status}[/{style}]", latency)
        if reason:
            notes.append(f"  {model_name} {target} / {runtime}: {reason}")
    print_table(console, table)
    for note in notes:
        console.print(note, markup=False, highlight=False, soft_wrap=True)
    failed = [f"{m} {t}/{r} (against {against})" for m, t, r, _, status, _, _, against in rows if status == "FAIL"]
    console.print(f"artefacts in {out}/ ; {time.perf_counter() - started:.0f} s")
    if failed:
        console.print(f"[bold red]FAIL[/bold red]: {', '.join(failed)} disagree "
                      f"(run `rope-export check {out}/<file>.onnx --report DIR` for details)")
        return 1
    return 0
