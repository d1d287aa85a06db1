"""``rope-export export --hf VLM_DIR -o OUT_DIR/``: what the ``--hf`` export runs for a vision-language model
(``rope_export.hf.vlm``), routed here from ``cli/export_hf.py``."""

from __future__ import annotations

from pathlib import Path

from rope_export.hf.errors import HFExportError

# export --hf options that have no meaning for a folder of components
NOT_FOR_VLM = ("layer", "hf_family", "attention_mask", "kv_buffer", "trace")


def wants_vlm_export(args) -> bool:
    """A vision-language type given a folder to write (a ``.onnx`` output keeps the causal-LM export of the text
    tower where transformers builds one); decided from the config alone, before anything is built."""
    if str(args.output).endswith(".onnx"):
        if getattr(args, "image_size", None):
            raise HFExportError("--image-size is for a vision-language model exported whole: give -o OUT_DIR/")
        return False
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    from rope_export.hf.loading import load_hf_config
    from rope_export.hf.vlm import kind_of
    from rope_export.hf.vlm.loading import is_vlm

    config = load_hf_config(args.hf)
    if not is_vlm(config) and config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        kind_of(config)  # an image-text-to-text type rope-export has no entry for: refused, naming what is covered
    return is_vlm(config)


def run_vlm_export(args, weights, weights_line: str) -> int:
    from rope_export.common.steps import cli_steps
    from rope_export.common.tables import console as make_console
    from rope_export.common.tables import print_table
    from rope_export.common.tables import table as make_table
    from rope_export.hf.checkpoints import weights_fact
    from rope_export.hf.vlm.exporting import check_output_folder, export_vlm
    from rope_export.hf.vlm.loading import build_vlm

    for option in NOT_FOR_VLM:
        value = getattr(args, option, None)
        if value is not None and value is not False:  # --layer 0 is given too
            raise HFExportError(f"--{option.replace('_', '-')} does not apply to a vision-language model exported "
                                "whole (its decoder always takes an attention_mask, as onnxruntime-genai feeds it)")
    check_output_folder(Path(args.output))  # before the minutes of building and tracing
    console = make_console()
    with cli_steps(console, f"rope-export export --hf: {args.output}", args.summary_json) as progress:
        progress.facts["weights"] = weights_fact(weights, args.seed)
        progress(f"building the model from {args.hf}" + (f" with weights from {weights}" if weights else
                                                          f" (random weights, seed {args.seed})"))
        model = build_vlm(args.hf, weights, dtype=args.dtype, seed=args.seed, random_weights=weights is None,
                          progress=progress)
        result = export_vlm(model, args.output, image_size=getattr(args, "image_size", None), opset=args.opset,
                            weights=None if weights is None else str(weights), seed=args.seed,
                            allow_decomposed=getattr(args, "allow_decomposed", False), external=args.external_data,
                            progress=progress, verbose=args.verbose)
        progress.add_files((p, p.stat().st_size) for p in sorted(Path(result.folder).iterdir()) if p.is_file())
    console.print(weights_line, soft_wrap=True, markup=False, highlight=False)
    table = make_table(f"{result.folder}/ ({type(model).__name__}, {args.dtype}, image {result.geometry.size}, "
                       f"{result.geometry.tokens} image tokens)", ["component", "file", "rotations in eager "
                       "transformers", "rotary nodes", "how"], keep=("component", "file"))
    for name, component in result.components.items():
        table.add_row(name, component.path.name, str(component.rotations), str(component.nodes), component.how)
    print_table(console, table)
    manifest = result.manifest
    for where, text in manifest["positions"].items():
        console.print(f"positions ({where}): {text}", soft_wrap=True, markup=False, highlight=False)
    for name, component in result.components.items():
        for note in component.notes:
            console.print(f"note ({name}): {note}", soft_wrap=True, markup=False, highlight=False)
    return 0
