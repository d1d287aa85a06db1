"""Command-line options several commands share, in a module that imports neither onnx nor torch, so that
``rope-export COMMAND --help`` answers at once (the commands import what they need when they run)."""

from __future__ import annotations

from rope_export.files import EXTERNAL_DATA

EXTERNAL_DATA_HELP = ("where the weights go: auto (inside the .onnx up to 2 GB, else NAME.data), single "
                      "(always one file NAME.data), per-tensor (a folder NAME.data/ with one file per tensor), "
                      "never (inside the .onnx; refused past 2 GB)")


def add_output_arguments(parser) -> None:
    """``--external-data`` and ``--summary-json``, shared by export, lower, fuse and package."""
    parser.add_argument("--external-data", choices=EXTERNAL_DATA, default="auto", help=EXTERNAL_DATA_HELP)
    parser.add_argument("--summary-json", metavar="PATH", default=None,
                        help="also write the summary (time and peak RSS per step, files and sizes) as JSON")
