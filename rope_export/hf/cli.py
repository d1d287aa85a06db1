"""``rope-export export --hf CONFIG``: the transformers options of the ``export`` command.

``register(subparsers)`` adds them to the ``export`` parser that ``rope_export.export`` made and
routes a call with any of them here, so ``rope_export.export`` never imports this package.
"""

from __future__ import annotations

from pathlib import Path

from rope_export import contract
from rope_export.checkpoints import weights_fact
from rope_export.hf.errors import HFExportError
from rope_export.hf.exporting import FALLBACKS, TRACES, export_hf
from rope_export.hf.families import HF_FAMILIES
from rope_export.hf.loading import build_hf_model, weights_beside
from rope_export.hf.versions import said_when_untested


def register_hf_arguments(parser) -> None:
    """Add ``--hf CONFIG_DIR_OR_JSON``, ``--weights DIR``, ``--random-weights``, ``--allow-no-rope``, ``--layer N``,
    ``--hf-family``, ``--hf-fallback``."""
    group = parser.add_argument_group("Hugging Face transformers models (instead of --preset)")
    group.add_argument("--hf", metavar="CONFIG_DIR_OR_JSON", default=None,
                       help="export a transformers causal LM built from this local config (folder or .json); any "
                            "RoPE model type: its rotary function is found by code and verified. The file always "
                            "has a KV cache (prefill: past 0)")
    group.add_argument("--weights", metavar="DIR", default=None,
                       help="local folder with the checkpoint save_pretrained wrote (safetensors or .bin, sharded or "
                            "not; default: the one in the --hf folder, or in the folder holding the .json); no hub "
                            "access")
    group.add_argument("--random-weights", action="store_true", default=None,
                       help="export random weights (--seed) even where the --hf folder holds a checkpoint: not a "
                            "trained model (a folder with a config only always gives random weights)")
    group.add_argument("--allow-no-rope", action="store_true", default=None,
                       help="write the file even when the model performs no rotary position embedding (a warning "
                            "instead of the error)")
    group.add_argument("--layer", type=int, default=None,
                       help="export only this attention layer (hidden_states, position_ids, past_key, past_value)")
    group.add_argument("--attention-mask", action="store_true", default=None,
                       help="the file takes an attention_mask input [batch, past+seq] (1: a token, 0: padding) after "
                            "position_ids, for batches with padding (onnxruntime-genai passes one)")
    group.add_argument("--kv-buffer", action="store_true", default=None,
                       help="each past is a preallocated buffer [batch, kv_heads, max_length, head] returned "
                            "updated in place (TensorScatter-24 + Attention-24, opset 24; implies --attention-mask), "
                            "so a decode step does not copy the whole past (onnxruntime-genai: "
                            "past_present_share_buffer true)")
    group.add_argument("--hf-family", choices=sorted(HF_FAMILIES), default=None,
                       help="override: accept only this family's rotary form (still checked numerically)")
    group.add_argument("--trace", choices=TRACES, default=None,
                       help="full (default): torch.export traces every decoder layer; per-kind: trace two layers and "
                            "stamp the second once per further layer with its weights and cache, where every layer is "
                            "one kind and the stamped file's rotary nodes per layer match transformers' (else the full "
                            "trace, with the reason in the summary)")
    group.add_argument("--hf-fallback", choices=FALLBACKS, default="auto",
                       help="override for a model whose rotary function does not verify: plain export then fuse "
                            "(auto, the default), refuse (error), keep RoPE decomposed (plain), or skip the hook "
                            "and fuse even when a function verifies (fuse)")


def register(subparsers) -> None:
    """Give the ``export`` command its --hf options and route calls that use them to ``run_hf_export``."""
    parser = subparsers.choices["export"]
    register_hf_arguments(parser)
    preset_run = parser.get_default("func")

    def run(args) -> int:
        return run_hf_export(args) if wants_hf_export(args) else preset_run(args)

    parser.set_defaults(func=run)


def wants_hf_export(args) -> bool:
    """Whether ``export`` was called with any of the --hf options (then ``run_hf_export`` handles it)."""
    return any(getattr(args, name, None) is not None
               for name in ("hf", "weights", "random_weights", "allow_no_rope", "layer", "hf_family",
                            "attention_mask", "kv_buffer", "trace"))


