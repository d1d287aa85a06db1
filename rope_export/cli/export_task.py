"""``rope-export export --hf DIR`` for a task other than the causal LM (``rope_export.hf.tasks``): build the class
the folder was saved with, export its files (``task_export``), print one summary table per file."""

from __future__ import annotations

from pathlib import Path

from rope_export.hf.checkpoints import weights_fact
from rope_export.hf.errors import HFExportError
from rope_export.hf.loading import build_hf_model, chosen_weights
from rope_export.hf.tasks import TaskChoice

# export --hf options that are the causal LM's own (its cache, its layers, its trace): refused for other tasks
CAUSAL_ONLY = (("layer", "--layer"), ("attention_mask", "--attention-mask"), ("kv_buffer", "--kv-buffer"),
               ("trace", "--trace"))


def run_task_export(args, choice: TaskChoice) -> int:
    from rich.console import Console

    from rope_export.common.steps import cli_steps
    from rope_export.exporting.core import check_output_writable
    from rope_export.files.onnx_files import output_files
    from rope_export.hf.task_export import check_output_folder, export_task

    task = choice.task
    # given: any value but None (not given) and False; --layer 0 is given (0 == False, so no "in (None, False)")
    given = [flag for name, flag in CAUSAL_ONLY if getattr(args, name, None) is not None
             and getattr(args, name) is not False]
    if given:
        raise HFExportError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for causal LMs; {args.hf} "
                            f"exports as {task.name} ({choice.reason}): drop {'it' if len(given) == 1 else 'them'}, "
                            "or pass --task causal-lm")
    output = Path(args.output)
    if len(task.parts) == 1:  # before the minutes of building and tracing
        check_output_writable(output)
    else:
        check_output_folder(output, task)
    weights, weights_line = chosen_weights(args.hf, args.weights, args.random_weights, args.seed)
    console = Console()
    with cli_steps(console, f"rope-export export --hf ({task.name}): {args.output}", args.summary_json) as progress:
        progress.facts["weights"] = weights_fact(weights, args.seed)
        progress.facts["task"] = task.name
        progress(f"building {choice.model_class} from {args.hf} ({choice.reason})")
        try:
            model = build_hf_model(args.hf, weights, dtype=args.dtype, seed=args.seed,
                                   random_weights=weights is None, progress=progress, model_class=choice.build_class)
        except HFExportError as exc:
            raise _with_head_hint(exc, args.hf, choice) from None
        result = export_task(model, task, output, family=args.hf_family, fallback=args.hf_fallback,
                             allow_decomposed=getattr(args, "allow_decomposed", False),
                             allow_no_rope=bool(args.allow_no_rope), opset=args.opset,
                             weights=None if weights is None else str(weights), seed=args.seed,
                             external=args.external_data, progress=progress, verbose=args.verbose)
        for file in result.files:
            progress.add_files(output_files(file.path))
    console.print(weights_line, soft_wrap=True, markup=False, highlight=False)  # the summary's first line
    _print_files(console, result, model, choice, args.dtype)
    return 0


def _print_files(console, result, model, choice: TaskChoice, dtype: str) -> None:
    from rich.table import Table

    from rope_export.exporting.core import summarize
    from rope_export.op import contract

    for file in result.files:
        summary = summarize(file.model)
        table = Table(title=f"{file.path} ({type(model).__name__}: {result.task}, {file.component}, {dtype})")
        table.add_column("what")
        table.add_column("value")
        table.add_row("model type", f"{model.config.model_type} ({choice.reason})")
        table.add_row("rotary hook", file.hook)
        table.add_row("rotations in eager transformers", str(file.rotations))
        table.add_row(f"{contract.DOMAIN}::{contract.OP_TYPE} nodes", str(summary["custom_nodes"]))
        table.add_row("nodes", str(summary["nodes"]))
        for side in ("inputs", "outputs"):
            cache = [name for name in summary[side] if name.startswith(("past_key_values.", "present."))]
            for name, dims in summary[side].items():
                if name not in cache:
                    table.add_row(f"{side[:-1]} {name}", str(dims))
            if cache:
                table.add_row(f"{side[:-1]} {cache[0]} ...", f"{summary[side][cache[0]]} ({len(cache)} cache tensors)")
        console.print(table)
    for note in result.notes:
        console.print(f"note: {note}", soft_wrap=True, markup=False, highlight=False)


def _with_head_hint(exc: HFExportError, folder, choice: TaskChoice) -> HFExportError:
    """A checkpoint of another head than ``--task``'s class (a masked-LM checkpoint exported as its base model)
    does not fit it; the error says so and how to export it."""
    from rope_export.hf.loading import load_hf_config

    saved = next(iter(getattr(load_hf_config(folder), "architectures", None) or []), None)
    if "does not fit" not in str(exc) or saved in (None, choice.model_class):
        return exc
    return HFExportError(f"{exc} ({folder} holds a {saved} checkpoint: as {choice.task.name} ({choice.model_class}) "
                         "its head's tensors are left over, which rope-export refuses; export it as saved (drop "
                         "--task), or save the model you want with save_pretrained)")
