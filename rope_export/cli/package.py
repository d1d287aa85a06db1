"""``rope-export package genai|triton``: what a serving stack loads as it is (``rope_export.serve``).

``package`` has one subcommand per runtime (``PACKAGERS``: name -> function adding its parser), so a
runtime is added with one entry; each imports its module lazily when it runs.
"""

from __future__ import annotations

from pathlib import Path

from rope_export.cli.options import add_model_source_arguments, add_output_arguments

GENAI_DESCRIPTION = (
    "Write a folder onnxruntime-genai runs as it is (og.Model(OUT_DIR)): model.onnx lowered to --target, "
    "genai_config.json generated from the transformers config and the file's own I/O names (heads, kv heads, head "
    "size and layers read from the file's past inputs; eos/bos/pad ids and search defaults from config.json and "
    "generation_config.json), and the tokenizer files of the model folder. From --hf MODEL_DIR the model is "
    "exported with an attention_mask input, so batches with padding work; onnxruntime-genai 0.18 takes a padded "
    "batch padded on the right with pad_token_id (it finds the pads from the end of each row) and generates what "
    "transformers' left-padded generate does. The KV cache grows by Concat (past_present_share_buffer false), or "
    "with --kv-buffer is a buffer per layer updated in place (past_present_share_buffer true). "
    "OUT_DIR must be new, empty, or an earlier package (replaced); it appears complete or not at all."
)


def _add_genai(packagers) -> None:
    from rope_export.serve.genai import TARGETS

    parser = packagers.add_parser("genai", help="an onnxruntime-genai folder (model.onnx, genai_config.json, "
                                                "tokenizer)", description=GENAI_DESCRIPTION)
    parser.add_argument("model", nargs="?", metavar="MODEL.onnx", default=None,
                        help="a file from `rope-export export --hf` (its config comes from its metadata), or the "
                             "folder it wrote for a vision-language model; or --hf")
    add_model_source_arguments(parser, "a local transformers folder (config.json): exported here with an "
                                       "attention_mask input, instead of MODEL.onnx")
    parser.add_argument("--tokenizer", metavar="DIR", default=None,
                        help="the folder to copy tokenizer files and generation_config.json's defaults from "
                             "(default: MODEL_DIR)")
    parser.add_argument("--target", "-t", choices=TARGETS, default="onnx",
                        help="how the rotary nodes are lowered: onnx (ai.onnx RotaryEmbedding-23, default) or ort "
                             "(com.microsoft RotaryEmbedding)")
    parser.add_argument("--output", "-o", required=True, metavar="OUT_DIR", help="the folder to write")
    parser.add_argument("--kv-buffer", action="store_true",
                        help="with --hf: the KV cache is a preallocated buffer per layer updated in place "
                             "(TensorScatter-24 + Attention-24, opset 24; past_present_share_buffer true), so a decode "
                             "step does not copy the whole past; refused for attention soft-capping (Gemma-2)")
    parser.add_argument("--image-size", metavar="HxW", default=None,
                        help="with --hf of a vision-language model (Qwen2.5-VL, Mistral 3): the image size its vision "
                             "encoder is exported for; genai's processor resizes every image to it (default: the "
                             "type's, e.g. 448x448)")
    parser.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default="fp32", help="with --hf: precision")
    add_output_arguments(parser)
    parser.set_defaults(func=_run_genai)