def run_hf_export(args) -> int:
    """The ``export --hf`` command: build offline, export, print a summary table."""
    from rich.console import Console
    from rich.table import Table

    from rope_export.export import _check_writable, output_files, summarize
    from rope_export.steps import cli_steps

    try:
        import transformers  # noqa: F401
    except ImportError:
        raise HFExportError("--hf needs transformers: pip install 'rope-export[hf]'") from None
    if args.hf is None:
        raise HFExportError("--weights, --random-weights, --allow-no-rope, --layer, --hf-family, --attention-mask, "
                            "--trace and --kv-buffer need --hf CONFIG_DIR_OR_JSON")
    if args.random_weights and args.weights is not None:
        raise HFExportError("--random-weights and --weights exclude each other: give one")
    for option, default in (("cache_len", None), ("compare_decomposed", False), ("module", None)):
        if getattr(args, option, default) not in (None, False):
            raise HFExportError(
                f"--{option.replace('_', '-')} does not apply to --hf: transformers computes per-token cos/sin in "
                "the graph and the model is exported as it is"
            )
    _check_writable(Path(args.output))  # before the minutes of building and tracing
    # the --hf folder's own checkpoint unless told otherwise: a folder with weights never exports random ones
    weights = args.weights if args.weights is not None or args.random_weights else weights_beside(args.hf)
    if weights is None:
        why = "--random-weights" if args.random_weights else f"{args.hf} holds no checkpoint; give --weights DIR"
        weights_line = f"random weights (seed {args.seed}): not a trained model ({why})"
    else:
        weights_line = f"weights from {weights}"
    console = Console()
    with said_when_untested(), cli_steps(console, f"rope-export export --hf: {args.output}",
                                         args.summary_json) as progress:
        # --summary-json says which weights the file holds, as its first line does
        progress.facts["weights"] = weights_fact(weights, args.seed)
        progress(f"building the model from {args.hf}" + (f" with weights from {weights}" if weights else
                                                          f" (random weights, seed {args.seed})"))
        model = build_hf_model(args.hf, weights, dtype=args.dtype, seed=args.seed,
                               random_weights=weights is None, progress=progress)
        result = export_hf(model, args.output, layer=args.layer, family=args.hf_family, fallback=args.hf_fallback,
                           allow_decomposed=getattr(args, "allow_decomposed", False),
                           allow_no_rope=bool(args.allow_no_rope), opset=args.opset,
                           attention_mask=bool(args.attention_mask), kv_buffer=bool(args.kv_buffer),
                           external=args.external_data, weights=None if weights is None else str(weights),
                           seed=args.seed, trace=args.trace or "full", progress=progress,
                           verbose=args.verbose)
        progress.facts["trace"] = result.trace  # which path ran, for --summary-json as for the line below
        progress.add_files(output_files(args.output))
    console.print(weights_line, soft_wrap=True, markup=False, highlight=False)  # the summary's first line
    console.print(f"trace: {result.trace}", soft_wrap=True, markup=False, highlight=False)
    summary = summarize(result.model)
    table = Table(title=f"{result.path} ({type(model).__name__}, {args.dtype})")
    table.add_column("what")
    table.add_column("value")
    table.add_row("model type", f"{model.config.model_type} ({result.family.notes or 'detected by code'})")
    table.add_row("weights", weights_line)
    table.add_row("rotary hook", result.hook)
    table.add_row("trace", result.trace)
    table.add_row("rotations in eager transformers", str(result.rotations))
    table.add_row(f"{contract.DOMAIN}::{contract.OP_TYPE} nodes", str(summary["custom_nodes"]))
    table.add_row("nodes", str(summary["nodes"]))
    for name, dims in list(summary["inputs"].items())[:4]:
        table.add_row(f"input {name}", str(dims))
    if len(summary["inputs"]) > 4:
        table.add_row("inputs", f"{len(summary['inputs'])} in all")
    table.add_row("opsets", str(summary["opsets"]))
    for note in result.notes:
        table.add_row("note", note)
    console.print(table)
    return 0
