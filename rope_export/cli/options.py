"""Command-line options several commands share, in a module that imports neither onnx nor torch, so that
``rope-export COMMAND --help`` answers at once (the commands import what they need when they run)."""

from __future__ import annotations

import argparse

from rope_export.files import EXTERNAL_DATA

EXTERNAL_DATA_HELP = ("where the weights go: auto (inside the .onnx up to 32 MB of weights, else NAME.data), "
                      "single (always one file NAME.data), per-tensor (a folder NAME.data/ with one file per "
                      "tensor), never (inside the .onnx; refused past 2 GB)")


def add_output_arguments(parser) -> None:
    """``--external-data`` and ``--summary-json``, shared by export, lower, fuse and package."""
    parser.add_argument("--external-data", choices=EXTERNAL_DATA, default="auto", help=EXTERNAL_DATA_HELP)
    parser.add_argument("--summary-json", metavar="PATH", default=None,
                        help="also write the summary (time and peak RSS per step, files and sizes) as JSON")


def whole_number(text: str) -> int:
    """argparse type: an int >= 0, with the reason when not."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def add_model_source_arguments(parser, hf_help: str):
    """The transformers model a command builds or compares with: ``--hf``, ``--weights``, ``--random-weights``
    and ``--seed``, shared by export, check and package (``hf_help`` says what this command does with it).

    Every default is None, so a command can tell "not given" from a value: export and package then take seed 0,
    check the seed the file records."""
    group = parser.add_argument_group("transformers model (a local folder; the hub is never contacted)")
    group.add_argument("--hf", metavar="MODEL_DIR", default=None, help=hf_help)
    group.add_argument("--weights", metavar="DIR", default=None,
                       help="the checkpoint folder save_pretrained wrote (safetensors or .bin, sharded or not); "
                            "default: the one in the --hf folder (check: the weights the file records)")
    group.add_argument("--random-weights", action="store_true", default=None,
                       help="random weights (--seed) even where a checkpoint is at hand: not a trained model")
    group.add_argument("--seed", type=whole_number, default=None,
                       help="seed of the random weights, drawn as `export --hf` draws them (default 0; check: the "
                            "seed the file records)")
    return group
