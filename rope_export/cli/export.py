"""``rope-export export``: a preset's attention block (the default), your own module (``--module``), a
transformers folder (``--hf``, run by ``rope_export.cli.export_hf``) or a diffusers folder (``--diffusers``, run by
``rope_export.cli.export_diffusers``). The parser names only options and help, so ``rope-export export --help``
imports neither torch nor transformers; a run imports the one front end it takes (``rope_export.presets.export``,
``rope_export.blocks.export``, ``rope_export.hf`` or ``rope_export.diffusion``)."""

from __future__ import annotations

from rope_export.cli.options import add_model_source_arguments, add_output_arguments
from rope_export.exporting import DTYPE_NAMES, FACTORY_HELP, HF_FALLBACKS, HF_TRACES, MIN_OPSET

# The options only export --hf takes: any of them routes the call to cli.export_hf.run_hf_export.
HF_ONLY = ("hf", "weights", "random_weights", "allow_no_rope", "layer", "hf_family", "attention_mask", "kv_buffer",
           "trace", "task", "image_size")


def register(subparsers) -> None:
    parser = subparsers.add_parser("export")
    parser.add_argument("--preset", default="tiny", help="preset name or .toml path (default tiny)")
    parser.add_argument("--dtype", default="fp32", choices=DTYPE_NAMES, help="precision of the whole file")
    parser.add_argument("--opset", type=int, default=23, help=f"ai.onnx opset ({MIN_OPSET} or newer, default 23)")
    parser.add_argument("--decode", action="store_true",
                        help="add past_key/past_value inputs: one file for prefill (past 0) and decode")
    parser.add_argument("--cache-len", type=int, default=None,
                        help="rows of the cos/sin caches (default: the preset's max_position_embeddings)")
    parser.add_argument("--compare-decomposed", action="store_true",
                        help="also export the block with decomposed RoPE and report the node-count reduction")
    parser.add_argument("--verbose", action="store_true",
                        help="show torch.onnx's own messages and the libraries' FutureWarnings")
    parser.add_argument("-o", "--output", required=True,
                        help="the .onnx file to write (missing folders above it are made)")
    add_output_arguments(parser)
    parser.add_argument("--module", metavar="SPEC", help=f"export any RoPE module instead of a preset: {FACTORY_HELP}")
    parser.add_argument("--allow-decomposed", action="store_true",
                        help="--module, --hf: write the file even if a rotation stayed decomposed (a warning, not "
                             "an error)")
    add_hf_arguments(parser)
    add_diffusers_arguments(parser)
    parser.set_defaults(func=run)


def add_hf_arguments(parser) -> None:
    """``--hf CONFIG_DIR_OR_JSON`` and the options that go with it."""
    group = add_model_source_arguments(
        parser, "export a transformers model built from this local config (folder or .json) instead of a preset; "
                "any RoPE model type: its rotary function is found by code and verified. A causal LM's file always "
                "has a KV cache (prefill: past 0); other tasks: --task")
    group.add_argument("--task", metavar="TASK", default=None,
                       help="the task to export the folder's model as, e.g. feature-extraction, fill-mask, "
                            "text-classification, speech-to-text (an unknown name lists them all); default: the class "
                            "config.json's architectures names, else a causal LM where transformers has one, else the "
                            "type's speech-to-text, text-to-text or base model. Encoder-decoders write a folder "
                            "(encoder.onnx, decoder.onnx)")
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
    group.add_argument("--image-size", metavar="HxW", default=None,
                       help="a vision-language model (Qwen2/2.5/3-VL, Mistral 3, Llama 4, GLM-4V) exports whole to "
                            "-o OUT_DIR/ "
                            "(vision encoder, embedding merge, decoder): the image size its vision encoder takes, in "
                            "pixels (default: the type's, e.g. 448x448; Llama 4: its tile size)")
    group.add_argument("--hf-family", metavar="FAMILY", default=None,
                       help="override: accept only this family's rotary form (still checked numerically; a wrong "
                            "name gets the list)")
    group.add_argument("--trace", choices=HF_TRACES, default=None,
                       help="per-kind (default): trace the leading decoder layers (two for a dense model) and stamp "
                            "them once per further layer with its weights and cache, where the layers group into "
                            "kinds and every stamped layer computes what transformers' own does (each run alone, "
                            "before the file is written); else the full trace, with the reason in the summary. "
                            "full: torch.export traces every decoder layer")
    group.add_argument("--hf-fallback", choices=HF_FALLBACKS, default="auto",
                       help="override for a model whose rotary function does not verify: plain export then fuse "
                            "(auto, the default), refuse (error), keep RoPE decomposed (plain), or skip the hook "
                            "and fuse even when a function verifies (fuse)")


