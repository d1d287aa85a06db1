"""``rope-export export --hf CONFIG``: what the ``export`` command runs when any of its transformers options is
given (the options: ``rope_export.cli.export``, which imports neither torch nor transformers)."""

from __future__ import annotations

from pathlib import Path

from rope_export.hf.checkpoints import weights_fact
from rope_export.hf.errors import HFExportError
from rope_export.hf.export import export_hf
from rope_export.hf.families import HF_FAMILIES
from rope_export.hf.loading import build_hf_model, chosen_weights, load_hf_config
from rope_export.hf.tasks import CAUSAL_LM, select_task
from rope_export.hf.versions import said_when_untested
from rope_export.op import contract


def run_hf_export(args) -> int:
    """The ``export --hf`` command: build offline, export, print a summary table."""
    _refuse_options(args)
    if args.seed is None:  # the shared --seed says "not given" with None (check then reads the file's own)
        args.seed = 0
    # the --hf folder's own checkpoint unless told otherwise: a folder with weights never exports random ones
    weights, weights_line = chosen_weights(args.hf, args.weights, args.random_weights, args.seed)
    from rope_export.cli.export_vlm import run_vlm_export, wants_vlm_export

    if wants_vlm_export(args):  # a vision-language model whole: a folder of components (rope_export.hf.vlm)
        with said_when_untested():
            return run_vlm_export(args, weights, weights_line)
    choice = task_choice(args)
    if choice.task.name != CAUSAL_LM:  # an encoder, embedder, speech or encoder-decoder model (rope_export.hf.tasks)
        from rope_export.cli.export_task import run_task_export

        return run_task_export(args, choice)
    return _export_causal_lm(args, weights, weights_line)


def _refuse_options(args) -> None:
    """Refuse what --hf cannot take, before the minutes of building."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise HFExportError("--hf needs transformers: pip install 'rope-export[hf]'") from None
    if args.hf is None:
        raise HFExportError("--weights, --random-weights, --allow-no-rope, --layer, --hf-family, --attention-mask, "
                            "--task, --trace and --kv-buffer need --hf CONFIG_DIR_OR_JSON")
    if args.random_weights and args.weights is not None:
        raise HFExportError("--random-weights and --weights exclude each other: give one")
    if args.hf_family is not None and args.hf_family not in HF_FAMILIES:
        raise HFExportError(f"unknown --hf-family {args.hf_family!r}; known: {', '.join(sorted(HF_FAMILIES))}")
    for option in ("cache_len", "compare_decomposed", "module"):
        value = getattr(args, option, None)
        if value is not None and value is not False:  # `--cache-len 0` is given too (0 == False)
            raise HFExportError(
                f"--{option.replace('_', '-')} does not apply to --hf: transformers computes per-token cos/sin in "
                "the graph and the model is exported as it is"
            )


def _export_causal_lm(args, weights, weights_line: str) -> int:
    from rich.console import Console

    from rope_export.common.steps import cli_steps
    from rope_export.exporting.core import check_output_writable
    from rope_export.files.onnx_files import output_files

    check_output_writable(Path(args.output))  # before the minutes of building and tracing
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
                           seed=args.seed, trace=args.trace or "per-kind", progress=progress,
                           verbose=args.verbose)
        progress.facts["trace"] = result.trace  # which path ran, for --summary-json as for the line below
        progress.add_files(output_files(args.output))
    console.print(weights_line, soft_wrap=True, markup=False, highlight=False)  # the summary's first line
    console.print(f"trace: {result.trace}", soft_wrap=True, markup=False, highlight=False)
    console.print(_summary_table(result, model, weights_line, args.dtype))
    return 0


def _summary_table(result, model, weights_line: str, dtype: str):
    from rich.table import Table

    from rope_export.exporting.core import summarize

    summary = summarize(result.model)
    table = Table(title=f"{result.path} ({type(model).__name__}, {dtype})")
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
    return table


def task_choice(args):
    """The task ``--hf`` exports (``rope_export.hf.tasks.select_task``: ``--task``, the config's architectures,
    else what the config implies; a causal LM wherever transformers has one)."""
    return select_task(load_hf_config(args.hf), getattr(args, "task", None))
