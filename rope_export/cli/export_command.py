"""The ``export`` command's parser: a preset (the default), your own module (``--module``), a transformers
folder (``--hf``) or a diffusers folder (``--diffusers``). Only names and help live here, so ``rope-export export
--help`` imports neither torch nor transformers; a run imports the one path it takes (``rope_export.presets.export``,
``module_export``, ``hf.cli`` or ``diffusion.cli``)."""

from __future__ import annotations

import importlib

from rope_export.cli.options import add_output_arguments
from rope_export.exporting import DTYPE_NAMES, FACTORY_HELP, HF_FALLBACKS, HF_TRACES, MIN_OPSET

# The options only export --hf takes: any of them routes the call to run_hf_export.
HF_ONLY = ("hf", "weights", "random_weights", "allow_no_rope", "layer", "hf_family", "attention_mask", "kv_buffer",
           "trace")


def register(subparsers) -> None:
    parser = subparsers.add_parser("export")
    parser.add_argument("--preset", default="tiny", help="preset name or .toml path (default tiny)")
    parser.add_argument("--dtype", default="fp32", choices=DTYPE_NAMES, help="precision of the whole file")
    parser.add_argument("--opset", type=int, default=23, help=f"ai.onnx opset ({MIN_OPSET} or newer, default 23)")
    parser.add_argument("--decode", action="store_true",
                        help="add past_key/past_value inputs: one file for prefill (past 0) and decode")
    parser.add_argument("--cache-len", type=int, default=None,
                        help="rows of the cos/sin caches (default: the preset's max_position_embeddings)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    parser.add_argument("--compare-decomposed", action="store_true",
                        help="also export the block with decomposed RoPE and report the node-count reduction")
    parser.add_argument("--verbose", action="store_true",
                        help="show torch.onnx's own messages and the libraries' FutureWarnings")
    parser.add_argument("-o", "--output", required=True, help="the .onnx file to write")
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
    group.add_argument("--hf-family", metavar="FAMILY", default=None,
                       help="override: accept only this family's rotary form (still checked numerically; a wrong "
                            "name gets the list)")
    group.add_argument("--trace", choices=HF_TRACES, default=None,
                       help="full (default): torch.export traces every decoder layer; per-kind: trace two layers and "
                            "stamp the second once per further layer with its weights and cache, where every layer is "
                            "one kind and the stamped file's rotary nodes per layer match transformers' (else the full "
                            "trace, with the reason in the summary)")
    group.add_argument("--hf-fallback", choices=HF_FALLBACKS, default="auto",
                       help="override for a model whose rotary function does not verify: plain export then fuse "
                            "(auto, the default), refuse (error), keep RoPE decomposed (plain), or skip the hook "
                            "and fuse even when a function verifies (fuse)")


def add_diffusers_arguments(parser) -> None:
    """``--diffusers DIR`` and the options that go with it (``rope_export.diffusion.cli``)."""
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
                            "cogvideox, ltx-video, lumina2); default: chosen by its forward's parameters")


def wants_hf_export(args) -> bool:
    """Whether ``export`` was called with any of the --hf options (then ``run_hf_export`` handles it)."""
    return any(getattr(args, name, None) is not None for name in HF_ONLY)


def run(args) -> int:
    if getattr(args, "diffusers", None) is not None:
        return importlib.import_module("rope_export.diffusion.cli").run_diffusers_export(args)
    if getattr(args, "component", None) is not None or getattr(args, "diffusers_family", None) is not None:
        from rope_export.common.errors import CLIError

        raise CLIError("--component and --diffusers-family need --diffusers DIR")
    if wants_hf_export(args):
        return importlib.import_module("rope_export.hf.cli").run_hf_export(args)
    if args.module:
        return importlib.import_module("rope_export.blocks.export").run_module_export(args)
    return importlib.import_module("rope_export.presets.export").run_preset_export(args)