def add_diffusers_arguments(parser) -> None:
    """``--diffusers DIR`` and the options that go with it (``rope_export.cli.export_diffusers``)."""
    group = parser.add_argument_group("diffusers image and video transformers (instead of --preset)")
    group.add_argument("--diffusers", metavar="DIR", default=None,
                       help="export a component of a local diffusers folder (a pipeline's, with model_index.json, or "
                            "one model's save_pretrained folder): the denoising transformer by default, with one "
                            "rotary node per rotation and dynamic latent sizes; its weights, or random ones (--seed) "
                            "when it holds none or with --random-weights")
    group.add_argument("--component", metavar="NAME", default=None,
                       help="--diffusers: the pipeline component to export (transformer, vae, text_encoder, ...; "
                            "default: the denoiser). A VAE (its decoder) or text encoder is exported as it is, its "
                            "rotations counted (none in a VAE, CLIP or T5)")
    group.add_argument("--diffusers-family", metavar="FAMILY", default=None,
                       help="--diffusers: call the transformer as this family does (flux, wan, hunyuan-video, "
                            "cogvideox, ltx-video, lumina2, video); default: the first whose inputs fit its forward")


def wants_hf_export(args) -> bool:
    """Whether ``export`` was called with any of the --hf options (then ``run_hf_export`` handles it)."""
    return any(getattr(args, name, None) is not None for name in HF_ONLY)


def run(args) -> int:
    from rope_export.common.fileio import parent_folders_made

    args.seed = 0 if args.seed is None else args.seed  # check reads "not given" as the file's own seed; export: 0
    with parent_folders_made(args.output):  # -o new/dir/model.onnx makes new/dir (removed again if the export fails)
        if args.diffusers is not None:
            from rope_export.cli.export_diffusers import run_diffusers_export

            return run_diffusers_export(args)
        if args.component is not None or args.diffusers_family is not None:
            from rope_export.common.errors import CLIError

            raise CLIError("--component and --diffusers-family need --diffusers DIR")
        if wants_hf_export(args):
            from rope_export.cli.export_hf import run_hf_export

            return run_hf_export(args)
        if args.module:
            return run_module_export(args)
        return run_preset_export(args)


def run_preset_export(args) -> int:
    """``rope-export export [--preset NAME] -o OUT.onnx`` ."""
    from rich.console import Console
    from rich.table import Table

    from rope_export.common.steps import cli_steps
    from rope_export.exporting.core import summarize
    from rope_export.files.onnx_files import output_files
    from rope_export.op import contract
    from rope_export.presets.export import decomposed_export, export

    console = Console()
    with cli_steps(console, f"rope-export export: {args.output}", args.summary_json) as steps:
        result = export(args.preset, args.output, dtype=args.dtype, opset=args.opset, decode=args.decode,
                        seed=args.seed, cache_len=args.cache_len, external=args.external_data, progress=steps,
                        verbose=args.verbose)
        baseline = None
        if args.compare_decomposed:
            steps("exporting the same block with decomposed RoPE, for comparison")
            baseline = decomposed_export(result.preset, args.dtype, args.decode, args.opset, args.cache_len)
        steps.add_files(output_files(args.output))
    summary = summarize(result.model)
    table = Table(title=f"{result.path} ({result.preset.name}, {args.dtype})")
    table.add_column("what")
    table.add_column("value")
    table.add_row("nodes", str(summary["nodes"]))
    table.add_row(f"{contract.DOMAIN}::{contract.OP_TYPE} nodes", str(summary["custom_nodes"]))
    for name, dims in summary["inputs"].items():
        table.add_row(f"input {name}", str(dims))
    for name, dims in summary["outputs"].items():
        table.add_row(f"output {name}", str(dims))
    table.add_row("opsets", str(summary["opsets"]))
    if baseline is not None:
        plain = len(baseline.graph.node)
        table.add_row("nodes with decomposed RoPE", f"{plain} ({plain - summary['nodes']} fewer with the op, "
                      f"{summary['nodes'] / plain:.0%} of the plain export)")
    console.print(table)
    return 0


def run_module_export(args) -> int:
    """``rope-export export --module SPEC -o OUT.onnx [--opset N] [--allow-decomposed]``."""
    from rich.console import Console

    from rope_export.blocks.export import export_module, load_factory
    from rope_export.common.fileio import check_writable
    from rope_export.common.steps import cli_steps
    from rope_export.files.onnx_files import output_files

    console = Console()
    check_writable(args.output)  # before importing the user's module and tracing it
    parts = load_factory(args.module)
    with cli_steps(console, f"rope-export export --module: {args.output}", args.summary_json) as progress:
        result = export_module(parts.pop("module"), parts.pop("args"), parts.pop("kwargs", None), output=args.output,
                               opset=args.opset, allow_decomposed=args.allow_decomposed, external=args.external_data,
                               progress=progress, verbose=args.verbose, **parts)
        progress.add_files(output_files(args.output))
    console.print(result.as_text(), markup=False, highlight=False)
    console.print(f"{result.rotary_nodes} rotary node(s) for {len(result.census.plain)} rotation(s): {result.path}")
    return 0