def _add_triton(packagers) -> None:
    import argparse

    from rope_export.serve.triton import BACKENDS, DESCRIPTION, ORT_TARGETS

    p = packagers.add_parser(
        "triton", help="write a Triton Inference Server model repository for an ONNX file",
        formatter_class=argparse.RawDescriptionHelpFormatter, description=DESCRIPTION)
    p.add_argument("onnx", type=Path, metavar="FILE.onnx", help="an export of rope-export (any lowering)")
    p.add_argument("-o", "--output", type=Path, required=True, metavar="REPO", help="the model repository folder")
    p.add_argument("--backend", choices=BACKENDS, default="onnxruntime", help="Triton backend (default onnxruntime)")
    p.add_argument("--name", help="model name, the folder in REPO (default: from the file name)")
    p.add_argument("--target", choices=ORT_TARGETS, default="onnx",
                   help="backends onnxruntime/python: the lowering to serve (default onnx)")
    p.add_argument("--engine", type=Path, help="tensorrt: the engine to serve (default: built here where TensorRT "
                                              "and a GPU exist)")
    p.add_argument("--plugin", type=Path, help="tensorrt: the plugin library (default: build/plugins/"
                                              "librope_export_trt_plugin.so, when built)")
    p.add_argument("--max-batch", type=int, default=1,
                   help="max_batch_size: Triton owns the first dim up to N (default 1); 0: no batch dim of Triton's")
    p.add_argument("--force", action="store_true", help="replace REPO/NAME if it exists")
    p.set_defaults(func=_run_triton)


def _run_triton(args) -> int:
    from rope_export.serve.triton import write_repository

    packaged = write_repository(args.onnx, args.output, backend=args.backend, name=args.name, engine=args.engine,
                                plugin=args.plugin, max_batch=args.max_batch, target=args.target, force=args.force,
                                say=print)
    for path in packaged.files:
        print(f"wrote {path}")
    print(f"serve it with: {packaged.server_command}")
    return 0


PACKAGERS = {"genai": _add_genai, "triton": _add_triton}


def register(subparsers) -> None:
    parser = subparsers.add_parser("package", help="write what a serving stack loads as it is (an onnxruntime-genai "
                                                   "folder, a Triton model repository)",
                                   description="Write a folder a serving runtime loads as it is.")
    packagers = parser.add_subparsers(dest="runtime", metavar="RUNTIME", required=True)
    for add in PACKAGERS.values():
        add(packagers)


def _run_genai(args) -> int:
    from pathlib import Path

    from rich.console import Console
    from rich.table import Table

    from rope_export.common.steps import cli_steps
    from rope_export.serve.genai import ServeError, package_genai
    from rope_export.serve.genai_vlm import is_vlm_source, package_genai_vlm

    console = Console()
    vlm = is_vlm_source(args.model, args.hf)  # a vision-language model: three components and the image processor
    if vlm and args.kv_buffer:
        raise ServeError("--kv-buffer is for causal LMs; a vision-language folder's decoder grows its cache by Concat")
    if not vlm and args.image_size is not None:
        raise ServeError("--image-size is for a vision-language model (Qwen2.5-VL, Mistral 3)")
    with cli_steps(console, f"rope-export package genai: {args.output}", args.summary_json) as steps:
        if vlm:
            package = package_genai_vlm(Path(args.output), folder=None if args.model is None else Path(args.model),
                                        hf=args.hf, weights=args.weights, random_weights=bool(args.random_weights),
                                        tokenizer=args.tokenizer, target=args.target, dtype=args.dtype,
                                        seed=args.seed or 0, image_size=args.image_size,
                                        external=args.external_data, progress=steps)
        else:
            package = package_genai(args.output, model=args.model, hf=args.hf, weights=args.weights,
                                    random_weights=bool(args.random_weights),
                                    tokenizer=args.tokenizer, target=args.target, dtype=args.dtype,
                                    seed=args.seed or 0, external=args.external_data, kv_buffer=args.kv_buffer,
                                    progress=steps)
        steps.add_files([(path, path.stat().st_size) for path in package.files])
    decoder = package.config["model"]["decoder"]
    table = Table(title=f"{package.folder} (onnxruntime-genai)")
    table.add_column("what")
    table.add_column("value")
    table.add_row("model type", package.config["model"]["type"])
    table.add_row("files", ", ".join(path.name for path in package.files))
    table.add_row("layers / heads / kv heads / head size", f"{decoder['num_hidden_layers']} / "
                  f"{decoder['num_attention_heads']} / {decoder['num_key_value_heads']} / {decoder['head_size']}")
    table.add_row("inputs", ", ".join(decoder["inputs"].values()))
    table.add_row("eos / pad", f"{package.config['model']['eos_token_id']} / {package.config['model']['pad_token_id']}")
    for note in package.notes:
        table.add_row("note", note)
    console.print(table)
    return 0
